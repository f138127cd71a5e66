"""A save's chunk table: a state layout's plan prepared once for this process (``Prepared``: its chunks, the
arrays' metadata, the devices each array is read from, the chunks indexed as the copier reads them), and one
save's chunks as the copier's table (``SaveChunks``, a ``core.copier.Chunks``). The engine keeps one ``Prepared``
per layout and hands the copier a ``SaveChunks`` per save.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import numpy as np

from jaxckpt.core import manifest as mf
from jaxckpt.core.hostbuf import host_bytes
from jaxckpt.core.plan import ArrayLayout, SavePlan, plan_save
from jaxckpt.core.protect import Protection

log = logging.getLogger("jaxckpt.core.engine")

# A record's shard reads on save: device id -> (that device's shard on the host, or fetch() returning it;
# optional start() of its transfer)
ShardReads = dict[int, tuple[np.ndarray | Callable[[], np.ndarray], Callable[[], None] | None]]


@dataclass
class ArrayRecord:
    """A front end's array leaf, neutral: the engine calls ``layout``/``meta`` only when the layout is new."""

    path: str
    layout_key: tuple  # hashable; equal keys promise equal layout() and meta()
    layout: Callable[[], ArrayLayout]
    meta: Callable[[], mf.ArrayMeta]  # chunks left empty
    # Called inside save() for the devices the plan reads from; it must take those devices' bytes as they are at
    # the call (views that block donation, or device copies). None for a front end that takes them itself
    # (jaxckpt.frontend: its take()); then only begin()/start() save it, not save().
    reads: Callable[[frozenset[int]], ShardReads] | None = None


@dataclass
class Prepared:
    """A layout's save plan on this process, made once per layout: its chunks, metadata and where each is read."""

    plan: SavePlan
    metas: list[mf.ArrayMeta]
    chunk_leaf: list[int]
    chunk_slices: list[tuple[slice, ...]]
    devices: list[frozenset[int]]  # per array leaf, the local devices its chunks are read from
    key: Hashable = ()  # the layout key (protection plans are kept per layout)
    copies: tuple = ()  # per local chunk (leaf index, device, slice of the device's shard, slot offset, nbytes)
    table: "ChunkIndex | None" = None  # the copies as the copier's table reads them; made on first use
    manifest: "mf.Template | None" = None  # the manifest's encoding (its leaf order's), made on the first save

    def template(self, process: int, process_count: int, framework: str, order: tuple[str, ...]) -> mf.Template:
        """This layout's manifest template for a save of leaves in ``order`` (made once per layout)."""
        t = self.manifest
        if t is None or (t.order is not order and t.order != order):
            chunks = [(i, c.box, c.offset, c.nbytes, process) for c, i in zip(self.plan.chunks, self.chunk_leaf)]
            t = self.manifest = mf.Template(process, process_count, framework, self.metas, chunks, order,
                                            self.plan.nbytes, self.plan.layout)
        return t


@dataclass(frozen=True)
class ChunkIndex:
    """A layout's chunks, indexed once: per chunk its shard read (a (leaf, device) pair, numbered), slice,
    offset and size; per shard read, its (leaf, device) and how many chunks read it."""

    shards: tuple[tuple[int, int], ...]
    uses: tuple[int, ...]
    shard_of: tuple[int, ...]
    slices: tuple[tuple[slice, ...], ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, copies: tuple) -> "ChunkIndex":
        number: dict[tuple[int, int], int] = {}
        for leaf_i, dev, _, _, _ in copies:
            number.setdefault((leaf_i, dev), len(number))
        shard_of = tuple(number[(c[0], c[1])] for c in copies)
        uses = [0] * len(number)
        for k in shard_of:
            uses[k] += 1
        return cls(tuple(number), tuple(uses), shard_of, tuple(c[2] for c in copies),
                   tuple(c[3] for c in copies), tuple(c[4] for c in copies))


class SaveChunks:
    """One save's chunks as the copier's table (``core.copier.Chunks``): a save keeps two lists of its shard reads
    and one of counts, nothing per chunk or per shard read that the collector tracks (see ``Chunks`` for why).
    A shard read is dropped as soon as its last chunk is copied, so a donating step can reuse that buffer."""

    __slots__ = ("_index", "_fetch", "_start", "_left", "offsets", "sizes")

    def __init__(self, prep: Prepared, reads: Callable[[], list[ShardReads]]) -> None:
        if prep.table is None:
            prep.table = ChunkIndex.of(prep.copies)
        index = self._index = prep.table
        srcs = reads()
        self._fetch: list[Any] = []
        starts: list[Any] = []
        for leaf_i, dev in index.shards:
            fetch, start = srcs[leaf_i][dev]
            self._fetch.append(fetch)
            starts.append(start)
        self._start = starts if any(st is not None for st in starts) else None
        self._left = list(index.uses)
        self.offsets, self.sizes = index.offsets, index.sizes

    def start(self, i: int) -> None:
        if self._start is not None:
            start = self._start[self._index.shard_of[i]]
            if start is not None:
                start()

    def fetch(self, i: int) -> np.ndarray:
        return host_bytes(self._fetch[self._index.shard_of[i]])[self._index.slices[i]]

    def done(self, lo: int, hi: int) -> None:
        shard_of, left = self._index.shard_of, self._left
        for i in range(lo, hi):
            k = shard_of[i]
            left[k] -= 1
            if not left[k]:
                self._fetch[k] = None
                if self._start is not None:
                    self._start[k] = None


def prepare(key: Hashable, records: list[ArrayRecord], process_index: int, process_count: int, chunk_bytes: int,
            protection: Protection | None, nodes: tuple[int, ...] | None = None) -> Prepared:
    """The save plan of a new layout (``records``) on process ``process_index``, with the devices protection
    reads its parity from; ``nodes``: each process's node, for whole replicas (``plan_save``)."""
    layouts = [r.layout() for r in records]
    plans = plan_save(layouts, process_count, chunk_bytes, nodes=nodes)
    plan = plans[process_index]
    index = {r.path: i for i, r in enumerate(records)}
    src_box = {(lay.path, p.device): p.box for lay in layouts for p in lay.placements}
    devices: list[set[int]] = [set() for _ in records]
    for c in plan.chunks:
        devices[index[c.path]].add(c.device)
    if protection is not None:  # the device copies this process's parity stripes are computed from
        for path, devs in protection.prepare(key, layouts, plans).items():
            devices[index[path]] |= devs
    chunk_leaf = [index[c.path] for c in plan.chunks]
    chunk_slices = [src_box[(c.path, c.device)].relative(c.box) for c in plan.chunks]
    prep = Prepared(plan, [r.meta() for r in records], chunk_leaf, chunk_slices,
                    [frozenset(d) for d in devices], key,
                    tuple((i, c.device, sl, c.offset, c.nbytes)
                          for c, i, sl in zip(plan.chunks, chunk_leaf, chunk_slices)))
    log.info("planned a new state layout: %d arrays, %d local chunks, %d bytes on process %d",
             len(records), len(plan.chunks), plan.nbytes, process_index)
    return prep
