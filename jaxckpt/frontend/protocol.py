"""The front-end protocol: what a framework supplies to jaxckpt, as one small interface.

Everything else is shared: the ``Checkpointer`` face (``jaxckpt.frontend.checkpointer``), the engine, the restore
driver, the stores. A front end (``jaxckpt.jax.frontend.JaxFrontend``, ``jaxckpt.torch.frontend.TorchFrontend``,
the chaos numpy trainer's ``jaxckpt.tools.chaos.trainer.NumpyFrontend``) supplies:

- its leaves to records: :meth:`Frontend.layout` flattens a state into its leaves and the :class:`StateLayout` of
  that state, cached per layout (tree structure, and per leaf its kind, shape, dtype, placement), which gives
  the engine its ``ArrayRecord`` per array leaf only for a layout the engine has not planned yet, and the plain
  values on every save;
- what a save must take before it returns (:meth:`Frontend.take`): views that block donation, copies of
  numpy leaves, device-side copies; the engine's copy workers read the rest later;
- its arrays from host boxes (:meth:`Frontend.build`): an opened step's manifests and chunk reader become the
  front end's state through the restore driver (``jaxckpt.core.restore.restore_leaves``);
- its coordinator and collective adapters: the job's key-value service (:meth:`Frontend.coordinator`, for a
  job of several processes) and the collective of a multi-process restore (:meth:`Frontend.gather`).
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Protocol

from jaxckpt.config import Config
from jaxckpt.core import manifest as mf
from jaxckpt.core.coordination import Coordinator
from jaxckpt.core.engine import ArrayRecord, CheckpointEngine, ShardReads
from jaxckpt.core.fetch import ChunkReader
from jaxckpt.core.restore import Gather

__all__ = ["Frontend", "StateLayout"]


class StateLayout(Protocol):
    """One state layout, cached by the front end: equal ``key`` promises equal records."""

    key: Hashable
    order: tuple[str, ...]  # every leaf's path, in flatten order

    def records(self, leaves: list[Any]) -> list[ArrayRecord]:
        """The engine's records of the array leaves (called only for a layout the engine has not planned)."""

    def value_metas(self, leaves: list[Any]) -> list[mf.LeafMeta]:
        """The plain values of ``leaves``, saved by value."""


class Frontend(Protocol):
    """What a framework supplies (see the module docstring)."""

    framework: str  # written into every manifest: "jax", "torch", "numpy"
    persists: bool  # whether it writes the persistent tier (Orbax's format holds JAX arrays)

    def coordinator(self) -> Coordinator:
        """The coordinator of this process's job (a local one for a single process)."""

    def layout(self, state: Any) -> tuple[StateLayout, list[Any]]:
        """``state``'s layout (cached) and its leaves; UnsupportedLeafError naming the path of a leaf it cannot
        hold."""

    def take(self, layout: StateLayout, devices: list[frozenset[int]], leaves: list[Any], owned: bool
             ) -> Callable[[], list[ShardReads]]:
        """Take now what must be taken before ``save()`` returns; the function (run on the copy dispatcher) gives
        each record's shard reads for the devices ``devices`` names. ``owned``: the leaves are jaxckpt's own copies."""

    def build(self, target: Any, manifests: list[mf.Manifest], reader: ChunkReader, *, step: int, process: int,
              gather: Gather | None, **options: Any) -> Any:
        """The state of ``target``'s structure (None: plain nested containers) from an opened step."""

    def gather(self, engine: CheckpointEngine, target: Any, config: Config) -> Gather | None:
        """The collective of a restore onto ``target`` in a job of several processes, else None. ``config``: the
        Checkpointer's as of this call (``Config.restore_collective``; a Config replaced after construction
        counts)."""

    def persist_note(self, layout: StateLayout, leaves: list[Any]) -> tuple[Any, list[Any]]:
        """For the persistent tier (only when ``persists``): the state's structure and its leaves (``path``,
        ``value``, ``kind``), so that a persisted step is written with the shardings it had at ``save()``."""
