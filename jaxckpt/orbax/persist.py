"""The persistent tier: committed snapshots drained to a directory in the standard Orbax format, and read back.

Every step that is a multiple of ``Config.persistent_interval`` (M) is, once committed, written from host memory
to ``Config.persistent_dir`` by one background thread, exactly as ``ocp.CheckpointManager`` writes
``args=StandardSave(state)`` (plus a ``JsonSave`` item when the step carries extra state)::

    <persistent_dir>/<step>/_CHECKPOINT_METADATA
    <persistent_dir>/<step>/default/...          the state: ocp.StandardCheckpointer's format for that pytree
    <persistent_dir>/<step>/extra/metadata       small non-array state as JSON (only when saved with extra=)

so a plain Orbax program reads it: ``ocp.StandardCheckpointer().restore(dir / str(step) / "default", target)``
or ``ocp.CheckpointManager(dir).restore(step, args=ocp.args.StandardRestore(target))``. Orbax writes the step
under ``<step>.orbax-checkpoint-tmp`` and renames it when complete: a crash mid-persist leaves only that temporary
name, which every listing here (and Orbax's) ignores and :class:`Persister` removes when it starts.

Call order for one persisted step:
  0) (commit thread, every process) the step committed and ``step % M == 0``: process 0 decides whether to
     persist it (no when one persist runs and another is queued: the tier never queues more, and never makes
     ``save()`` wait) and publishes the decision; the others read it, so every process persists the same steps
     in the same order (Orbax saves are collective). On yes the engine holds the step past ``Config.keep``;
  1) (persist thread) rebuilds the state's arrays from the snapshot's host bytes (other processes' chunks via
     the peer transport) on the shardings the state had at ``save()``; a single process whose state lived on
     an accelerator rebuilds on its CPU device instead, using no accelerator memory;
  2) (persist thread) ``CheckpointManager.save`` of that pytree, synchronous in the thread, with Orbax's
     barriers on the coordination service (never device collectives, which would race the training step);
  3) the hold is released; ``Config.persistent_keep`` newest persisted steps are kept (Orbax ``max_to_keep``).
Memory: up to MAX_PENDING held steps beyond ``Config.keep`` (they count against ``memory_budget_bytes``), plus a
transient copy of the arrays while Orbax writes them. Training thread: it never waits for a persist; the persist
thread competes with it only for the GIL (measured: a waiter got the GIL within 0.4 ms on average, p99 ~5 ms,
during 64 MB persists) and for CPU cores.

Supported: one process, and several processes of one job on a shared directory (tested with
``jaxckpt.testing``). Leaves Orbax cannot write (``str``, ``bytes``) make a step's persist fail with an error
naming the path; the step stays in memory. Restore falls back to this directory when memory cannot supply a
step (:func:`restore`).
"""
from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxckpt.config import Config
from jaxckpt.core.dtypes import dtype_from_name
from jaxckpt.core.engine import CheckpointEngine
from jaxckpt.errors import (ChecksumError, CommitError, ManifestError, NoCheckpointError, PeerError, PlanError,
                            StepError, StepNotFoundError, TargetMismatchError, UnsupportedLeafError)
from jaxckpt.jax.gather import gather_for
from jaxckpt.jax.restore import restore_tree
from jaxckpt.jax.tree import Leaf, flatten, nested
from jaxckpt.core.manifest import LeafMeta, Manifest

log = logging.getLogger("jaxckpt.orbax.persist")

__all__ = ["Persister", "Restored", "restore", "persisted_steps", "read_state", "read_extra", "encode_extra"]

STATE_ITEM = "default"  # ocp.CheckpointManager's item name for a single StandardSave
EXTRA_ITEM = "extra"
EXTRA_PATH = "__jaxckpt_extra__"  # a manifest leaf outside ``order``: invisible to restore_tree
TMP_SUFFIX = ocp.path.step.TMP_DIR_SUFFIX
MAX_PENDING = 2  # persists running + queued; an eligible step beyond that is skipped, never waited for
PROGRESS_EVERY_S = 10.0
# Memory could not supply the step: these send a restore to the persistent directory.
MEMORY_MISSES = (StepNotFoundError, PeerError, ChecksumError, PlanError, ManifestError)


