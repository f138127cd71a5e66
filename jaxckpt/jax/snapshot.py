"""The JAX front end's save path on the calling thread: a plan per state layout, and the pins a save takes now.

What ``save()`` can compute once per layout (the tree structure with, per leaf, its type, shape, dtype and
sharding) is a :class:`TreeLayout`, cached: leaf paths and kinds, the engine's save plan (cached by the same
key), and which local buffers each array's chunks are read from. A save with a known layout then does, on the
calling thread: one flatten, one key (a few attribute reads per leaf), and what must happen before the call
returns for the snapshot to equal the state at the call:

- jax arrays on CPU: a zero-copy numpy view of each shard read. It makes a donating next step leave that
  buffer alone (JAX skips donation of buffers with external references), so the workers copy the state as it
  was at the call. The view goes through the buffer protocol where jaxlib gives it (``_buffer_protocol``):
  about 3 us per first view of a buffer here (2 cores, jax 0.10.2), the one per-shard cost left, beside
  JAX's own cost of exposing the buffers of an array a step just made (``_arrays`` builds a Python array
  and a sharding for every local buffer, about 3.3 us each, unsaved replicas too; the sharding, about half
  of it, comes from a per-device cache while the views are taken: ``buffers.shared_shardings``): a fully
  replicated array read from one device is taken through its one buffer (``_fully_replicated_shard``). The collector is
  paused while the views are taken and what it did not examine is handed to its oldest generation unexamined
  (see ``Saver.pins``, ``jaxckpt.core.collector``).
- jax arrays on an accelerator: one ``device_put`` of all of them to pinned host memory, dispatched now
  (``shards.pinned_sharding``); where the backend has no pinned host memory, and for PRNG keys, a
  device-side copy each, then a transfer each (``shards.shard_reads``).
- numpy arrays: copied now (the caller may write them in place as soon as ``save()`` returns).

Everything per shard after that (the engine's shard reads) is built on the copier's dispatcher thread, and as few
Python objects as it can: the views themselves, no function per shard, no task per chunk (see
``core.copier.Chunks``: objects per shard that live while the copy runs set off the collector's full
collections, which cost the training thread more than the rest of a save). A state that is jaxckpt's own (the
fused path's host copies) needs no pin at all: its views are taken on the dispatcher.
"""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np

from jaxckpt.core import collector, hostbuf
from jaxckpt.core.dtypes import native_order
from jaxckpt.core import manifest as mf
from jaxckpt.core.engine import ArrayRecord, ShardReads
from jaxckpt.core.plan import HOST
from jaxckpt.jax import buffers, shards
from jaxckpt.jax.tree import Leaf, classify, paths

log = logging.getLogger("jaxckpt.jax.snapshot")

MAX_LAYOUTS = 64  # layouts remembered; a job whose layout keeps changing re-plans (and logs it)


def _array_type() -> type:
    """jaxlib's concrete array class. Taken from where jax defines it: making an array to ask costs the
    first-dispatch compile of ``zeros`` (0.14 s of ``Checkpointer()`` start-up on CPU, measured)."""
    try:
        from jax._src.array import ArrayImpl
        return ArrayImpl
    except ImportError:  # another layout of jax's internals: ask an array
        return type(jax.numpy.zeros(()))


_array_key: Callable[[Any], Any] | None = None  # (aval, sharding) of a jax.Array; set on first use (needs jax)


def _leaf_key(x: Any) -> Any:
    """What a leaf contributes to the layout key: everything its record, kind and plan depend on."""
    if isinstance(x, jax.Array):
        return (x.aval, x.sharding)  # aval: shape, dtype (PRNG key dtypes included), weak type
    if isinstance(x, np.ndarray):
        return (np.ndarray, x.shape, x.dtype)
    if isinstance(x, np.generic):
        return (type(x), x.dtype)
    return type(x)  # a plain value: saved by value, its kind checked on every save


class LayoutKey:
    """A state layout as a dict key: the treedef and per leaf ``_leaf_key``, hashed once (a save looks it up
    in three caches; a tuple of thousands of avals would be hashed again for each)."""

    __slots__ = ("treedef", "parts", "_hash")

    def __init__(self, treedef: Any, parts: tuple) -> None:
        self.treedef, self.parts = treedef, parts
        self._hash = hash((treedef, parts))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LayoutKey) and self._hash == other._hash and self.treedef == other.treedef \
            and self.parts == other.parts


