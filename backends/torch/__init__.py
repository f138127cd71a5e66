"""The PyTorch front end on the jaxckpt core: torch state dicts (tensors, DTensors, generators) in, the same
manifests, stores and planner as the JAX front end. Importing this package imports torch; ``import jaxckpt``
and ``import jaxckpt.backends`` do not."""
from jaxckpt.backends.torch.checkpointer import Checkpointer, SaveHandle
from jaxckpt.backends.torch.coordination import TorchStoreCoordinator
from jaxckpt.backends.torch.dcp import JaxckptReader, JaxckptWriter
from jaxckpt.backends.torch.restore import restore_state
from jaxckpt.backends.torch.tree import PerRank

__all__ = ["Checkpointer", "JaxckptReader", "JaxckptWriter", "PerRank", "SaveHandle", "TorchStoreCoordinator",
           "restore_state"]
