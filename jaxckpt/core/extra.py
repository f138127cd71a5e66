"""Extra state: small non-array state (a data iterator's position, numpy RNG state, a config dict) saved with a
step as JSON, never pickle.

It travels in the snapshot's manifest as one leaf outside the leaf order (``EXTRA_PATH``), so restore targets
never see it; the persistent tier writes it as Orbax's ``JsonSave`` item ``extra`` (``jaxckpt.persistent``).
Numpy RNG state (``Generator.bit_generator.state``, with its 128-bit ints), iterator positions and config dicts
fit; tuples come back as lists.
"""
from __future__ import annotations

import json
from typing import Any

from jaxckpt.core.manifest import LeafMeta, Manifest
from jaxckpt.errors import UnsupportedLeafError

__all__ = ["EXTRA_PATH", "decode_extra", "encode_extra", "extra_leaf", "extra_of"]

EXTRA_PATH = "__jaxckpt_extra__"  # a manifest leaf outside ``order``: invisible to restore targets


def encode_extra(extra: Any) -> str:
    """``extra`` as JSON text; anything but dict (str keys), list, tuple, str, int, float, bool, None is refused
    with UnsupportedLeafError naming its path."""
    def check(x: Any, path: str) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if not isinstance(k, str):
                    raise UnsupportedLeafError(f"extra{path}: key {k!r} is not a str (JSON objects have str keys)")
                check(v, f"{path}/{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                check(v, f"{path}/{i}")
        elif x is not None and not isinstance(x, (str, int, float, bool)):
            raise UnsupportedLeafError(f"extra{path}: {type(x).__module__}.{type(x).__qualname__} is not a JSON "
                                       f"type (use dict, list, str, int, float, bool, None; .item()/.tolist() "
                                       f"numpy values)")

    check(extra, "")
    return json.dumps(extra)


def decode_extra(text: str) -> Any:
    """The extra state from its JSON text."""
    return json.loads(text)


def extra_of(manifest: Manifest) -> Any:
    """The extra state saved with a snapshot, or None."""
    for v in manifest.leaves:
        if v.path == EXTRA_PATH:
            return decode_extra(v.value)
    return None


def extra_leaf(extra: Any) -> LeafMeta:
    """The manifest leaf that carries ``extra`` (kept out of the leaf order, so restore targets never see it)."""
    return LeafMeta(EXTRA_PATH, (("key", EXTRA_PATH),), encode_extra(extra))