# --------------------------------------------------------------------------------------------- extra state
def encode_extra(extra: Any) -> str:
    """``extra`` as JSON text; anything but dict (str keys), list, tuple, str, int, float, bool, None is refused.

    JSON, never pickle: numpy RNG state (``Generator.bit_generator.state``, with its 128-bit ints), iterator
    positions and config dicts fit. Tuples come back as lists.
    """
    def check(x: Any, path: str) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if not isinstance(k, str):
                    raise UnsupportedLeafError(f"extra{path}: key {k!r} is not a str (JSON objects have str keys)")
                check(v, f"{path}/{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                check(v, f"{path}/{i}")
        elif x is not None and not isinstance(x, (str, int, float, bool)):
            raise UnsupportedLeafError(f"extra{path}: {type(x).__module__}.{type(x).__qualname__} is not a JSON "
                                       f"type (use dict, list, str, int, float, bool, None; .item()/.tolist() "
                                       f"numpy values)")

    check(extra, "")
    return json.dumps(extra)


def decode_extra(text: str) -> Any:
    """The extra state from its JSON text."""
    return json.loads(text)


def extra_of(manifest: Manifest) -> Any:
    """The extra state saved with a snapshot, or None."""
    for v in manifest.leaves:
        if v.path == EXTRA_PATH:
            return decode_extra(v.value)
    return None


def extra_leaf(extra: Any) -> LeafMeta:
    """The manifest leaf that carries ``extra`` (kept out of the leaf order, so restore targets never see it)."""
    return LeafMeta(EXTRA_PATH, (("key", EXTRA_PATH),), encode_extra(extra))


# ------------------------------------------------------------------------------------------ the directory
def persisted_steps(directory: epath.PathLike) -> list[int]:
    """Finalized steps in ``directory``, ascending (temporary, half-written ones are not steps)."""
    directory = epath.Path(directory)
    if not directory.exists():
        return []
    return sorted(ocp.path.step.checkpoint_steps(directory))


def remove_temporaries(directory: epath.PathLike) -> list[str]:
    """Delete the ``<step>.orbax-checkpoint-tmp*`` leftovers of persists that crashed; returns their names."""
    directory = epath.Path(directory)
    if not directory.exists():
        return []
    gone = []
    for p in directory.iterdir():
        if TMP_SUFFIX in p.name:
            shutil.rmtree(str(p), ignore_errors=True)
            gone.append(p.name)
    if gone:
        log.warning("removed %d half-written persisted step(s) from %s: %s", len(gone), directory, sorted(gone))
    return gone


def _orbax_target(target: Any) -> tuple[Any, list]:
    """``target`` as Orbax's StandardRestore wants it, and the numpy scalar types to give back per leaf."""
    leaves, treedef = jax.tree_util.tree_flatten(target)
    out, scalar_types = [], []
    for path_leaf, x in zip(flatten(target, classify_leaves=False)[0], leaves):
        scalar_types.append(None)
        if isinstance(x, jax.Array):
            x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        elif isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
            x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        elif isinstance(x, np.generic):
            scalar_types[-1] = type(x)
            x = np.zeros((), x.dtype)
        elif isinstance(x, (str, bytes)):
            raise UnsupportedLeafError(f"{path_leaf.path}: a {type(x).__name__} leaf cannot come from the "
                                       f"persistent tier (Orbax's format has no {type(x).__name__} leaves)")
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out), scalar_types


def _check_target(item: epath.Path, target: Any, step: int) -> None:
    """TargetMismatchError naming the first path whose structure, shape or dtype differs from what was persisted."""
    saved = {l.path: l.value for l in flatten(ocp.StandardCheckpointHandler().metadata(item).tree,
                                              classify_leaves=False)[0]}
    wanted = {l.path: l.value for l in flatten(target, classify_leaves=False)[0]}
    for path in wanted:
        if path not in saved:
            raise TargetMismatchError(f"{path}: in the target but not in persisted step {step} (structure differs)")
    for path in saved:
        if path not in wanted:
            raise TargetMismatchError(f"{path}: persisted in step {step} but missing from the target "
                                      f"(structure differs)")
    for path, t in wanted.items():
        m = saved[path]
        if getattr(t, "dtype", None) is not None and jax.dtypes.issubdtype(t.dtype, jax.dtypes.prng_key):
            continue  # Orbax records a key array by its key data (an extra trailing dimension)
        if hasattr(t, "shape") and getattr(m, "shape", None) is not None and tuple(t.shape) != tuple(m.shape):
            raise TargetMismatchError(f"{path}: persisted shape {tuple(m.shape)} in step {step}, target shape "
                                      f"{tuple(t.shape)}")
        # Orbax would cast an array silently; memory restores refuse a dtype change, and so does this tier.
        # (A Python scalar is recorded as int64/float64 and may be restored into any numeric target, as from memory.)
        if (isinstance(m, ocp.metadata.ArrayMetadata) and hasattr(t, "dtype")
                and np.dtype(t.dtype) != np.dtype(m.dtype)):
            raise TargetMismatchError(f"{path}: persisted dtype {np.dtype(m.dtype).name} in step {step}, target "
                                      f"dtype {np.dtype(t.dtype).name}")


