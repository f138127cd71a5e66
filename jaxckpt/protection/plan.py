"""Protection planning: which redundancy each saved chunk gets so that a step survives the loss of a node.

Pure functions of the global save plan (:func:`jaxckpt.core.plan.plan_save`), the arrays' layouts and the node of
every process; every process computes the same :class:`ProtectionPlan`, so no messages are needed to agree on it.

Policies (``Config.protection``), decided per saved chunk (all chunks of one replicated box get the same one):

* ``parity`` (REFT) for a box whose device copies sit on Rn >= 2 distinct nodes. plan.py cut the box into pieces
  saved once each, so node n saves a stream S_n (its replicas' pieces, concatenated; all boxes replicated over
  the same processes share one stream). Each S_n is cut into Rn-1 units d[n, j], one per other node j, and
  node j holds the stripe parity

      P_j = XOR_{n != j} d[n, j]                         (units zero-padded to the longest)

  computed by a replica process on node j *from its own full device copy*: zero bytes are sent at save time.
  Node j holds about |S|/(Rn-1) extra bytes, 1/(Rn-1) of what it saves: RAID-5 with rotating parity. (The
  naive scheme, replica i keeping P_i = XOR_{j != i} piece_j with piece_i = P_j ^ XOR_{k != i, j} piece_k,
  rebuilds just as well but holds a whole piece of parity per piece saved: 100% extra for every R.) Losing
  node i loses S_i and P_i; every unit of S_i is rebuilt as

      d[i, j] = (P_j ^ XOR_{n != i, j} d[n, j])[:len(d[i, j])]      for each j != i,

  all from survivors. P_i is not needed (it protects the others). Rn = 2: S_n is one unit and P_j = d[n, j] is
  a copy of the other node's share, so each node holds the whole box. Two lost nodes i, i' of one replica set
  lose d[i, i'] with its parity P_i' (and, where the units overlap, d[i, j] with d[i', j]): the error names
  those bytes. Replicas are grouped by *node*, not process: replicas that share a node protect nothing against
  that node's loss; a box whose copies all sit on one node is not parity-protectable and falls back to
  ``replica``. The computing process reads the other nodes' units from its device copy, about as many bytes as
  its own share; a front end can XOR them on the device and copy only P_j (1/(Rn-1) of the share) to host.
* ``xor-group`` for any data: nodes are split into groups of ``group_size`` (the last ones enlarged rather than
  left alone) and the same striping is applied to each node's stream S_n of xor-protected chunks, the parity of
  stripe j held by node j's agent, outside the data it protects; the units are sent to it in the background.
  Extra memory 1/(G-1) of the data, the whole data sent once. One lost node per group is rebuilt.
* ``replica``: every chunk saved on node n is copied to the next ``copies`` nodes of the ring of node ids
  (n+1, ..., n+k, never n itself). A chunk is lost only with its node and all k copy holders.
* ``hybrid``: the cheapest choice that survives one node loss, per box: ``parity`` when its copies span >= 2
  nodes (no network at save time); else ``xor-group`` when its node's group has >= 3 nodes (extra 1/(G-1) <= 1/2);
  else ``replica`` (one copy costs what a group of 2 would).
* ``whole`` (whatever the policy): a chunk whose box is also saved whole on another node
  (``Config.replicas="whole"``, :func:`jaxckpt.core.plan.plan_save`) gets no redundancy of its own: the copies
  on the other nodes are it. A lost one is read back from a surviving copy (``jaxckpt.protection.rebuild``),
  checked against its crc32c. A box saved on one node only still gets the policy's choice.
* ``none``; and any policy on a single-node job, where nothing survives the node (logged).

Streams are cut into rounds of at most ``unit_bytes`` per unit so that no parity block is unbounded; a last
partial round is cut into equal units at 64-byte boundaries (aligned uint64 XOR). Who does what:

  (replica processes)  compute the ``parity`` stripes of :meth:`ProtectionPlan.parity_tasks` from device copies;
  (node agents)        send the units of :meth:`xor_sends` and the blocks of :meth:`copy_sends`; hold what
                       :meth:`held_by` lists; the step is protected when every holder has its blocks.
The rebuild after a set of nodes is lost is planned by :mod:`jaxckpt.protection.rebuild`; the plan's bytes, which
the agents keep with each step, are :mod:`jaxckpt.protection.plan_wire`'s.
"""
from __future__ import annotations

