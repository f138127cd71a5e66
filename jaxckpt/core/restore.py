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

With a ``gather`` (a multi-process front end's collective, :class:`Gather`), arrays whose request carries a
target ``layout`` are routed first (``jaxckpt.core.routes.plan_route``, after one round in which every process
says which saving processes it reads from its node's memory): an array routed ``collective`` is not fetched;
this process reads only the chunks it contributes, lays them into its rows of the staging array, and after a
round in which every process confirms its rows are ready, ``gather.run`` forms the target's arrays with the
framework's collective. The route of every array and the bytes the collective brought go to the report.

Numpy only: the front ends' frameworks appear here only behind ``make``.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol, Sequence

import numpy as np

from jaxckpt.core import collector, hostbuf
from jaxckpt.core import plan as _plan
from jaxckpt.core import routes as _routes
from jaxckpt.core.box import Box
from jaxckpt.core.dtypes import dtype_from_name
from jaxckpt.core.collective import agree
from jaxckpt.core.fallback import agree_outcome
from jaxckpt.core.fetch import ChunkReader, assemble
from jaxckpt.core.manifest import ArrayMeta, ChunkMeta, Manifest
from jaxckpt.core.plan import HOST, Assembly
from jaxckpt.core.timeline import RestoreTimeline, Tally

if TYPE_CHECKING:
    from jaxckpt.core.engine import CheckpointEngine

log = logging.getLogger("jaxckpt.core.restore")

__all__ = ["ArrayRequest", "Gather", "Staged", "restore_leaves", "restore_step"]

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
    # Where the target array lives over all processes (jaxckpt.core.routes): with a Gather, the array may be
    # formed by the collective; ``target`` is the front end's own description of it (a sharding), for ``run``.
    layout: "_routes.TargetLayout | None" = None
    target: Any = None

    @classmethod
    def whole(cls, meta: ArrayMeta, make: Callable[[np.ndarray], Any], *, private: bool = False,
              box: Box | None = None, out: np.ndarray | None = None) -> "ArrayRequest":
        """A request for one host box (default: the whole array); ``make`` receives that one host array."""
        box = Box.full(meta.shape) if box is None else box
        return cls(meta, {box: [HOST]}, lambda hosts: make(hosts[box]), private,
                   None if out is None else {box: out})


@dataclass
class Staged:
    """An array routed to the collective: its request, its route, and this process's staging rows (device id ->
    a 1-d host array of ``route.row_elements`` elements, for this process's devices among ``route.devices``)."""

    request: ArrayRequest
    route: "_routes.Route"
    rows: dict[int, np.ndarray]


class Gather(Protocol):
    """A front end's collective (e.g. ``jaxckpt.jax.gather.JaxGather``)."""

    process_count: int

    def all_gather(self, name: str, value: Any) -> list:
        """Every process's ``value`` (or the error ``value()`` raised, raised everywhere), by process."""

    def local_devices(self, devices: Sequence[int]) -> list[int]:
        """The ids among ``devices`` that are this process's."""

    def run(self, staged: list[Staged]) -> list[Any]:
        """The front end's arrays of ``staged``, formed by one collective program per device set."""


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
                 fill: Callable[[int, list[Manifest], ChunkReader], Any], *, near: bool = False) -> Any:
    """Open ``step`` (default: the latest committed) on ``engine`` and return ``fill(step, manifests, reader)``,
    the front end's state built through :func:`restore_leaves`; the engine keeps the report.

    With ``step=None`` every process of a job must call this (one round, ``jaxckpt.core.fallback``): when the
    newest step cannot be read bit for bit on some process, every process falls back to the newest older step
    they all hold, in this same call, and the report's ``skipped`` says why.

    ``near`` (``fill`` runs no collective round): ``fill`` first gets only this node's manifests
    (``CheckpointEngine.open``), so a restore that needs nothing but this node's memory asks no other node; when
    it raises (a box those manifests do not cover, a chunk with no good copy on this node) the step is opened
    again with every process's manifests and ``fill`` runs once more (the report's ``widened`` says why)."""
    t0 = time.perf_counter()
    skipped: list[str] = []
    passed: list[int] = []
    want, begun = step, None
    while True:
        error: Exception | None = None
        out, opened = None, [None]
        try:
            out = _open_fill(engine, want, fill, near, opened)
        except Exception as e:  # noqa: BLE001 - every process hears of it in the outcome round, then it raises
            if step is not None:
                raise
            error = e
        at = opened[0]
        if step is not None:
            break
        tried = at if at is not None else _attempted(engine, want)
        decided = agree_outcome(engine, tried, error)
        if decided.fallback is None:
            break
        skipped.append(decided.skipped)
        passed.append(tried)
        want = decided.fallback
        begun = max(b for b in (begun, decided.newest_begun, tried) if b is not None)
    if passed:
        engine.forget_newer(at, passed, begun)
    report = engine.last_restore_report
    if report is not None:
        report.skipped = skipped
    log.info("restored step %d in %.3fs (bytes by source process: %s)%s", at, time.perf_counter() - t0,
             report.bytes_by_process if report is not None else {},
             f"; passed over: {'; '.join(skipped)}" if skipped else "")
    return out


def _open_fill(engine: "CheckpointEngine", want: int | None, fill: Callable[[int, list[Manifest], ChunkReader], Any],
               near: bool, opened: list[int | None]) -> Any:
    """``fill`` over ``want`` opened near first (see :func:`restore_step`), else over every process's manifests;
    ``opened[0]``: the step opened (what a failed attempt was for)."""
    why = ""
    if near:
        with engine.open(want, near=True) as (at, manifests, reader):
            opened[0] = at
            if not manifests or len(manifests) >= manifests[0].process_count:  # nothing left out: no second try
                return fill(at, manifests, reader)
            try:
                return fill(at, manifests, reader)
            except Exception as e:  # noqa: BLE001 - the same fill runs again below, over every manifest
                why = f"{type(e).__name__}: {e}"
        log.debug("process %d: step %d needs more than this node's snapshots (%s); opening every process's",
                  engine.process_index, at, why)
        want = at
    with engine.open(want) as (at, manifests, reader):
        opened[0] = at
        reader.report.widened = why
        return fill(at, manifests, reader)


def _attempted(engine: "CheckpointEngine", want: int | None) -> int | None:
    """The step an attempt that failed before it opened one was for."""
    return want if want is not None else engine.newest_step()


@functools.lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="jaxckpt-restore")


