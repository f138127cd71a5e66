"""Levels 1 and 2 of a snapshot: device-to-host transfers under a byte budget, then copy + checksum on workers.

The training thread only calls :meth:`Copier.submit` with a function that builds the list of :class:`CopyTask`;
the dispatcher thread runs it, so the per-chunk Python of a save is off the training thread.

Level 1 (device): a dispatcher thread calls each task's ``start()`` (``copy_to_host_async`` of a device-side
copy) in plan order while the bytes in flight stay under ``Config.inflight_bytes``. Why this order and bound:
the device-side copies were all dispatched inside ``save()``, so on the device stream they sit before the next
step and read the state before any donated update can write it; the transfers to host then run on the copy
engine alongside that step. Plan order is the pytree's order (parameters, then optimizer moments), which is
also the order in which the next step's forward pass wants memory bandwidth, so the oldest transfers finish
first; the budget keeps pinned staging memory and link contention bounded so that the step's own transfers
(e.g. the input batch) never queue behind a whole state. On CPU there is no transfer: ``start`` is None and
the workers read zero-copy views taken at ``save()``.

Level 2 (host): worker threads copy each chunk into the store's preallocated slot and checksum it (numpy's
copy and crc32c both release the GIL on large buffers), dropping their reference to the shard read as soon as
their chunk is done.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np

from jaxckpt.core.checksum import crc32c
from jaxckpt.core.store import Slot

log = logging.getLogger("jaxckpt.core.copier")


@dataclass
class CopyTask:
    """One chunk: ``fetch()`` returns its bytes as a host array (may block on a transfer ``start()`` began)."""

    fetch: Callable[[], np.ndarray]
    offset: int
    nbytes: int
    start: Callable[[], None] | None = None


class Chunks(Protocol):
    """A save's chunks as one table (what :meth:`Copier.submit` takes besides a list of :class:`CopyTask`).

    A state of thousands of shards made a Python object or three per chunk (a task, its closure) that lived as
    long as the copy: enough to promote into the collector's oldest generation and set off a full collection
    (100+ ms of the training thread's time with JAX's heap) every few saves. A table keeps per chunk only
    what a plan already holds; the copier asks it for each chunk's bytes when a worker copies that chunk."""

    offsets: Sequence[int]  # per chunk, its byte offset in the slot
    sizes: Sequence[int]  # per chunk, its bytes

    def start(self, i: int) -> None:
        """Begin chunk ``i``'s transfer to host, if it has one (called in order, under the byte budget)."""

    def fetch(self, i: int) -> np.ndarray:
        """Chunk ``i``'s bytes as a host array (may wait for its transfer)."""

    def done(self, lo: int, hi: int) -> None:
        """Chunks ``lo`` to ``hi - 1`` are copied (or failed): drop what only they read. Called under a lock."""


class _TaskList:
    """A list of :class:`CopyTask` as :class:`Chunks`."""

    def __init__(self, tasks: list[CopyTask]) -> None:
        self._tasks = tasks
        self.offsets = [t.offset for t in tasks]
        self.sizes = [t.nbytes for t in tasks]

    def start(self, i: int) -> None:
        start = self._tasks[i].start
        if start is not None:
            start()

    def fetch(self, i: int) -> np.ndarray:
        return self._tasks[i].fetch()

    def done(self, lo: int, hi: int) -> None:
        for task in self._tasks[lo:hi]:
            # Drop these chunks' references to their shard reads now: a view released early lets a later
            # donating step reuse that buffer instead of allocating a fresh one.
            task.fetch = task.start = None  # type: ignore[assignment]


@dataclass
class SnapshotResult:
    crcs: list[int]
    seconds: float


# Copy and checksum in blocks that stay in the core's cache: the checksum then reads what the copy just wrote
# from cache instead of from memory (measured here: 12 GB/s against 9 GB/s for copy-then-checksum of 256 MB).
BLOCK_BYTES = 512 << 10
BATCH_BYTES, BATCH_TASKS = 1 << 20, 256  # chunks smaller than this are handed to a worker together
# Chunks up to this size are copied under the GIL and checksummed without releasing it (the crc32c library lets
# it go from 32 KiB on). Above it, the copy must release the GIL too: a worker copying under the GIL while another
# comes back from its checksum made that one wait for it, chunk after chunk, and two workers took an idle 879-leaf
# snapshot (218 MiB in 1,314 chunks) in 68 ms where they take 40 once both calls release it (BENCHMARKS.md).
SMALL_BYTES = 32 << 10


