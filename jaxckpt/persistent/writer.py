"""The persistent tier's writer: committed snapshots drained to ``Config.persistent_dir`` in Orbax's format.

Every step that is a multiple of ``Config.persistent_interval`` (M) is, once committed, written from host memory
to the directory by one background thread, as ``ocp.CheckpointManager`` writes ``args=StandardSave(state)``
(plus the ``extra`` item when the step carries extra state, and jaxckpt's index: ``jaxckpt.persistent.directory``).

Call order for one persisted step:
  0) (commit thread, every process) the step committed and ``step % M == 0``: process 0 decides whether to
     persist it (no when one persist runs and another is queued: the tier never queues more, and never makes
     ``save()`` wait) and publishes the decision (a ``broadcast`` round of the engine's ``persist`` channel); the
     others read it, so every process persists the same steps in the same order (Orbax saves are collective).
     On yes the engine pins the step past ``Config.keep``;
  1) (persist thread) the front end builds the state's arrays from the snapshot's host bytes (other processes'
     chunks via the peer transport) on the shardings the state had at ``save()``; a single process whose state
     lived on an accelerator builds on its CPU device instead, using no accelerator memory;
  2) (persist thread) ``CheckpointManager.save`` of that pytree, synchronous in the thread, with Orbax's
     barriers on the coordination service (never device collectives, which would race the training step);
  3) the pin is released; ``Config.persistent_keep`` newest persisted steps are kept (Orbax ``max_to_keep``).
Memory: up to MAX_PENDING pinned steps beyond ``Config.keep`` (they count against ``memory_budget_bytes``), plus a
transient copy of the arrays while Orbax writes them. Training thread: it never waits for a persist; the persist
thread competes with it only for the GIL (measured: a waiter got the GIL within 0.4 ms on average, p99 ~5 ms,
during 64 MB persists) and for CPU cores.

Supported: one process, and several processes of one job on a shared directory. Leaves Orbax cannot write
(``str``, ``bytes``) make a step's persist fail with an error naming the path; the step stays in memory. Reading
back is the restore driver's (``jaxckpt.persistent.holder``).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import jax
import numpy as np
from etils import epath

from jaxckpt.config import Config
from jaxckpt.core import manifest as mf
from jaxckpt.core.dtypes import dtype_from_name
from jaxckpt.core.extra import extra_of
from jaxckpt.core.fetch import ChunkReader
from jaxckpt.core.keypath import nested
from jaxckpt.errors import CommitError, UnsupportedLeafError
from jaxckpt.persistent.directory import (EXTRA_ITEM, INDEX_ITEM, STATE_ITEM, index_item, remove_temporaries)
from jaxckpt.persistent.holder import PersistentHolder

if TYPE_CHECKING:
    import orbax.checkpoint as ocp

    from jaxckpt.core.engine import CheckpointEngine

log = logging.getLogger("jaxckpt.persistent.writer")

__all__ = ["Build", "Persister"]

MAX_PENDING = 2  # persists running + queued; an eligible step beyond that is skipped, never waited for
PROGRESS_EVERY_S = 10.0

# The front end's arrays from host boxes: the state of ``target``'s structure from an opened step.
Build = Callable[[Any, list[mf.Manifest], ChunkReader, int], Any]


def _nbytes(tree: Any) -> int:
    return sum(int(getattr(x, "nbytes", 0) or 0) for x in jax.tree_util.tree_leaves(tree)
               if not (isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)))


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / max(seconds, 1e-9) / 1e6:.0f} MB/s"


@dataclass
class _Note:
    """What ``save()`` knew of a step the tier may persist: its tree structure and its arrays' dtypes/shardings."""

    treedef: Any
    arrays: dict[str, tuple[Any, Any]]  # path -> (dtype, sharding) of jax.Array leaves


