"""jaxckpt: in-memory, asynchronous, fault-tolerant checkpointing for JAX/Flax (and PyTorch).

``import jaxckpt`` imports neither jax nor torch: ``jaxckpt.Checkpointer`` (the JAX front end) loads on first use.
"""
from __future__ import annotations

from typing import Any

from jaxckpt import errors
from jaxckpt.config import Config

__version__ = "0.1.0"
__all__ = ["Checkpointer", "Config", "errors", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Checkpointer":
        from jaxckpt.jax.checkpointer import Checkpointer
        return Checkpointer
    raise AttributeError(f"module 'jaxckpt' has no attribute {name!r}")
