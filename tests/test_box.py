"""Boxes: construction, slicing, intersection, splitting and coverage."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxckpt.core.box import Box, covers, disjoint
from jaxckpt.errors import PlanError


def test_full_and_properties():
    b = Box.full((4, 6, 2))
    assert (b.start, b.stop, b.shape, b.size, b.ndim) == ((0, 0, 0), (4, 6, 2), (4, 6, 2), 48, 3)
    s = Box.full(())
    assert (s.shape, s.size, s.ndim, s.slices()) == ((), 1, 0, ())


def test_invalid_boxes_raise_plan_error():
    with pytest.raises(PlanError, match="rank mismatch"):
        Box((0,), (1, 2))
    with pytest.raises(PlanError, match="negative extent"):
        Box((3,), (2,))


def test_from_index_like_jax_shard_index():
    shape = (8, 6)
    assert Box.from_index((slice(2, 4), slice(None)), shape) == Box((2, 0), (4, 6))
    assert Box.from_index((slice(None, None, None),), shape) == Box((0, 0), (8, 6))  # missing dims are whole
    assert Box.from_index((), shape) == Box.full(shape)
    assert Box.from_index((slice(-2, None), slice(1, 100)), shape) == Box((6, 1), (8, 6))
    with pytest.raises(PlanError, match="strided"):
        Box.from_index((slice(0, 8, 2),), shape)


def test_slices_select_the_box():
    a = np.arange(48).reshape(6, 8)
    b = Box((1, 2), (4, 5))
    np.testing.assert_array_equal(a[b.slices()], a[1:4, 2:5])


def test_intersect_contains_relative():
    a, b = Box((0, 0), (4, 4)), Box((2, 3), (6, 8))
    assert a.intersect(b) == Box((2, 3), (4, 4)) == b.intersect(a)
    assert a.intersect(Box((4, 0), (6, 4))) is None  # touching edges share no index
    assert a.intersect(Box((5, 5), (6, 6))) is None
    assert Box((), ()).intersect(Box((), ())) == Box((), ())
    assert a.contains(Box((1, 1), (3, 4))) and not a.contains(b) and a.contains(a)
    outer, inner = Box((2, 3), (6, 8)), Box((3, 5), (5, 8))
    arr = np.arange(100).reshape(10, 10)
    held = arr[outer.slices()]
    np.testing.assert_array_equal(held[outer.relative(inner)], arr[inner.slices()])


def test_split_along_longest_axis_leading_axis_wins_ties():
    assert Box.full((4, 4)).split(2) == [Box((0, 0), (2, 4)), Box((2, 0), (4, 4))]
    assert Box.full((2, 8)).split(2) == [Box((0, 0), (2, 4)), Box((0, 4), (2, 8))]
    assert Box.full((3,)).split(5) == [Box((0,), (1,)), Box((1,), (2,)), Box((2,), (3,))]  # empties dropped
    assert Box.full(()).split(4) == [Box.full(())]
    assert Box.full((0, 5)).split(3) == [Box.full((0, 5))]
    assert Box.full((5,)).split(1) == [Box.full((5,))]


def test_wire_roundtrip():
    b = Box((1, 2, 0), (3, 4, 9))
    assert Box.from_wire(b.to_wire()) == b
    assert Box.from_wire(Box.full(()).to_wire()) == Box.full(())


def test_covers_and_disjoint():
    whole = Box.full((4, 4))
    halves = Box.full((4, 4)).split(2)
    assert covers(whole, halves) and disjoint(halves)
    assert not covers(whole, halves[:1])
    assert not covers(whole, [])
    assert covers(Box.full((0, 4)), [])  # nothing to cover
    overlapping = [Box((0, 0), (3, 4)), Box((2, 0), (4, 4))]
    assert covers(whole, overlapping) and not disjoint(overlapping)
    holed = [Box((0, 0), (4, 1)), Box((0, 2), (4, 4))]
    assert not covers(whole, holed)
    assert covers(Box.full(()), [Box.full(())]) and not disjoint([Box.full(()), Box.full(())])
    assert covers(Box((1, 1), (2, 2)), [Box.full((8, 8))])  # boxes larger than the whole are clipped


boxes = st.lists(st.integers(0, 9), min_size=1, max_size=3).flatmap(
    lambda shape: st.tuples(st.just(tuple(shape)), st.integers(1, 12)))


@settings(max_examples=150, deadline=None)
@given(boxes)
def test_split_pieces_partition_the_box(case):
    shape, parts = case
    whole = Box.full(shape)
    pieces = whole.split(parts)
    assert 1 <= len(pieces) <= max(1, parts)
    assert sum(p.size for p in pieces) == whole.size
    assert all(whole.contains(p) for p in pieces)
    assert disjoint(pieces) and covers(whole, pieces)
    if whole.size and len(pieces) > 1:
        sizes = [p.size for p in pieces]
        row = whole.size // max(whole.shape)
        assert max(sizes) - min(sizes) <= row  # balanced to within one row of the split axis
