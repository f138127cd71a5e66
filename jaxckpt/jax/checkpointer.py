"""``jaxckpt.Checkpointer``: asynchronous snapshots of JAX pytrees into a store, restored onto any sharding.

Save path, three hops: this front end (flatten, plan lookup, zero-copy views) -> the core snapshot engine
(copy + checksum on worker threads) -> the store (slot commit). The commit across processes runs on a
background thread (see ``jaxckpt.coordination``).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxckpt import manifest as mf
from jaxckpt.config import Config
from jaxckpt.coordination import CommitTracker, Coordinator, LocalCoordinator
from jaxckpt.errors import ClosedError, CommitError, NoCheckpointError, StepError, StepNotFoundError
from jaxckpt.jax import shards
from jaxckpt.jax.restore import restore_tree
from jaxckpt.jax.tree import Leaf, flatten
from jaxckpt.plan import SavePlan, plan_save
from jaxckpt.registry import get_store_class
from jaxckpt.snapshot import CopyTask, SnapshotEngine, SnapshotResult

log = logging.getLogger("jaxckpt.jax")


@dataclass
class _Prepared:
    """Everything about a state layout that does not change from step to step."""

    plan: SavePlan
    metas: list[mf.ArrayMeta]  # one per array leaf, chunks empty
    chunk_leaf: list[int]  # for each chunk of the plan, the index of its array leaf
    chunk_slices: list[tuple[slice, ...]]  # for each chunk, its slices inside the source shard


class SaveHandle:
    """The outcome of one ``save()``: ``done()`` once decided, ``result()`` waits and raises on failure."""

    def __init__(self, step: int, tracker: CommitTracker) -> None:
        self.step = step
        self._tracker = tracker
        self._local = threading.Event()
        self.error: BaseException | None = None
        self.snapshot_seconds: float | None = None
        self.save_call_seconds: float = 0.0
        self.nbytes = 0

    def local_done(self) -> bool:
        """True once this process's chunks are in host memory (or failed)."""
        return self._local.is_set()

    def done(self) -> bool:
        return self._local.is_set() and (self.error is not None or self._tracker.decided(self.step))

    def result(self, timeout: float | None = None) -> None:
        """Wait until the step is committed by all processes; raise its error if it was not."""
        if not self._local.wait(timeout):
            raise CommitError(f"step {self.step}: snapshot not finished within {timeout}s")
        if self.error is not None:
            raise self.error
        if not self._tracker.wait(self.step, timeout):
            raise CommitError(f"step {self.step}: not committed by every process (a process failed or timed out)")


