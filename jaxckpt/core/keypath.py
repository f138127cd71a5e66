"""Leaf names every front end shares: keypaths, the ``/``-joined path users see, and nested containers rebuilt
from keypaths (a restore without a target).

A keypath is a tuple of entries ``("key", dict key)``, ``("idx", sequence index)`` or ``("attr", attribute
name)``; the JAX front end, the torch front end and the manifests spell them alike, so one manifest serves both.
"""
from __future__ import annotations

from typing import Any

__all__ = ["KeyEntry", "nested", "path_string"]

KeyEntry = tuple[str, Any]  # ("key", dict key) | ("idx", sequence index) | ("attr", attribute name)


def path_string(entries: tuple[KeyEntry, ...]) -> str:
    """``params/Dense_0/kernel``: the name users see in errors and ``jaxckpt inspect``."""
    return "/".join(str(v) for _, v in entries) or "<root>"


def nested(items: list[tuple[tuple[KeyEntry, ...], Any]]) -> Any:
    """Plain nested containers from keypaths (a restore without a target): "idx" entries make lists, the others
    dicts (int keys stay ints, as an optimizer's ``state`` needs)."""
    root: dict = {}
    for entries, value in items:
        if not entries:
            return value
        node = root
        for entry in entries[:-1]:
            node = node.setdefault(tuple(entry), {})
        node[tuple(entries[-1])] = value

    def build(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if node and all(kind == "idx" for kind, _ in node):
            return [build(node[e]) for e in sorted(node, key=lambda e: e[1])]
        return {key: build(v) for (_, key), v in node.items()}

    return build(root)
