"""Protection planning and rebuild, end to end in numpy: random layouts and node maps, real bytes in per-process
snapshot buffers, parity computed the way each policy says (REFT parity from the holder's own full copy, xor groups
and copies from other nodes' buffers), nodes lost, chunks rebuilt bit for bit or a DataLossError naming the boxes.
"""
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxckpt.protection import plan as pr
from jaxckpt.protection import plan_wire as wire
from jaxckpt.protection import rebuild as rc
from jaxckpt.core.box import Box, covers
from jaxckpt.core.checksum import crc32c
from jaxckpt.errors import ChecksumError, DataLossError, ManifestError, PeerError, PlanError, StepNotFoundError
from jaxckpt.core.fetch import ChunkReader
from jaxckpt.core.manifest import ChunkMeta
from jaxckpt.core.plan import ArrayLayout, Placement, plan_save

STEP = 42
PROTECTING = ("replica", "parity", "xor-group", "hybrid")


# ------------------------------------------------------------------------------------------------- a simulated job
class Job:
    """Arrays with random bytes, each process's snapshot buffer per the save plan, and every protection block
    computed by whom the plan says, from what that party really has."""

    def __init__(self, layouts, nodes, policy, *, chunk_bytes=1 << 20, seed=0, whole=False, **kw):
        self.layouts, self.nodes = layouts, list(nodes)
        rng = np.random.default_rng(seed)
        self.data = {a.path: rng.integers(0, 256, (*a.shape, a.itemsize), dtype=np.uint8) for a in layouts}
        self.plans = plan_save(layouts, len(nodes), chunk_bytes, nodes=nodes if whole else None)
        self.prot = pr.plan_protection(layouts, self.plans, nodes, policy, **kw)
        self.bufs = [np.zeros(p.nbytes, np.uint8) for p in self.plans]
        for plan in self.plans:
            for c in plan.chunks:
                self.bufs[plan.process][c.offset:c.offset + c.nbytes] = self.chunk_bytes(c.path, c.box)
        self.crcs = {c.key: crc32c(self.saved(c)) for c in self.prot.chunks}
        held = {(a.path, pl.box, pl.process) for a in layouts for pl in a.placements}

        def from_device(process):  # a replica reads its own device copy of the source box, nothing else
            def read(c, lo, hi):
                assert (c.path, c.source, process) in held
                shard = self.data[c.path][c.source.slices()]
                return pr.range_from_copy(c, lo, hi, shard, c.source)
            return read

        def from_node(node):  # an agent reads the snapshot buffers of its own node's processes
            def read(c, lo, hi):
                assert c.node == node
                return self.saved(c)[lo:hi]
            return read
        self.parity = {}
        for s in self.prot.stripes:
            if s.kind == "parity":
                assert self.nodes[s.process] == s.node and s in self.prot.parity_tasks(s.process)
                self.parity[s.id] = pr.stripe_parity(self.prot, s, from_device(s.process))
            else:  # each unit is read on its own node (and sent), then XORed on the holder
                bufs = [pr.unit_buffers(self.prot, u, from_node(u.node)) for u in s.units]
                self.parity[s.id] = pr.parity.encode(bufs, length=s.nbytes)
                assert all((s, u) in self.prot.xor_sends(u.node) for u in s.units)
        self.copies = {b.id: pr.copy_block(self.prot, b, from_node(b.source_node)) for b in self.prot.copy_blocks}

    def chunk_bytes(self, path, box):
        return np.ascontiguousarray(self.data[path][box.slices()]).reshape(-1)

    def saved(self, c):
        return self.bufs[c.process][c.offset:c.offset + c.nbytes]


class IO:
    """RebuildIO over a Job: lost nodes unreachable, corrupt bytes served as stored."""

    def __init__(self, job, lost, corrupt_chunks=(), corrupt_copies=(), at_holder=False):
        self.job, self.lost = job, set(lost)
        self.corrupt, self.corrupt_copies = set(corrupt_chunks), set(corrupt_copies)
        self.at_holder = at_holder  # the parity's holder XORs and sends the result (when its node survives)
        self.reads = []
        self.nbytes = 0  # bytes read, every kind

    def _node(self, node):
        if node in self.lost:
            raise PeerError(f"node {node} is gone")

    def chunk(self, c):
        self._node(c.node)
        self.reads.append(("chunk", c.key))
        data = self.job.saved(c).copy()
        self.nbytes += data.size
        if c.key in self.corrupt:
            data[0] ^= 1
        if crc32c(data) != self.job.crcs[c.key]:
            raise ChecksumError(f"{c.path}: chunk of process {c.process} corrupt")
        return data

    def chunk_range(self, c, lo, hi):
        self._node(c.node)
        self.reads.append(("range", c.key))
        data = self.job.saved(c)[lo:hi].copy()
        self.nbytes += data.size
        if c.key in self.corrupt and data.size:  # corrupt throughout: every range of it has a bad byte
            data[0] ^= 1
        return data

    def spans(self, process, ranges):
        self._node(self.job.nodes[process])
        self.reads.append(("spans", process, len(ranges)))
        sizes = {c.key: c.nbytes for c in self.job.prot.chunks}
        out = []
        for off, n in ranges:
            data = self.job.bufs[process][off:off + n].copy()
            self.nbytes += n
            if n and any(q == process and o < off + n and off < o + sizes[(q, o)] for q, o in self.corrupt):
                data[0] ^= 1
            out.append(data)
        return out

    def parity(self, s, lo, hi):
        self._node(s.node)
        self.reads.append(("stripe", s.id))
        self.nbytes += hi - lo
        return self.job.parity[s.id][lo:hi]

    def rebuilt(self, s, unit, lo, hi):
        """What the parity's holder computes from what it reads of the other nodes (lost ones unreachable)."""
        if not self.at_holder or s.node in self.lost:
            return None
        units = []
        for k, u in enumerate(s.units):
            if k == unit:
                continue
            pos, spans = 0, []
            for g in u.ranges:
                x, y = max(lo, pos), min(hi, pos + g.nbytes)
                if y > x:
                    c = self.job.prot.chunks[g.chunk]
                    if c.node in self.lost:
                        return None  # the holder cannot reach it either
                    spans.append(self.job.saved(c)[g.lo + x - pos:g.lo + y - pos])
                pos += g.nbytes
            units.append(spans)
        self.reads.append(("rebuilt", s.id))
        self.nbytes += hi - lo
        return pr.parity.encode([self.job.parity[s.id][lo:hi]] + units, length=hi - lo)

    def copy(self, b, lo, hi):
        self._node(b.node)
        self.reads.append(("copy", b.id))
        data = self.job.copies[b.id][lo:hi].copy()
        if b.id in self.corrupt_copies and data.size:
            data[0] ^= 1
        return data


