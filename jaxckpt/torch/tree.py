"""torch state dicts as leaves: flattening (paths shared with the JAX front end), leaf kinds, and rebuilding.

A state dict is nested dicts (any Mapping, keys str or int), lists and tuples. Each leaf gets the keypath and
the "/"-joined path the JAX front end gives the same nesting (``{"model": {"layer.weight": t}}`` ->
``model/layer.weight``), so one manifest serves both front ends.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch

from jaxckpt.core.manifest import host_kind
from jaxckpt.errors import UnsupportedLeafError
from jaxckpt.core.keypath import KeyEntry, path_string


class PerRank:
    """Marks a tensor whose value differs on every process (an RNG state, a data-loader position).

    A plain tensor in a multi-process job is taken to be the same on every process (as in data parallelism)
    and is split across them when saved; a ``PerRank`` tensor is saved by each process as its own row of a
    ``(process_count, *shape)`` array and comes back, on restore, as this process's row. Every process must
    pass a tensor of the same shape and dtype.
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or is_dtensor(tensor):
            raise UnsupportedLeafError(f"PerRank wraps a plain torch.Tensor, got {type(tensor).__qualname__}")
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"PerRank({self.tensor!r})"


@dataclass
class Leaf:
    path: str
    keypath: tuple[KeyEntry, ...]
    value: Any
    # "tensor" | "dtensor" | "generator" | "per_rank" | "numpy" | "numpy_scalar" | "value"
    kind: str


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor, without importing ``torch.distributed.tensor`` (0.6-0.7 s of a relaunched
    process's start-up, most of it sympy): a DTensor exists only once that module has been imported."""
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls is not None and isinstance(value, cls)


def classify(value: Any, path: str) -> str:
    """The kind of a leaf; UnsupportedLeafError naming ``path`` for anything else."""
    if is_dtensor(value):
        return "dtensor"
    if isinstance(value, torch.Tensor):
        if value.is_quantized or value.is_sparse or value.layout != torch.strided:
            raise UnsupportedLeafError(f"{path}: {value.layout} / quantized tensors cannot be snapshotted")
        return "tensor"
    if isinstance(value, torch.Generator):
        return "generator"
    if isinstance(value, PerRank):
        return "per_rank"
    kind = host_kind(value, path)
    if kind is not None:
        return kind
    raise UnsupportedLeafError(f"{path}: leaf of type {type(value).__module__}.{type(value).__qualname__} is not "
                               f"supported (tensors, DTensors, torch.Generator, PerRank, numpy, "
                               f"int/float/bool/str/bytes/None are)")


def _children(node: Any, entries: tuple[KeyEntry, ...]) -> list[tuple[KeyEntry, Any]] | None:
    if isinstance(node, Mapping):
        out = []
        for k, v in node.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise UnsupportedLeafError(f"{path_string(entries)}: dict key {k!r} is not a str or int")
            out.append((("key", k), v))
        return out
    if isinstance(node, (list, tuple)):
        return [(("idx", i), v) for i, v in enumerate(node)]
    return None


def flatten(state: Any, *, classify_leaves: bool = True) -> list[Leaf]:
    """The leaves of ``state`` in insertion order, each with its keypath, path and kind; paths are unique."""
    leaves: list[Leaf] = []
    seen: set[str] = set()

    def walk(node: Any, entries: tuple[KeyEntry, ...]) -> None:
        kids = _children(node, entries)
        if kids is not None:
            for entry, child in kids:
                walk(child, entries + (entry,))
            return
        path = path_string(entries)
        if path in seen:
            raise UnsupportedLeafError(f"{path}: two leaves have the same path (a key containing '/'?)")
        seen.add(path)
        leaves.append(Leaf(path, entries, node, classify(node, path) if classify_leaves else ""))

    walk(state, ())
    return leaves


def rebuild(state: Any, fn: Callable[[Any], Any]) -> Any:
    """``state``'s structure (dict types, lists, tuples, named tuples) with every leaf replaced by ``fn(leaf)``.

    ``fn`` is called in the order :func:`flatten` lists the leaves.
    """
    if isinstance(state, Mapping):
        items = [(k, rebuild(v, fn)) for k, v in state.items()]
        try:
            return type(state)(items)
        except TypeError:  # a Mapping type that cannot be built from pairs
            return dict(items)
    if isinstance(state, (list, tuple)):
        items = [rebuild(v, fn) for v in state]
        if isinstance(state, tuple) and hasattr(state, "_fields"):
            return type(state)(*items)
        return type(state)(items) if type(state) in (list, tuple) else list(items)
    return fn(state)
