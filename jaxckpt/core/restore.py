"""The restore driver every front end runs: plan each array once, prefetch, fetch, assemble, make, report.

A front end (JAX, torch, or a plain numpy one) turns each leaf of its target into either an
:class:`ArrayRequest` (the saved array's metadata, the boxes this process needs of it, and how to make the
front end's array from those boxes as host numpy arrays) or a ready value (a leaf with no saved bytes). The
driver then, for one opened step (``CheckpointEngine.open``):

  1. plans every requested array exactly once (``jaxckpt.core.plan.plan_restore``), in leaf order, so the
     first leaf that cannot be restored raises its own error before any byte is fetched;
  2. prefetches every saved chunk the plans read, each once, in parallel and verified, from the cheapest
     source that holds it, falling back to the next (``ChunkReader.prefetch``: local memory, the node's agent,
     peers, rebuilds from parity or copies);
  3. assembles each needed box from the fetched chunks (large boxes on a thread pool, a bounded window of
     arrays ahead of the one being made) and hands the boxes of each array to its ``make`` in leaf order;
  4. records bytes and seconds per phase in the reader's report (``report.timeline``, a
     :class:`jaxckpt.core.timeline.RestoreTimeline`), which the engine keeps as ``last_restore_report``.

Numpy only: the front ends' frameworks appear here only behind ``make``.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from jaxckpt.core import plan as _plan
from jaxckpt.core.box import Box
from jaxckpt.core.dtypes import dtype_from_name
from jaxckpt.core.fetch import ChunkReader, assemble
from jaxckpt.core.manifest import ArrayMeta, ChunkMeta, Manifest
from jaxckpt.core.plan import HOST, Assembly
from jaxckpt.core.timeline import RestoreTimeline, Tally

if TYPE_CHECKING:
    from jaxckpt.core.engine import CheckpointEngine

log = logging.getLogger("jaxckpt.core.restore")

__all__ = ["ArrayRequest", "restore_leaves", "restore_step"]

# A box whose assembly copies at least this much goes to the thread pool; smaller ones (and zero-copy views)
# are cheaper inline than a task.
PARALLEL_BYTES = 1 << 20
# Host boxes assembled ahead of the array being made, at most (the next array's boxes are always allowed):
# bounds the host memory held beyond what the restored arrays keep, while assembly overlaps ``make``.
LOOKAHEAD_BYTES = 128 << 20


@dataclass
class ArrayRequest:
    """What a front end asks of one saved array.

    ``needed`` maps each box (global coordinates) this process needs to the local device ids that need it
    (``HOST`` for a host array). ``make`` receives ``{box: host array}`` (the saved dtype, the box's shape) and
    returns the front end's value for the leaf. ``private``: every host array must be memory of its own (a
    copy when the bytes would otherwise be a read-only view of a store); otherwise a box equal to one saved
    chunk may come as a view that is only valid inside the opened step, so ``make`` must copy it or hand it to
    something that does. ``out`` optionally gives, per box, an array (e.g. a view of the target's own memory)
    to assemble that box into; ``make`` then receives those arrays.
    """

    meta: ArrayMeta
    needed: Mapping[Box, Sequence[int]]
    make: Callable[[dict[Box, np.ndarray]], Any]
    private: bool = False
    out: Mapping[Box, np.ndarray] | None = None

    @classmethod
    def whole(cls, meta: ArrayMeta, make: Callable[[np.ndarray], Any], *, private: bool = False,
              box: Box | None = None, out: np.ndarray | None = None) -> "ArrayRequest":
        """A request for one host box (default: the whole array); ``make`` receives that one host array."""
        box = Box.full(meta.shape) if box is None else box
        return cls(meta, {box: [HOST]}, lambda hosts: make(hosts[box]), private,
                   None if out is None else {box: out})


@dataclass
class _Job:
    request: ArrayRequest
    plans: list[Assembly]
    dtype: np.dtype
    nbytes: int
    big: list[Assembly]  # boxes whose assembly copies at least PARALLEL_BYTES
    big_bytes: int


def _job(request: ArrayRequest, plans: list[Assembly]) -> _Job:
    dtype = dtype_from_name(request.meta.dtype)
    sizes = [a.box.size * dtype.itemsize for a in plans]
    out, big = request.out or {}, []
    for a, n in zip(plans, sizes):
        # A box that is exactly one saved chunk is a view unless it must be private or go into ``out``.
        copies = request.private or a.box in out or not a.whole_chunk
        if copies and n >= PARALLEL_BYTES:
            big.append(a)
    return _Job(request, plans, dtype, sum(sizes), big, sum(a.box.size for a in big) * dtype.itemsize)


def restore_step(engine: "CheckpointEngine", step: int | None,
                 fill: Callable[[int, list[Manifest], ChunkReader], Any]) -> Any:
    """Open ``step`` (default: the latest committed) on ``engine`` and return ``fill(step, manifests, reader)``,
    the front end's state built through :func:`restore_leaves`; the engine keeps the report."""
    t0 = time.perf_counter()
    with engine.open(step) as (step, manifests, reader):
        out = fill(step, manifests, reader)
    log.info("restored step %d in %.3fs (bytes by source process: %s)", step, time.perf_counter() - t0,
             reader.bytes_by_process)
    return out


@functools.lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="jaxckpt-restore")