def restore_leaves(items: Iterable[ArrayRequest | Any], reader: ChunkReader, *, step: int,
                   process: int, gather: Gather | None = None) -> list[Any]:
    """The value of every item, in order: ``make``'s result for an :class:`ArrayRequest`, the item itself
    otherwise. ``items`` may be a generator: it is consumed (and each array planned) in order before any
    chunk is fetched, so the first leaf that cannot be described or planned raises its error first.

    With ``gather`` in a job of several processes, every process must call this for the same target (the
    routing rounds and the collective programs are collective); a process's own error still raises as is.

    The collector is paused meanwhile: a restore makes several objects per chunk (plans, reads, host pieces,
    arrays) that live until it returns, and a 4,096-leaf restore spent a fifth of its time in the young
    collections they set off (measured: 1,609 -> 1,242 ms); reference counts still free what dies sooner."""
    with collector.paused():
        return _restore_leaves(items, reader, step=step, process=process, gather=gather)


def _restore_leaves(items: Iterable[ArrayRequest | Any], reader: ChunkReader, *, step: int,
                    process: int, gather: Gather | None) -> list[Any]:
    timeline = reader.report.timeline
    if gather is not None and gather.process_count <= 1:
        gather = None
    jobs: list[Any] = []
    chunks: list[tuple[str, ChunkMeta]] = []
    pending: list[int] = []  # jobs that may go by the collective, routed once every process has planned
    planning = Tally("plan")
    error: Exception | None = None
    costs = reader.process_costs()  # copies of one box (whole replicas): this node's first
    try:
        for item in items:
            if not isinstance(item, ArrayRequest):
                jobs.append(item)
                continue
            t0 = time.perf_counter()
            plans = _plan.plan_restore(item.meta, item.needed, step=step, prefer_process=process, cost=costs)
            job = _job(item, plans)
            if gather is not None and item.layout is not None:
                pending.append(len(jobs))
            else:
                chunks += [(item.meta.path, r.chunk) for a in plans for r in a.reads]
            planning.add(t0, time.perf_counter(), job.nbytes)
            jobs.append(job)
    except Exception as e:
        if gather is None:
            raise
        error = e  # the other processes learn of it in the routing round instead of waiting for it there
    finally:
        planning.flush(timeline)
    staged: dict[int, Staged] = {}
    if gather is not None:
        staged = _route(jobs, pending, chunks, reader, gather, error, process)
    if not staged and not reader.near(chunks):
        return _build_while_fetching(jobs, chunks, reader, timeline)
    if not staged:  # this node's memory only: nothing to wait for, so nothing to overlap (a thread only costs)
        reader.prefetch(chunks)
        return _build(jobs, reader, timeline)
    try:
        reader.prefetch(chunks)
        rows = _stage(staged, reader, timeline)
    except Exception as e:  # noqa: BLE001 - every process hears of it in the next round, then it raises
        error = e
    agree(gather, "restore staged", error)
    t0 = time.perf_counter()
    values = gather.run([Staged(jobs[i].request, r.route, rows[i]) for i, r in staged.items()])
    timeline.record("collective", t0, time.perf_counter(), reader.report.collective_bytes, len(values))
    for i, v in zip(staged, values):
        jobs[i] = v  # made: handed back as it is
    return _build(jobs, reader, timeline)


