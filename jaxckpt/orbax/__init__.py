"""Orbax integration: ``SnapshotHandler`` (v0 ``AsyncCheckpointHandler``), ``TieredCheckpointManager``, the
persistent tier in the standard Orbax format, and (``import jaxckpt.orbax.v1``, not imported here) the Orbax v1
``CheckpointableHandler``."""
from jaxckpt.orbax.handler import (MARKER_NAME, SnapshotHandler, SnapshotMetadata, SnapshotRestore, SnapshotSave,
                                   default_checkpointer, step_from_directory)
from jaxckpt.orbax.tiered import TieredCheckpointManager

__all__ = ["MARKER_NAME", "SnapshotHandler", "SnapshotMetadata", "SnapshotRestore", "SnapshotSave", "TieredCheckpointManager",
           "default_checkpointer", "step_from_directory"]