def restore_leaves(items: Iterable[ArrayRequest | Any], reader: ChunkReader, *, step: int,
                   process: int) -> list[Any]:
    """The value of every item, in order: ``make``'s result for an :class:`ArrayRequest`, the item itself
    otherwise. ``items`` may be a generator: it is consumed (and each array planned) in order before any
    chunk is fetched, so the first leaf that cannot be described or planned raises its error first."""
    timeline = reader.report.timeline
    jobs: list[Any] = []
    chunks: list[tuple[str, ChunkMeta]] = []
    planning = Tally("plan")
    try:
        for item in items:
            if not isinstance(item, ArrayRequest):
                jobs.append(item)
                continue
            t0 = time.perf_counter()
            plans = _plan.plan_restore(item.meta, item.needed, step=step, prefer_process=process)
            job = _job(item, plans)
            chunks += [(item.meta.path, r.chunk) for a in plans for r in a.reads]
            planning.add(t0, time.perf_counter(), job.nbytes)
            jobs.append(job)
    finally:
        planning.flush(timeline)
    reader.prefetch(chunks)
    return _build(jobs, reader, timeline)


def _assemble(a: Assembly, job: _Job, reader: ChunkReader, tally: Tally | None = None,
              timeline: RestoreTimeline | None = None) -> np.ndarray:
    """One host box; timed into ``tally`` (this thread's) or straight into ``timeline`` (a pool thread)."""
    t0 = time.perf_counter()
    out = job.request.out.get(a.box) if job.request.out is not None else None
    host = assemble(a, job.dtype, reader, job.request.private, out=out)
    nbytes = a.box.size * job.dtype.itemsize
    if tally is not None:
        tally.add(t0, time.perf_counter(), nbytes)
    else:
        timeline.record("assemble", t0, time.perf_counter(), nbytes)
    return host


def _build(jobs: list[Any], reader: ChunkReader, timeline: RestoreTimeline) -> list[Any]:
    """Assemble and make every job in order, big boxes of the next arrays assembled ahead on the pool."""
    out: list[Any] = []
    ahead: dict[int, dict[Box, Future]] = {}  # job index -> its big boxes being assembled on the pool
    ahead_bytes, nxt = 0, 0
    pool = _pool()
    assembling, making = Tally("assemble"), Tally("device_put")
    try:
        for i, job in enumerate(jobs):
            if not isinstance(job, _Job):
                out.append(job)
                continue
            while nxt < len(jobs) and (nxt <= i or ahead_bytes < LOOKAHEAD_BYTES):
                j = jobs[nxt]
                # A lone big box of the array needed now is assembled here: a task would only add a hop.
                if isinstance(j, _Job) and j.big and not (nxt == i and len(j.big) == 1):
                    ahead[nxt] = {a.box: pool.submit(_assemble, a, j, reader, None, timeline) for a in j.big}
                    ahead_bytes += j.big_bytes
                nxt += 1
            mine = ahead.pop(i, None)
            if mine is None:
                hosts = {a.box: _assemble(a, job, reader, assembling) for a in job.plans}
            else:
                hosts = {a.box: mine[a.box].result() if a.box in mine else _assemble(a, job, reader, assembling)
                         for a in job.plans}
                ahead_bytes -= job.big_bytes
            t0 = time.perf_counter()
            out.append(job.request.make(hosts))
            making.add(t0, time.perf_counter(), job.nbytes)
    finally:
        assembling.flush(timeline)
        making.flush(timeline)
        # After an error no assembly may outlive the restore: the chunks it reads are views of sources that
        # are released when the step closes.
        for fs in ahead.values():
            for f in fs.values():
                f.cancel()
        for fs in ahead.values():
            for f in fs.values():
                if not f.cancelled():
                    f.exception()  # waits; the error that ended the restore is the one raised
    return out
