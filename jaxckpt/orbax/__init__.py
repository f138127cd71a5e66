"""Orbax integration: ``SnapshotHandler`` (v0 ``AsyncCheckpointHandler``), ``TieredCheckpointManager``, and the
persistent tier in the standard Orbax format."""
from jaxckpt.orbax.handler import (MARKER_NAME, SnapshotHandler, SnapshotRestore, SnapshotSave,
                                   default_checkpointer, step_from_directory)
from jaxckpt.orbax.tiered import TieredCheckpointManager

__all__ = ["MARKER_NAME", "SnapshotHandler", "SnapshotRestore", "SnapshotSave", "TieredCheckpointManager",
           "default_checkpointer", "step_from_directory"]