def layout_key(leaves: list[Any], treedef: Any) -> LayoutKey:
    """The cache key of a flattened state: equal keys promise the same plan."""
    global _array_key
    if _array_key is None:
        # ``sharding`` is a Python property over ``_sharding``; the attribute itself is a third cheaper
        probe = jax.numpy.zeros(())
        _array_key = operator.attrgetter("aval", "_sharding" if hasattr(probe, "_sharding") else "sharding")
    try:  # all jax arrays (the common state): one C-level pass; other leaves have no ``aval``
        parts = tuple(map(_array_key, leaves))
    except AttributeError:
        parts = tuple(map(_leaf_key, leaves))
    return LayoutKey(treedef, parts)


def _record(leaf: Leaf, saved: Any = None) -> ArrayRecord:
    v, kind = leaf.value, leaf.kind

    def meta() -> mf.ArrayMeta:
        lay = shards.array_layout(leaf.path, v, kind, saved)
        attrs: dict[str, Any] = {}
        if kind == "prng_key":
            attrs = {"impl": str(jax.random.key_impl(v)), "key_dtype": str(v.dtype), "key_shape": list(v.shape)}
        return mf.ArrayMeta(leaf.path, leaf.keypath, lay.shape, lay.dtype, kind, shards.describe_sharding(v), attrs)

    return ArrayRecord(leaf.path, (), lambda: shards.array_layout(leaf.path, v, kind, saved), meta,
                       lambda devs: shards.shard_reads(v, kind, devs))


@dataclass
class TreeLayout:
    """One state layout: leaves by kind and path, and (once the engine planned it) where each array is read."""

    key: LayoutKey
    treedef: Any
    leaves: tuple[Leaf, ...]  # paths and kinds (values None: a plan must not keep a state alive)
    shardings: tuple[Any, ...]  # per leaf, a jax leaf's sharding (None for the others)
    arrays: tuple[int, ...]  # leaf index of each array record, in record order
    values: tuple[int, ...]  # leaf index of each plain value
    jax_leaves: frozenset[int]  # leaf indices of jax.Array leaves, keys too (the fused path saves their copies)
    order: tuple[str, ...]
    # Filled on the first save: per array record, how its shards are read (see ``Saver._reads``).
    reads: tuple | None = field(default=None, repr=False)
    eager: tuple[int, ...] = field(default=(), repr=False)
    pinned: tuple[int, ...] = field(default=(), repr=False)  # the "pinned" reads, moved in one device_put
    # Copies to an accelerator's pinned host memory cut into pieces (``shards.local_pieces``): per leaf the
    # sharding its copy has where that is not the leaf's own (None), and the same layout with every copy as its
    # leaf lies (``uncut``, under a key of its own).
    cuts: tuple | None = field(default=None, repr=False)
    uncut: "TreeLayout | None" = field(default=None, repr=False)

    def records(self, leaves: list[Any]) -> list[ArrayRecord]:
        """The engine's records (layouts and metadata; their shard reads are not used: see ``Saver.pins``)."""
        cuts = self.cuts or (None,) * len(self.leaves)
        return [_record(Leaf(self.leaves[i].path, self.leaves[i].keypath, leaves[i], self.leaves[i].kind), cuts[i])
                for i in self.arrays]

    def value_metas(self, leaves: list[Any]) -> list[mf.LeafMeta]:
        out = []
        for i in self.values:
            lf = self.leaves[i]
            classify(leaves[i], lf.path)  # an int out of 64-bit range is refused on every save
            out.append(mf.LeafMeta(lf.path, lf.keypath, leaves[i]))
        return out

    def leaf_list(self, leaves: list[Any]) -> list[Leaf]:
        return [Leaf(lf.path, lf.keypath, v, lf.kind) for lf, v in zip(self.leaves, leaves)]


