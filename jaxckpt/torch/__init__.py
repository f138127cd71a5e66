"""The PyTorch front end on the jaxckpt core: torch state dicts (tensors, DTensors, generators) in, the same
manifests, stores, planner and restore driver as the JAX front end, through the same ``Checkpointer`` face
(``jaxckpt.frontend``). Importing this package imports torch; ``import jaxckpt`` and ``import jaxckpt.backends``
do not. (``jaxckpt.backends.torch``, its earlier name, still gives these names.)"""
from typing import Any

from jaxckpt.torch.checkpointer import Checkpointer, SaveHandle
from jaxckpt.torch.coordination import TorchStoreCoordinator
from jaxckpt.torch.restore import restore_state
from jaxckpt.torch.tree import PerRank

_DCP = ("JaxckptReader", "JaxckptWriter")  # imported on first use: DCP's import takes 0.7 s (DTensor's with it)

__all__ = ["Checkpointer", "JaxckptReader", "JaxckptWriter", "PerRank", "SaveHandle", "TorchStoreCoordinator",
           "restore_state"]


def __getattr__(name: str) -> Any:
    """DCP's storage classes, imported when first named (PEP 562)."""
    if name in _DCP:
        from jaxckpt.torch import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module 'jaxckpt.torch' has no attribute {name!r}")