def _to_host(x: Any) -> Any:
    """Without a target, arrays come back as numpy (typed keys as their key data), as from memory."""
    if isinstance(x, jax.Array):
        return np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
    return x


def _step_number(step: Any) -> int:
    """``step`` as an int; anything else (a float, a bool, a path like "../x") is refused before it names a path."""
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
        raise StepError(f"step must be a non-negative int, got {step!r}")
    return int(step)


def read_state(directory: epath.PathLike, step: int, target: Any = None) -> Any:
    """Persisted ``step`` laid out like ``target`` (shardings honoured); None: nested dicts of numpy arrays.

    Without a target Orbax places arrays on the shardings recorded at save time (this process's CPU device for a
    single-process job, the job's mesh for a multi-process one): pass a target to restore onto another topology.
    """
    item = epath.Path(directory) / str(_step_number(step)) / STATE_ITEM
    if not item.exists():
        raise StepNotFoundError(f"step {step} is not in the persistent directory {directory} "
                                f"(persisted: {persisted_steps(directory) or 'none'})")
    handler = ocp.StandardCheckpointHandler()
    try:
        if target is None:
            out = handler.restore(item)
            return jax.tree_util.tree_map(_to_host, out)
        _check_target(item, target, step)
        orbax_target, scalar_types = _orbax_target(target)
        out = handler.restore(item, args=ocp.args.StandardRestore(orbax_target))
    finally:
        handler.close()
    leaves, treedef = jax.tree_util.tree_flatten(out)
    leaves = [t(np.asarray(x)[()]) if t is not None else x for x, t in zip(leaves, scalar_types)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def read_extra(directory: epath.PathLike, step: int) -> Any:
    """The extra state persisted with ``step``, or None if it had none."""
    item = epath.Path(directory) / str(_step_number(step)) / EXTRA_ITEM
    if not item.exists():
        return None
    handler = ocp.JsonCheckpointHandler()
    try:
        return handler.restore(item)
    finally:
        handler.close()


def _nbytes(tree: Any) -> int:
    return sum(int(getattr(x, "nbytes", 0) or 0) for x in jax.tree_util.tree_leaves(tree)
               if not (isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)))


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / max(seconds, 1e-9) / 1e6:.0f} MB/s"


# --------------------------------------------------------------------------------------------- restoring
@dataclass
class Restored:
    """A restored step: the state, the extra state saved with it (or None), and where it came from."""

    state: Any
    extra: Any
    step: int
    source: str  # "memory" | "persistent"


def restore(engine: CheckpointEngine, persister: "Persister | None", target: Any, step: int | None) -> Restored:
    """``step`` (default: the newest in memory, else the newest persisted) from memory, else from the directory.

    Memory is tried first; when it cannot supply the step (not held, a needed chunk gone, corrupt or
    unreachable) and the step is persisted, the persistent directory serves it. The source is logged.
    """
    t0 = time.perf_counter()
    if step is None:
        step = engine.latest_step()
        if step is None and persister is not None:
            step = persister.latest_step()
        if step is None:
            where = f" nor in {persister.directory}" if persister is not None else ""
            raise NoCheckpointError(f"nothing has been committed yet (store {engine.config.store!r}, job "
                                    f"{engine.config.job_id!r}){where}")
    step = _step_number(step)
    try:
        with engine.open(step) as (step, manifests, reader):
            state = restore_tree(target, manifests, reader, step=step, process=engine.process_index,
                                 gather=gather_for(engine, target))
            extra = extra_of(next((m for m in manifests if m.process == engine.process_index), manifests[0]))
        log.info("restored step %d from memory in %.3fs (bytes by source process: %s)", step,
                 time.perf_counter() - t0, reader.bytes_by_process)
        return Restored(state, extra, step, "memory")
    except MEMORY_MISSES as e:
        if persister is None:
            raise
        on_disk = persister.steps()
        if step not in on_disk:
            if isinstance(e, StepNotFoundError):
                raise StepNotFoundError(f"{e}; nor is it persisted in {persister.directory} "
                                        f"(persisted: {on_disk or 'none'})") from None
            raise
        log.warning("step %d: memory cannot supply it (%s); restoring from the persistent directory %s",
                    step, e, persister.directory)
    t1 = time.perf_counter()
    state = read_state(persister.directory, step, target)
    extra = read_extra(persister.directory, step)
    dt, nbytes = time.perf_counter() - t1, _nbytes(state)
    log.info("restored step %d from the persistent directory %s: %d bytes in %.3fs (%s)", step,
             persister.directory, nbytes, dt, _rate(nbytes, dt))
    return Restored(state, extra, step, "persistent")


