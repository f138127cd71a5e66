"""The front-end protocol (what a framework supplies) and the ``Checkpointer`` face every front end shares."""
from jaxckpt.frontend.checkpointer import Checkpointer, Restored
from jaxckpt.frontend.protocol import Frontend, StateLayout

__all__ = ["Checkpointer", "Frontend", "Restored", "StateLayout"]