class Saver:
    """Turns flattened JAX states into engine saves; holds the layout plans of one Checkpointer."""

    def __init__(self) -> None:
        self._layouts: dict[tuple, TreeLayout] = {}
        self._views = fast_view()

    def layout(self, leaves: list[Any], treedef: Any, key: LayoutKey | None = None, tree: Any = None) -> TreeLayout:
        """The plan of a flattened state (``tree`` is needed only for a layout not seen before). Raises
        UnsupportedLeafError naming the path of a leaf it cannot hold."""
        key = layout_key(leaves, treedef) if key is None else key
        got = self._layouts.get(key)
        if got is not None:
            return got
        if tree is None:
            tree = jax.tree_util.tree_unflatten(treedef, leaves)
        named = paths(tree, treedef)
        classified = tuple(Leaf(p, kp, None, classify(v, p)) for (p, kp), v in zip(named, leaves))
        got = TreeLayout(key, treedef, classified,
                       tuple(v.sharding if lf.kind == "jax" else None for lf, v in zip(classified, leaves)),
                       tuple(i for i, lf in enumerate(classified) if lf.kind != "value"),
                       tuple(i for i, lf in enumerate(classified) if lf.kind == "value"),
                       frozenset(i for i, lf in enumerate(classified) if lf.kind in ("jax", "prng_key")),
                       tuple(lf.path for lf in classified))
        # On an accelerator save() and wrap_step copy the arrays to pinned host memory: replicas inside a process
        # are copied once, in pieces, and the save planned on the pieces. On CPU the views copy nothing to cut,
        # and the fused path's copies stay whole: cut, they saved no step time measurably here and made the
        # restore of their many more chunks slower (BENCHMARKS.md, issue 28).
        cuts = tuple(shards.local_pieces(tuple(v.shape), v.dtype.itemsize, s)
                     if s is not None and shards.pinned_sharding(s) is not None else None
                     for v, s in zip(leaves, got.shardings))
        if any(cuts):
            got = _cut(got, cuts)
        if len(self._layouts) >= MAX_LAYOUTS:
            self._layouts.pop(next(iter(self._layouts)))
        self._layouts[key] = got
        return got

    def latest(self) -> TreeLayout | None:
        """The layout planned last (None before any save): its ``reads`` say which buffers its saves view."""
        return next(reversed(self._layouts.values()), None)

    def _reads(self, plan: TreeLayout, devices: list[frozenset[int]], leaves: list[Any]
               ) -> tuple[tuple, tuple[int, ...]]:
        """Per array record: ("view", leaf, positions in ``_arrays``, device ids, all positions? or "one": the
        fully replicated array's one buffer read, or "public": read through jax's public API (``jax.buffers``),
        viewed through the buffer protocol?) for a CPU jax array,
        ("copy", leaf) for numpy, ("same", leaf) for a numpy scalar, ("pinned", leaf, devs, pinned host sharding)
        for a jax array on an accelerator, ("shards", leaf, devs) otherwise,
        or ("none",) when this process reads nothing of it; and the records an owned state still takes at once
        (numpy leaves are the caller's memory even there)."""
        out = []
        for i, devs in zip(plan.arrays, devices):
            lf = plan.leaves[i]
            pinned = shards.pinned_sharding(plan.shardings[i]) if lf.kind == "jax" and devs else None
            if not devs:
                out.append(("none",))
            elif lf.kind == "numpy":
                out.append(("copy", i))
            elif lf.kind == "numpy_scalar":
                out.append(("same", i))
            elif pinned is not None:
                out.append(("pinned", i, devs, pinned))
            elif lf.kind == "jax" and shards.needs_private_hosts(plan.shardings[i]):
                order = shards.local_order(plan.shardings[i])
                pos = tuple(k for k, d in enumerate(order) if d in devs)
                # A fully replicated array read from one device: its first buffer holds the same bytes and is
                # the one JAX exposes without building a Python array (and a sharding) for every local buffer.
                whole = plan.shardings[i].is_fully_replicated and len(pos) == 1
                how: Any = pos == tuple(range(len(order)))
                if whole and buffers.private_whole(leaves[i]):
                    how = "one"
                elif whole or not buffers.private_arrays(leaves[i], order):
                    how = "public"  # jax's private names are not there (or not wanted): see jax.buffers
                out.append(("view", i, pos, tuple(order[k] for k in pos), how, _buffer_protocol(leaves[i].dtype)))
            else:
                out.append(("shards", i, devs))
        return tuple(out), tuple(j for j, r in enumerate(out) if r[0] in ("copy", "same"))

    def pins(self, plan: TreeLayout, devices: list[frozenset[int]], leaves: list[Any], owned: bool
             ) -> Callable[[], list[ShardReads]]:
        """Take now what must be taken before ``save()`` returns; return the function (run on the dispatcher
        thread) that makes the engine's shard reads from it. ``owned``: the jax leaves are jaxckpt's own copies
        (the fused path), so only numpy leaves are taken now."""
        if plan.reads is None:
            plan.reads, plan.eager = self._reads(plan, devices, leaves)
            plan.pinned = tuple(j for j, r in enumerate(plan.reads) if r[0] == "pinned")
            if plan.pinned:
                log.info("%d arrays move to pinned host memory with one device_put at every save() of this layout: "
                         "their transfers are enqueued at the call, before a donating step can run "
                         "(Config.inflight_bytes bounds only transfers started later)", len(plan.pinned))
        reads, views = plan.reads, self._views
        taken: list[Any] = [None] * len(reads)
        if owned:
            for j in plan.eager:
                taken[j] = _take(reads[j], leaves)
            return lambda: _shard_reads(reads, taken, leaves, plan, views)
        # JAX builds several collector-tracked objects per buffer it exposes (a Python array, its sharding, tuples);
        # with the collector running, a many-leaf save sets off a young collection every 700 of them and promotes
        # them all to the oldest generation while the loop runs, which feeds the full collections. Paused, they
        # go to the oldest generation unexamined after the loop and count towards no full collection (reference
        # counts free them with the state at the next step).
        with collector.paused(), buffers.shared_shardings():
            _pin(reads, taken, leaves, plan, views)
        return lambda: _shard_reads(reads, taken, None, plan, views)


