"""Host buffers a CPU device can adopt as they are, and a shard read's bytes on the host.

XLA:CPU takes a host array given to ``device_put`` without copying it only when the data is aligned to 64 bytes;
numpy's large allocations come from malloc's mmap path at 16 bytes past a page boundary, so a restored shard
held in such memory is copied a second time by ``device_put``. Restore allocates through here instead.
"""
from __future__ import annotations

import math
import mmap
from typing import Callable, Sequence

import numpy as np

ALIGN = 64
# Buffers from this size on are mappings of their own advised for transparent huge pages: a restore's host memory
# is fresh from the kernel in a relaunched process, and faulting it in 4 KiB pages (one trap each, 13.5k for a
# 128 MiB restore) made the first restore cost 2.5x the CPU of a later one, which reuses what glibc kept
# (BENCHMARKS.md, first restore). A 2 MiB page is one fault; where THP is off the advice changes nothing.
HUGE = 2 << 20
_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def empty(shape: int | Sequence[int], dtype: np.dtype | type | str) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an ``ALIGN``-byte boundary (a page, and huge
    pages advised, from ``HUGE`` bytes on)."""
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    nbytes = int(math.prod(shape)) * dtype.itemsize  # math.prod: np.prod took 4 of the 7 us of a small buffer
    if nbytes >= HUGE and _HUGEPAGE is not None:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            m.madvise(_HUGEPAGE)
        except OSError:  # a kernel without THP: plain pages
            pass
        # the array holds the mapping (its base): unmapped when the last view of it goes
        return np.frombuffer(m, dtype=np.uint8, count=nbytes).view(dtype).reshape(shape)
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
