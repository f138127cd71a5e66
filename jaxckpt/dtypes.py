"""Dtype names on the wire: numpy's names, plus the ml_dtypes extensions (bfloat16, float8_*) JAX and torch use."""
from __future__ import annotations

import numpy as np

from jaxckpt.errors import ManifestError

try:  # ml_dtypes ships with jax; torch users without jax still get the standard numpy dtypes.
    import ml_dtypes as _ml
except ImportError:  # pragma: no cover - depends on the environment
    _ml = None


def dtype_name(dtype: np.dtype) -> str:
    """The name under which ``dtype`` is written into a manifest."""
    return np.dtype(dtype).name


def dtype_from_name(name: str) -> np.dtype:
    """The numpy dtype of a manifest dtype name; raises ManifestError for names it cannot map."""
    try:
        return np.dtype(name)
    except TypeError:
        pass
    if _ml is not None and hasattr(_ml, name):
        return np.dtype(getattr(_ml, name))
    raise ManifestError(f"unknown dtype {name!r} in manifest")