def copy_and_checksum(out: np.ndarray, src: np.ndarray) -> int:
    """Copy ``src`` into the uint8 buffer ``out`` (exactly its size) and return the crc32c of the bytes written."""
    contiguous = src.flags.c_contiguous
    if contiguous and src.dtype.isbuiltin == 1 and 0 < src.nbytes <= SMALL_BYTES:
        # A small chunk (a state of thousands of leaves): the buffer protocol's copy costs two thirds of numpy's
        # view, reshape and copyto (1.1 against 1.6 us of CPU per 1 KiB chunk, measured here). numpy exports no
        # buffer of a dtype it does not define (isbuiltin 2: bfloat16); those, and byte-swapped or structured
        # dtypes (isbuiltin 0), take copyto below.
        written = memoryview(out)
        written[:] = memoryview(src).cast("B")
        return crc32c(written)
    if not contiguous or src.nbytes <= BLOCK_BYTES:
        np.copyto(out.view(src.dtype).reshape(src.shape), src, casting="no")
        return crc32c(out)
    flat = src.reshape(-1).view(np.uint8)
    crc = 0
    for off in range(0, out.nbytes, BLOCK_BYTES):
        block = out[off:off + BLOCK_BYTES]
        np.copyto(block, flat[off:off + BLOCK_BYTES])
        crc = crc32c(block, crc)
    return crc


def _raiser(e: BaseException) -> Callable[[], np.ndarray]:
    def fetch() -> np.ndarray:
        raise e
    return fetch


class _Job:
    """One snapshot being copied: the batches the dispatcher admitted under the budget (``bounds``: batch ``k`` is
    chunks ``bounds[k]`` to ``bounds[k + 1] - 1``, of ``sizes[k]`` bytes) and what the workers took and finished.
    A save makes this object and its lists, nothing per batch or per chunk (a thread pool's hand-over made a
    future, a work item and their locks and lists per batch: most of a save's young collections once the
    manifest made none)."""

    __slots__ = ("chunks", "dst", "crcs", "bounds", "sizes", "taken", "pending", "admitting", "errors", "release",
                 "fut", "t0")

    def __init__(self, chunks: Chunks, dst: np.ndarray, release, fut: Future, t0: float) -> None:
        self.chunks, self.dst, self.release, self.fut, self.t0 = chunks, dst, release, fut, t0
        self.crcs = [0] * len(chunks.sizes)
        self.bounds = [0]
        self.sizes: list[int] = []
        self.taken = 0  # batches a worker took
        self.pending = len(chunks.sizes)  # chunks not yet copied (or failed)
        self.admitting = True  # the dispatcher still admits batches (and may wait for budget)
        self.errors: list[BaseException] = []


