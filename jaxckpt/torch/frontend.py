"""The torch front end's side of the front-end protocol (``jaxckpt.frontend.protocol.Frontend``).

How tensors map onto the planner (every process derives the same layouts, so no messages are needed; each
process is one "device" to the planner, with its process index as device id, since a rank holds one local
shard of each tensor):

- a plain tensor (or numpy array) is taken to hold the same value on every process of the group (data
  parallelism): the planner splits it so each process saves 1/N of it;
- a DTensor is laid out by its mesh and placements: each rank's local shard is its box, and a box replicated
  over R ranks is split between them;
- a ``torch.Generator`` and a :class:`~jaxckpt.torch.tree.PerRank` tensor differ per process: each process saves
  its own row of a ``(process_count, *shape)`` array and restores its own row.

Leaves to records, once per state layout (paths, kinds, shapes, dtypes, devices, DTensor placements: the
layout's key); what a save takes now, per save (``jaxckpt.torch.host``: CPU views, pinned copies on a CUDA
stream, numpy copies). Arrays from host boxes: ``jaxckpt.torch.restore.restore_state``. Coordinator: the
``torch.distributed`` store of the process group. Collective: ``jaxckpt.torch.gather``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch.distributed as dist

from jaxckpt.config import Config
from jaxckpt.core import manifest as mf
from jaxckpt.core.box import Box
from jaxckpt.core.coordination import Coordinator, LocalCoordinator
from jaxckpt.core.dtypes import dtype_from_name, native_order
from jaxckpt.core.dtypes import dtype_name as np_dtype_name
from jaxckpt.core.engine import ArrayRecord, CheckpointEngine, ShardReads
from jaxckpt.core.fetch import ChunkReader
from jaxckpt.core.plan import ArrayLayout, Placement
from jaxckpt.core.restore import Gather
from jaxckpt.torch.coordination import TorchStoreCoordinator
from jaxckpt.torch.dtypes import dtype_name
from jaxckpt.torch.host import HostCopies, Reads
from jaxckpt.torch.restore import restore_state
from jaxckpt.torch.tree import Leaf, flatten

if TYPE_CHECKING:  # DTensor's module is imported only by a state holding one (jaxckpt.torch.tree.is_dtensor)
    from torch.distributed.tensor import DTensor

__all__ = ["TorchFrontend", "TorchLayout"]

MAX_LAYOUTS = 64  # layouts remembered; a job whose layout keeps changing re-plans


def _leaf_key(leaf: Leaf) -> tuple:
    """What a leaf contributes to the layout key: everything its record depends on."""
    v, kind = leaf.value, leaf.kind
    if kind == "dtensor":
        return (leaf.path, kind, tuple(v.shape), v.dtype, v.device_mesh, tuple(v.placements))
    if kind == "generator":
        return (leaf.path, kind, str(v.device))
    if kind == "per_rank":
        return (leaf.path, kind, tuple(v.tensor.shape), v.tensor.dtype, str(v.tensor.device))
    if kind in ("numpy", "numpy_scalar"):
        return (leaf.path, kind, np.shape(v), np.asarray(v).dtype)
    if kind == "value":
        return (leaf.path, kind)
    return (leaf.path, kind, tuple(v.shape), v.dtype, str(v.device))


class TorchLayout:
    """One state dict layout (see the module docstring): its key, leaf order, and the records it makes."""

    def __init__(self, key: tuple, order: tuple[str, ...], frontend: "TorchFrontend") -> None:
        self.key, self.order, self._frontend = key, order, frontend

    def records(self, leaves: list[Leaf]) -> list[ArrayRecord]:
        return [self._frontend.record(leaf) for leaf in leaves if leaf.kind != "value"]

    def value_metas(self, leaves: list[Leaf]) -> list[mf.LeafMeta]:
        return [mf.LeafMeta(leaf.path, leaf.keypath, leaf.value) for leaf in leaves if leaf.kind == "value"]


class TorchFrontend:
    """torch state dicts (nested dicts/lists of tensors, DTensors, generators, numpy arrays, plain values)."""

    framework = "torch"
    persists = False

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.host = HostCopies()
        self.last_reads: Reads | None = None  # the reads the latest take() began
        self._layouts: dict[tuple, TorchLayout] = {}
        self._rank_cache: dict[int, int] = {}
        self._boxes: dict[tuple, Any] = {}  # (path, layout key of a DTensor) -> this rank's box of it
        self._engine: CheckpointEngine | None = None  # set by the face (process index and count)

    def bind(self, engine: CheckpointEngine) -> None:
        """The engine this front end saves through (its process index and count)."""
        self._engine = engine

    def coordinator(self) -> Coordinator:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1:
            return TorchStoreCoordinator.from_process_group(self.process_group)
        return LocalCoordinator()

    # ------------------------------------------------------------------------------------------------ save
    def layout(self, state: Any) -> tuple[TorchLayout, list[Leaf]]:
        leaves = flatten(state)
        key = tuple(_leaf_key(leaf) for leaf in leaves)
        got = self._layouts.get(key)
        if got is None:
            if len(self._layouts) >= MAX_LAYOUTS:
                self._layouts.pop(next(iter(self._layouts)))
            got = self._layouts[key] = TorchLayout(key, tuple(leaf.path for leaf in leaves), self)
        return got, leaves

    def take(self, layout: TorchLayout, devices: list[frozenset[int]], leaves: list[Leaf], owned: bool
             ) -> Callable[[], list[ShardReads]]:
        reads = self.host.begin()
        self.last_reads = reads
        try:
            arrays = [leaf for leaf in leaves if leaf.kind != "value"]
            out = [self._shard_reads(leaf, reads) if devs else {} for leaf, devs in zip(arrays, devices)]
        except BaseException:
            self.drop_reads()
            raise
        return lambda: out

    def drop_reads(self) -> None:
        """Forget the reads of a save that failed before the engine took it."""
        if self.last_reads is not None:
            self.host.drop(self.last_reads)
            self.last_reads = None

    def _shard_reads(self, leaf: Leaf, reads: Reads) -> ShardReads:
        """What this process's save reads of ``leaf``, taken now."""
        me, v, kind = self._engine.process_index, leaf.value, leaf.kind
        if kind == "dtensor":
            box, local = self._local_box(leaf)
            return {} if box is None else {me: self.host.shard_read(local, reads)}
        if kind == "generator":
            return {me: self.host.shard_read(v.get_state(), reads, lead=True)}
        if kind == "per_rank":
            return {me: self.host.shard_read(v.tensor, reads, lead=True)}
        if kind in ("numpy", "numpy_scalar"):
            # Copied at save(): wait_for_reads() cannot know when numpy arrays are written in place.
            arr = _native(v)
            return {me: ((lambda: arr), None)}
        return {me: self.host.shard_read(v, reads)}

    def _local_box(self, leaf: Leaf) -> tuple[Box | None, Any]:
        """This rank's box of a DTensor (checked once per layout) and its local tensor."""
        from jaxckpt.torch import dtensor as dt

        x: DTensor = leaf.value
        key = (leaf.path, _leaf_key(leaf))
        if key in self._boxes:
            return self._boxes[key], x.to_local()
        box, local = dt.local_tensor(leaf.path, x)
        self._boxes[key] = box
        return box, local

    def _process_of(self, global_rank: int) -> int:
        p = self._rank_cache.get(global_rank)
        if p is None:
            if self.process_group is None or not dist.is_initialized():
                p = global_rank
            else:
                p = dist.get_group_rank(self.process_group, global_rank)
            self._rank_cache[global_rank] = p
        return p

    def record(self, leaf: Leaf) -> ArrayRecord:
        """The engine's record of an array leaf (called once per layout)."""
        path, v, kind, n = leaf.path, leaf.value, leaf.kind, self._engine.process_count
        if kind == "dtensor":
            return self._dtensor_record(leaf)
        rows = kind in ("generator", "per_rank")
        if rows:
            # One row per process: every process holds (and later restores) only its own row.
            t = v.get_state() if kind == "generator" else v.tensor
            meta_kind = "torch_rng" if kind == "generator" else "per_rank"
            attrs = {"device": str(v.device if kind == "generator" else t.device)}
            shape, name, sharding = (n,) + tuple(t.shape), dtype_name(t.dtype, path), f"per-process({n})"
        elif kind in ("numpy", "numpy_scalar"):
            arr = np.asarray(v)
            shape, name, meta_kind, attrs = tuple(arr.shape), np_dtype_name(arr.dtype.newbyteorder("=")), kind, {}
            sharding = "replicated" if n > 1 else "host"
        else:
            shape, name, meta_kind = tuple(v.shape), dtype_name(v.dtype, path), "torch"
            attrs = {"device": str(v.device)}
            sharding = "replicated" if n > 1 else "local"

        def layout() -> ArrayLayout:
            if rows:
                row = shape[1:]
                pl = tuple(Placement(Box((p,) + (0,) * len(row), (p + 1,) + row), p, p) for p in range(n))
            else:
                pl = tuple(Placement(Box.full(shape), p, p) for p in range(n))
            return ArrayLayout(path, shape, name, dtype_from_name(name).itemsize, pl)

        return ArrayRecord(path, (meta_kind, shape, name, attrs.get("device")), layout,
                           lambda: mf.ArrayMeta(path, leaf.keypath, shape, name, meta_kind, sharding, attrs))

    def _dtensor_record(self, leaf: Leaf) -> ArrayRecord:
        from jaxckpt.torch import dtensor as dt

        x: DTensor = leaf.value
        path, shape, name = leaf.path, tuple(x.shape), dtype_name(x.dtype, leaf.path)
        mesh, placements = x.device_mesh, tuple(x.placements)

        def layout() -> ArrayLayout:
            return ArrayLayout(path, shape, name, dtype_from_name(name).itemsize,
                               dt.placements(path, shape, mesh, placements, self._process_of))

        def meta() -> mf.ArrayMeta:
            return mf.ArrayMeta(path, leaf.keypath, shape, name, "dtensor", dt.describe(x),
                                {"device_type": mesh.device_type})

        return ArrayRecord(path, ("dtensor", shape, name, mesh, placements), layout, meta)

    # --------------------------------------------------------------------------------------------- restore
    def build(self, target: Any, manifests: list[mf.Manifest], reader: ChunkReader, *, step: int, process: int,
              gather: Gather | None, in_place: bool = False) -> Any:
        return restore_state(target, manifests, reader, step=step, process=process, in_place=in_place,
                             gather=gather)

    def gather(self, engine: CheckpointEngine, target: Any, config: Config) -> Gather | None:
        """The collective of a multi-rank restore onto a target (the default process group, its ranks the
        engine's processes), else None."""
        if target is None or engine.process_count <= 1 or not config.restore_collective or \
                not dist.is_available() or not dist.is_initialized() or \
                dist.get_world_size() != engine.process_count or dist.get_rank() != engine.process_index:
            return None
        from jaxckpt.torch.gather import TorchGather
        return TorchGather(engine.collective.channel("restore"))

    def persist_note(self, layout: TorchLayout, leaves: list[Leaf]) -> tuple[Any, list[Any]]:
        raise NotImplementedError("the torch front end writes no persistent tier")


def _native(v: Any) -> np.ndarray:
    """A private copy of a numpy leaf in native byte order (the manifest names the native dtype)."""
    return native_order(np.array(v, copy=True))