import bisect
import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

from jaxckpt.protection import parity
from jaxckpt.core.box import Box
from jaxckpt.errors import PlanError
from jaxckpt.core.plan import ArrayLayout, SavePlan

if TYPE_CHECKING:
    from jaxckpt.config import Config

log = logging.getLogger("jaxckpt.protection.plan")

POLICIES = ("none", "replica", "parity", "xor-group", "hybrid")
KINDS = ("none", "replica", "parity", "xor-group", "whole")  # what a chunk ends up with
ALIGN = 64


@dataclass(frozen=True)
class SavedChunk:
    """A chunk of the save plan as protection sees it; ``replicas`` hold its whole ``source`` box on devices."""

    process: int
    node: int
    offset: int
    nbytes: int
    path: str
    box: Box
    source: Box
    replicas: tuple[int, ...]
    policy: str

    @property
    def key(self) -> tuple[int, int]:
        """(process, offset): the chunk's name within a step, as in the manifests."""
        return self.process, self.offset

    @property
    def itemsize(self) -> int:
        return self.nbytes // self.box.size if self.box.size else 1


@dataclass(frozen=True)
class ChunkRange:
    """Bytes [lo, hi) of chunk number ``chunk`` of the plan."""

    chunk: int
    lo: int
    hi: int

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class Unit:
    """One node's share of a stripe: the concatenation of ``ranges``, all saved on ``node``."""

    node: int
    ranges: tuple[ChunkRange, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.ranges)


@dataclass(frozen=True)
class Stripe:
    """Parity block ``id``: the XOR of ``units`` (zero-padded), held by ``node``, which none of them is on.

    ``kind`` "parity": computed by replica ``process`` on ``node`` from its device copy; "xor-group": by the
    node's agent from the units the other nodes send (``process`` is -1).
    """

    id: int
    kind: str
    node: int
    process: int
    units: tuple[Unit, ...]

    @property
    def nbytes(self) -> int:
        return max((u.nbytes for u in self.units), default=0)


@dataclass(frozen=True)
class CopyBlock:
    """Copy ``id`` of chunks saved by ``process`` (on ``source_node``), held by ``node``, 64-byte aligned."""

    id: int
    node: int
    source_node: int
    process: int
    chunks: tuple[int, ...]
    positions: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class ProtectionPlan:
    """The redundancy of one save layout: chunk policies, parity stripes and copy blocks, with accounting."""

    policy: str
    copies: int
    group_size: int
    unit_bytes: int
    nodes: tuple[int, ...]  # node of each process
    groups: tuple[tuple[int, ...], ...]  # xor groups of node ids
    chunks: tuple[SavedChunk, ...]
    stripes: tuple[Stripe, ...]
    copy_blocks: tuple[CopyBlock, ...]
    layout: str = ""
    # The agent of each process where a node runs several (two pods of one machine); () = one agent per node.
    agents: tuple[int, ...] = ()

    @property
    def node_ids(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.nodes)))

    def agent_of(self, process: int) -> int:
        """The agent (an id within this plan) holding ``process``'s slots."""
        return self.agents[process] if self.agents else self.nodes[process]

    def policies(self) -> dict[str, tuple[str, ...]]:
        """The policies each array's chunks got (one unless a hybrid array mixes replicated and local boxes)."""
        out: dict[str, set[str]] = {}
        for c in self.chunks:
            out.setdefault(c.path, set()).add(c.policy)
        return {p: tuple(sorted(v)) for p, v in out.items()}

    def parity_tasks(self, process: int) -> tuple[Stripe, ...]:
        """The ``parity`` stripes trainer ``process`` computes from its device copies (stored on its node)."""
        return tuple(s for s in self.stripes if s.kind == "parity" and s.process == process)

    def xor_sends(self, node: int) -> tuple[tuple[Stripe, Unit], ...]:
        """The ``xor-group`` units ``node``'s agent sends: each to ``stripe.node``, which XORs them into parity."""
        return tuple((s, u) for s in self.stripes if s.kind == "xor-group" for u in s.units if u.node == node)

    def copy_sends(self, node: int) -> tuple[CopyBlock, ...]:
        """The copy blocks ``node``'s agent builds from its processes' chunks and sends to ``block.node``."""
        return tuple(b for b in self.copy_blocks if b.source_node == node)

    def held_by(self, node: int) -> tuple[tuple[Stripe, ...], tuple[CopyBlock, ...]]:
        """The parity stripes and copy blocks ``node`` holds once the step is protected."""
        return (tuple(s for s in self.stripes if s.node == node),
                tuple(b for b in self.copy_blocks if b.node == node))

    def data_bytes(self) -> dict[int, int]:
        """Snapshot bytes saved on each node (protected or not)."""
        out = {n: 0 for n in self.node_ids}
        for c in self.chunks:
            out[c.node] += c.nbytes
        return out

    def extra_bytes(self) -> dict[int, int]:
        """Protection bytes each node holds: parity blocks plus copy blocks."""
        out = {n: 0 for n in self.node_ids}
        for s in self.stripes:
            out[s.node] += s.nbytes
        for b in self.copy_blocks:
            out[b.node] += b.nbytes
        return out

    def sent_bytes(self) -> dict[int, int]:
        """Bytes each node sends to others to protect a step (``parity`` sends none)."""
        out = {n: 0 for n in self.node_ids}
        for s in self.stripes:
            if s.kind == "xor-group":
                for u in s.units:
                    out[u.node] += u.nbytes
        for b in self.copy_blocks:
            out[b.source_node] += sum(self.chunks[i].nbytes for i in b.chunks)
        return out


