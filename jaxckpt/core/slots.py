"""The slot writer: the one path a snapshot's bytes take into a store, and the retention of what it wrote.

Every save of the library goes through :class:`SlotWriter`: the engine's (``jaxckpt.core.engine``, for every
front end) and DCP's storage (``jaxckpt.torch.dcp.JaxckptWriter``). One slot, in order:

1. :meth:`SlotWriter.reserve` a slot of ``step`` of exactly the snapshot's bytes in the store. With
   ``replace=True`` (DCP: saving a checkpoint id again replaces it) a committed slot of that step is freed
   first; otherwise the store refuses a held step (StepError).
2. :meth:`SlotWriter.write` the chunks into it on the copy workers (``jaxckpt.core.copier``), with a crc32c each.
   The caller lays the slot out: the chunks' offsets and sizes are its own (the engine's come from its save
   plan, DCP's from the items each rank writes).
3. Commit it with its manifest, or abort it. The manifest is the caller's and may be given with the write (a
   function of the chunks' crc32cs, run right after the copy: the engine) or later (:meth:`SlotWriter.commit`:
   DCP's, known only once every rank has written). A failure at any point frees the slot; a committed slot is
   never touched by a later failure.
4. :meth:`SlotWriter.count` the step once it counts (the engine: once every process committed it; DCP: once
   every rank of the group wrote its slot) and apply retention: the ``keep`` newest counted steps and the step
   just counted stay, a pinned step stays until its last :meth:`SlotWriter.unpin`, the others are deleted.

A step pinned as a spare (``pin(step, spare=...)``: what a start-up adoption holds past ``keep``, a fallback or
the newest protected step, until a newer step is protected) gives way to a save that would not fit the store's
budget otherwise: fallbacks first, then the guard, oldest first, each deleted with a warning and the reservation
tried again. Nothing else is deleted to make room: a counted step is never lost to a newer save's reservation.
Without this, a start-up that kept spares in a tight budget refused every later save, so no newer step was ever
protected to release them (seen in ``jaxckpt chaos --profile long``: a job that never committed again).

What a step number means (the engine's rule that steps only grow, DCP's checkpoint ids), the commit rounds
across processes and the error agreement are the callers'.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Callable, Iterable

from jaxckpt.core.copier import Chunks, Copier, CopyTask, SnapshotResult
from jaxckpt.core.store import Slot, Store
from jaxckpt.errors import BudgetExceededError

log = logging.getLogger("jaxckpt.core.slots")


class SlotWriter:
    """Slots of one process's store: reserved, written with crc32cs, committed or aborted, kept ``keep`` deep.

    ``workers`` copy threads with at most ``inflight_bytes`` in flight (started on the first write);
    ``replace``: whether a step the store holds may be saved again (its slot is freed first); ``counted``: the
    steps already counted (an earlier run's, kept by a store that outlives its process)."""

    def __init__(self, store: Store, keep: int, *, workers: int, inflight_bytes: int, replace: bool = False,
                 counted: Iterable[int] = ()) -> None:
        self.store = store
        self.keep = max(1, keep)
        self.replace = replace
        self._workers, self._inflight = max(1, workers), inflight_bytes
        self._copier: Copier | None = None
        self._lock = threading.Lock()
        self._counted: list[int] = sorted(set(counted))
        self._pins: dict[int, int] = {}
        self._deferred: set[int] = set()  # let go by retention while pinned: freed with the last pin
        self._spares: dict[int, str] = {}  # step -> "fallback" or "guard": given up for room (module docstring)

    # ------------------------------------------------------------------------------------------ one slot
    @property
    def copier(self) -> Copier:
        """The copy workers every slot of this writer is written by."""
        with self._lock:
            if self._copier is None:
                self._copier = Copier(self._workers, self._inflight)
            return self._copier

    def reserve(self, step: int, nbytes: int) -> Slot:
        """A writable slot of ``nbytes`` for ``step`` (StepError if the store holds the step and this writer
        does not replace; BudgetExceededError, StoreUnavailableError as the store raises them)."""
        if self.replace and step in self.store.steps():
            with self._lock:
                self._counted = [s for s in self._counted if s != step]
            self.store.delete(step)
        while True:
            try:
                return self.store.reserve(step, nbytes)
            except BudgetExceededError as e:
                spare = self._give_up_spare()
                if spare is None:
                    raise
                log.warning("%s; step %d, kept past retention only as the start-up %s, is deleted to make room",
                            e, *spare)

    def _give_up_spare(self) -> tuple[int, str] | None:
        """Delete the first spare retention let go (fallbacks, then the guard, oldest first): (step, kind)."""
        with self._lock:
            order = sorted((kind != "fallback", s) for s, kind in self._spares.items() if s in self._deferred)
            if not order:
                return None
            step = order[0][1]
            kind = self._spares.pop(step)
            self._pins.pop(step, None)
            self._deferred.discard(step)
        self.store.delete(step)
        return step, kind

    def write(self, slot: Slot, chunks: list[CopyTask] | Chunks | Callable[[], list[CopyTask] | Chunks],
              manifest: Callable[[SnapshotResult], bytes] | None = None,
              on_done: Callable[[Future], None] | None = None) -> Future:
        """Copy ``chunks`` into ``slot`` with a crc32c each; with ``manifest``, commit the slot with
        ``manifest(result)`` right after. The returned future resolves to the :class:`SnapshotResult` (crc32cs
        in chunk order) once written (and committed), or to the failure, the slot then freed. ``on_done(future)``
        runs on the copier's thread when it resolves; the copy starts last, so the caller may return at once."""
        out: Future = Future()
        if on_done is not None:
            out.add_done_callback(on_done)

        def copied(fut: Future) -> None:
            try:
                result = fut.result()
                if manifest is not None:
                    self.store.commit(slot, manifest(result))
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                self._abort_quietly(slot)
                out.set_exception(e)
            else:
                out.set_result(result)

        self.copier.submit(slot, chunks, on_done=copied)
        return out

    def commit(self, slot: Slot, manifest: bytes) -> None:
        """Commit a written slot with ``manifest`` (stored last: a reader never sees it half done); a failure
        frees the slot and is raised."""
        try:
            self.store.commit(slot, manifest)
        except BaseException:
            self._abort_quietly(slot)
            raise

    def abort(self, slot: Slot) -> None:
        """Free a slot that will not be committed (a committed one is left alone)."""
        self.store.abort(slot)

    def _abort_quietly(self, slot: Slot) -> None:
        try:
            self.store.abort(slot)
        except Exception:  # noqa: BLE001 - the failure that made us abort is the one to report
            log.exception("step %d: freeing the slot after a failed save failed", slot.step)

    # ----------------------------------------------------------------------------------------- retention
    def count(self, step: int) -> list[int]:
        """Count the committed ``step`` and apply retention (see the module docstring); returns the steps
        deleted from the store."""
        with self._lock:
            steps = sorted(set(self._counted) | {step})
            stay = set(steps[-self.keep:]) | {step}
            drop = [s for s in steps if s not in stay]
            self._counted = [s for s in steps if s in stay]
            self._deferred.update(s for s in drop if self._pins.get(s))
            drop = [s for s in drop if not self._pins.get(s)]
        for s in drop:
            self.store.delete(s)
        return drop

    def discard(self, step: int) -> None:
        """Delete ``step``, committed here but not counted (another process failed it)."""
        self.store.delete(step)

    def counted(self) -> list[int]:
        """Counted steps retention keeps, ascending (pinned ones past ``keep`` not included)."""
        with self._lock:
            return list(self._counted)

    def adopt(self, steps: Iterable[int]) -> None:
        """Make ``steps`` the counted ones (what an earlier run left and the job agreed on)."""
        with self._lock:
            self._counted = sorted(set(steps))

    def forget(self, steps: Iterable[int]) -> None:
        """Stop counting and pinning ``steps`` (the job forgot them); their bytes are the caller's to delete."""
        gone = set(steps)
        with self._lock:
            self._counted = [s for s in self._counted if s not in gone]
            for s in gone:
                self._pins.pop(s, None)
                self._deferred.discard(s)
                self._spares.pop(s, None)

    def pin(self, step: int, *, let_go: bool = False, spare: str = "") -> None:
        """Keep ``step`` past retention until :meth:`unpin`; ``let_go``: retention already let it go (it is
        freed with its last pin); ``spare`` ("fallback" or "guard"): it gives way to a save that would not fit
        the budget otherwise (see the module docstring)."""
        if spare not in ("", "fallback", "guard"):
            raise ValueError(f"step {step}: a spare is a 'fallback' or the 'guard', got {spare!r}")
        with self._lock:
            self._pins[step] = self._pins.get(step, 0) + 1
            if let_go:
                self._deferred.add(step)
            if spare:
                self._spares[step] = spare

    def unpin(self, step: int) -> None:
        """Drop one pin of ``step``; a step retention already let go is freed with its last pin."""
        with self._lock:
            n = self._pins.get(step, 0) - 1
            if n > 0:
                self._pins[step] = n
                return
            self._pins.pop(step, None)
            self._spares.pop(step, None)
            free = step in self._deferred
            self._deferred.discard(step)
        if free:
            self.store.delete(step)

    def pinned(self) -> list[int]:
        """Pinned steps, ascending."""
        with self._lock:
            return sorted(s for s, n in self._pins.items() if n > 0)

    def close(self) -> None:
        """Finish queued writes and stop the copy workers (the store is the caller's)."""
        with self._lock:
            copier, self._copier = self._copier, None
        if copier is not None:
            copier.close()