class Checkpointer:
    """In-memory asynchronous checkpointing of JAX pytrees (see DESIGN.md for the guarantees)."""

    def __init__(self, config: Config | None = None, *, coordinator: Coordinator | None = None) -> None:
        self.config = (config or Config()).with_env()
        if coordinator is None:
            if jax.process_count() > 1:
                from jaxckpt.jax.coordination import JaxCoordinator
                coordinator = JaxCoordinator()
            else:
                coordinator = LocalCoordinator()
        self._coord = coordinator
        self.process_index, self.process_count = coordinator.process_index, coordinator.process_count
        store_cls = get_store_class(self.config.store)
        self.store = store_cls(self.config, process_index=self.process_index, process_count=self.process_count)
        self._engine = SnapshotEngine(self.config.workers, self.config.inflight_bytes)
        self._tracker = CommitTracker(coordinator, self.config.job_id, self.config.commit_timeout_s,
                                      on_commit=self._after_commit)
        self._prepared: dict[tuple, _Prepared] = {}
        self._pending: deque[SaveHandle] = deque()
        self._committed: list[int] = []
        self._last_step: int | None = None
        self._lock = threading.Lock()
        self._closed = False

    # ----------------------------------------------------------------------------------------------- save
    def save(self, step: int, state: Any) -> SaveHandle:
        """Start a snapshot of ``state`` as step ``step`` and return at once.

        The snapshot equals ``state`` at this call bit for bit, even if the caller's next jitted step donates
        its buffers. Raises StepError if ``step`` is not newer than the last saved step, UnsupportedLeafError
        for a leaf it cannot hold, BudgetExceededError when the store's memory budget is full.
        """
        t0 = time.perf_counter()
        self._check_open()
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
            raise StepError(f"step must be a non-negative int, got {step!r}")
        step = int(step)
        if self._last_step is not None and step <= self._last_step:
            raise StepError(f"step {step} is not newer than the newest saved step {self._last_step}")
        self._throttle()
        leaves, _ = flatten(state)
        arrays = [l for l in leaves if l.kind != "value"]
        prep = self._prepare(arrays)
        try:
            slot = self.store.reserve(step, prep.plan.nbytes)
        except Exception:
            self._tracker.local_done(step, False)  # other processes must not wait for us
            raise
        sources = [shards.local_sources(l.value, l.kind) for l in arrays]
        tasks = []
        for c, leaf_i, sl in zip(prep.plan.chunks, prep.chunk_leaf, prep.chunk_slices):
            fetch, start = sources[leaf_i][c.device]
            tasks.append(CopyTask(fetch=(lambda f=fetch, s=sl: f()[s]), offset=c.offset, nbytes=c.nbytes,
                                  start=start))
        handle = SaveHandle(step, self._tracker)
        handle.nbytes = prep.plan.nbytes
        values = [mf.LeafMeta(l.path, l.keypath, l.value) for l in leaves if l.kind == "value"]
        order = tuple(l.path for l in leaves)
        fut = self._engine.submit(slot, tasks, release=sources.clear)
        fut.add_done_callback(lambda f: self._local_finished(f, handle, slot, prep, values, order))
        self._last_step = step
        with self._lock:
            self._pending.append(handle)
        handle.save_call_seconds = time.perf_counter() - t0
        return handle

    def _throttle(self) -> None:
        while True:
            with self._lock:
                while self._pending and self._pending[0].done():
                    self._pending.popleft()
                if sum(not h.local_done() for h in self._pending) < self.config.max_pending_saves:
                    return
                oldest = next(h for h in self._pending if not h.local_done())
            oldest._local.wait()

    def _prepare(self, arrays: list[Leaf]) -> _Prepared:
        key = tuple((l.path, l.kind, *_array_key(l)) for l in arrays)
        prep = self._prepared.get(key)
        if prep is not None:
            return prep
        layouts = [shards.array_layout(l.path, l.value, l.kind) for l in arrays]
        plan = plan_save(layouts, self.process_count, self.config.chunk_bytes)[self.process_index]
        index = {l.path: i for i, l in enumerate(arrays)}
        metas = []
        for l, lay in zip(arrays, layouts):
            attrs: dict[str, Any] = {}
            if l.kind == "prng_key":
                attrs = {"impl": str(jax.random.key_impl(l.value)), "key_dtype": str(l.value.dtype),
                         "key_shape": list(l.value.shape)}
            metas.append(mf.ArrayMeta(l.path, l.keypath, lay.shape, lay.dtype, l.kind,
                                      shards.describe_sharding(l.value), attrs))
        src_box = {(p.path, pl.device): pl.box for p in layouts for pl in p.placements}
        chunk_leaf = [index[c.path] for c in plan.chunks]
        chunk_slices = [src_box[(c.path, c.device)].relative(c.box) for c in plan.chunks]
        prep = _Prepared(plan, metas, chunk_leaf, chunk_slices)
        self._prepared[key] = prep
        log.info("planned a new state layout: %d arrays, %d local chunks, %d bytes on process %d",
                 len(arrays), len(plan.chunks), plan.nbytes, self.process_index)
        return prep

    def _local_finished(self, fut, handle: SaveHandle, slot, prep: _Prepared, values, order) -> None:
        try:
            res: SnapshotResult = fut.result()
            chunks: dict[int, list[mf.ChunkMeta]] = {}
            for c, leaf_i, crc in zip(prep.plan.chunks, prep.chunk_leaf, res.crcs):
                chunks.setdefault(leaf_i, []).append(
                    mf.ChunkMeta(c.box, c.offset, c.nbytes, crc, self.process_index))
            arrays = tuple(mf.ArrayMeta(m.path, m.keypath, m.shape, m.dtype, m.kind, m.sharding, m.attrs,
                                        tuple(chunks.get(i, ()))) for i, m in enumerate(prep.metas))
            manifest = mf.Manifest(step=handle.step, process=self.process_index, process_count=self.process_count,
                                   framework="jax", arrays=arrays, leaves=tuple(values), order=order,
                                   nbytes=prep.plan.nbytes, layout=prep.plan.layout)
            self.store.commit(slot, mf.encode(manifest))
            handle.snapshot_seconds = res.seconds
        except BaseException as e:  # noqa: BLE001 - reported through the handle and the commit protocol
            log.error("step %d: snapshot failed on process %d: %s", handle.step, self.process_index, e)
            handle.error = e
            self.store.abort(slot)
            self._tracker.local_done(handle.step, False)
        else:
            self._tracker.local_done(handle.step, True)
        finally:
            handle._local.set()

    def _after_commit(self, step: int, committed: bool) -> None:
        if not committed:
            log.warning("step %d was not committed by every process; dropping it", step)
            self.store.delete(step)
            return
        with self._lock:
            self._committed.append(step)
            self._committed.sort()
            drop, self._committed = self._committed[:-self.config.keep], self._committed[-self.config.keep:]
        for s in drop:
            self.store.delete(s)

    # ----------------------------------------------------------------------------------------------- wait
    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far is committed; raise the first failure (CommitError or the save's error)."""
        with self._lock:
            handles = list(self._pending)
        for h in handles:
            h.result(timeout)

    def latest_step(self) -> int | None:
        """The newest step committed by all processes, or None."""
        return self._tracker.latest()

    def all_steps(self) -> list[int]:
        """Committed steps still held, ascending."""
        with self._lock:
            return list(self._committed)

    # -------------------------------------------------------------------------------------------- restore
    def restore(self, target: Any = None, step: int | None = None) -> Any:
        """The state saved at ``step`` (default: the latest committed), laid out like ``target``.

        ``target`` is a pytree of ``jax.ShapeDtypeStruct`` (with shardings), jax or numpy arrays; arrays come
        back with exactly the target's shardings, whatever the saved ones were. Without a target, nested
        dicts of numpy arrays come back.
        """
        self._check_open()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise NoCheckpointError(f"nothing has been committed yet (store {self.config.store!r}, "
                                        f"job {self.config.job_id!r})")
        view = self.store.open(step)
        if view is None:
            raise StepNotFoundError(f"step {step} is not held by store {self.config.store!r} "
                                    f"(held: {self.store.steps() or 'none'})")
        t0 = time.perf_counter()
        with view:
            manifest = mf.decode(view.manifest, source=f"step {step} manifest")
            out = restore_tree(target, [manifest], {self.process_index: view.buffer}, step=step,
                               process=self.process_index, verify=self.config.verify_on_restore)
        log.info("restored step %d (%d bytes held here) in %.3fs", step, manifest.nbytes, time.perf_counter() - t0)
        return out

    # ---------------------------------------------------------------------------------------------- close
    def close(self) -> None:
        """Finish in-flight saves, stop the threads and free the store."""
        if self._closed:
            return
        try:
            self.wait(timeout=self.config.commit_timeout_s * 2)
        except Exception as e:  # noqa: BLE001 - closing must not fail because a save did
            log.warning("close: pending save did not commit: %s", e)
        self._closed = True
        self._engine.close()
        self._tracker.close()
        self.store.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("checkpointer is closed")


def _array_key(leaf: Leaf) -> tuple:
    v = leaf.value
    if leaf.kind in ("jax", "prng_key"):
        return (v.shape, str(v.dtype), v.sharding)
    a = np.asarray(v)
    return (a.shape, a.dtype.str, None)

