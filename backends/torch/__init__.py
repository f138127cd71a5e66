"""``jaxckpt.backends.torch``: the torch front end's earlier public name, kept for the README's users. The front
end is ``jaxckpt.torch`` (a front end is a folder under ``jaxckpt/``, beside ``jaxckpt.jax``); this package only
names its public classes, so nothing in ``jaxckpt.backends`` depends on it."""
from typing import Any

from jaxckpt.torch import Checkpointer, PerRank, SaveHandle, TorchStoreCoordinator, restore_state

__all__ = ["Checkpointer", "JaxckptReader", "JaxckptWriter", "PerRank", "SaveHandle", "TorchStoreCoordinator",
           "restore_state"]


def __getattr__(name: str) -> Any:
    """DCP's storage classes, imported when first named, as ``jaxckpt.torch`` gives them (PEP 562)."""
    if name in ("JaxckptReader", "JaxckptWriter"):
        import jaxckpt.torch

        return getattr(jaxckpt.torch, name)
    raise AttributeError(f"module 'jaxckpt.backends.torch' has no attribute {name!r}")