def lost_chunks(job, lost):
    return [c for c in job.prot.chunks if c.node in lost and c.nbytes]


def check_rebuild(job, lost, **kw):
    """Plan the rebuild of ``lost``, rebuild every lost chunk and compare with the saved bytes."""
    plan = rc.plan_rebuild(job.prot, lost, step=STEP)
    rb = rc.Rebuilder(plan, IO(job, lost, **kw), job.crcs)
    want = {c.key for c in lost_chunks(job, lost)}
    assert {job.prot.chunks[r.chunk].key for r in plan.rebuilds} == want
    for c in lost_chunks(job, lost):
        np.testing.assert_array_equal(rb.chunk(c.process, c.offset), job.saved(c))
    check_bulk(job, lost, plan, **kw)
    return plan


def check_bulk(job, lost, plan, **kw):
    """Every lost process's share rebuilt at once (Rebuilder.read_into), compared with the saved bytes; the IO."""
    io = IO(job, lost, **kw)
    rb = rc.Rebuilder(plan, io, job.crcs)
    for p in plan.lost_processes:
        chunks = [c for c in lost_chunks(job, lost) if c.process == p]
        out = np.full(job.bufs[p].size, 0xEE, np.uint8)
        rb.read_into(p, memoryview(out), [(c.offset, c.nbytes) for c in chunks])
        for c in chunks:
            np.testing.assert_array_equal(out[c.offset:c.offset + c.nbytes], job.saved(c))
    return io


