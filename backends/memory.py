"""The embedded default store: snapshots in this process's own memory, no agent needed.

Buffers of freed snapshots go back to a pool and are reused by later saves of the same layout, so after the
first few steps a save allocates nothing (and pays no page faults). With ``keep=1`` the store holds one committed
snapshot plus the one being written: double-buffered, and the writer never touches the committed buffer.

A committed buffer is immutable, so a restore on CPU lends it (``_View.lend``) instead of copying it: the restored
arrays use it as their memory (XLA never writes into host memory it adopted: a donating step allocates its
output elsewhere), and the buffer is never pooled again once lent; it is freed when the last of them goes.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import numpy as np

from jaxckpt.core import hostbuf
from jaxckpt.config import Config
from jaxckpt.errors import BudgetExceededError, ClosedError, StepError, StepNotFoundError
from jaxckpt.core.store import Slot, SnapshotView, Store

log = logging.getLogger("jaxckpt.backends.memory")

WRITING, COMMITTED = "writing", "committed"


@dataclass
class _Entry:
    step: int
    buf: np.ndarray
    nbytes: int
    state: str = WRITING
    manifest: bytes = b""
    pins: int = 0
    doomed: bool = False
    lent: bool = False  # restored arrays use this memory: never back to the pool


class _View(SnapshotView):
    def __init__(self, store: "MemoryStore", entry: _Entry) -> None:
        self._store, self._entry = store, entry
        self.step = entry.step
        self.manifest = entry.manifest
        self.buffer = memoryview(entry.buf[:entry.nbytes]).toreadonly()
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.buffer = memoryview(b"")
            self._store._unpin(self._entry)

    def lend(self) -> bool:
        with self._store._lock:
            self._entry.lent = True
        return True


class MemoryStore(Store):
    """Snapshots held in numpy buffers of this process."""

    name = "memory"

    def __init__(self, config: Config, *, process_index: int = 0, process_count: int = 1) -> None:
        super().__init__(config, process_index=process_index, process_count=process_count)
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}
        self._pool: list[np.ndarray] = []
        self._closed = False
        self.allocations = 0  # buffers allocated so far: flat after warm-up, which tests check

    def reserve(self, step: int, nbytes: int) -> Slot:
        with self._lock:
            self._check_open()
            if step in self._entries:
                raise StepError(f"step {step} is already held by the memory store ({self._entries[step].state})")
            buf = self._take_buffer(step, nbytes)
            entry = _Entry(step, buf, nbytes)
            self._entries[step] = entry
        return Slot(step, nbytes, memoryview(buf[:nbytes]), token=entry)

    def _take_buffer(self, step: int, nbytes: int) -> np.ndarray:
        fits = [b for b in self._pool if b.nbytes >= nbytes]
        if fits:
            best = min(fits, key=lambda b: b.nbytes)
            self._pool = [b for b in self._pool if b is not best]
            return best
        budget = self.config.memory_budget_bytes
        if budget and self._held() + nbytes > budget:
            self._pool.clear()  # idle buffers are the first thing to give back
            if self._held() + nbytes > budget:
                committed = sorted(e.step for e in self._entries.values() if e.state == COMMITTED)
                raise BudgetExceededError(
                    f"step {step}: snapshot of {nbytes} bytes does not fit the memory budget of {budget} bytes "
                    f"({self._held()} held; committed steps {committed} are kept)")
        self.allocations += 1
        return hostbuf.empty(max(nbytes, 1), np.uint8)  # aligned: a CPU device can adopt lent chunks

    def commit(self, slot: Slot, manifest: bytes) -> None:
        with self._lock:
            self._check_open()
            entry: _Entry = slot.token
            if self._entries.get(slot.step) is not entry or entry.state != WRITING:
                raise StepError(f"step {slot.step}: slot is not being written (state {entry.state})")
            entry.manifest = bytes(manifest)
            entry.state = COMMITTED  # last: a reader can see the step only from here on

    def abort(self, slot: Slot) -> None:
        with self._lock:
            entry: _Entry = slot.token
            if self._entries.get(slot.step) is entry and entry.state == WRITING:
                del self._entries[slot.step]
                self._pool.append(entry.buf)

    def steps(self) -> list[int]:
        with self._lock:
            return sorted(s for s, e in self._entries.items() if e.state == COMMITTED and not e.doomed)

    def open(self, step: int) -> SnapshotView | None:
        with self._lock:
            self._check_open()
            entry = self._entries.get(step)
            if entry is None or entry.state != COMMITTED or entry.doomed:
                return None
            entry.pins += 1
        return _View(self, entry)

    def slot_bytes(self, step: int) -> np.ndarray:
        """The bytes of the slot of ``step`` in place, writable (the whole buffer, which may be longer than the
        snapshot): what a test damages to see a checksum catch it. StepNotFoundError if no slot holds ``step``."""
        with self._lock:
            entry = self._entries.get(step)
            if entry is None:
                raise StepNotFoundError(f"step {step} is not held by the memory store (held: {sorted(self._entries)})")
            return entry.buf

    def _unpin(self, entry: _Entry) -> None:
        with self._lock:
            entry.pins -= 1
            if entry.doomed and entry.pins == 0:
                self._free(entry)

    def delete(self, step: int) -> None:
        with self._lock:
            entry = self._entries.get(step)
            if entry is None or entry.state != COMMITTED or entry.doomed:
                return
            entry.doomed = True
            if entry.pins == 0:
                self._free(entry)

    def _free(self, entry: _Entry) -> None:
        del self._entries[entry.step]
        if not self._closed and not entry.lent:
            self._pool.append(entry.buf)

    def _held(self) -> int:
        return sum(e.buf.nbytes for e in self._entries.values()) + sum(b.nbytes for b in self._pool)

    def held_bytes(self) -> int:
        with self._lock:
            return self._held()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._pool.clear()
            for s, e in list(self._entries.items()):
                if e.pins == 0:
                    del self._entries[s]
                else:
                    e.doomed = True  # open views stay readable; their last close frees the buffer

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("memory store is closed")
