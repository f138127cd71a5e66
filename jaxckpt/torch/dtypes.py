"""torch dtypes <-> the manifest's dtype names (numpy's, plus ml_dtypes'), and zero-copy numpy views of tensors."""
from __future__ import annotations

import numpy as np
import torch

from jaxckpt.core.dtypes import dtype_from_name
from jaxckpt.errors import ManifestError, UnsupportedLeafError

# Names are those jaxckpt.core.dtypes writes for the same numpy / ml_dtypes dtype, so a JAX snapshot and a torch
# snapshot of the same values carry the same manifest.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bool: "bool",
    torch.uint8: "uint8", torch.uint16: "uint16", torch.uint32: "uint32", torch.uint64: "uint64",
    torch.int8: "int8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64",
    torch.float16: "float16", torch.float32: "float32", torch.float64: "float64",
    torch.complex64: "complex64", torch.complex128: "complex128",
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2",
    torch.float8_e4m3fnuz: "float8_e4m3fnuz", torch.float8_e5m2fnuz: "float8_e5m2fnuz",
    torch.float8_e8m0fnu: "float8_e8m0fnu",
}
_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}
# numpy has no bfloat16/float8: such tensors are viewed as same-width integers, then as the ml_dtypes type.
_NATIVE = {torch.bool, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16, torch.int32,
           torch.int64, torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_name(dtype: torch.dtype, path: str = "") -> str:
    """The manifest name of a torch dtype; UnsupportedLeafError (naming ``path``) when it has none."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise UnsupportedLeafError(f"{path}: torch dtype {dtype} cannot be snapshotted (no numpy/ml_dtypes "
                                   f"equivalent)") from None


def torch_dtype(name: str, path: str = "") -> torch.dtype:
    """The torch dtype of a manifest dtype name; ManifestError when torch has none."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ManifestError(f"{path}: saved dtype {name!r} has no torch equivalent") from None


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of a CPU tensor with the manifest dtype (strides kept, no conj/neg bits)."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()  # numpy cannot express lazily conjugated/negated tensors
    if t.dtype in _NATIVE:
        return t.numpy()
    np_dtype = dtype_from_name(dtype_name(t.dtype))
    return t.view(_BITS[t.element_size()]).numpy().view(np_dtype)


def from_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor sharing ``a``'s memory, read as ``dtype`` (which must have ``a``'s item size)."""
    if dtype in _NATIVE:
        return torch.from_numpy(a)
    return torch.from_numpy(a.view(np.dtype(f"i{a.dtype.itemsize}") if a.dtype.itemsize > 1 else np.uint8)).view(dtype)
