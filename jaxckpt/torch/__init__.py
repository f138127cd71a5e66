"""The PyTorch front end on the jaxckpt core: torch state dicts (tensors, DTensors, generators) in, the same
manifests, stores, planner and restore driver as the JAX front end, through the same ``Checkpointer`` face
(``jaxckpt.frontend``). Importing this package imports torch; ``import jaxckpt`` and ``import jaxckpt.backends``
do not. (``jaxckpt.backends.torch``, its earlier name, still gives these names.)"""
from jaxckpt.torch.checkpointer import Checkpointer, SaveHandle
from jaxckpt.torch.coordination import TorchStoreCoordinator
from jaxckpt.torch.dcp import JaxckptReader, JaxckptWriter
from jaxckpt.torch.restore import restore_state
from jaxckpt.torch.tree import PerRank

__all__ = ["Checkpointer", "JaxckptReader", "JaxckptWriter", "PerRank", "SaveHandle", "TorchStoreCoordinator",
           "restore_state"]
