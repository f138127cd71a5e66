"""Dtype names on the wire: numpy's names, plus the ml_dtypes extensions (bfloat16, float8_*) JAX and torch use."""
from __future__ import annotations

import functools
import re
from types import ModuleType
from typing import TYPE_CHECKING

from jaxckpt.errors import ManifestError, UnsupportedLeafError

if TYPE_CHECKING:
    import numpy as np


_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}(\[[a-zA-Z0-9]{1,8}\])?\Z")
# Fixed-width strings and raw bytes: numpy names them by bit width ("str160"), which np.dtype cannot read back,
# so they travel as "str[5]" (5 UCS-4 characters, little-endian), "bytes[7]", "void[3]" (itemsize bytes).
_FIXED = {"U": "str", "S": "bytes", "V": "void"}
_FIXED_NAME = re.compile(r"(str|bytes|void)\[(\d{1,8})\]\Z")
_FIXED_CODE = {"str": "<U", "bytes": "S", "void": "V"}
# Without ml_dtypes (a torch-only install) its types still travel under their own names, their bytes held as
# same-width unsigned integers: the torch front end reinterprets the bits, and numpy could not compute with them.
ML_WIDTHS = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
              "float8_e4m3b11fnuz": 1, "float8_e8m0fnu": 1, "float8_e3m4": 1, "float8_e4m3": 1,
              "float4_e2m1fn": 1, "float6_e2m3fn": 1, "float6_e3m2fn": 1, "int1": 1, "int2": 1, "int4": 1,
              "uint1": 1, "uint2": 1, "uint4": 1}


@functools.cache
def _ml_dtypes() -> ModuleType | None:
    """ml_dtypes, imported on the first name numpy does not know: its import costs about a second of CPU (it
    registers hundreds of ufunc loops), which processes that never meet such a name (node agents, numpy trainers)
    need not pay. It ships with jax; a torch-only install may lack it (see ML_WIDTHS)."""
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - depends on the environment
        return None
    return ml_dtypes


def _numpy() -> ModuleType:
    """numpy, imported on the first dtype name: the node agent imports the manifest format (its limits, the
    records it serves) but decodes no manifest before it serves, so its start, on which a replacement node's
    first ``Checkpointer()`` waits, does not pay numpy's import (about half of it)."""
    import numpy

    return numpy


# Names and dtypes already mapped, each way: a save names every leaf's dtype and a restore maps every array's
# name back, and numpy computes ``dtype.name`` in Python (7 us; 17 us for an ml_dtypes name, per array). Bounded
# (a process meets a handful of dtypes; a hostile peer could send many names).
_NAMES: dict = {}
_DTYPES: dict = {}
_MEMO_MAX = 256


def dtype_name(dtype: np.dtype) -> str:
    """The name under which ``dtype`` is written into a manifest."""
    np = _numpy()
    dt = np.dtype(dtype)
    name = _NAMES.get(dt)
    if name is not None:
        return name
    if dt.type in (np.str_, np.bytes_, np.void) and dt.names is None and dt.subdtype is None:  # not ml_dtypes
        name = f"{_FIXED[dt.kind]}[{dt.itemsize // 4 if dt.kind == 'U' else dt.itemsize}]"
    else:
        name = dt.name
    if len(_NAMES) < _MEMO_MAX:
        _NAMES[dt] = name
    return name


def dtype_from_name(name: str) -> np.dtype:
    """The numpy dtype of a manifest dtype name; raises ManifestError for names it cannot map.

    Only plain element types are accepted: a name from another process or from disk must never turn bytes into
    Python objects (dtype object) or into another shape (sub-array and structured dtypes).
    """
    if type(name) is str:
        dt = _DTYPES.get(name)
        if dt is not None:
            return dt
    dt = _dtype_from_name(name)
    if type(name) is str and len(_DTYPES) < _MEMO_MAX:
        _DTYPES[name] = dt
    return dt


def _dtype_from_name(name: str) -> np.dtype:
    np = _numpy()
    dt = None
    fixed = _FIXED_NAME.match(name) if isinstance(name, str) else None
    if fixed:
        return np.dtype(f"{_FIXED_CODE[fixed.group(1)]}{int(fixed.group(2))}")
    if isinstance(name, str) and _NAME.match(name):  # never hand numpy's comma/shape mini-language to a peer
        try:
            dt = np.dtype(name)
        except (TypeError, ValueError):
            ml = _ml_dtypes()
            scalar = getattr(ml, name, None) if ml is not None and not name.startswith("_") else None
            if isinstance(scalar, type) and issubclass(scalar, np.generic):
                dt = np.dtype(scalar)
            elif ml is None and name in ML_WIDTHS:
                dt = np.dtype(f"u{ML_WIDTHS[name]}")
    if dt is None or dt.hasobject or dt.subdtype is not None or dt.names is not None:
        raise ManifestError(f"unknown dtype {name!r} in manifest")
    return dt


def check_plain(dtype: np.dtype, path: str) -> None:
    """UnsupportedLeafError naming ``path`` for a structured or sub-array dtype: manifests name element types
    only, so such an array could be committed but never restored."""
    if dtype.names is not None or dtype.subdtype is not None:
        raise UnsupportedLeafError(f"{path}: numpy structured or sub-array dtype {dtype} cannot be snapshotted "
                                   f"(save each field as its own array)")


def native_order(arr: np.ndarray) -> np.ndarray:
    """``arr`` itself when its bytes are in the machine's order, else a copy in that order: a manifest names the
    native dtype (:func:`dtype_name`), so the bytes saved under it must be native too."""
    return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))
