"""The Store interface: where one process's snapshot bytes live. Small on purpose (zarr's Store is the model).

Per-slot state machine, the same in every backend::

    reserve(step) -> WRITING --commit(manifest)--> COMMITTED --delete--> FREED
                        \\--abort-------------------------------------> FREED

A reader only ever sees COMMITTED slots: ``open(step)`` pins one (a pinned slot is freed when its last reader
closes), ``steps()`` lists only committed ones. A slot's buffer is written by its reserver alone.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from jaxckpt.config import Config
from jaxckpt.errors import CapabilityError

C = TypeVar("C")


@dataclass
class Slot:
    """A writable buffer of exactly ``nbytes`` bytes for ``step``; the backend keeps its data in ``token``."""

    step: int
    nbytes: int
    buffer: memoryview
    token: Any = None


class SnapshotView(abc.ABC):
    """A pinned, read-only view of one committed snapshot; close it (or use ``with``) to unpin."""

    step: int
    manifest: bytes
    buffer: memoryview

    @abc.abstractmethod
    def close(self) -> None: ...

    def lend(self) -> bool:
        """Let arrays restored from this view keep using its memory: the store then never rewrites it (a later
        save gets other memory) while anything references it. True if the store agreed."""
        return False

    def __enter__(self) -> "SnapshotView":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Store(abc.ABC):
    """Holds the snapshots of one process, keyed by step."""

    name: ClassVar[str] = ""
    # True when snapshots outlive the process (a node agent holds them): the engine then adopts, at start, the
    # steps an earlier run of this process committed.
    survives_process: ClassVar[bool] = False
    # What this class offers beyond this interface (jaxckpt.core.capabilities): declared, never probed for.
    capabilities: ClassVar[frozenset[type]] = frozenset()

    def __init__(self, config: Config, *, process_index: int = 0, process_count: int = 1) -> None:
        self.config = config
        self.process_index = process_index
        self.process_count = process_count

    @abc.abstractmethod
    def reserve(self, step: int, nbytes: int) -> Slot:
        """A writable slot for ``step``; raises StepError if the step is held, BudgetExceededError if over budget."""

    @abc.abstractmethod
    def commit(self, slot: Slot, manifest: bytes) -> None:
        """Make a fully written slot readable, its manifest stored last so a reader never sees it half done."""

    @abc.abstractmethod
    def abort(self, slot: Slot) -> None:
        """Discard a slot that will not be committed."""

    @abc.abstractmethod
    def steps(self) -> list[int]:
        """Committed steps, ascending."""

    @abc.abstractmethod
    def open(self, step: int) -> SnapshotView | None:
        """Pin and return a committed snapshot, or None if ``step`` is not committed here."""

    def manifest(self, step: int) -> bytes | None:
        """The manifest of committed ``step`` (None if it is not committed here), its bytes left unread: what a
        start-up's adoption reads of every held step (a store that maps snapshots overrides it to map none)."""
        view = self.open(step)
        if view is None:
            return None
        with view:
            return bytes(view.manifest)

    def prefetch(self, step: int) -> None:
        """Start making committed ``step``'s bytes ready to read (a relaunch restores it next) and return at once;
        a store whose reads cost nothing up front does nothing. Failures are the restore's to report."""

    @abc.abstractmethod
    def delete(self, step: int) -> None:
        """Free a committed snapshot (deferred while readers hold it); unknown steps are ignored."""

    @abc.abstractmethod
    def held_bytes(self) -> int:
        """Host memory this store holds now, in bytes (committed, in flight and pooled buffers)."""

    def close(self) -> None:
        """Release everything; the default has nothing to release."""

    # Capabilities (jaxckpt.core.capabilities).
    def supports(self, kind: type) -> bool:
        """True when this store's class declares capability ``kind``."""
        return kind in type(self).capabilities

    def capability(self, kind: type[C]) -> C:
        """This store's implementation of capability ``kind``; CapabilityError if its class does not declare it."""
        if kind not in type(self).capabilities:
            offers = ", ".join(sorted(k.__name__ for k in type(self).capabilities)) or "nothing beyond Store"
            raise CapabilityError(f"store {self.name or type(self).__name__!r} ({type(self).__name__}) does not offer "
                                  f"{kind.__name__} (it offers {offers})")
        impl = self._capability(kind)
        if not isinstance(impl, kind):
            raise CapabilityError(f"store {type(self).__name__} declares {kind.__name__} but gives a "
                                  f"{type(impl).__name__}")
        return impl

    def _capability(self, kind: type) -> Any:
        """The implementation of declared capability ``kind``: a class that declares any overrides this."""
        raise CapabilityError(f"store {type(self).__name__} declares {kind.__name__} but implements no capability")

    # Defaults derived from the primitives above.
    def latest(self) -> int | None:
        """The newest committed step, or None."""
        s = self.steps()
        return s[-1] if s else None

    def retain(self, keep: set[int]) -> None:
        """Delete every committed step not in ``keep``."""
        for step in self.steps():
            if step not in keep:
                self.delete(step)