class Copier:
    """A few copy workers plus one dispatcher enforcing the in-flight byte budget.

    The dispatcher admits a snapshot's chunks in batches, in plan order, under the budget; idle workers take the
    next admitted batch from the snapshot itself (a counter under one lock), so handing a batch over allocates
    nothing and wakes one worker, and a worker that finishes a batch takes the next one without sleeping."""

    def __init__(self, workers: int = 2, inflight_bytes: int = 256 << 20) -> None:
        self._budget = inflight_bytes
        self._inflight = 0
        lock = threading.Lock()
        self._room = threading.Condition(lock)  # the dispatcher waits here for budget
        self._ready = threading.Condition(lock)  # idle workers wait here for a batch
        self._job: _Job | None = None
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._stopping = False
        self._workers = [threading.Thread(target=self._work, name=f"jaxckpt-copy_{i}", daemon=True)
                         for i in range(max(1, workers))]
        for w in self._workers:
            w.start()
        self._dispatcher = threading.Thread(target=self._dispatch, name="jaxckpt-dispatch", daemon=True)
        self._dispatcher.start()

    def submit(self, slot: Slot, tasks: list[CopyTask] | Chunks | Callable[[], list[CopyTask] | Chunks],
               release: Callable[[], None] | None = None,
               on_done: Callable[[Future], None] | None = None) -> Future:
        """Copy every task into ``slot``; the future resolves to a SnapshotResult (crcs in task order).

        ``tasks`` (a list of :class:`CopyTask` or a :class:`Chunks` table) may be a function returning them: it
        then runs on the dispatcher thread, so the caller pays nothing per chunk (an exception it raises fails
        the future).

        ``release`` runs once all copies are done (or failed): the caller drops its views of the shards
        buffers there, so a donating step can reuse them as early as possible. ``on_done(future)`` is
        attached before the work is queued (so the caller can queue it last: waking the dispatcher may cost
        the caller its core on a busy machine).
        """
        fut: Future = Future()
        if on_done is not None:
            fut.add_done_callback(on_done)
        self._queue.put((slot, tasks, release, fut))
        return fut

    def _dispatch(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            slot, tasks, release, fut = item
            del item
            if callable(tasks):
                make, tasks = tasks, None
                try:
                    tasks = make()
                except BaseException as e:  # noqa: BLE001 - delivered through the future
                    tasks = [CopyTask(fetch=_raiser(e), offset=0, nbytes=0)]
                del make  # the shard reads it captured now live only in the tasks
            if isinstance(tasks, list):
                tasks = _TaskList(tasks)
            self._run_one(slot, tasks, release, fut)
            del tasks, slot, release, fut

    def _run_one(self, slot: Slot, chunks: Chunks, release, fut: Future) -> None:
        job = _Job(chunks, np.frombuffer(slot.buffer, dtype=np.uint8), release, fut, time.perf_counter())
        sizes = chunks.sizes
        n = len(sizes)
        if not n:
            self._finish(job)
            return
        with self._room:
            self._job = job
        # Small chunks (a state of many small leaves) go to the workers in batches of up to BATCH_BYTES: one
        # hand-over per chunk would cost more than its copy and keep the GIL busy while the step runs.
        lo, limit = 0, min(BATCH_BYTES, self._budget)
        while lo < n:
            hi, nbytes = lo + 1, sizes[lo]
            while hi < n and hi - lo < BATCH_TASKS and nbytes + sizes[hi] <= limit:
                nbytes += sizes[hi]
                hi += 1
            with self._room:
                # One batch may exceed the budget alone; it then runs with nothing else in flight.
                while self._inflight and self._inflight + nbytes > self._budget:
                    self._room.wait()
                self._inflight += nbytes
            for i in range(lo, hi):
                try:
                    if not job.errors:
                        chunks.start(i)
                except BaseException as e:  # noqa: BLE001
                    job.errors.append(e)
            with self._ready:
                job.sizes.append(nbytes)
                job.bounds.append(hi)
                self._ready.notify()
            lo = hi
        with self._room:  # the workers finish the job; the next one starts after it
            job.admitting = False
            while job.pending:
                self._room.wait()
            self._job = None
        self._finish(job)

    def _work(self) -> None:
        ready = self._ready
        while True:
            with ready:
                while True:
                    job = self._job
                    if job is not None and job.taken < len(job.sizes):
                        k = job.taken
                        job.taken += 1
                        break
                    # Not held while idle: a job keeps its slot's buffer, whose segment (once the agent unlinks it)
                    # lived on mapped until this worker's next job
                    job = None
                    if self._stopping:
                        return
                    ready.wait()
            self._copy(job, job.bounds[k], job.bounds[k + 1], job.sizes[k])
            del job

    def _copy(self, job: _Job, lo: int, hi: int, nbytes: int) -> None:
        chunks, dst, crcs, errors = job.chunks, job.dst, job.crcs, job.errors
        offsets, sizes = chunks.offsets, chunks.sizes
        for i in range(lo, hi):
            try:
                if not errors:
                    off = offsets[i]
                    crcs[i] = copy_and_checksum(dst[off:off + sizes[i]], chunks.fetch(i))
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                errors.append(e)
        with self._room:
            try:
                chunks.done(lo, hi)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
            self._inflight -= nbytes
            job.pending -= hi - lo
            if job.admitting or not job.pending:  # the dispatcher may wait for budget, or for the job's end
                self._room.notify()

    def _finish(self, job: _Job) -> None:
        if job.release is not None:
            try:
                job.release()
            except Exception:  # releasing views must never mask the copy's own outcome
                log.exception("releasing shard views failed")
        if job.errors:
            job.fut.set_exception(job.errors[0])
        else:
            job.fut.set_result(SnapshotResult(job.crcs, time.perf_counter() - job.t0))

    def close(self) -> None:
        """Finish queued snapshots, then stop the threads."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._dispatcher.join()
        with self._ready:
            self._stopping = True
            self._ready.notify_all()
        for w in self._workers:
            w.join()
