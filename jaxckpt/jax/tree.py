"""Pytree leaves classified for a snapshot: arrays (by kind) and plain values, each named by its path."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

from jaxckpt.core.manifest import host_kind
from jaxckpt.errors import UnsupportedLeafError
from jaxckpt.core.keypath import KeyEntry, path_string

@dataclass
class Leaf:
    path: str
    keypath: tuple[KeyEntry, ...]
    value: Any
    kind: str  # "jax" | "prng_key" | "numpy" | "numpy_scalar" | "value"


def keypath_entries(path: tuple) -> tuple[KeyEntry, ...]:
    out = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            key = k.key if isinstance(k.key, (str, int)) and not isinstance(k.key, bool) else str(k.key)
            out.append(("key", key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(("idx", k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(("attr", k.name))
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            out.append(("idx", k.key))
        else:
            out.append(("key", str(k)))
    return tuple(out)


def classify(value: Any, path: str) -> str:
    if isinstance(value, jax.Array):
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            return "prng_key"
        return "jax"
    kind = host_kind(value, path)
    if kind is not None:
        return kind
    raise UnsupportedLeafError(f"{path}: leaf of type {type(value).__module__}.{type(value).__qualname__} "
                               f"is not supported (arrays, numpy, int/float/bool/str/bytes/None are)")


_paths_by_treedef: dict[Any, tuple[tuple[str, tuple[KeyEntry, ...]], ...]] = {}


def _paths(tree: Any, treedef: Any) -> tuple[tuple[str, tuple[KeyEntry, ...]], ...]:
    # Key paths are a pure function of the treedef: computed once per structure, not on every save.
    got = _paths_by_treedef.get(treedef)
    if got is None:
        out, seen = [], set()
        for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
            entries = keypath_entries(kp)
            path = path_string(entries)
            if path in seen:
                raise UnsupportedLeafError(f"{path}: two leaves have the same path (a key containing '/'?)")
            seen.add(path)
            out.append((path, entries))
        got = _paths_by_treedef[treedef] = tuple(out)
    return got


def paths(tree: Any, treedef: Any) -> tuple[tuple[str, tuple[KeyEntry, ...]], ...]:
    """(path, keypath) of every leaf of ``tree`` (whose structure is ``treedef``), in leaf order; paths are
    unique (UnsupportedLeafError otherwise)."""
    return _paths(tree, treedef)


def flatten(tree: Any, *, classify_leaves: bool = True) -> tuple[list[Leaf], Any]:
    """The leaves of ``tree`` with paths, and its treedef; paths must be unique."""
    values, treedef = jax.tree_util.tree_flatten(tree)
    return [Leaf(path, entries, value, classify(value, path) if classify_leaves else "")
            for (path, entries), value in zip(_paths(tree, treedef), values)], treedef