def xor_groups(node_ids: Sequence[int], group_size: int) -> tuple[tuple[int, ...], ...]:
    """Consecutive node ids in groups of ``group_size``; a remainder joins the groups before it (sizes >= g)."""
    ids = sorted(node_ids)
    count = max(1, len(ids) // group_size)
    return tuple(tuple(ids[len(ids) * k // count:len(ids) * (k + 1) // count]) for k in range(count))


def plan_protection(layouts: Sequence[ArrayLayout], plans: Sequence[SavePlan], nodes: Sequence[int], policy: str,
                    *, copies: int = 1, group_size: int = 4, unit_bytes: int = 64 << 20,
                    agents: Sequence[int] | None = None) -> ProtectionPlan:
    """The protection of the global save plan ``plans`` of ``layouts``; ``nodes[p]`` is process p's node (its
    failure domain: redundancy is placed by it), ``agents[p]`` its agent where a node has several."""
    if policy not in POLICIES:
        raise PlanError(f"protection policy {policy!r}: expected one of {', '.join(POLICIES)}")
    if copies < 1 or group_size < 2 or unit_bytes < ALIGN:
        raise PlanError(f"protection needs copies >= 1, group_size >= 2 and unit_bytes >= {ALIGN} "
                        f"(got {copies}, {group_size}, {unit_bytes})")
    if len(nodes) != len(plans) or any(p.process != i for i, p in enumerate(plans)):
        raise PlanError(f"protection needs one save plan per process in order and a node for each "
                        f"({len(plans)} plans, {len(nodes)} nodes)")
    unit_bytes = unit_bytes // ALIGN * ALIGN
    nodes = tuple(int(n) for n in nodes)
    node_ids = sorted(set(nodes))
    groups = xor_groups(node_ids, group_size)
    group_of = {n: g for g in groups for n in g}
    held: dict[tuple[str, Box], set[int]] = {}
    for a in layouts:
        for pl in a.placements:
            held.setdefault((a.path, pl.box), set()).add(pl.process)
    replicas = {k: tuple(sorted(v)) for k, v in held.items()}  # one shared tuple per box
    spread = {k: len({nodes[p] for p in v}) for k, v in replicas.items()}  # nodes holding a copy
    saved_on: dict[tuple[str, Box], set[int]] = {}  # nodes saving each chunk's box (whole replicas: several)
    for plan in plans:
        for c in plan.chunks:
            saved_on.setdefault((c.path, c.box), set()).add(nodes[plan.process])
    if policy != "none" and len(node_ids) < 2:
        log.warning("protection %r: the job has one node, so nothing survives its loss; snapshots are unprotected",
                    policy)
    chunks = []
    for plan in plans:
        for c in plan.chunks:
            reps = replicas.get((c.path, c.source))
            if reps is None or plan.process not in reps:
                raise PlanError(f"{c.path}: process {plan.process} saves a chunk of box {c.source} it does not hold")
            kind = _choose(policy, len(node_ids), spread[(c.path, c.source)], len(group_of[nodes[plan.process]]))
            if kind != "none" and len(saved_on[(c.path, c.box)]) >= 2:
                kind = "whole"  # the other nodes' whole copies protect it
            chunks.append(SavedChunk(plan.process, nodes[plan.process], c.offset, c.nbytes, c.path, c.box, c.source,
                                     reps, kind if c.nbytes else "none"))
    fallback = sum(c.nbytes for c in chunks if c.policy == "replica") if policy == "parity" else 0
    if fallback:
        log.info("protection 'parity': %d bytes have all their copies on one node and get %d copies instead",
                 fallback, copies)
    stripes = _parity_stripes(chunks, nodes, unit_bytes) + _xor_stripes(chunks, groups, unit_bytes)
    stripes = [Stripe(i, s.kind, s.node, s.process, s.units) for i, s in enumerate(stripes)]
    k = min(copies, len(node_ids) - 1)
    if k < copies and any(c.policy == "replica" for c in chunks):
        log.warning("protection: %d copies asked for but the job has %d nodes; keeping %d", copies, len(node_ids), k)
    agents = tuple(int(a) for a in agents) if agents is not None else ()
    if agents and len(agents) != len(nodes):
        raise PlanError(f"protection needs an agent for each process ({len(agents)} for {len(nodes)} processes)")
    out = ProtectionPlan(policy, copies, group_size, unit_bytes, nodes, groups, tuple(chunks), tuple(stripes),
                         _copy_blocks(chunks, node_ids, k), plans[0].layout if plans else "",
                         () if agents == nodes else agents)
    validate_protection(out)
    return out


def plan_for_config(layouts: Sequence[ArrayLayout], plans: Sequence[SavePlan], nodes: Sequence[int],
                    config: "Config", agents: Sequence[int] | None = None) -> ProtectionPlan:
    """:func:`plan_protection` with the policy, copies, group size and unit size (``chunk_bytes``) of ``config``."""
    return plan_protection(layouts, plans, nodes, config.protection, copies=config.protection_copies,
                           group_size=config.protection_group, unit_bytes=max(config.chunk_bytes, ALIGN),
                           agents=agents)


def _choose(policy: str, n_nodes: int, replica_nodes: int, group: int) -> str:
    if policy == "none" or n_nodes < 2:
        return "none"
    if policy in ("replica", "xor-group"):
        return policy
    if replica_nodes >= 2:
        return "parity"
    if policy == "hybrid" and group >= 3:
        return "xor-group"
    return "replica"


def _rounds(total: int, parts: int, unit: int) -> list[list[tuple[int, int]]]:
    """Stream ranges of each round's ``parts`` units: full rounds of ``unit`` bytes, then equal 64-byte-cut units."""
    out, pos = [], 0
    while total - pos > parts * unit:
        out.append([(pos + t * unit, pos + (t + 1) * unit) for t in range(parts)])
        pos += parts * unit
    rem = total - pos
    if rem > 0:
        cuts = [pos + (rem * t // parts) // ALIGN * ALIGN for t in range(parts)] + [total]
        out.append([(cuts[t], cuts[t + 1]) for t in range(parts)])
    return out


def _ranges(chunks: Sequence[SavedChunk], stream: Sequence[int], starts: Sequence[int], lo: int,
              hi: int) -> tuple[ChunkRange, ...]:
    """The pieces of stream bytes [lo, hi); ``starts`` are the stream positions of the stream's chunks."""
    out = []
    for k in range(max(bisect.bisect_right(starts, lo) - 1, 0), len(stream)):
        pos, i = starts[k], stream[k]
        if pos >= hi:
            break
        a, b = max(lo, pos), min(hi, pos + chunks[i].nbytes)
        if b > a:
            out.append(ChunkRange(i, a - pos, b - pos))
    return tuple(out)


def _stripe(chunks: Sequence[SavedChunk], streams: Mapping[int, Sequence[int]], members: Sequence[int],
            unit_bytes: int) -> list[tuple[int, int, tuple[Unit, ...]]]:
    """(round, holder node, units) of RAID-5 striping over ``members``' streams (chunk indices in order)."""
    parts = len(members) - 1
    starts = {n: list(itertools.accumulate((chunks[i].nbytes for i in s), initial=0)) for n, s in streams.items()}
    rounds = {n: _rounds(starts[n][-1] if n in starts else 0, parts, unit_bytes) for n in members}
    out = []
    for r in range(max((len(v) for v in rounds.values()), default=0)):
        for j in members:
            units = []
            for n in members:
                if n == j or r >= len(rounds[n]):
                    continue
                lo, hi = rounds[n][r][[m for m in members if m != n].index(j)]
                if hi > lo:
                    units.append(Unit(n, _ranges(chunks, streams[n], starts[n], lo, hi)))
            if units:
                out.append((r, j, tuple(units)))
    return out


def _parity_stripes(chunks: Sequence[SavedChunk], nodes: Sequence[int], unit_bytes: int) -> list[Stripe]:
    sets: dict[tuple[int, ...], dict[int, list[int]]] = {}
    for i, c in enumerate(chunks):
        if c.policy == "parity":
            sets.setdefault(c.replicas, {}).setdefault(c.node, []).append(i)
    out = []
    for reps, streams in sorted(sets.items()):
        members = sorted({nodes[p] for p in reps})
        for r, j, units in _stripe(chunks, streams, members, unit_bytes):
            local = [p for p in reps if nodes[p] == j]
            out.append(Stripe(-1, "parity", j, local[r % len(local)], units))  # rotate the work over j's replicas
    return out


def _xor_stripes(chunks: Sequence[SavedChunk], groups: Sequence[Sequence[int]], unit_bytes: int) -> list[Stripe]:
    streams: dict[int, list[int]] = {}
    for i, c in enumerate(chunks):
        if c.policy == "xor-group":
            streams.setdefault(c.node, []).append(i)
    out = []
    for g in groups:
        if len(g) >= 2 and any(n in streams for n in g):
            out += [Stripe(-1, "xor-group", j, -1, units) for _, j, units in _stripe(chunks, streams, g, unit_bytes)]
    return out


def _copy_blocks(chunks: Sequence[SavedChunk], node_ids: Sequence[int], k: int) -> tuple[CopyBlock, ...]:
    by_proc: dict[int, list[int]] = {}
    for i, c in enumerate(chunks):
        if c.policy == "replica":
            by_proc.setdefault(c.process, []).append(i)
    out = []
    for proc, idx in sorted(by_proc.items()):
        positions, pos = [], 0
        for i in idx:
            positions.append(pos)
            pos += -(-chunks[i].nbytes // ALIGN) * ALIGN
        src = chunks[idx[0]].node
        at = node_ids.index(src)
        for c in range(1, k + 1):
            out.append(CopyBlock(len(out), node_ids[(at + c) % len(node_ids)], src, proc, tuple(idx),
                                 tuple(positions), pos))
    return tuple(out)


def validate_protection(plan: ProtectionPlan) -> None:
    """Raise PlanError unless every protected byte is covered as its policy says, never on its own node."""
    cover: dict[int, int] = {}
    for s in plan.stripes:
        nodes = [u.node for u in s.units]
        if s.node in nodes or len(set(nodes)) != len(nodes):
            raise PlanError(f"stripe {s.id}: parity on node {s.node} with units on nodes {nodes}")
        for u in s.units:
            for g in u.ranges:
                c = plan.chunks[g.chunk]
                if c.node != u.node or c.policy != s.kind or not 0 <= g.lo < g.hi <= c.nbytes:
                    raise PlanError(f"{c.path}: stripe {s.id} has a bad range {g.lo}..{g.hi} of chunk {c.box}")
                cover[g.chunk] = cover.get(g.chunk, 0) + g.nbytes
        if s.kind == "parity" and any(s.process not in plan.chunks[g.chunk].replicas
                                      for u in s.units for g in u.ranges):
            raise PlanError(f"stripe {s.id}: process {s.process} does not hold every box it must compute parity of")
    twins: dict[tuple[str, Box], set[int]] = {}
    for c in plan.chunks:
        twins.setdefault((c.path, c.box), set()).add(c.node)
    for c in plan.chunks:
        if c.policy == "whole" and len(twins[(c.path, c.box)]) < 2:
            raise PlanError(f"{c.path}: chunk {c.box} of process {c.process} counts on a whole copy on another "
                            f"node, and no other node saves it")
    copied: dict[int, int] = {}
    for b in plan.copy_blocks:
        for i in b.chunks:
            if plan.chunks[i].node == b.node or plan.chunks[i].policy != "replica":
                raise PlanError(f"{plan.chunks[i].path}: copy {b.id} of chunk {plan.chunks[i].box} on node {b.node}")
            copied[i] = copied.get(i, 0) + 1
    for i, c in enumerate(plan.chunks):
        if c.policy in ("parity", "xor-group") and cover.get(i, 0) != c.nbytes:
            raise PlanError(f"{c.path}: {cover.get(i, 0)} of the {c.nbytes} bytes of chunk {c.box} are in stripes")
        if c.policy == "replica" and not copied.get(i) and len(plan.node_ids) > 1:
            raise PlanError(f"{c.path}: chunk {c.box} of process {c.process} has no copy")


# ------------------------------------------------------------------------------------------------ computing blocks
# read(chunk, lo, hi) -> bytes [lo, hi) of that saved chunk: from a snapshot buffer, a peer, or a device copy.
RangeReader = Callable[[SavedChunk, int, int], "parity.Buffer"]


def unit_buffers(plan: ProtectionPlan, unit: Unit, read: RangeReader) -> list[np.ndarray]:
    """The bytes of ``unit`` as a list of buffers (its chunk ranges, in order)."""
    return [parity.as_bytes(read(plan.chunks[g.chunk], g.lo, g.hi)) for g in unit.ranges]


def stripe_parity(plan: ProtectionPlan, stripe: Stripe, read: RangeReader, out: np.ndarray | None = None,
                  *, workers: int = 1) -> np.ndarray:
    """The parity block of ``stripe`` (``stripe.nbytes`` bytes)."""
    return parity.encode([unit_buffers(plan, u, read) for u in stripe.units], out, length=stripe.nbytes,
                         workers=workers)


def copy_block(plan: ProtectionPlan, block: CopyBlock, read: RangeReader, out: np.ndarray | None = None
               ) -> np.ndarray:
    """The bytes of ``block``: its chunks at their positions, zeros between; written into ``out`` (a uint8
    buffer of ``block.nbytes``, e.g. a slot's region) when given."""
    res = np.empty(block.nbytes, dtype=np.uint8) if out is None else parity.as_bytes(out)[:block.nbytes]
    at = 0
    for i, pos in sorted(zip(block.chunks, block.positions), key=lambda t: t[1]):
        c = plan.chunks[i]
        res[at:pos] = 0
        res[pos:pos + c.nbytes] = parity.as_bytes(read(c, 0, c.nbytes))
        at = max(at, pos + c.nbytes)
    res[at:] = 0
    return res


def range_from_copy(chunk: SavedChunk, lo: int, hi: int, shard: np.ndarray, shard_box: Box) -> np.ndarray:
    """Bytes [lo, hi) of ``chunk`` taken from a full host copy ``shard`` of ``shard_box`` (which contains it)."""
    if not shard_box.contains(chunk.box):
        raise PlanError(f"{chunk.path}: box {shard_box} does not contain chunk {chunk.box}")
    part = np.ascontiguousarray(shard[shard_box.relative(chunk.box)])
    return parity.as_bytes(part)[lo:hi]

