"""Which arrays a multi-process restore forms with the framework's collective, and which it fetches (pure).

A restoring process reads some saving processes' snapshots from its own node's memory (its own store, its node
agent's shared memory); everything else reaches it over the host transport (another node's agent, another
process, a rebuild from parity pulled from surviving nodes). For an array replicated over R data-parallel
replicas each replica saved 1/R of it (``jaxckpt.core.plan.plan_save``): fetching the full array on every
process moves (R-1)/R of it over the host transport, R times. Through the collective each process instead
reads only the share its node holds, lays it out in a staging array on its devices, and one jitted program of
the front end (XLA's all-gather on the device interconnect; gloo on CPU) forms the target's shards.

The rule, per array, the same on every process (its inputs are the merged manifests, the target's layout and
the holder map every process contributed to, see :func:`plan_route`):

  * ``fetch`` (single process): the job has one process; nothing changes.
  * ``fetch`` (a host target): no collective can carry anything.
  * ``fetch`` (outside the target's mesh): a saved piece is held in the memory of some process's node, but no
    process of the target's mesh holds it: the target's mesh does not contain (splits) the saved replica group,
    so those bytes can only travel over the host transport.
  * ``fetch`` (local): every process of the target needs only boxes that it reads from its own node's memory.
  * ``fetch`` (one process): the target's devices belong to one process (and it does not hold everything).
  * ``collective`` otherwise. Each saved chunk is contributed to the staging array by exactly one process of the
    target's mesh: one that reads it from its node's memory (the saving process itself first, then the least
    loaded one); a chunk no process holds in its node's memory (a lost node's, single-copy data on a node the
    job does not use) by the saving process's namesake if it is in the mesh, else by the least loaded process,
    which fetches or rebuilds it over the host transport once for all.

The staging array of a collective array has one row per device of the target's sharding (in its order); each
contributor's chunks are spread over its own devices' rows, flattened back to back (``Contribution.offset``,
in elements), the rows padded to the longest.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, MutableMapping, Sequence

from jaxckpt.core.box import Box
from jaxckpt.core.manifest import ArrayMeta, ChunkMeta

__all__ = ["COLLECTIVE", "FETCH", "Contribution", "Route", "TargetLayout", "plan_route", "received_elements"]

COLLECTIVE, FETCH = "collective", "fetch"


@dataclass(frozen=True)
class TargetLayout:
    """Where a target array lives: every device of its sharding with its process, and the box each holds."""

    devices: tuple[tuple[int, int, Box], ...]  # (device id, process, box), in the sharding's device order

    @property
    def processes(self) -> tuple[int, ...]:
        return tuple(sorted({p for _, p, _ in self.devices}))

    def boxes_of(self, process: int) -> tuple[Box, ...]:
        """The distinct boxes ``process``'s devices hold."""
        return tuple(dict.fromkeys(b for _, p, b in self.devices if p == process))


@dataclass(frozen=True)
class Contribution:
    """Saved ``chunk`` is put by ``process`` into row ``row`` (the device ``device``) at element ``offset``."""

    chunk: ChunkMeta
    process: int
    device: int
    row: int
    offset: int


@dataclass(frozen=True)
class Route:
    """How one array is restored: ``kind`` is COLLECTIVE or FETCH, ``reason`` says why (for the report)."""

    path: str
    kind: str
    reason: str
    contributions: tuple[Contribution, ...] = ()
    row_elements: int = 0  # elements per staging row
    devices: tuple[int, ...] = ()  # the staging rows' devices, in the target sharding's device order

    def mine(self, process: int) -> tuple[Contribution, ...]:
        """The chunks ``process`` puts into the staging array."""
        return tuple(c for c in self.contributions if c.process == process)


def _covered(box: Box, chunks: Sequence[ChunkMeta]) -> bool:
    """Whether the saved chunks (disjoint but for copies of a box) cover ``box``."""
    got = 0
    for b in dict.fromkeys(c.box for c in chunks):  # copies of one box (whole replicas) count once
        part = b.intersect(box)
        if part is not None:
            got += part.size
    return got >= box.size


