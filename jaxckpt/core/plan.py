"""Save and restore planning as pure functions of layouts and manifests (no framework, no I/O).

Save (every process computes the same global plan from the arrays' shardings, so no messages are needed):
  1) group each array's device placements by box; the processes holding a box are its replicas;
  2) a box held by one process is saved by it; a box replicated over R processes is cut into R pieces along
     its longest axis and each replica saves one piece, the least loaded replica taking the largest piece, so
     every replica saves about 1/R of every replicated array and the total is balanced across arrays
     (``Config.replicas="split"``, REFT). Given the node of every process (``Config.replicas="whole"``), a box
     is instead saved whole once per node that holds it, cut alike on every such node into as many pieces as
     the fewest replicas any of them has, each piece saved by one of the node's own replicas (least loaded
     first): every node then keeps a full copy of what it holds, so a restore reads its own node's memory, the
     copies on the other nodes are its redundancy (the same chunk boxes on each node), and a node's replicas
     share its copy's saving as split replicas share the box (on one node, whole and split are the same plan);
  3) pieces larger than ``chunk_bytes`` are cut further so that worker threads share big arrays;
  4) each process lays its chunks out back to back (64-byte aligned) in one buffer.
Restore: for the boxes a process's new shardings need, pick the saved chunks that cover them.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Mapping, Sequence

from jaxckpt.core.box import Box, covers, disjoint
from jaxckpt.errors import PlanError
from jaxckpt.core.manifest import ArrayMeta, ChunkMeta

ALIGN = 64
HOST = -1  # device id of a host (numpy) array


@dataclass(frozen=True)
class Placement:
    """Device ``device`` of process ``process`` holds ``box`` of an array."""

    box: Box
    process: int
    device: int


@dataclass(frozen=True)
class ArrayLayout:
    """An array as the planner sees it: global shape, dtype and where its pieces live."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    placements: tuple[Placement, ...]

    @property
    def nbytes(self) -> int:
        return Box.full(self.shape).size * self.itemsize


@dataclass(frozen=True)
class ChunkPlan:
    """Process-local instruction: copy ``box`` out of the shard ``source`` on ``device`` to ``offset``."""

    path: str
    box: Box
    source: Box
    device: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class SavePlan:
    process: int
    chunks: tuple[ChunkPlan, ...]
    nbytes: int
    layout: str


def layout_digest(layouts: Sequence[ArrayLayout]) -> str:
    """A short stable name of a layout; equal layouts get equal plans."""
    h = hashlib.blake2b(digest_size=8)
    for a in layouts:
        h.update(repr((a.path, a.shape, a.dtype, a.placements)).encode())
    return h.hexdigest()


