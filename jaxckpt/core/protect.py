"""What the engine and protection (``jaxckpt.protection``) ask of each other: two protocols, so that neither
imports the other's module and the direction core <- protection holds.

The engine takes a :data:`ProtectionFactory` (the front end's face passes ``jaxckpt.protection.runtime.Protector``
when ``Config.protection`` asks for it); when the store has node agents (``ProtectionSlots``) it calls it with
itself as the :class:`ProtectionHost` (with another store it warns and keeps snapshots unprotected), and then
drives the :class:`Protection` it gets back: ``prepare`` for a new layout, ``on_save`` when a save starts
(``CheckpointEngine.start``), ``adopt`` at start-up, ``wait`` and ``close``.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Hashable, Iterable, Protocol, Sequence

from jaxckpt.config import Config
from jaxckpt.core.capabilities import AgentInfo
from jaxckpt.core.collective import Collective
from jaxckpt.core.plan import ArrayLayout, SavePlan
from jaxckpt.core.sources import Holder
from jaxckpt.core.store import Store
from jaxckpt.errors import DataLossError

__all__ = ["AgentCatalog", "Protection", "ProtectionFactory", "ProtectionHost", "RebuildSteps"]


class AgentCatalog(Protocol):
    """The part of the engine's catalog (``jaxckpt.core.catalog.Catalog``) protection reads and follows agents by."""

    def add_holders(self, provider: Callable[[], Iterable[Holder]]) -> None:
        """Also read restores from the holders ``provider()`` returns."""

    def holders(self) -> list[Holder]:
        """Every holder known now, cheapest first."""

    def begin(self, operation: str) -> None:
        """Start an operation: follow restarted agents."""

    def suspect(self) -> None:
        """An agent may have restarted elsewhere: read the others' published addresses at the next operation."""

    def agent_holder(self, generation: str) -> tuple[Holder, AgentInfo | None] | None:
        """The holder of the agent of ``generation`` as it is now, and how other agents reach it."""

    def current_generation(self, generation: str) -> str:
        """The generation serving now where the agent of ``generation`` was."""


class ProtectionHost(Protocol):
    """What protection needs from the engine (``jaxckpt.core.engine.CheckpointEngine`` offers it)."""

    config: Config
    store: Store
    catalog: AgentCatalog
    collective: Collective
    process_index: int
    process_count: int

    def add_commit_hook(self, hook: Callable[[int, bool], None]) -> None:
        """Call ``hook(step, committed)`` on the commit thread for every decided step, before retention."""

    def pin(self, step: int) -> None:
        """Keep ``step`` in the store past ``Config.keep`` until :meth:`unpin`."""

    def unpin(self, step: int) -> None:
        """Drop one pin of ``step``."""

    def commit_times(self) -> dict[int, tuple[float, float]]:
        """Newest steps' (local done, decided) times (``time.monotonic()``)."""


class RebuildSteps(Protocol):
    """Protection's restore holder as the engine and adoption read it (``jaxckpt.protection.holder``)."""

    losses: dict[int, DataLossError]  # steps a node loss made unrestorable, with why

    def protected_steps(self) -> list[int]:
        """Steps whose protection is complete on every node, ascending."""

    def rebuildable_steps(self) -> list[int]:
        """Steps that can be rebuilt from protection, ascending."""


class Protection(Protocol):
    """What the engine drives of ``Config.protection`` (``jaxckpt.protection.runtime.Protector``)."""

    holder: RebuildSteps

    def prepare(self, key: Hashable, layouts: Sequence[ArrayLayout], plans: Sequence[SavePlan]
                ) -> dict[str, frozenset[int]]:
        """Plan the protection of a new layout; the local devices whose shards this process's parity reads."""

    def on_save(self, step: int, key: Hashable, paths: Sequence[str], sources: Sequence[dict]) -> Future | None:
        """Start this process's parity of ``step`` from the save's sources; its future."""

    def adopt(self, step: int, *, complete: bool = True) -> None:
        """Take ``step``, pinned at start-up, as the newest protected (or, not complete, rebuildable) one."""

    def protected_steps(self) -> list[int]:
        """Steps protected on every node, ascending."""

    def wait(self, step: int | None = None, timeout: float | None = None) -> bool:
        """Until ``step`` (default: every step saved so far) is protected or failed."""

    def close(self) -> None:
        """Stop the threads."""


ProtectionFactory = Callable[[ProtectionHost], Protection]
