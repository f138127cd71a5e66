"""The JAX front end: pytrees of jax.Array on a mesh in, neutral shard records out, and back on restore."""
from jaxckpt.jax.checkpointer import Checkpointer, SaveHandle

__all__ = ["Checkpointer", "SaveHandle"]