# ----------------------------------------------------------------------------------------------- writing
@dataclass
class _Note:
    """What ``save()`` knew of a step the tier may persist: its tree structure and its arrays' dtypes/shardings."""

    treedef: Any
    arrays: dict[str, tuple[Any, Any]]  # path -> (dtype, sharding) of jax.Array leaves


class Persister:
    """Writes committed snapshots to ``config.persistent_dir`` on one background thread; lists and reads them.

    With ``persistent_interval == 0`` it only reads (restore fallback, ``latest_step``).
    """

    def __init__(self, engine: CheckpointEngine, config: Config) -> None:
        self.engine, self.config = engine, config
        self.directory = epath.Path(config.persistent_dir)
        self.interval = config.persistent_interval
        self._pi, self._pc = engine.process_index, engine.process_count
        self._cv = threading.Condition()
        self._notes: dict[int, _Note] = {}
        self._queue: deque[tuple[int, _Note | None]] = deque()
        self._busy = False
        self._closed = False
        self._errors: list[BaseException] = []
        self.persisted: list[int] = []  # steps this persister wrote, in order
        self.skipped: list[int] = []  # eligible steps not persisted because MAX_PENDING persists were pending
        self._mngr: ocp.CheckpointManager | None = None
        self._thread: threading.Thread | None = None
        if self.interval > 0:
            if self._pi == 0:
                remove_temporaries(self.directory)
            engine.add_commit_hook(self._on_commit)
            self._thread = threading.Thread(target=self._run, name="jaxckpt-persist", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------------------------------ listing
    def steps(self) -> list[int]:
        """Finalized persisted steps, ascending."""
        return persisted_steps(self.directory)

    def latest_step(self) -> int | None:
        """The newest finalized persisted step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------- training thread (save) side
    def wants(self, step: Any) -> bool:
        """True for the steps this tier persists: multiples of ``persistent_interval``."""
        return (self.interval > 0 and isinstance(step, (int, np.integer)) and not isinstance(step, bool)
                and step >= 0 and step % self.interval == 0)

    def note(self, step: int, treedef: Any, leaves: list[Leaf]) -> None:
        """Remember the structure and shardings ``save(step)`` had (cheap: no array is referenced)."""
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
        self.engine.hold(step)
        with self._cv:
            self._queue.append((step, note))
            self._cv.notify_all()

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
                self.engine.release(step)
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _manager(self) -> ocp.CheckpointManager:
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
        t0 = time.perf_counter()
        with self.engine.open(step) as (step, manifests, reader):
            own = next(m for m in manifests if m.process == self._pi)
            target = self._target(own, note)
            state = restore_tree(target, manifests, reader, step=step, process=self._pi)
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
        items = {STATE_ITEM: ocp.args.StandardSave(state)}
        if extra is not None:
            items[EXTRA_ITEM] = ocp.args.JsonSave(extra)
        with _Progress(step, nbytes, self.directory):
            mngr.save(step, args=ocp.args.Composite(**items), force=True)
        del state
        dt = time.perf_counter() - t1
        log.info("persisted step %d to %s: %d bytes written in %.3fs (%s)", step, self.directory, nbytes, dt,
                 _rate(nbytes, dt))

    def _target(self, own: Manifest, note: _Note | None) -> Any:
        """Placeholders of the saved state: ShapeDtypeStructs on the persist sharding, numpy/plain values."""
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
            return jax.tree_util.tree_unflatten(note.treedef, leaves)
        return nested(list(zip(keypaths, leaves)))

    def _placement(self, saved: Any) -> jax.sharding.Sharding:
        """Where the persist thread rebuilds an array (see the module docstring, step 1)."""
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
        if self._thread is not None:
            self._thread.join(timeout)
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