# ------------------------------------------------------------------------------------------------- random layouts
@st.composite
def jobs(draw, min_nodes=2, max_nodes=4):
    n_nodes = draw(st.integers(min_nodes, max_nodes))
    ppn = draw(st.integers(1, 3))
    nodes = draw(st.permutations([p // ppn for p in range(n_nodes * ppn)]))
    layouts = []
    for a in range(draw(st.integers(1, 4))):
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.lists(st.integers(0, 12), min_size=ndim, max_size=ndim)))
        itemsize = draw(st.sampled_from([1, 2, 4, 8]))
        placements = []
        for b in Box.full(shape).split(draw(st.integers(1, 4))):
            for p in sorted(draw(st.sets(st.integers(0, len(nodes) - 1), min_size=1))):
                placements.append(Placement(b, p, 0))
        layouts.append(ArrayLayout(f"arr{a}", shape, f"u{itemsize}", itemsize, tuple(placements)))
    kw = dict(chunk_bytes=draw(st.sampled_from([8, 64, 1 << 20])),
              unit_bytes=draw(st.sampled_from([64, 64, 192, 1 << 20])),
              copies=draw(st.integers(1, 3)), group_size=draw(st.integers(2, 4)), seed=draw(st.integers(0, 9)))
    return layouts, nodes, kw


SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(job=jobs(), policy=st.sampled_from(PROTECTING), at_holder=st.booleans())
def test_every_single_node_loss_is_rebuilt_bit_for_bit(job, policy, at_holder):
    """Every single node loss rebuilds bit for bit, from parity and units read here or rebuilt where each
    stripe's parity lives (``at_holder``)."""
    layouts, nodes, kw = job
    j = Job(layouts, nodes, policy, **kw)
    for node in sorted(set(nodes)):
        check_rebuild(j, {node}, at_holder=at_holder)


@SETTINGS
@given(job=jobs(), policy=st.sampled_from(PROTECTING))
def test_whole_replicas_need_no_parity_and_every_single_node_loss_is_rebuilt(job, policy):
    """Config.replicas="whole": a box held on several nodes is saved whole on each and gets kind "whole" (no
    stripe, no copy block reads it); a box on one node keeps the policy's protection; every single node loss
    is rebuilt bit for bit, the whole chunks from another node's copy."""
    layouts, nodes, kw = job
    j = Job(layouts, nodes, policy, whole=True, **kw)
    for a in layouts:
        held = {}
        for pl in a.placements:
            held.setdefault(pl.box, set()).add(nodes[pl.process])
        saved = {}  # (source box, chunk box) -> the nodes saving that chunk
        for c in j.prot.chunks:
            if c.path == a.path:
                saved.setdefault((c.source, c.box), []).append(c.node)
        assert {src for src, _ in saved} == set(held)
        for (src, _), on in saved.items():  # once per node holding it, never twice on one
            assert sorted(on) == sorted(held[src])
        for c in j.prot.chunks:
            if c.path == a.path and c.nbytes:
                assert (c.policy == "whole") == (len(held[c.source]) >= 2), c
    read = {g.chunk for s in j.prot.stripes for u in s.units for g in u.ranges} | \
        {i for b in j.prot.copy_blocks for i in b.chunks}
    assert not any(j.prot.chunks[i].policy == "whole" for i in read)
    assert wire.decode_plan(wire.encode_plan(j.prot)) == j.prot
    for node in sorted(set(nodes)):
        plan = check_rebuild(j, {node})
        for r in plan.rebuilds:
            if j.prot.chunks[r.chunk].policy == "whole":
                assert all(isinstance(src, rc.FromTwin) for p in r.parts for src in p.sources) and r.parts[0].sources


def test_whole_replica_lost_with_every_copy_is_named():
    """Both nodes holding a whole replica lost: DataLossError names the step and the box."""
    rep = ArrayLayout("rep", (8, 4), "u4", 4, tuple(Placement(Box.full((8, 4)), p, 0) for p in (0, 1)))
    j = Job([rep], [0, 1, 2], "hybrid", whole=True)
    assert {c.policy for c in j.prot.chunks} == {"whole"} and len(j.prot.chunks) == 2 and not j.prot.stripes
    check_rebuild(j, {0})
    with pytest.raises(DataLossError, match=r"step 42: .* node\(s\) 0, 1: .*rep \[0, 0\]..\[8, 4\]") as e:
        rc.plan_rebuild(j.prot, {0, 1}, step=STEP)
    assert e.value.missing == {"rep": (Box.full((8, 4)),)}


def test_a_whole_replica_is_rebuilt_from_the_first_good_copy_each_copy_read_once():
    """A lost whole replica comes from another node's copy as it is; a corrupt copy (its crc32c fails) is passed
    over for the next, and is not read a second time; every copy corrupt: DataLossError names each."""
    rep = ArrayLayout("rep", (64, 4), "u4", 4, tuple(Placement(Box.full((64, 4)), p, 0) for p in (0, 1, 2)))
    j = Job([rep], [0, 1, 2], "hybrid", whole=True)
    plan = rc.plan_rebuild(j.prot, {0}, step=STEP)
    (lost,) = [c for c in j.prot.chunks if c.node == 0]
    first, second = [j.prot.chunks[src.chunk] for src in plan.rebuilds[0].parts[0].sources]
    given = []

    class Kept(IO):
        def chunk(self, c):
            given.append(super().chunk(c))
            return given[-1]
    io = Kept(j, {0})
    got = rc.Rebuilder(plan, io, j.crcs).chunk(*lost.key)
    np.testing.assert_array_equal(got, j.saved(lost))
    assert io.reads == [("chunk", first.key)]
    assert np.shares_memory(got, given[0])  # handed over as read: not copied into a buffer of its own
    io = IO(j, {0}, corrupt_chunks=[first.key])
    np.testing.assert_array_equal(rc.Rebuilder(plan, io, j.crcs).chunk(*lost.key), j.saved(lost))
    assert io.reads == [("chunk", first.key), ("chunk", second.key)]
    io = IO(j, {0}, corrupt_chunks=[first.key, second.key])
    with pytest.raises(DataLossError, match=r"step 42: .*rep \[0, 0\]..\[64, 4\].*sources failed: .*corrupt.*corrupt"):
        rc.Rebuilder(plan, io, j.crcs).chunk(*lost.key)
    # once in each of the rebuild's two passes (byte ranges, then whole verified chunks), never twice in one
    assert sorted(io.reads) == sorted([("chunk", first.key), ("chunk", second.key)] * 2)


@SETTINGS
@given(job=jobs(min_nodes=3), policy=st.sampled_from(PROTECTING))
def test_two_node_losses_rebuild_or_name_exactly_what_is_missing(job, policy):
    layouts, nodes, kw = job
    j = Job(layouts, nodes, policy, **kw)
    for lost in itertools.combinations(sorted(set(nodes)), 2):
        try:
            check_rebuild(j, set(lost))
            continue
        except DataLossError as e:
            err = e
        assert f"step {STEP}" in str(err) and err.step == STEP and err.lost_nodes == lost and err.missing
        # Every byte outside the named boxes is still rebuilt exactly; the named boxes are inside lost chunks.
        plan = rc.plan_rebuild(j.prot, lost, step=STEP, strict=False)
        assert plan.missing() == err.missing
        lost_boxes = {}
        for c in lost_chunks(j, lost):
            lost_boxes.setdefault(c.path, []).append(c.box)
        for path, boxes in err.missing.items():
            assert f"{path} {list(boxes[0].start)}..{list(boxes[0].stop)}" in str(err)
            assert all(covers(b, lost_boxes[path]) for b in boxes)
        rb = rc.Rebuilder(plan, IO(j, lost))
        for r in plan.rebuilds:
            c = j.prot.chunks[r.chunk]
            for part in r.parts:
                if part.sources:
                    out = np.empty(c.nbytes, np.uint8)
                    one = rc.RebuildPlan(STEP, plan.lost_nodes, j.prot, (rc.ChunkRebuild(r.chunk, (part,)),))
                    out[part.lo:part.hi] = rc.Rebuilder(one, IO(j, lost)).chunk(c.process, c.offset)[part.lo:part.hi]
                    np.testing.assert_array_equal(out[part.lo:part.hi], j.saved(c)[part.lo:part.hi])
        with pytest.raises(DataLossError):
            for r in plan.rebuilds:
                rb.chunk(j.prot.chunks[r.chunk].process, j.prot.chunks[r.chunk].offset)


@SETTINGS
@given(job=jobs(min_nodes=2), policy=st.sampled_from(PROTECTING))
def test_plan_invariants_and_wire_round_trip(job, policy):
    layouts, nodes, kw = job
    kw.pop("seed"), kw.pop("chunk_bytes")
    plans = plan_save(layouts, len(nodes), 64)
    p = pr.plan_protection(layouts, plans, nodes, policy, **kw)
    assert wire.decode_plan(wire.encode_plan(p)) == p
    node_ids = sorted(set(nodes))
    for c in p.chunks:
        rep_nodes = {nodes[q] for q in c.replicas}
        if c.nbytes == 0:
            assert c.policy == "none"
        elif policy in ("replica", "xor-group"):
            assert c.policy == policy
        elif policy == "parity":
            assert c.policy == ("parity" if len(rep_nodes) >= 2 else "replica")
        else:  # hybrid: parity only where copies span nodes, never "none"
            assert c.policy == "parity" if len(rep_nodes) >= 2 else c.policy in ("xor-group", "replica")
    for b in p.copy_blocks:
        assert b.node != b.source_node
        k = min(p.copies, len(node_ids) - 1)
        ring = [node_ids[(node_ids.index(b.source_node) + i) % len(node_ids)] for i in range(1, k + 1)]
        assert b.node in ring
    sent = p.sent_bytes()
    if all(c.policy in ("parity", "none") for c in p.chunks):
        assert not any(sent.values())  # REFT parity: nothing leaves a node at save time
    for node in node_ids:
        stripes, blocks = p.held_by(node)
        assert all(s.node == node for s in stripes) and all(b.node == node for b in blocks)


# --------------------------------------------------------------------------------------------- deterministic cases
def dp_layouts(nodes, rows=(4096, 2048), cols=64, sharded=0):
    """Data-parallel arrays replicated on every process, plus ``sharded`` arrays split over all processes."""
    n = len(nodes)
    out = [ArrayLayout(f"params/w{k}", (r, cols), "float32", 4,
                       tuple(Placement(Box.full((r, cols)), p, 0) for p in range(n))) for k, r in enumerate(rows)]
    for k in range(sharded):
        boxes = Box.full((64 * n, cols)).split(n)
        out.append(ArrayLayout(f"opt/m{k}", (64 * n, cols), "float32", 4,
                               tuple(Placement(b, p, 0) for p, b in enumerate(boxes))))
    return out


def pairs_layout(n_nodes=4, ppn=2):
    """An array replicated over pairs of nodes ({0,1} and {2,3}): two parity groups."""
    nodes = [p // ppn for p in range(n_nodes * ppn)]
    boxes = Box.full((256, 32)).split(2)
    placements = tuple(Placement(boxes[nodes[p] // 2], p, 0) for p in range(len(nodes)))
    return [ArrayLayout("params/w", (256, 32), "float32", 4, placements)], nodes


@pytest.mark.parametrize("policy,lost_ok,lost_bad", [
    ("xor-group", {0, 2}, {0, 1}),   # groups {0,1} and {2,3}
    ("parity", {1, 3}, {2, 3}),      # replica node sets {0,1} and {2,3}
    ("replica", {0, 2}, {0, 1}),     # ring 0->1->2->3->0, one copy
])
def test_two_losses_in_different_groups_recover_in_the_same_group_fail(policy, lost_ok, lost_bad):
    if policy == "parity":
        layouts, nodes = pairs_layout()
    else:
        nodes = [p // 2 for p in range(8)]
        layouts = dp_layouts(nodes, rows=(512,), sharded=2)
    j = Job(layouts, nodes, policy, group_size=2, copies=1, chunk_bytes=4096, unit_bytes=2048)
    check_rebuild(j, lost_ok)
    with pytest.raises(DataLossError) as e:
        rc.plan_rebuild(j.prot, lost_bad, step=STEP)
    msg = str(e.value)
    assert msg.startswith(f"step {STEP}: protection {policy!r} cannot rebuild what was lost with node(s) "
                          f"{', '.join(map(str, sorted(lost_bad)))}: ")
    assert isinstance(e.value, StepNotFoundError)
    for path, boxes in e.value.missing.items():
        assert f"{path} {list(boxes[0].start)}..{list(boxes[0].stop)}" in msg


def test_replica_with_two_copies_survives_two_neighbours():
    nodes = [0, 1, 2, 3]
    j = Job(dp_layouts(nodes, rows=(), sharded=3), nodes, "replica", copies=2)
    check_rebuild(j, {0, 1})
    with pytest.raises(DataLossError, match=r"opt/m0 \[0, 0\]\.\.\[64, 64\]"):
        rc.plan_rebuild(j.prot, {0, 1, 2}, step=STEP)


def test_parity_algebra_r2_is_a_copy_and_r3_rotates():
    # R = 2: the parity each node holds is the other node's share, byte for byte.
    nodes = [0, 1]
    j = Job(dp_layouts(nodes, rows=(64,), cols=16), nodes, "parity", unit_bytes=1 << 20)
    assert len(j.prot.stripes) == 2
    for s in j.prot.stripes:
        (u,) = s.units
        other = np.concatenate([j.saved(j.prot.chunks[g.chunk])[g.lo:g.hi] for g in u.ranges])
        np.testing.assert_array_equal(j.parity[s.id], other)
    # R = 3: node j's parity is d[n, j] ^ d[m, j] over the two other nodes' units, each half of their share.
    nodes = [0, 1, 2]
    j = Job(dp_layouts(nodes, rows=(96,), cols=16), nodes, "parity", unit_bytes=1 << 20)
    share = j.prot.data_bytes()
    for s in j.prot.stripes:
        assert sorted(u.node for u in s.units) == sorted(set(nodes) - {s.node})
        for u in s.units:
            assert abs(u.nbytes - share[u.node] / 2) <= pr.ALIGN
    extra = j.prot.extra_bytes()
    assert all(abs(extra[n] / share[n] - 0.5) < 0.1 * 0.5 for n in nodes)


@pytest.mark.parametrize("n_nodes,ppn", [(2, 1), (3, 2), (4, 2), (5, 1), (8, 1)])
def test_parity_memory_within_10_percent_of_one_over_r_minus_1(n_nodes, ppn):
    nodes = [p // ppn for p in range(n_nodes * ppn)]
    plans = plan_save(dp_layouts(nodes), len(nodes), 1 << 20)
    p = pr.plan_protection(dp_layouts(nodes), plans, nodes, "parity", unit_bytes=1 << 20)
    data, extra = p.data_bytes(), p.extra_bytes()
    want = 1 / (n_nodes - 1)
    for n in range(n_nodes):
        assert abs(extra[n] / data[n] - want) <= 0.1 * want, (n, extra[n] / data[n], want)
    assert not any(p.sent_bytes().values())
    # Each replica computes only stripes held on its own node.
    assert all(nodes[s.process] == s.node for s in p.stripes)


@pytest.mark.parametrize("n_nodes,g", [(4, 4), (6, 3), (8, 4), (7, 3)])
def test_xor_group_and_replica_memory(n_nodes, g):
    nodes = list(range(n_nodes))
    layouts = dp_layouts(nodes, rows=(), sharded=4)
    plans = plan_save(layouts, n_nodes, 1 << 20)
    x = pr.plan_protection(layouts, plans, nodes, "xor-group", group_size=g, unit_bytes=1 << 20)
    assert all(len(grp) >= g for grp in x.groups) and sorted(sum(x.groups, ())) == nodes
    data, extra, sent = x.data_bytes(), x.extra_bytes(), x.sent_bytes()
    for grp in x.groups:
        for n in grp:
            want = 1 / (len(grp) - 1)
            assert abs(extra[n] / data[n] - want) <= 0.1 * want
            assert sent[n] == data[n]
    for k in (1, 2):
        r = pr.plan_protection(layouts, plans, nodes, "replica", copies=k)
        assert all(r.extra_bytes()[n] == k * data[n] for n in nodes)  # 64-byte multiples: no padding here
    h = pr.plan_protection(layouts, plans, nodes, "hybrid", group_size=g)
    assert set(h.policies().values()) == {("xor-group",)}


def test_hybrid_mixes_per_array_and_handles_replicas_on_one_node():
    # 2 nodes x 2 processes: "dp" is replicated across nodes (parity), "local" is replicated over the two processes
    # of node 0 only (no node-disjoint copy: parity would not survive node 0), "shard" is held once.
    nodes = [0, 0, 1, 1]
    full = Box.full((128, 8))
    halves = Box.full((64, 8)).split(4)
    layouts = [
        ArrayLayout("dp", (128, 8), "float32", 4, tuple(Placement(full, p, 0) for p in range(4))),
        ArrayLayout("local", (128, 8), "float32", 4, (Placement(full, 0, 0), Placement(full, 1, 1))),
        ArrayLayout("shard", (64, 8), "float32", 4, tuple(Placement(b, p, 0) for p, b in enumerate(halves))),
    ]
    for policy, want in [("hybrid", {"dp": ("parity",), "local": ("replica",), "shard": ("replica",)}),
                         ("parity", {"dp": ("parity",), "local": ("replica",), "shard": ("replica",)}),
                         ("xor-group", {"dp": ("xor-group",), "local": ("xor-group",), "shard": ("xor-group",)})]:
        j = Job(layouts, nodes, policy, chunk_bytes=256, unit_bytes=256)
        assert j.prot.policies() == want
        for node in (0, 1):
            check_rebuild(j, {node})
    # With 3 nodes a group of 3 makes xor cheaper than a copy for data held on one node.
    nodes3 = [0, 0, 1, 1, 2, 2]
    lay3 = [ArrayLayout("local", (128, 8), "float32", 4, (Placement(full, 0, 0), Placement(full, 1, 1)))]
    j = Job(lay3, nodes3, "hybrid", group_size=3)
    assert j.prot.policies() == {"local": ("xor-group",)}
    check_rebuild(j, {0})


def test_single_node_job_and_none_policy_lose_everything_with_a_clear_error(caplog):
    nodes = [0, 0]
    j = Job(dp_layouts(nodes, rows=(64,)), nodes, "hybrid")
    assert "the job has one node" in caplog.text
    assert {c.policy for c in j.prot.chunks} == {"none"}
    with pytest.raises(DataLossError, match=r"params/w0 \[0, 0\]\.\.\[64, 64\]"):
        rc.plan_rebuild(j.prot, {0}, step=STEP)
    nodes = [0, 1]
    j = Job(dp_layouts(nodes, rows=(64,)), nodes, "none")
    with pytest.raises(DataLossError, match=f"step {STEP}: protection 'none'"):
        rc.plan_rebuild(j.prot, {1}, step=STEP)
    assert rc.plan_rebuild(j.prot, (), step=STEP).rebuilds == ()


def test_corrupt_sources_are_routed_around_or_named():
    nodes = [0, 1, 2, 3]
    layouts = dp_layouts(nodes, rows=(256,), sharded=1)
    # A corrupt first copy is detected by the chunk's crc32c and the second copy is used.
    j = Job(layouts, nodes, "replica", copies=2)
    first = {b.id for b in j.prot.copy_blocks if b.source_node == 0 and b.node == 1}
    check_rebuild(j, {0}, corrupt_chunks=(), corrupt_copies=first)
    # A corrupt surviving chunk is rebuilt from parity like a lost one (and is not used as a source).
    j = Job(layouts, nodes, "hybrid")
    bad = next(c for c in j.prot.chunks if c.policy == "parity" and c.node == 2)
    plan = rc.plan_rebuild(j.prot, (), step=STEP, bad_chunks=[bad.key])
    got = rc.Rebuilder(plan, IO(j, (), corrupt_chunks=[bad.key]), j.crcs).chunk(*bad.key)
    np.testing.assert_array_equal(got, j.saved(bad))
    # A stripe whose other unit turns out corrupt at rebuild time cannot give the bytes: the error names them.
    lost = next(c for c in j.prot.chunks if c.policy == "parity" and c.node == 0)
    plan = rc.plan_rebuild(j.prot, {0}, step=STEP)
    others = {j.prot.chunks[g.chunk].key for s in j.prot.stripes for u in s.units if u.node == 1 for g in u.ranges}
    with pytest.raises(DataLossError, match=f"step {STEP}: .*params/w0.*sources failed: .*corrupt"):
        rc.Rebuilder(plan, IO(j, {0}, corrupt_chunks=others), j.crcs).chunk(*lost.key)
    # A known-bad parity block is planned around: with one lost node it leaves exactly its bytes missing.
    s = next(s for s in j.prot.stripes if s.kind == "parity" and s.node == 1)
    with pytest.raises(DataLossError) as e:
        rc.plan_rebuild(j.prot, {0}, step=STEP, bad_blocks=[("stripe", s.id)])
    assert set(e.value.missing) == {"params/w0"}


def test_rebuilt_chunks_feed_the_ordinary_chunk_reader():
    nodes = [0, 0, 1, 1, 2, 2]
    j = Job(dp_layouts(nodes, rows=(300,), sharded=1), nodes, "hybrid", chunk_bytes=8192, unit_bytes=4096)
    plan = rc.plan_rebuild(j.prot, {1}, step=STEP)
    assert plan.lost_processes == (2, 3) and plan.nbytes == sum(c.nbytes for c in lost_chunks(j, {1}))
    rb = rc.Rebuilder(plan, IO(j, {1}), j.crcs)
    sources = {p: (lambda off, n, p=p: memoryview(j.bufs[p])[off:off + n]) for p in range(6) if nodes[p] != 1}
    sources.update({p: rb.reader(p) for p in plan.lost_processes})
    reader = ChunkReader(sources, STEP)
    for c in j.prot.chunks:
        meta = ChunkMeta(c.box, c.offset, c.nbytes, j.crcs[c.key], c.process)
        np.testing.assert_array_equal(np.frombuffer(reader.raw(c.path, meta), np.uint8), j.saved(c))
    with pytest.raises(StepNotFoundError, match="process 2 has no lost chunk at offset 7"):
        rb.chunk(2, 7)
    # A rebuilt chunk that does not match its manifest crc32c is refused.
    c = lost_chunks(j, {1})[0]
    with pytest.raises(ChecksumError, match=f"{c.path}: step {STEP} chunk .* rebuilt from protection"):
        rc.Rebuilder(plan, IO(j, {1}), {c.key: j.crcs[c.key] ^ 1}).chunk(*c.key)


def test_a_rebuild_reads_only_the_byte_ranges_its_stripes_need():
    """Each lost chunk is rebuilt from the ranges of the other units its stripes cover, not from every other
    unit's whole chunk read again per lost chunk; the rebuilt bytes are checked by the chunk's crc32c."""
    nodes = [0, 0, 1, 1, 2, 2]
    j = Job(dp_layouts(nodes, rows=(300,), sharded=1), nodes, "hybrid", chunk_bytes=8192, unit_bytes=4096)
    plan = rc.plan_rebuild(j.prot, {1}, step=STEP)
    ranged, whole = IO(j, {1}), IO(j, {1})
    for io, crcs in ((ranged, j.crcs), (whole, {})):  # without a crc32c to check it by, whole verified chunks
        rb = rc.Rebuilder(plan, io, crcs)
        for c in lost_chunks(j, {1}):
            np.testing.assert_array_equal(rb.chunk(c.process, c.offset), j.saved(c))
    assert not [r for r in ranged.reads if r[0] == "chunk"] and [r for r in whole.reads if r[0] == "chunk"]
    width = max(len(s.units) for s in j.prot.stripes)
    assert ranged.nbytes <= width * plan.nbytes < whole.nbytes, (ranged.nbytes, plan.nbytes, whole.nbytes)


def test_a_lost_range_is_rebuilt_where_its_parity_lives_and_received_once():
    """With the parity's holder rebuilding (RebuildIO.rebuilt), a lost node's chunks come back bit for bit and
    the bytes received are exactly the bytes rebuilt from parity (plus the copies of copied chunks), where reading
    the parity and every other unit costs more; a holder that cannot (None) leaves the rebuild to read them."""
    nodes = [0, 0, 1, 1, 2, 2, 3, 3]
    j = Job(dp_layouts(nodes, rows=(300,), sharded=1), nodes, "hybrid", chunk_bytes=8192, unit_bytes=4096)
    plan = rc.plan_rebuild(j.prot, {1}, step=STEP)
    held, here = IO(j, {1}, at_holder=True), IO(j, {1})
    for io in (held, here):
        rb = rc.Rebuilder(plan, io, j.crcs)
        for c in lost_chunks(j, {1}):
            np.testing.assert_array_equal(rb.chunk(c.process, c.offset), j.saved(c))
    assert {r[0] for r in held.reads} <= {"rebuilt", "copy"} and any(r[0] == "rebuilt" for r in held.reads), \
        held.reads  # no parity block nor other unit came here
    copied = sum(c.nbytes for c in lost_chunks(j, {1}) if c.policy == "replica")
    assert held.nbytes == plan.nbytes - copied < here.nbytes, (held.nbytes, plan.nbytes, here.nbytes)


def test_a_lost_share_is_rebuilt_in_bulk_in_a_few_requests(caplog):
    """Rebuilder.read_into (a replacement's recovery): a share of many small chunks comes back bit for bit in far
    fewer requests than chunks (a stripe's lost unit rebuilt at its holder in one, the twins' ranges in one
    flight), receiving the same bytes as chunk by chunk; a chunk whose bulk bytes fail its crc32c, or whose
    stripe's holder cannot rebuild, is rebuilt alone from its next source, and the log says which."""
    nodes = [0, 1, 2, 3]
    layouts = dp_layouts(nodes, rows=(8,) * 64, sharded=32)
    j = Job(layouts, nodes, "hybrid", whole=True, chunk_bytes=8192, unit_bytes=1 << 20)
    plan = rc.plan_rebuild(j.prot, {1}, step=STEP)
    lost = lost_chunks(j, {1})
    kinds = {j.prot.chunks[r.chunk].policy for r in plan.rebuilds}
    assert "whole" in kinds and kinds & {"parity", "xor-group"} and len(lost) >= 64, (kinds, len(lost))
    each, bulk = IO(j, {1}, at_holder=True), check_bulk(j, {1}, plan, at_holder=True)
    rb = rc.Rebuilder(plan, each, j.crcs)
    for c in lost:
        rb.chunk(c.process, c.offset)
    assert len(bulk.reads) * 8 <= len(lost) <= len(each.reads), (len(bulk.reads), len(lost), len(each.reads))
    assert bulk.nbytes == each.nbytes == plan.nbytes, (bulk.nbytes, each.nbytes, plan.nbytes)
    assert {r[0] for r in bulk.reads} == {"rebuilt", "spans"}, bulk.reads
    # No holder rebuilds (the parity and the other units read here) and a twin corrupt: each such chunk alone.
    twin = next(j.prot.chunks[s.chunk] for r in plan.rebuilds for s in r.parts[0].sources
                if isinstance(s, rc.FromTwin))
    with caplog.at_level("WARNING", logger="jaxckpt.protection.rebuild"):
        io = check_bulk(j, {1}, plan, corrupt_chunks=[twin.key])
    assert any(r[0] == "stripe" for r in io.reads) and any(r[0] == "chunk" for r in io.reads), io.reads
    assert f"step {STEP}: chunk at " in caplog.text and "failed its crc32c rebuilt in bulk; again alone" in caplog.text


def test_planner_errors():
    nodes = [0, 1]
    layouts = dp_layouts(nodes, rows=(8,))
    plans = plan_save(layouts, 2)
    with pytest.raises(PlanError, match="policy 'raid6'"):
        pr.plan_protection(layouts, plans, nodes, "raid6")
    with pytest.raises(PlanError, match="one save plan per process"):
        pr.plan_protection(layouts, plans, [0], "parity")
    with pytest.raises(PlanError, match="group_size >= 2"):
        pr.plan_protection(layouts, plans, nodes, "xor-group", group_size=1)
    with pytest.raises(PlanError, match=r"lost node\(s\) \[7\]"):
        rc.plan_rebuild(pr.plan_protection(layouts, plans, nodes, "parity"), {7}, step=1)
    other = dp_layouts([0], rows=(8,))  # process 1 saves a box the layout says only process 0 holds
    with pytest.raises(PlanError, match="params/w0: process 1 saves a chunk"):
        pr.plan_protection(other, plans, nodes, "parity")


def test_decode_refuses_damaged_plans():
    nodes = [0, 1, 2]
    layouts = dp_layouts(nodes, rows=(64,), sharded=1)
    data = wire.encode_plan(pr.plan_protection(layouts, plan_save(layouts, 3), nodes, "hybrid"))
    with pytest.raises(ManifestError, match="peer 2: protection plan checksum mismatch"):
        wire.decode_plan(data[:-3] + bytes([data[-3] ^ 1]) + data[-2:], source="peer 2")
    with pytest.raises(ManifestError, match="malformed protection plan|not a jaxckpt protection plan"):
        wire.decode_plan(data[:20])
    import msgpack
    env = msgpack.unpackb(data)
    body = msgpack.unpackb(env[3], strict_map_key=False)
    body["stripes"][0][1] = body["stripes"][0][3][0][0]  # parity on a node whose unit it protects
    bad = msgpack.packb(body, use_bin_type=True)
    with pytest.raises(ManifestError, match="malformed protection plan .*stripe 0: parity on node"):
        wire.decode_plan(msgpack.packb([env[0], env[1], crc32c(bad), bad], use_bin_type=True))



def test_decoded_plans_are_kept_by_their_bytes_a_few_at_a_time():
    # An agent decodes the plan at every step's pull, a restore once per step it scans: the same bytes each time.
    plans = [pr.plan_protection(ls, plan_save(ls, 3), [0, 1, 2], "hybrid")
             for ls in (dp_layouts([0, 1, 2], rows=(64 * (k + 1),), sharded=1) for k in range(wire.KEEP_DECODED + 1))]
    data = [wire.encode_plan(p) for p in plans]
    first = wire.decode_plan(data[0])
    assert first == plans[0] and wire.decode_plan(bytearray(data[0])) is first  # equal bytes: no second decode
    with pytest.raises(ManifestError, match="step 7 plan: protection plan checksum mismatch"):
        wire.decode_plan(data[0][:-3] + bytes([data[0][-3] ^ 1]) + data[0][-2:], source="step 7 plan")
    for d, p in zip(data[1:], plans[1:]):
        assert wire.decode_plan(d) == p
    again = wire.decode_plan(data[0])  # pushed out by KEEP_DECODED newer plans: decoded anew, equal
    assert again == plans[0] and again is not first
    assert wire.decode_plan(wire.encode_plan(plans[1])) is plans[1]  # the process that made a plan never decodes it


def test_decode_refuses_a_box_bound_that_is_not_a_non_negative_int():
    import msgpack
    nodes = [0, 1]
    layouts = dp_layouts(nodes, rows=(64,))
    env = msgpack.unpackb(wire.encode_plan(pr.plan_protection(layouts, plan_save(layouts, 2), nodes, "hybrid")))
    for bad_bound in (64.5, -1, True):
        body = msgpack.unpackb(env[3], strict_map_key=False)
        body["chunks"][0][4][1][0] = bad_bound  # the stop of the first chunk's box, axis 0
        raw = msgpack.packb(body, use_bin_type=True)
        with pytest.raises(ManifestError, match=f"peer 1: malformed protection plan .*got {bad_bound!r}"):
            wire.decode_plan(msgpack.packb([env[0], env[1], crc32c(raw), raw], use_bin_type=True), source="peer 1")

@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=0, max_size=3), itemsize=st.sampled_from([1, 4]), data=st.data())
def test_byte_range_boxes_are_exact(shape, itemsize, data):
    start = tuple(data.draw(st.integers(0, 3)) for _ in shape)
    box = Box(start, tuple(s + n for s, n in zip(start, shape)))
    n = box.size * itemsize
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    chunk = pr.SavedChunk(0, 0, 0, n, "x", box, box, (0,), "parity")
    boxes = rc.byte_range_boxes(chunk, lo, hi)
    mark = np.zeros([s + 4 for s in shape] if shape else [], np.int32)
    for b in boxes:
        mark[b.slices()] += 1
    want = np.zeros(box.size, np.int32)
    want[lo // itemsize:-(-hi // itemsize)] = 1
    np.testing.assert_array_equal(mark[box.slices()].reshape(-1), want)
    assert mark.sum() == want.sum() and len(boxes) <= max(1, 2 * len(shape) - 1)


def test_coalesce_joins_neighbours_only():
    b = [Box((0, 0), (2, 4)), Box((2, 0), (4, 4)), Box((0, 4), (4, 8)), Box((6, 0), (7, 8))]
    assert rc.coalesce(b) == (Box((0, 0), (4, 8)), Box((6, 0), (7, 8)))
    assert rc.coalesce([Box((0,), (3,)), Box((3,), (5,)), Box((), ())][:2]) == (Box((0,), (5,)),)


def test_plan_for_config_uses_its_knobs():
    from jaxckpt import Config
    nodes = [0, 1, 2, 3, 4, 5]
    layouts = dp_layouts(nodes, rows=(64,), sharded=1)
    plans = plan_save(layouts, 6)
    p = pr.plan_for_config(layouts, plans, nodes, Config(protection="replica", protection_copies=2, chunk_bytes=4096))
    assert (p.policy, p.copies, p.unit_bytes) == ("replica", 2, 4096) and len(p.copy_blocks) == 2 * 6
    p = pr.plan_for_config(layouts, plans, nodes, Config(protection="xor-group", protection_group=3))
    assert p.groups == ((0, 1, 2), (3, 4, 5))
