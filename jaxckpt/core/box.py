"""Boxes: n-dimensional half-open index ranges, the unit in which arrays are cut, saved and fetched."""
from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass
from typing import Iterable, Sequence

from jaxckpt.errors import PlanError


@dataclass(frozen=True, order=True)
class Box:
    """The index range ``start[i] <= idx[i] < stop[i]`` of an array; a 0-d array is ``Box((), ())``."""

    start: tuple[int, ...]
    stop: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.start) != len(self.stop):
            raise PlanError(f"box rank mismatch: start={self.start} stop={self.stop}")
        if any(map(operator.gt, self.start, self.stop)):
            raise PlanError(f"box with negative extent: start={self.start} stop={self.stop}")

    @classmethod
    def full(cls, shape: Sequence[int]) -> "Box":
        """The box covering a whole array of ``shape``."""
        return cls(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    @classmethod
    def from_index(cls, index: Sequence[slice], shape: Sequence[int]) -> "Box":
        """The box of a tuple of step-1 slices (as ``jax.Shard.index`` gives) into an array of ``shape``."""
        start, stop = [], []
        for dim, sl in zip(shape, index):
            lo, hi, step = sl.indices(int(dim))
            if step != 1:
                raise PlanError(f"strided index {sl} is not a box")
            start.append(lo)
            stop.append(max(lo, hi))
        for dim in shape[len(index):]:
            start.append(0)
            stop.append(int(dim))
        return cls(tuple(start), tuple(stop))

    @property
    def ndim(self) -> int:
        return len(self.start)

    # Cached (in the instance's dict, beside the fields that equality and hashing use): a restore asks every
    # chunk's shape and size several times, a tenth of its own Python on a 4,096-leaf state.
    @functools.cached_property
    def shape(self) -> tuple[int, ...]:
        return tuple(map(operator.sub, self.stop, self.start))

    @functools.cached_property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def slices(self) -> tuple[slice, ...]:
        """Global slices selecting this box."""
        return tuple(slice(a, b) for a, b in zip(self.start, self.stop))

    def intersect(self, other: "Box") -> "Box | None":
        """The common part of two boxes, or None when they do not meet (or meet in an empty box)."""
        start = tuple(max(a, b) for a, b in zip(self.start, other.start))
        stop = tuple(min(a, b) for a, b in zip(self.stop, other.stop))
        if any(a >= b for a, b in zip(start, stop)) and self.ndim:
            return None
        return Box(start, stop)

    def contains(self, other: "Box") -> bool:
        return all(a <= c and d <= b for a, b, c, d in zip(self.start, self.stop, other.start, other.stop))

    def relative(self, inner: "Box") -> tuple[slice, ...]:
        """Slices selecting ``inner`` inside an array that holds exactly this box."""
        return tuple(slice(c - a, d - a) for a, c, d in zip(self.start, inner.start, inner.stop))

    def split(self, parts: int) -> list["Box"]:
        """Cut into ``parts`` boxes along the longest axis, sizes differing by at most one row.

        Axis 0 wins ties because row-major memory makes leading-axis pieces contiguous. Boxes that would
        be empty are left out, so fewer than ``parts`` may come back for small arrays.
        """
        if parts <= 1 or self.ndim == 0 or self.size == 0:
            return [self]
        shape = self.shape
        axis = max(range(self.ndim), key=lambda i: (shape[i], -i))
        n = shape[axis]
        out = []
        for k in range(parts):
            lo = self.start[axis] + (n * k) // parts
            hi = self.start[axis] + (n * (k + 1)) // parts
            if hi > lo:
                out.append(Box(self.start[:axis] + (lo,) + self.start[axis + 1:],
                               self.stop[:axis] + (hi,) + self.stop[axis + 1:]))
        return out

    def to_wire(self) -> list[list[int]]:
        return [list(self.start), list(self.stop)]

    @classmethod
    def from_wire(cls, value: Sequence[Sequence[int]]) -> "Box":
        start, stop = value
        return cls(tuple(map(int, start)), tuple(map(int, stop)))


def covers(whole: Box, boxes: Iterable[Box]) -> bool:
    """True when the union of ``boxes`` contains every index of ``whole`` (boxes may overlap)."""
    boxes = [b for b in (x.intersect(whole) for x in boxes) if b is not None]
    if whole.size == 0:
        return True
    if not boxes:
        return False
    # Cut every axis at all box edges; each grid cell is then either inside a box or outside all of them.
    edges = []
    for d in range(whole.ndim):
        cuts = {whole.start[d], whole.stop[d]}
        for b in boxes:
            cuts.update((b.start[d], b.stop[d]))
        edges.append(sorted(cuts))
    for cell in itertools.product(*(range(len(e) - 1) for e in edges)):
        lo = tuple(edges[d][i] for d, i in enumerate(cell))
        if not any(all(b.start[d] <= lo[d] < b.stop[d] for d in range(whole.ndim)) for b in boxes):
            return False
    return True


def disjoint(boxes: Sequence[Box]) -> bool:
    """True when no two non-empty boxes share an index.

    A sweep along axis 0: only boxes whose axis-0 ranges overlap are compared, so the usual plan (pieces cut
    along one axis) costs about n log n instead of n^2 comparisons.
    """
    items = sorted((b for b in boxes if b.size), key=lambda b: b.start[:1])
    if items and items[0].ndim == 0:
        return len(items) <= 1
    active: list[Box] = []
    for b in items:
        active = [a for a in active if a.stop[0] > b.start[0]]
        for a in active:
            if a.intersect(b) is not None:
                return False
        active.append(b)
    return True