def _cut(plan: TreeLayout, cuts: tuple) -> TreeLayout:
    """``plan`` with its copies cut as ``cuts`` says, under its key; ``uncut``: ``plan`` under a key of its own."""
    uncut = TreeLayout(("as they lie", plan.key), plan.treedef, plan.leaves, plan.shardings, plan.arrays,
                       plan.values, plan.jax_leaves, plan.order)
    return TreeLayout(plan.key, plan.treedef, plan.leaves, tuple(c or s for c, s in zip(cuts, plan.shardings)),
                      plan.arrays, plan.values, plan.jax_leaves, plan.order, cuts=cuts, uncut=uncut)


def _pin(reads: tuple, taken: list[Any], leaves: list[Any], plan: TreeLayout,
         views: Callable[[list[Any]], list[np.ndarray]]) -> None:
    """Take the views (and copies) of ``reads`` into ``taken``."""
    for j, r in enumerate(reads):
        what = r[0]
        if what == "view":  # the one per-shard cost of a save (see the module docstring)
            arrs = _local_arrays(leaves[r[1]], r)
            taken[j] = list(map(np.asarray, arrs)) if r[5] else views(arrs)
        elif what == "shards":
            taken[j] = shards.shard_reads(leaves[r[1]], plan.leaves[r[1]].kind, r[2])
        elif what not in ("none", "pinned"):
            taken[j] = _take(r, leaves)
    if plan.pinned:  # one call for every array on an accelerator: the transfers are batched and dispatched at once
        # may_alias=False: an array the caller already keeps in pinned host memory is copied, not handed back
        hosts = jax.device_put([leaves[reads[j][1]] for j in plan.pinned], [reads[j][3] for j in plan.pinned],
                               may_alias=False)
        for j, host in zip(plan.pinned, hosts):  # jaxckpt's own copies: read lazily, on the workers
            taken[j] = shards.shard_reads(host, "jax", reads[j][2], owned=True)


def _local_arrays(x: Any, r: tuple) -> list[Any]:
    """The single-device arrays of ``x`` that the "view" read ``r`` takes, the way its plan found to them
    (``r[4]``): the one buffer of a fully replicated array, jax's public per-shard data (its private names
    unavailable: jax/buffers.py), or jax's per-device arrays, all of them or those at positions ``r[2]``."""
    how = r[4]
    if how == "one":
        return [x._fully_replicated_shard()]
    if how == "public":
        return buffers.public(x, r[3])
    arrs = x._arrays
    return arrs if how else [arrs[p] for p in r[2]]


def _buffer_protocol(dtype: Any) -> bool:
    """Whether a CPU buffer of ``dtype`` is viewed through the buffer protocol (``np.asarray`` of a per-device
    array): its view holds the buffer as jaxlib's direct view does (JAX skips donating it) for less than half
    the first-view cost of the direct one, which builds a second Python array and a sharding for the buffer
    (2.9 us against 6.3-8.0 us measured here). jaxlib gives the protocol for numpy's own types only: bfloat16,
    float8 and int4 buffers take the direct view."""
    dt = np.dtype(dtype)
    return dt.isbuiltin == 1 and dt.kind in "biufc"