def _one_copy(meta: ArrayMeta, holders: Mapping[int, Sequence[int]]) -> ArrayMeta:
    """``meta`` with one saved chunk per box: whole replicas saved a box on several nodes, and the collective
    needs it once (the copy most processes read from their node's memory, then the lowest process)."""
    best: dict = {}
    for c in meta.chunks:
        b = best.get(c.box)
        if b is None or (len(holders.get(c.process, ())), -c.process) > (len(holders.get(b.process, ())), -b.process):
            best[c.box] = c
    if len(best) == len(meta.chunks):
        return meta
    return dataclasses.replace(meta, chunks=tuple(best.values()))


def plan_route(meta: ArrayMeta, target: TargetLayout | None, holders: Mapping[int, Sequence[int]], *,
               process_count: int, load: MutableMapping[int, int] | None = None) -> Route:
    """How to restore ``meta`` onto ``target`` (see the module docstring for the rule).

    ``holders`` maps each saving process to the restoring processes that read its snapshot from their own node's
    memory. ``load`` (process -> bytes contributed so far) is carried across the arrays of one restore, in leaf
    order, so contributions are balanced over the processes; every process must pass the same sequence.
    """
    load = {} if load is None else load
    every = meta.chunks  # all copies: a process reads locally whichever its node holds
    meta = _one_copy(meta, holders)
    if process_count <= 1:
        return Route(meta.path, FETCH, "single process")
    if target is None:
        return Route(meta.path, FETCH, "a host target")
    if not meta.chunks or any(c.box.size == 0 for c in meta.chunks) or not meta.shape:
        return Route(meta.path, FETCH, "no bytes to move by collective (a scalar or an empty array)")
    mesh = set(target.processes)
    outside: dict[int, tuple[int, ...]] = {}
    for c in meta.chunks:
        hs = tuple(holders.get(c.process, ()))
        if hs and not mesh.intersection(hs):
            outside[c.process] = hs
    if outside:
        said = ", ".join(f"saving process {q} (held by process{'es' if len(h) > 1 else ''} "
                         f"{', '.join(map(str, h))})" for q, h in sorted(outside.items()))
        return Route(meta.path, FETCH, f"saved pieces outside the target's mesh (processes "
                                       f"{', '.join(map(str, sorted(mesh)))}): {said}")
    if all(_covered(box, [c for c in every if p in holders.get(c.process, ())])
           for p in mesh for box in target.boxes_of(p)):
        return Route(meta.path, FETCH, "local: every process of the target reads what it needs from its node")
    if len(mesh) <= 1:
        return Route(meta.path, FETCH, "a target on one process's devices: no collective to form it with")
    itemsize = meta.chunks[0].nbytes // max(1, meta.chunks[0].box.size)
    devs_of: dict[int, list[int]] = {}
    for dev, p, _ in target.devices:
        devs_of.setdefault(p, []).append(dev)
    row_of = {dev: i for i, (dev, _, _) in enumerate(target.devices)}
    fill = {dev: 0 for dev, _, _ in target.devices}
    out = []
    lost = 0
    for c in sorted(meta.chunks, key=lambda c: (c.process, c.offset)):
        hs = [p for p in holders.get(c.process, ()) if p in mesh]
        if not hs:
            lost += 1
            hs = [c.process] if c.process in mesh else sorted(mesh)
        p = c.process if c.process in hs else min(hs, key=lambda q: (load.get(q, 0), q))
        dev = min(devs_of[p], key=lambda d: (fill[d], d))
        out.append(Contribution(c, p, dev, row_of[dev], fill[dev]))
        fill[dev] += c.box.size
        load[p] = load.get(p, 0) + c.box.size * itemsize
    reason = "replicas formed by collective" + (f"; {lost} chunk(s) no node holds go over the host transport once"
                                                if lost else "")
    return Route(meta.path, COLLECTIVE, reason, tuple(out), max(1, max(fill.values())),
                 tuple(dev for dev, _, _ in target.devices))


def received_elements(route: Route, target: TargetLayout, process: int) -> int:
    """Elements of the boxes ``process`` needs that the collective brings it from other processes."""
    n = 0
    for box in target.boxes_of(process):
        for c in route.contributions:
            if c.process != process:
                part = c.chunk.box.intersect(box)
                n += part.size if part is not None else 0
    return n