def plan_save(layouts: Sequence[ArrayLayout], process_count: int, chunk_bytes: int = 64 << 20, *,
              nodes: Sequence[int] | None = None) -> list[SavePlan]:
    """The global save plan: one SavePlan per process, every unique box saved exactly once; with ``nodes`` (the
    node of each process: ``Config.replicas="whole"``) every unique box saved whole once on each node holding it,
    shared among that node's replicas."""
    if nodes is not None and len(nodes) != process_count:
        raise PlanError(f"a whole-replica plan needs the node of each of the {process_count} processes "
                        f"(got {len(nodes)})")
    load = [0] * process_count
    per_proc: list[list[tuple[str, Box, Box, int, int]]] = [[] for _ in range(process_count)]
    for a in layouts:
        holders: dict[Box, dict[int, int]] = {}
        for p in a.placements:
            if not 0 <= p.process < process_count:
                raise PlanError(f"{a.path}: placement on process {p.process} outside 0..{process_count - 1}")
            holders.setdefault(p.box, {}).setdefault(p.process, p.device)  # first device of each process
        for box, procs in holders.items():
            replicas = sorted(procs, key=lambda q: (load[q], q))
            # Owner lists, least loaded first: the box's replicas (split), or each node's own replicas (whole).
            if nodes is None:
                groups = [replicas]
            else:
                local: dict[int, list[int]] = {}
                for q in replicas:
                    local.setdefault(nodes[q], []).append(q)
                groups = list(local.values())
            # Every node cuts its copy alike (the fewest replicas any node has), so the copies' chunk boxes
            # match and each is the other's redundancy. Pieces differ by up to a row and split() puts the small
            # ones first: the biggest goes to the least loaded replica, or one replica would take the small
            # piece of every array.
            pieces = sorted(box.split(min(len(g) for g in groups)), key=lambda b: -b.size)
            for owners in groups:
                for piece, owner in zip(pieces, owners):
                    for chunk in _cut(piece, a.itemsize, chunk_bytes):
                        nbytes = chunk.size * a.itemsize
                        per_proc[owner].append((a.path, chunk, box, procs[owner], nbytes))
                        load[owner] += nbytes
    digest = layout_digest(layouts)
    plans = []
    for proc, items in enumerate(per_proc):
        off, chunks = 0, []
        for path, box, source, device, nbytes in items:
            chunks.append(ChunkPlan(path, box, source, device, off, nbytes))
            off += -(-nbytes // ALIGN) * ALIGN
        plans.append(SavePlan(proc, tuple(chunks), off, digest))
    validate_save_plan(layouts, plans, nodes)
    return plans


def _cut(box: Box, itemsize: int, chunk_bytes: int) -> list[Box]:
    nbytes = box.size * itemsize
    if nbytes <= chunk_bytes or box.ndim == 0:
        return [box]
    return box.split(-(-nbytes // chunk_bytes))


def validate_save_plan(layouts: Sequence[ArrayLayout], plans: Sequence[SavePlan],
                       nodes: Sequence[int] | None = None) -> None:
    """Raise PlanError unless every array is covered exactly once by in-bounds chunks; with ``nodes`` (whole
    replicas) a chunk may be saved again, the same box, on another node, never twice on one node."""
    by_path: dict[str, list[Box]] = {a.path: [] for a in layouts}
    on_node: set[tuple[str, Box, int]] = set()
    for plan in plans:
        for c in plan.chunks:
            if c.path not in by_path:
                raise PlanError(f"{c.path}: process {plan.process} plans a chunk of an array the layout does not have")
            if nodes is not None:
                key = (c.path, c.box, nodes[plan.process])
                if key in on_node:
                    raise PlanError(f"{c.path}: chunk {c.box} is saved twice on node {nodes[plan.process]}")
                on_node.add(key)
            by_path[c.path].append(c.box)
    for a in layouts:
        boxes, whole = by_path[a.path], Box.full(a.shape)
        if nodes is not None:
            boxes = list(dict.fromkeys(boxes))  # each node's copy is the same boxes: the distinct ones cover it
        for b in boxes:
            if not whole.contains(b):
                raise PlanError(f"{a.path}: chunk {b} out of bounds of shape {a.shape}")
        if sum(b.size for b in boxes) != whole.size or not disjoint(boxes):
            raise PlanError(f"{a.path}: chunks do not cover the array exactly once")


@dataclass(frozen=True)
class Read:
    """Copy ``part`` (global coordinates) out of saved ``chunk``."""

    chunk: ChunkMeta
    part: Box


@dataclass(frozen=True)
class Assembly:
    """Build ``box`` of array ``path`` from ``reads`` and place it on ``devices``."""

    path: str
    box: Box
    devices: tuple[int, ...]
    reads: tuple[Read, ...]

    @property
    def whole_chunk(self) -> bool:
        """True when one saved chunk is exactly the needed box, so its bytes can be used without a copy."""
        return len(self.reads) == 1 and self.reads[0].chunk.box == self.box


def plan_restore(meta: ArrayMeta, needed: Mapping[Box, Sequence[int]], *, step: int,
                 prefer_process: int = 0, cost: Mapping[int, int] | None = None) -> list[Assembly]:
    """For each needed box (with the local devices that need it), the saved chunks that cover it.

    Chunks of the processes of lowest ``cost`` (saving process -> how dear its bytes are to read, default 0:
    whole replicas saved the same box on several nodes, and this node's copy is the one to read) are taken
    first, of those ``prefer_process``'s first; chunks from other processes fill what is left. A box that the
    saved chunks cannot cover raises PlanError naming the array, step and the uncovered box.
    """
    cost = cost or {}
    order = sorted(meta.chunks, key=lambda c: (cost.get(c.process, 0), c.process != prefer_process, c.process,
                                               c.box))
    # The usual restore asks for the boxes it saved: a preferred chunk that is exactly the box is the plan, with
    # no intersecting of every chunk with every box (per array, thousands of arrays: the restore's plan cost).
    # A copy of the box no dearer than this process's own counts as preferred too (whole replicas: this node's
    # copy; a lost process's box from another node's copy rather than rebuilt).
    mine = cost.get(prefer_process, 0)
    exact = {c.box: c for c in reversed(order)
             if (c.process == prefer_process or (cost and cost.get(c.process, 0) <= mine)) and c.box.size}
    out = []
    for box, devices in needed.items():
        c = exact.get(box)
        if c is not None:
            out.append(Assembly(meta.path, box, tuple(devices), (Read(c, box),)))
            continue
        reads, got = [], []
        for c in order:
            part = c.box.intersect(box)
            if part is None or any(part.intersect(g) is not None for g in got if g.size and part.size):
                continue
            reads.append(Read(c, part))
            got.append(part)
        if not covers(box, got):
            raise PlanError(f"{meta.path}: step {step} has no saved bytes for box {box.start}..{box.stop}")
        out.append(Assembly(meta.path, box, tuple(devices), tuple(reads)))
    return out