def _build_while_fetching(jobs: list[Any], chunks: list[tuple[str, ChunkMeta]], reader: ChunkReader,
                          timeline: RestoreTimeline) -> list[Any]:
    """``_build`` while the prefetch runs behind it: an array is assembled and made as soon as its chunks are in
    (a chunk it needs first is fetched, or waited for, through the reader, each still once), so the copies and
    device transfers of the first arrays overlap the fetches of the last. The prefetch's error, the first in
    plan order, is the one raised; neither outlives the restore (the chunks are views of the opened step)."""
    failed: list[BaseException] = []

    def fetch() -> None:
        try:
            reader.prefetch(chunks)
        except BaseException as e:  # noqa: BLE001 - raised on the restoring thread below
            failed.append(e)
    behind = threading.Thread(target=fetch, name="jaxckpt-prefetch", daemon=True)
    behind.start()
    try:
        out = _build(jobs, reader, timeline)
    except BaseException:
        behind.join()
        if failed:
            raise failed[0] from None
        raise
    behind.join()
    if failed:
        raise failed[0]
    return out


def _route(jobs: list[Any], pending: list[int], chunks: list[tuple[str, ChunkMeta]], reader: ChunkReader,
           gather: Gather, error: Exception | None, process: int) -> dict[int, "_Routed"]:
    """Route every pending job (one round: which saving processes each process reads from its node's memory);
    the chunks each needs are added to ``chunks``; the jobs routed to the collective are returned."""
    held = agree(gather, "restore holders", error, reader.local_processes())
    t0 = time.perf_counter()
    holders: dict[int, list[int]] = {}
    for p, qs in enumerate(held):
        for q in qs:
            holders.setdefault(q, []).append(p)
    report, load, out = reader.report, {}, {}
    for i in pending:
        job: _Job = jobs[i]
        req = job.request
        route = _routes.plan_route(req.meta, req.layout, holders, process_count=gather.process_count, load=load)
        report.routes[req.meta.path] = route.kind if route.kind == _routes.COLLECTIVE else \
            f"{route.kind}: {route.reason}"
        if route.kind != _routes.COLLECTIVE:
            chunks += [(req.meta.path, r.chunk) for a in job.plans for r in a.reads]
            continue
        chunks += [(req.meta.path, c.chunk) for c in route.mine(process)]
        report.collective_bytes += _routes.received_elements(route, req.layout, process) * job.dtype.itemsize
        out[i] = _Routed(route, job.dtype, gather.local_devices(route.devices))
    n = sum(1 for i in pending if i in out)
    if pending:
        log.info("step %d on process %d: %d of %d array(s) formed by collective (%d bytes brought), the others "
                 "fetched", report.step, process, n, len(pending), report.collective_bytes)
    report.timeline.record("plan", t0, time.perf_counter(), 0, 0)
    return out


@dataclass
class _Routed:
    route: "_routes.Route"
    dtype: np.dtype
    devices: list[int]  # this process's staging rows


def _stage(staged: dict[int, _Routed], reader: ChunkReader, timeline: RestoreTimeline) -> dict[int, dict]:
    """This process's staging rows of every collective array, filled with the chunks it contributes."""
    out: dict[int, dict[int, np.ndarray]] = {}
    tally = Tally("assemble")
    try:
        for i, r in staged.items():
            t0 = time.perf_counter()
            rows = {d: hostbuf.empty(r.route.row_elements, r.dtype) for d in r.devices}
            n = 0
            for c in r.route.mine(reader.report.process):
                src = reader.array(r.route.path, c.chunk, r.dtype).reshape(-1)
                rows[c.device][c.offset:c.offset + src.size] = src
                n += src.nbytes
            out[i] = rows
            tally.add(t0, time.perf_counter(), n)
    finally:
        tally.flush(timeline)
    return out


def _assemble(a: Assembly, job: _Job, reader: ChunkReader, tally: Tally | None = None,
              timeline: RestoreTimeline | None = None) -> np.ndarray:
    """One host box; timed into ``tally`` (this thread's) or straight into ``timeline`` (a pool thread). Its
    chunks are had first (fetched, or waited for while the prefetch brings them): the time counted is the copy's."""
    for r in a.reads:
        reader.raw(a.path, r.chunk)
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