def _take(r: tuple, leaves: list[Any]) -> np.ndarray:
    return _copy_numpy(leaves[r[1]]) if r[0] == "copy" else np.asarray(leaves[r[1]])


def _shard_reads(reads: tuple, taken: list[Any], owned: list[Any] | None, plan: TreeLayout,
             views: Callable[[list[Any]], list[np.ndarray]]) -> list[ShardReads]:
    """The engine's shard reads, on the dispatcher thread; ``owned``: the fused path's copies, read from here."""
    if owned is not None:
        return _owned_reads(reads, taken, owned, plan, views)
    out: list[ShardReads] = []
    for r, t in zip(reads, taken):
        what = r[0]
        if what == "view":  # the host arrays themselves, no function per shard (see core.copier.Chunks)
            out.append({d: (v, None) for v, d in zip(t, r[3])})
        elif what in ("copy", "same"):
            out.append({HOST: (t, None)})
        elif what in ("shards", "pinned"):
            out.append(t)
        else:
            out.append({})
    taken.clear()
    return out


def _owned_reads(reads: tuple, taken: list[Any], owned: list[Any], plan: TreeLayout,
                 views: Callable[[list[Any]], list[np.ndarray]]) -> list[ShardReads]:
    """The fused path's shard reads: views of its host copies, taken here (the first waits for its program).

    JAX builds a Python array and a sharding for every local buffer of each copy (``_arrays``), and the reads
    (a dict and a tuple per shard) live until the engine has indexed them: thousands of tracked objects per
    save, made while the training thread runs. With the collector on, they set off a young collection every
    700, survive it, and are promoted into the middle generation and then the oldest, where they count
    towards a full collection (a 200-270 ms pause of every thread every ~10 saves with JAX's heap, measured
    on the 879-leaf state). Paused here, and handed to the oldest generation unexamined at the end
    (``jaxckpt.core.collector``), they are freed by reference counts when the engine drops them and count towards
    nothing; the direct view's base holds the buffer, not JAX's per-buffer array, so those die at once. The
    program is waited for first, with the collector on: the outputs of one program are ready together."""
    first = next((r[1] for r in reads if r[0] == "view"), None)
    if first is not None:
        owned[first].block_until_ready()
    with collector.paused(), buffers.shared_shardings():
        return _owned_views(reads, taken, owned, plan, views)


def _owned_views(reads: tuple, taken: list[Any], owned: list[Any], plan: TreeLayout,
                 views: Callable[[list[Any]], list[np.ndarray]]) -> list[ShardReads]:
    out: list[ShardReads] = []
    for r, t in zip(reads, taken):
        what = r[0]
        if what == "view":
            got = views(_local_arrays(owned[r[1]], r))
            out.append({d: (v, None) for v, d in zip(got, r[3])})
        elif what in ("copy", "same"):
            out.append({HOST: (t, None)})  # numpy leaves: taken at the call
        elif what in ("shards", "pinned"):  # the fused path's copies are on the host already
            out.append(shards.shard_reads(owned[r[1]], plan.leaves[r[1]].kind, r[2], True))
        else:
            out.append({})
    taken.clear()
    return out


def _copy_numpy(x: np.ndarray) -> np.ndarray:
    """A private copy of a numpy leaf, in native byte order (the manifest names the native dtype)."""
    arr = np.asarray(x)
    return hostbuf.copy(arr) if arr.dtype.isnative else native_order(arr)


def fast_view() -> Callable[[list[Any]], list[np.ndarray]]:
    """``views(arrays)``: ``np.asarray`` of each single-device CPU array. Where jaxlib has the direct call (it
    returns (array, copied)), that, skipping the Python of ``__array__`` (a third of the per-shard cost here);
    its tuple is dropped at once, so it never reaches the collector (kept, 1,272 per save set off a collection
    of the young objects every 700)."""
    direct = getattr(_array_type(), "_single_device_array_to_np_array_did_copy", None)
    if direct is None:
        return lambda arrs: list(map(np.asarray, arrs))
    first = operator.itemgetter(0)
    return lambda arrs: list(map(first, map(direct, arrs)))