class Persister:
    """Writes committed snapshots to ``config.persistent_dir`` on one background thread, and holds them for the
    restore driver (``holder``). With ``persistent_interval == 0`` it only reads.

    ``build``: the front end's arrays from host boxes (the JAX front end's ``restore_tree``)."""

    def __init__(self, engine: "CheckpointEngine", config: Config, build: Build) -> None:
        self.engine, self.config, self._build = engine, config, build
        self.directory = epath.Path(config.persistent_dir)
        self.interval = config.persistent_interval
        self.holder = PersistentHolder(self.directory)
        self._pi, self._pc = engine.process_index, engine.process_count
        self._cv = threading.Condition()
        self._notes: dict[int, _Note] = {}
        self._queue: deque[tuple[int, _Note | None]] = deque()
        self._busy = False
        self._closed = False
        self._errors: list[BaseException] = []
        self.persisted: list[int] = []  # steps this persister wrote, in order
        self.skipped: list[int] = []  # eligible steps not persisted because MAX_PENDING persists were pending
        self._mngr: "ocp.CheckpointManager | None" = None
        self._thread: threading.Thread | None = None
        engine.attach_tier(self)
        if self.interval > 0:
            engine.add_commit_hook(self._on_commit)

    # ------------------------------------------------------------------------------------------ listing
    def steps(self) -> list[int]:
        """Persisted steps jaxckpt can read back, ascending."""
        return self.holder.steps()

    def latest_step(self) -> int | None:
        """The newest persisted step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------- training thread (save) side
    def wants(self, step: Any) -> bool:
        """True for the steps this tier persists: multiples of ``persistent_interval``."""
        return (self.interval > 0 and isinstance(step, (int, np.integer)) and not isinstance(step, bool)
                and step >= 0 and step % self.interval == 0)

    def note(self, step: int, treedef: Any, leaves: list[Any]) -> None:
        """Remember the structure and shardings ``save(step)`` had (cheap: no array is referenced). ``leaves``:
        the front end's leaves (``path``, ``value``, ``kind``)."""
        arrays = {l.path: (l.value.dtype, l.value.sharding) for l in leaves if l.kind in ("jax", "prng_key")}
        with self._cv:
            self._notes[int(step)] = _Note(treedef, arrays)

    def forget(self, step: int) -> None:
        """Drop the note of a ``save`` that raised."""
        with self._cv:
            self._notes.pop(int(step), None)

    # ----------------------------------------------------------------------------------- commit thread
    def _on_commit(self, step: int, committed: bool) -> None:
        with self._cv:
            note = self._notes.pop(step, None)
            for s in [s for s in self._notes if s < step]:  # saves that never reached the commit protocol
                del self._notes[s]
            pending = len(self._queue) + self._busy
        if not committed or not self.wants(step):
            return
        if not self._decide(step, pending < MAX_PENDING and not self._closed):
            self.skipped.append(step)
            log.warning("step %d: not persisted (%d persists still pending; the tier skips rather than stall)",
                        step, pending)
            return
        self.engine.pin(step)
        with self._cv:
            self._queue.append((step, note))
            self._cv.notify_all()
            if self._thread is None:
                # Started with the first persist, on the commit thread, not in Checkpointer(): a thread's
                # start waits until the new thread runs, 30-120 ms of a relaunched trainer's start-up on a
                # machine whose cores its peers' restores fill (BENCHMARKS.md, stop 43).
                self._thread = threading.Thread(target=self._run, name="jaxckpt-persist", daemon=True)
                self._thread.start()

    def _decide(self, step: int, mine: bool) -> bool:
        """Process 0's decision for ``step``, the same on every process (a ``broadcast`` round of the engine's
        ``persist`` channel, jaxckpt.core.collective: O(processes) at process 0, O(1) elsewhere)."""
        try:
            return bool(self.engine.collective.channel("persist").broadcast(f"persist {step}", mine, number=step,
                                                                            timeout_s=self.config.commit_timeout_s))
        except CommitError as e:  # CoordinationError: a process (process 0, say) did not take part in time
            log.error("step %d: no persist decision: %s", step, e)
            return False

    # ---------------------------------------------------------------------------------- persist thread
    def _run(self) -> None:
        if self._pi == 0:
            # Here, before the first persist, not in Checkpointer(): listing a directory on a disk still writing
            # back the last job's persists took up to 77 ms of a relaunched trainer's start-up (stop 43). Until
            # then the leftovers are harmless: no listing counts a temporary directory.
            try:
                remove_temporaries(self.directory)
            except OSError as e:
                log.warning("%s: leftovers of crashed persists not removed: %s", self.directory, e)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                step, note = self._queue.popleft()
                self._busy = True
            try:
                self._persist(step, note)
                self.persisted.append(step)
            except BaseException as e:  # noqa: BLE001 - reported by wait(); training goes on
                log.error("step %d: persisting to %s failed: %s: %s", step, self.directory, type(e).__name__, e)
                with self._cv:
                    self._errors.append(e)
            finally:
                self.engine.unpin(step)
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _manager(self) -> "ocp.CheckpointManager":
        import orbax.checkpoint as ocp  # here, not above: a Checkpointer that never persists never imports Orbax

        if self._mngr is None:
            self.directory.mkdir(parents=True, exist_ok=True)  # Orbax refuses create=True with active_processes
            mp = ocp.options.MultiprocessingOptions(
                primary_host=0, active_processes=set(range(self._pc)) if self._pc > 1 else None,
                barrier_sync_key_prefix=f"jaxckpt-{self.config.job_id}-persist")
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.config.persistent_keep, enable_async_checkpointing=False, create=False,
                cleanup_tmp_directories=True, multiprocessing_options=mp)
            self._mngr = ocp.CheckpointManager(self.directory, options=options)
        return self._mngr

    def _persist(self, step: int, note: _Note | None) -> None:
        import orbax.checkpoint as ocp

        t0 = time.perf_counter()
        with self.engine.open(step, report=False) as (step, manifests, reader):
            own = next(m for m in manifests if m.process == self._pi)
            target, paths = self._target(own, note)
            state = self._build(target, manifests, reader, step)
            extra = extra_of(own)
        nbytes, gathered = _nbytes(state), sum(reader.bytes_by_process.values())
        t1 = time.perf_counter()
        log.info("step %d: %d bytes rebuilt from host memory for the persistent tier in %.3fs (%s; bytes by "
                 "source process %s)", step, nbytes, t1 - t0, _rate(gathered, t1 - t0), reader.bytes_by_process)
        mngr = self._manager()
        stale = [s for s in mngr.all_steps() if s >= step]
        for s in stale:  # persisted by a run that trained past ``step`` and was then restored to an older step
            log.warning("step %d: deleting persisted step %d of an abandoned timeline from %s", step, s,
                        self.directory)
            mngr.delete(s)
        arrays = {a.path for a in own.arrays}
        names = {p: n for p, n in zip(jax.tree_util.tree_leaves(paths),
                                      jax.tree_util.tree_leaves(ocp.tree.get_param_names(
                                          state, include_empty_nodes=False)))
                 if p in arrays}
        items = {STATE_ITEM: ocp.args.StandardSave(state),
                 INDEX_ITEM: ocp.args.JsonSave(index_item([mf.encode(m) for m in manifests], names))}
        if extra is not None:
            items[EXTRA_ITEM] = ocp.args.JsonSave(extra)
        with _Progress(step, nbytes, self.directory):
            mngr.save(step, args=ocp.args.Composite(**items), force=True)
        del state
        dt = time.perf_counter() - t1
        log.info("persisted step %d to %s: %d bytes written in %.3fs (%s)", step, self.directory, nbytes, dt,
                 _rate(nbytes, dt))

    def _target(self, own: mf.Manifest, note: _Note | None) -> tuple[Any, Any]:
        """Placeholders of the saved state (ShapeDtypeStructs on the persist sharding, numpy/plain values), and
        the same structure with each leaf's path in its place."""
        arrays = {a.path: a for a in own.arrays}
        values = {v.path: v for v in own.leaves}
        leaves, keypaths = [], []
        for path in own.order:
            if path not in arrays:
                v = values[path].value
                if isinstance(v, (str, bytes)):
                    raise UnsupportedLeafError(f"{path}: a {type(v).__name__} leaf cannot be written in the Orbax "
                                               f"format; step {own.step} stays in memory only")
                leaves.append(v)
                keypaths.append(values[path].keypath)
                continue
            a = arrays[path]
            keypaths.append(a.keypath)
            if a.kind in ("jax", "prng_key"):
                dtype, sharding = note.arrays.get(path, (None, None)) if note is not None else (None, None)
                if a.kind == "prng_key":
                    shape = tuple(a.attrs["key_shape"])
                    if dtype is None:
                        dtype = jax.eval_shape(lambda: jax.random.wrap_key_data(
                            jax.numpy.zeros(a.shape, a.dtype), impl=a.attrs["impl"])).dtype
                else:
                    shape, dtype = a.shape, np.dtype(dtype) if dtype is not None else dtype_from_name(a.dtype)
                leaves.append(jax.ShapeDtypeStruct(shape, dtype, sharding=self._placement(sharding)))
            elif a.kind == "numpy":
                leaves.append(np.broadcast_to(np.zeros((), dtype_from_name(a.dtype)), a.shape))
            else:  # numpy_scalar: the saved scalar comes back as one
                leaves.append(0)
        if note is not None and note.treedef.num_leaves == len(leaves):
            return (jax.tree_util.tree_unflatten(note.treedef, leaves),
                    jax.tree_util.tree_unflatten(note.treedef, list(own.order)))
        return nested(list(zip(keypaths, leaves))), nested(list(zip(keypaths, own.order)))

    def _placement(self, saved: Any) -> jax.sharding.Sharding:
        """Where the persist thread builds an array (see the module docstring, step 1)."""
        if saved is not None:
            devices = saved.device_set
            if self._pc > 1 or all(d.platform == "cpu" for d in devices):
                kind = next(iter(devices)).default_memory().kind
                return saved if saved.memory_kind in (None, kind) else saved.with_memory_kind(kind)
        if self._pc > 1:  # every process must take part in Orbax's save: replicate over the whole job
            mesh = jax.sharding.Mesh(np.array(jax.devices()), ("all",))
            return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        return jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])

    # ------------------------------------------------------------------------------------------ waiting
    def pending(self) -> int:
        """Persists queued or running."""
        with self._cv:
            return len(self._queue) + self._busy

    def wait(self, timeout: float | None = None) -> None:
        """Block until every queued persist is done; raise the first failure since the last wait()."""
        with self._cv:
            if not self._cv.wait_for(lambda: not self._queue and not self._busy, timeout=timeout):
                raise TimeoutError(f"persists to {self.directory} still pending after {timeout}s")
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def close(self, timeout: float | None = None) -> None:
        """Finish the saves in flight and the persists they queue, then stop the thread."""
        if self._closed:
            return
        try:
            self.engine.wait(timeout=self.config.commit_timeout_s * 2)
        except Exception as e:  # noqa: BLE001 - closing must not fail because a save did
            log.warning("close: a pending save did not commit: %s", e)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        if self._mngr is not None:
            self._mngr.close()
        for e in self._errors:
            log.warning("persist error not reported by wait(): %s", e)


class _Progress:
    """Logs a line every PROGRESS_EVERY_S seconds while a long persist runs (Orbax's save is one call)."""

    def __init__(self, step: int, nbytes: int, directory: epath.Path) -> None:
        self._step, self._nbytes, self._dir = step, nbytes, directory
        self._done = threading.Event()

    def __enter__(self) -> "_Progress":
        t0 = time.perf_counter()

        def run() -> None:
            while not self._done.wait(PROGRESS_EVERY_S):
                log.info("step %d: still writing %d bytes to %s (%.0fs so far)", self._step, self._nbytes,
                         self._dir, time.perf_counter() - t0)

        threading.Thread(target=run, name="jaxckpt-persist-progress", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
