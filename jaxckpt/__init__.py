"""jaxckpt: in-memory, asynchronous, fault-tolerant checkpointing for JAX/Flax (and PyTorch).

``import jaxckpt`` imports neither jax nor torch: ``jaxckpt.Checkpointer`` (the JAX front end) loads on first use.
``jaxckpt.start_agent()`` starts the node agent before the framework's import (``jaxckpt.early_agent``).
"""
from __future__ import annotations

from typing import Any

from jaxckpt import errors
from jaxckpt.config import Config

__version__ = "0.1.0"
__all__ = ["Checkpointer", "Config", "errors", "start_agent", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Checkpointer":
        from jaxckpt.jax.checkpointer import Checkpointer
        return Checkpointer
    if name == "start_agent":
        from jaxckpt.early_agent import start_agent
        return start_agent
    raise AttributeError(f"module 'jaxckpt' has no attribute {name!r}")
