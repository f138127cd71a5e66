"""``jaxckpt.backends.torch``: the torch front end's earlier public name, kept for the README's users. The front
end is ``jaxckpt.torch`` (a front end is a folder under ``jaxckpt/``, beside ``jaxckpt.jax``); this package only
names its public classes, so nothing in ``jaxckpt.backends`` depends on it."""
from jaxckpt.torch import (Checkpointer, JaxckptReader, JaxckptWriter, PerRank, SaveHandle, TorchStoreCoordinator,
                           restore_state)

__all__ = ["Checkpointer", "JaxckptReader", "JaxckptWriter", "PerRank", "SaveHandle", "TorchStoreCoordinator",
           "restore_state"]
