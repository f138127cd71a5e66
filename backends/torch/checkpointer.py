"""``jaxckpt.backends.torch.Checkpointer``: asynchronous in-memory snapshots of torch state dicts.

Save path, three hops as in the JAX front end: this front end (flatten the state dict, host sources per
tensor) -> the core engine (plan, copy + checksum on worker threads) -> the store (slot commit). Planning,
snapshots, manifests, commit and retention are the core's; nothing here duplicates them.

How tensors map onto the planner (every process derives the same layouts, so no messages are needed; each
process is one "device" to the planner, with its process index as device id, since a rank holds one local
shard of each tensor):

- a plain tensor (or numpy array) is taken to hold the same value on every process of the group (data
  parallelism): the planner splits it so each process saves 1/N of it;
- a DTensor is laid out by its mesh and placements: each rank's local shard is its box, and a box replicated
  over R ranks is split between them;
- a ``torch.Generator`` and a :class:`PerRank` tensor differ per process: each process saves its own row of a
  ``(process_count, *shape)`` array and restores its own row.

On restore each process assembles the boxes its target needs; bytes held by another process of the job come
through the core's peer transport (``jaxckpt.backends.peers``), so a 2-rank job can restore onto other placements and a
sub-mesh can restore what a larger mesh saved.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from jaxckpt.core import manifest as mf
from jaxckpt.core.box import Box
from jaxckpt.config import Config
from jaxckpt.core.advise import IntervalAdvice
from jaxckpt.core.dtypes import dtype_from_name
from jaxckpt.core.dtypes import dtype_name as np_dtype_name
from jaxckpt.core.coordination import Coordinator, LocalCoordinator
from jaxckpt.core.engine import ArrayRecord, CheckpointEngine, SaveHandle
from jaxckpt.errors import ConfigError
from jaxckpt.core.plan import ArrayLayout, Placement

from jaxckpt.backends.torch import dtensor as dt
from jaxckpt.backends.torch.coordination import TorchStoreCoordinator
from jaxckpt.backends.torch.dtypes import dtype_name
from jaxckpt.backends.torch.host import HostCopies, Reads
from jaxckpt.backends.torch.restore import restore_state
from jaxckpt.core.restore import restore_step
from jaxckpt.backends.torch.tree import Leaf, flatten

log = logging.getLogger("jaxckpt.backends.torch")

__all__ = ["Checkpointer", "SaveHandle"]


def _refuse_persistent(config: Config) -> None:
    """ConfigError for ``Config.persistent_dir``: the persistent tier writes Orbax's format, which holds JAX arrays;
    this front end writes none, and an option it cannot honour is refused, never ignored."""
    if config.persistent_dir:
        raise ConfigError(f"Config.persistent_dir={config.persistent_dir!r}: the torch front end has no persistent "
                          f"tier (it writes Orbax's format, for JAX state); unset it, or write torch state to disk "
                          f"with torch.distributed.checkpoint")


class Checkpointer:
    """In-memory asynchronous checkpointing of torch state dicts (docs/design.md states the guarantees).

    ``defer_reads=False`` (default): ``save()`` returns once the snapshot no longer reads live tensors, so the
    caller may update them in place right away. On CPU that means it waits for the host copy (done by the
    worker threads in parallel); on CUDA it only queues the copies and orders the current stream after them.
    ``defer_reads=True``: ``save()`` returns at once and the copy overlaps the caller's next forward/backward;
    the caller MUST call :meth:`wait_for_reads` before anything writes the saved tensors in place
    (``optimizer.step()``, a training-mode forward that updates BatchNorm statistics, ``load_state_dict``).

    ``engine``: attach to an existing core engine (e.g. ``jaxckpt.Checkpointer().engine``) so a JAX and a torch
    front end share one store, one commit protocol and one retention policy; ``close()`` then leaves it open.
    """

    def __init__(self, config: Config | None = None, process_group: dist.ProcessGroup | None = None, *,
                 coordinator: Coordinator | None = None, engine: CheckpointEngine | None = None,
                 defer_reads: bool = False) -> None:
        if engine is not None:
            if config is not None or coordinator is not None:
                raise ConfigError("pass either engine= or config=/coordinator=, not both")
            _refuse_persistent(engine.config)
            self.engine, self._owns_engine = engine, False
        else:
            config = (config or Config()).with_env()
            _refuse_persistent(config)
            if coordinator is None:
                if dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1:
                    coordinator = TorchStoreCoordinator.from_process_group(process_group)
                else:
                    coordinator = LocalCoordinator()
            self.engine, self._owns_engine = CheckpointEngine(config, coordinator, framework="torch"), True
        self.config = self.engine.config
        self.process_group = process_group
        self.defer_reads = defer_reads
        self._host = HostCopies()
        self._rank_cache: dict[int, int] = {}
        self._boxes: dict[tuple, Any] = {}

    @property
    def store(self):
        """The store holding this process's snapshots."""
        return self.engine.store

    @property
    def process_index(self) -> int:
        return self.engine.process_index

    @property
    def process_count(self) -> int:
        return self.engine.process_count

    # ------------------------------------------------------------------------------------------------ save
    def save(self, step: int, state: Any) -> SaveHandle:
        """Start a snapshot of ``state`` (nested dicts/lists of tensors, DTensors, generators, values) as ``step``.

        The snapshot equals ``state`` at this call bit for bit (with ``defer_reads=True``, provided
        :meth:`wait_for_reads` is called before the state is written in place). Raises StepError if ``step`` is
        not newer than the last saved step, UnsupportedLeafError for a leaf it cannot hold, BudgetExceededError
        when the store's memory budget is full. Every process of the group must call it with a state of the
        same structure, shapes, dtypes and placements.
        """
        t0 = time.perf_counter()
        self.engine.check_open()
        leaves = flatten(state)
        reads = self._host.begin()
        try:
            records = [self._record(l, reads) for l in leaves if l.kind != "value"]
            values = [mf.LeafMeta(l.path, l.keypath, l.value) for l in leaves if l.kind == "value"]
            handle = self.engine.save(step, records, values, tuple(l.path for l in leaves), t0=t0)
        except BaseException:
            self._host.drop(reads)
            raise
        reads.handle = handle
        if not self.defer_reads:
            self._host.wait_for_reads()
            handle.save_call_seconds = time.perf_counter() - t0
        return handle

    def wait_for_reads(self, timeout: float | None = None) -> None:
        """Return once no pending snapshot reads the live tensors any more; call it before updating them in place.

        CPU: blocks until the worker threads have copied the tensors into host memory. CUDA: makes the current
        stream wait for the device-to-host copies (kernels queued afterwards run after them; the CPU does not
        wait). A no-op when nothing is pending; with ``defer_reads=False`` ``save()`` has already done it.
        """
        self._host.wait_for_reads(timeout)

    def _process_of(self, global_rank: int) -> int:
        p = self._rank_cache.get(global_rank)
        if p is None:
            if self.process_group is None or not dist.is_initialized():
                p = global_rank
            else:
                p = dist.get_group_rank(self.process_group, global_rank)
            self._rank_cache[global_rank] = p
        return p

    def _record(self, leaf: Leaf, reads: Reads) -> ArrayRecord:
        path, v, kind, n, me = leaf.path, leaf.value, leaf.kind, self.process_count, self.process_index
        if kind == "dtensor":
            return self._dtensor_record(leaf, reads)
        rows = kind in ("generator", "per_rank")
        if rows:
            # One row per process: every process holds (and later restores) only its own row.
            t = v.get_state() if kind == "generator" else v.tensor
            meta_kind = "torch_rng" if kind == "generator" else "per_rank"
            attrs = {"device": str(v.device if kind == "generator" else t.device)}
            shape, name, sharding = (n,) + tuple(t.shape), dtype_name(t.dtype, path), f"per-process({n})"
            sources = lambda devs: {me: self._host.source(t, reads, lead=True)}
        elif kind in ("numpy", "numpy_scalar"):
            # Copied at save(): wait_for_reads() cannot know when numpy arrays are written in place.
            arr = np.array(v, copy=True)
            if not arr.dtype.isnative:  # the manifest names the native dtype (jaxckpt.core.dtypes): save its bytes
                arr = arr.astype(arr.dtype.newbyteorder("="))
            shape, name, meta_kind, attrs = tuple(arr.shape), np_dtype_name(arr.dtype), kind, {}
            sharding = "replicated" if n > 1 else "host"
            sources = lambda devs: {me: ((lambda: arr), None)}
        else:
            shape, name, meta_kind = tuple(v.shape), dtype_name(v.dtype, path), "torch"
            attrs = {"device": str(v.device)}
            sharding = "replicated" if n > 1 else "local"
            sources = lambda devs: {me: self._host.source(v, reads)}

        def layout() -> ArrayLayout:  # only called when this layout is new to the engine
            if rows:
                row = shape[1:]
                pl = tuple(Placement(Box((p,) + (0,) * len(row), (p + 1,) + row), p, p) for p in range(n))
            else:
                pl = tuple(Placement(Box.full(shape), p, p) for p in range(n))
            return ArrayLayout(path, shape, name, dtype_from_name(name).itemsize, pl)

        return ArrayRecord(path, (meta_kind, shape, name, attrs.get("device")), layout,
                           lambda: mf.ArrayMeta(path, leaf.keypath, shape, name, meta_kind, sharding, attrs), sources)

    def _dtensor_record(self, leaf: Leaf, reads: Reads) -> ArrayRecord:
        x: DTensor = leaf.value
        path, shape, name = leaf.path, tuple(x.shape), dtype_name(x.dtype, leaf.path)
        mesh, placements = x.device_mesh, tuple(x.placements)
        key = ("dtensor", shape, name, mesh, placements)
        if (path, key) in self._boxes:  # checked once per layout: later saves only take the local shard
            box, local = self._boxes[(path, key)], x.to_local()
        else:
            box, local = dt.local_tensor(path, x)
            self._boxes[(path, key)] = box

        def layout() -> ArrayLayout:
            return ArrayLayout(path, shape, name, dtype_from_name(name).itemsize,
                               dt.placements(path, shape, mesh, placements, self._process_of))

        def meta() -> mf.ArrayMeta:
            return mf.ArrayMeta(path, leaf.keypath, shape, name, "dtensor", dt.describe(x),
                                {"device_type": mesh.device_type})

        def sources(devs: frozenset[int]) -> dict:
            return {} if box is None else {self.process_index: self._host.source(local, reads)}

        return ArrayRecord(path, key, layout, meta, sources)

    # ------------------------------------------------------------------------------------------------ wait
    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far is committed by all processes; raise the first failure."""
        self.engine.wait(timeout)

    def latest_step(self) -> int | None:
        """The newest step committed by all processes, or None."""
        return self.engine.latest_step()

    def all_steps(self) -> list[int]:
        """Committed steps still held, ascending."""
        return self.engine.all_steps()

    # --------------------------------------------------------------------------------------------- restore
    def advise_interval(self, mtbf_node_s: float, nodes: int, *, step_time_s: float | None = None,
                        overhead_s: float | None = None, latency_s: float | None = None,
                        restart_s: float = 0.0) -> "IntervalAdvice":
        """How often to snapshot so that the expected lost time is least (Young/Daly; ``jaxckpt.core.advise``
        states the formula and its assumptions), for ``nodes`` nodes failing every ``mtbf_node_s`` seconds on
        average. The step time, the per-snapshot overhead (what save() blocks) and the save -> committed latency
        are this job's own measured medians unless given; ``restart_s``: relaunch + restore time."""
        return self.engine.advise_interval(mtbf_node_s, nodes, step_time_s=step_time_s, overhead_s=overhead_s,
                                           latency_s=latency_s, restart_s=restart_s)

    @property
    def last_restore_report(self):
        """Where the last restore read its bytes and where its time went (a ``jaxckpt.core.sources.RestoreReport``
        with its per-phase ``timeline``), or None before the first restore."""
        return self.engine.last_restore_report

    def restore(self, target: Any = None, step: int | None = None, *, in_place: bool = False) -> Any:
        """The state saved at ``step`` (default: the latest committed), shaped like ``target``.

        ``target`` is a state dict like the one saved (e.g. ``{"model": model.state_dict(), "optim":
        opt.state_dict()}``): tensors come back with the target's dtype, shape and device, DTensors with the
        target's mesh and placements (resharded by the core planner), ``torch.Generator`` targets get
        ``set_state()`` (always in place), ``PerRank(t)`` targets come back as this process's tensor. Meta-device
        tensors ask for new CPU tensors. ``in_place=True`` copies into the target's tensors and returns them.
        A mismatch in structure, shape or dtype raises TargetMismatchError naming the path. Without a target,
        nested dicts/lists of CPU tensors come back (optimizer ``state`` keys stay ints).
        """
        return restore_step(self.engine, step, lambda step, manifests, reader: restore_state(
            target, manifests, reader, step=step, process=self.engine.process_index, in_place=in_place,
            gather=self._gather(target)))

    def _gather(self, target: Any) -> Any:
        """The collective of a multi-rank restore onto a target (the default process group, its ranks the
        engine's processes), else None."""
        import torch.distributed as dist

        if target is None or self.engine.process_count <= 1 or not self.config.restore_collective or \
                not dist.is_available() or not dist.is_initialized() or \
                dist.get_world_size() != self.engine.process_count or dist.get_rank() != self.engine.process_index:
            return None
        from jaxckpt.backends.torch.gather import TorchGather
        return TorchGather(self.engine.collective.channel("restore"))

    def close(self) -> None:
        """Finish in-flight saves, stop the threads and free the store (unless the engine was passed in)."""
        if self._owns_engine:
            self.engine.close()
        else:
            self.engine.wait(timeout=self.config.commit_timeout_s * 2)
        self._host.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
