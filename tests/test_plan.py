"""Save and restore planning, as pure functions of layouts and manifests (no cluster needed)."""
import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from jaxckpt.core.box import Box, covers, disjoint
from jaxckpt.errors import PlanError
from jaxckpt.core.manifest import ArrayMeta, ChunkMeta
from jaxckpt.core.plan import (ALIGN, HOST, ArrayLayout, Assembly, ChunkPlan, Placement, Read, SavePlan, layout_digest,
                          plan_restore, plan_save, validate_save_plan)


def layout(path, shape, placements, itemsize=4, dtype="float32"):
    return ArrayLayout(path, tuple(shape), dtype, itemsize, tuple(placements))


def sharded(path, shape, procs, devs_per_proc=1, itemsize=4):
    """Rows split over procs * devs_per_proc devices, device d on process d // devs_per_proc."""
    n = procs * devs_per_proc
    boxes = Box.full(shape).split(n)
    return layout(path, shape, [Placement(b, d // devs_per_proc, d) for d, b in enumerate(boxes)], itemsize)


def replicated(path, shape, procs, devs_per_proc=1, itemsize=4):
    return layout(path, shape, [Placement(Box.full(shape), d // devs_per_proc, d)
                                for d in range(procs * devs_per_proc)], itemsize)


def saved_by(plans, path):
    return [(p.process, c) for p in plans for c in p.chunks if c.path == path]


def assert_exactly_once(layouts, plans):
    for a in layouts:
        boxes = [c.box for _, c in saved_by(plans, a.path)]
        assert disjoint(boxes) and covers(Box.full(a.shape), boxes)
        assert sum(b.size for b in boxes) == Box.full(a.shape).size


def test_sharded_array_each_shard_saved_once_by_its_holder():
    lay = sharded("w", (16, 4), procs=4, devs_per_proc=2)
    plans = plan_save([lay], 4)
    assert [p.process for p in plans] == [0, 1, 2, 3]
    assert_exactly_once([lay], plans)
    for proc, c in saved_by(plans, "w"):
        held = {p.box: p for p in lay.placements}[c.source]
        assert held.process == proc and held.device == c.device
        assert c.source.contains(c.box)


def test_replicated_box_split_across_replicas_one_chunk_each():
    lay = replicated("b", (64, 8), procs=4, devs_per_proc=2)
    plans = plan_save([lay], 4)
    assert_exactly_once([lay], plans)
    per_proc = {p.process: [c for c in p.chunks] for p in plans}
    assert all(len(chunks) == 1 for chunks in per_proc.values())  # 1/R each, in one chunk
    assert sorted(c.box.shape for chunks in per_proc.values() for c in chunks) == [(16, 8)] * 4
    for proc, (c,) in per_proc.items():
        assert c.source == Box.full((64, 8))
        assert c.device == proc * 2  # the first device of the process holds it
        assert c.nbytes == 16 * 8 * 4


def test_partially_replicated_each_half_split_over_its_replicas():
    # Rows split in two over "data", each half replicated over 2 processes ("model").
    halves = Box.full((8, 6)).split(2)
    placements = [Placement(halves[p // 2], p, p) for p in range(4)]
    lay = layout("w", (8, 6), placements)
    plans = plan_save([lay], 4)
    assert_exactly_once([lay], plans)
    for proc, c in saved_by(plans, "w"):
        assert c.source == halves[proc // 2] and c.source.contains(c.box)
    assert sorted(p.nbytes for p in plans)[0] > 0  # every replica saves a share


def test_replicated_load_is_balanced_across_arrays():
    lays = [replicated(f"a{i}", (3, 1), procs=2) for i in range(6)]  # 3 rows: shares of 2 and 1 rows
    plans = plan_save(lays, 2)
    assert_exactly_once(lays, plans)
    loads = [sum(c.nbytes for c in p.chunks) for p in plans]
    assert abs(loads[0] - loads[1]) <= 4  # at most one row apart, not "replica 0 saves the bigger share"


def test_host_arrays_saved_by_process_zero():
    lay = layout("np", (5,), [Placement(Box.full((5,)), 0, HOST)], itemsize=8, dtype="int64")
    plans = plan_save([lay], 3)
    assert [len(p.chunks) for p in plans] == [1, 0, 0]
    assert plans[0].chunks[0].device == HOST


def test_large_pieces_are_cut_into_chunks():
    lay = replicated("big", (1024, 16), procs=2)  # 64 KiB, 32 KiB per replica
    plans = plan_save([lay], 2, chunk_bytes=8 << 10)
    assert_exactly_once([lay], plans)
    for p in plans:
        assert len(p.chunks) == 4 and all(c.nbytes <= 8 << 10 for c in p.chunks)


def test_offsets_aligned_back_to_back_and_in_bounds():
    lays = [sharded("a", (7, 3), 2, itemsize=1), replicated("b", (5,), 2, itemsize=8), layout("s", (), [
        Placement(Box.full(()), 1, 0)])]
    for p in plan_save(lays, 2):
        end = 0
        for c in p.chunks:
            assert c.offset % ALIGN == 0 and c.offset >= end
            end = c.offset + c.nbytes
        assert p.nbytes >= end and p.nbytes % ALIGN == 0


def test_scalar_and_empty_arrays():
    lays = [layout("s", (), [Placement(Box.full(()), 0, 0), Placement(Box.full(()), 1, 1)]),
            layout("e", (0, 4), [Placement(Box.full((0, 4)), 0, 0)])]
    plans = plan_save(lays, 2)
    assert len(saved_by(plans, "s")) == 1
    assert saved_by(plans, "e")[0][1].nbytes == 0


def test_equal_layouts_give_equal_plans_and_digests():
    a = [sharded("w", (16, 4), 2), replicated("b", (4,), 2)]
    b = [sharded("w", (16, 4), 2), replicated("b", (4,), 2)]
    assert plan_save(a, 2) == plan_save(b, 2)
    assert layout_digest(a) == layout_digest(b) != layout_digest([sharded("w", (16, 4), 2)])
    assert len({p.layout for p in plan_save(a, 2)}) == 1


def test_placement_outside_the_job_is_refused():
    with pytest.raises(PlanError, match="w: placement on process 3"):
        plan_save([layout("w", (4,), [Placement(Box.full((4,)), 3, 0)])], 2)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.lists(st.tuples(st.integers(0, 9), st.integers(1, 7),
                                                                st.booleans()), min_size=1, max_size=5))
def test_any_mix_of_layouts_saves_every_box_exactly_once(procs, devs, specs):
    lays = []
    for i, (rows, cols, rep) in enumerate(specs):
        make = replicated if rep else sharded
        lays.append(make(f"a{i}", (rows, cols), procs, devs))
    plans = plan_save(lays, procs, chunk_bytes=64)
    assert_exactly_once(lays, plans)


# ------------------------------------------------------------------------------------- validate_save_plan
def _plan(chunks, process=0):
    return SavePlan(process, tuple(chunks), sum(c.nbytes for c in chunks), "x")


def _chunk(path, box, offset=0):
    return ChunkPlan(path, box, box, 0, offset, box.size * 4)


def test_validate_accepts_a_good_plan():
    lay = layout("w", (4, 4), [Placement(Box.full((4, 4)), 0, 0)])
    validate_save_plan([lay], [_plan([_chunk("w", b) for b in Box.full((4, 4)).split(2)])])


@pytest.mark.parametrize("boxes, match", [
    ([Box((0, 0), (2, 4))], "w: chunks do not cover the array exactly once"),                       # gap
    ([Box((0, 0), (3, 4)), Box((2, 0), (4, 4))], "w: chunks do not cover"),                          # overlap
    ([Box((0, 0), (4, 4)), Box((0, 0), (4, 4))], "w: chunks do not cover"),                          # twice
    ([Box((0, 0), (2, 4)), Box((2, 0), (5, 4))], r"w: chunk .* out of bounds of shape \(4, 4\)"),  # bounds
    ([Box((0, 0), (2, 4)), Box((3, 0), (4, 4)), Box((1, 0), (2, 4))], "w: chunks do not cover"),     # sums up
])
def test_validate_catches_bad_plans(boxes, match):
    lay = layout("w", (4, 4), [Placement(Box.full((4, 4)), 0, 0)])
    plans = [_plan([_chunk("w", b) for b in boxes[:1]], 0), _plan([_chunk("w", b) for b in boxes[1:]], 1)]
    with pytest.raises(PlanError, match=match):
        validate_save_plan([lay], plans)


def test_validate_catches_a_chunk_of_an_unknown_array():
    lay = layout("w", (4,), [Placement(Box.full((4,)), 0, 0)])
    with pytest.raises(PlanError, match="ghost"):
        validate_save_plan([lay], [_plan([_chunk("w", Box.full((4,))), _chunk("ghost", Box.full((2,)))])])


def test_validate_catches_an_array_nobody_saves():
    lays = [layout(p, (4,), [Placement(Box.full((4,)), 0, 0)]) for p in ("w", "v")]
    with pytest.raises(PlanError, match="v: chunks do not cover"):
        validate_save_plan(lays, [_plan([_chunk("w", Box.full((4,)))])])


# ----------------------------------------------------------------------------------------------- restore
def meta(shape, chunks, path="w"):
    return ArrayMeta(path=path, keypath=(("key", path),), shape=shape, dtype="float32", kind="jax",
                     chunks=tuple(ChunkMeta(b, i * 1024, b.size * 4, 0, proc) for i, (b, proc) in enumerate(chunks)))


def test_restore_plan_covers_every_needed_box():
    m = meta((8, 8), [(b, i % 2) for i, b in enumerate(Box.full((8, 8)).split(4))])  # row blocks of 2
    needed = {Box((0, 0), (8, 4)): [0, 1], Box((0, 4), (8, 8)): [2], Box((3, 1), (5, 2)): [3]}
    plan = plan_restore(m, needed, step=5)
    assert [a.box for a in plan] == list(needed)
    for a in plan:
        parts = [r.part for r in a.reads]
        assert disjoint(parts) and covers(a.box, parts)
        assert all(r.chunk.box.contains(r.part) for r in a.reads)
        assert a.devices == tuple(needed[a.box])
    assert {r.chunk.box for r in plan[2].reads} == {Box((2, 0), (4, 8)), Box((4, 0), (6, 8))}
    assert [r.chunk.process for r in plan[2].reads] == [0, 1]  # own process first


def test_restore_prefers_own_process_for_replicated_chunks():
    whole = Box.full((4, 4))
    m = meta((4, 4), [(whole, 0), (whole, 1), (whole, 2)])
    (a,) = plan_restore(m, {whole: [0]}, step=1, prefer_process=2)
    assert [r.chunk.process for r in a.reads] == [2] and a.whole_chunk


def test_restore_plan_error_names_array_step_and_missing_box():
    m = meta((8, 4), [(Box((0, 0), (4, 4)), 0)], path="params/dense/kernel")
    with pytest.raises(PlanError, match=r"params/dense/kernel: step 7 has no saved bytes for box \(4, 0\)\.\.\(8, 4\)"):
        plan_restore(m, {Box((0, 0), (4, 4)): [0], Box((4, 0), (8, 4)): [1]}, step=7)


def test_restore_of_scalar_and_empty_boxes():
    (a,) = plan_restore(meta((), [(Box.full(()), 0)]), {Box.full(()): [0]}, step=1)
    assert a.whole_chunk
    (e,) = plan_restore(meta((0, 3), []), {Box.full((0, 3)): [0]}, step=1)
    assert e.reads == ()


def test_whole_chunk_only_when_one_chunk_is_exactly_the_box():
    c = ChunkMeta(Box((0,), (4,)), 0, 16, 0, 0)
    assert Assembly("w", Box((0,), (4,)), (0,), (Read(c, Box((0,), (4,))),)).whole_chunk
    assert not Assembly("w", Box((0,), (2,)), (0,), (Read(c, Box((0,), (2,))),)).whole_chunk


def test_plans_are_frozen():
    plan = plan_save([replicated("b", (4,), 1)], 1)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.nbytes = 0


# ------------------------------------------------------------------------------------------- whole replicas
def test_whole_replicas_one_whole_copy_per_node_shared_by_its_replicas():
    """Config.replicas="whole": 4 processes on 2 nodes; a replicated box is saved whole once per node (not per
    process), its copy shared by the node's replicas like split's 1/R; the copies are cut alike; a sharded box
    once. With 3 replicas on one node and 1 on the other, both copies stay whole and cut alike (no cut)."""
    nodes = [0, 0, 1, 1]
    rep = replicated("rep", (64, 8), procs=4)
    w = sharded("w", (16, 4), procs=4)
    plans = plan_save([w, rep], 4, chunk_bytes=1 << 10, nodes=nodes)
    by_node = {}
    for proc, c in saved_by(plans, "rep"):
        by_node.setdefault(nodes[proc], []).append((proc, c.box))
    assert sorted(by_node) == [0, 1]
    for n, got in by_node.items():
        assert covers(Box.full((64, 8)), [b for _, b in got]) and disjoint([b for _, b in got])
        share = {p: sum(b.size for q, b in got if q == p) for p in (2 * n, 2 * n + 1)}
        assert share == {2 * n: 64 * 8 // 2, 2 * n + 1: 64 * 8 // 2}, share  # half of the copy each
    assert sorted(b for _, b in by_node[0]) == sorted(b for _, b in by_node[1])
    assert_exactly_once([w], plans)

    uneven = plan_save([rep], 4, nodes=[0, 0, 0, 1])
    boxes = {nodes_: sorted(c.box for p, c in saved_by(uneven, "rep") if [0, 0, 0, 1][p] == nodes_)
             for nodes_ in (0, 1)}
    assert boxes[0] == boxes[1] == [Box.full((64, 8))]


def test_whole_replicas_on_one_node_are_the_split_plan():
    """One node: whole's one copy per node, shared by the node's replicas, is split's plan exactly."""
    layouts = [replicated("rep", (64, 8), procs=4), sharded("w", (16, 4), procs=4), replicated("s", (3,), 4)]
    assert plan_save(layouts, 4, chunk_bytes=1 << 10, nodes=[0] * 4) == plan_save(layouts, 4, chunk_bytes=1 << 10)


def test_whole_replica_validation_and_node_count():
    rep = replicated("rep", (8, 4), procs=2)
    plans = plan_save([rep], 2, nodes=[0, 1])  # two nodes: one copy each
    assert [len(p.chunks) for p in plans] == [1, 1]
    one = plans[0].chunks
    twice = [dataclasses.replace(p, chunks=one) for p in plans]  # both processes of node 0 save it
    with pytest.raises(PlanError, match=r"rep: chunk .* is saved twice on node 0"):
        validate_save_plan([rep], twice, [0, 0])
    with pytest.raises(PlanError, match="needs the node of each of the 2 processes"):
        plan_save([rep], 2, nodes=[0])


def test_restore_prefers_the_cheapest_copy_of_a_box():
    """Copies of one box on processes 0 (another node), 1 (this one's own, lost: dearest) and 2 (this node)."""
    box = Box.full((4, 4))
    meta = ArrayMeta("rep", (), (4, 4), "float32", "jax",
                     chunks=tuple(ChunkMeta(box, 0, 64, 0, p) for p in (0, 1, 2)))
    (a,) = plan_restore(meta, {box: [0]}, step=3, prefer_process=1, cost={0: 1, 1: 3, 2: 0})
    assert [r.chunk.process for r in a.reads] == [2]
    (a,) = plan_restore(meta, {Box((0, 0), (2, 4)): [0]}, step=3, prefer_process=1, cost={0: 1, 1: 3, 2: 0})
    assert [r.chunk.process for r in a.reads] == [2]
    (a,) = plan_restore(meta, {box: [0]}, step=3, prefer_process=1)  # no costs: its own first, as before
    assert [r.chunk.process for r in a.reads] == [1]
