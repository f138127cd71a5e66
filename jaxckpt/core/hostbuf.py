"""Host buffers a CPU device can adopt as they are, and a shard read's bytes on the host.

XLA:CPU takes a host array given to ``device_put`` without copying it only when the data is aligned to 64 bytes;
numpy's large allocations come from malloc's mmap path at 16 bytes past a page boundary, so a restored shard
held in such memory is copied a second time by ``device_put``. Restore allocates through here instead.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

ALIGN = 64


def empty(shape: int | Sequence[int], dtype: np.dtype | type | str) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an ``ALIGN``-byte boundary.

    Plain pages, as malloc gives them: advising a restore's buffers for transparent huge pages (one fault per
    2 MiB) made a relaunched process's first restore slower, not faster, on the virtual machine the benchmarks run
    on (its guest hands free memory back to the host, which backs a fresh 2 MiB page again in one fault of
    several ms), and memory malloc kept from an earlier restore is reused either way (BENCHMARKS.md, "Huge pages
    for a restore's buffers, measured again")."""
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    nbytes = int(math.prod(shape)) * dtype.itemsize  # math.prod: np.prod took 4 of the 7 us of a small buffer
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def copy(a: np.ndarray) -> np.ndarray:
    """A private, aligned, C-contiguous copy of ``a``."""
    out = empty(a.shape, a.dtype)
    np.copyto(out, a, casting="no")
    return out


def host_bytes(fetch: np.ndarray | Callable[[], np.ndarray]) -> np.ndarray:
    """A shard read's bytes on the host (``core.engine.ShardReads``): the array itself, or what ``fetch()`` returns."""
    return fetch if isinstance(fetch, np.ndarray) else fetch()
