"""The machine's host memcpy bandwidth: the limit a snapshot into host memory can approach."""
from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np

log = logging.getLogger("jaxckpt.tools.bench")


def memcpy_seconds(nbytes: int, repeats: int, before: Callable[[int], None] | None = None) -> list[float]:
    """Seconds per copy of ``nbytes`` between two preallocated, pre-faulted numpy buffers (one thread);
    ``before(k)`` runs ahead of the ``k``-th timed copy, untimed (a barrier, so that processes copy at once)."""
    if nbytes < 1 or repeats < 1:
        raise ValueError(f"memcpy_seconds: nbytes={nbytes} and repeats={repeats} must be positive")
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    # Touch every page of the destination and copy once untimed, so page faults never count as bandwidth.
    dst.fill(0)
    np.copyto(dst, src)
    out = []
    for k in range(repeats):
        if before is not None:
            before(k)
        t0 = time.perf_counter()
        np.copyto(dst, src)
        out.append(time.perf_counter() - t0)
    return out


def memcpy_gbps(nbytes: int = 256 << 20, repeats: int = 10) -> list[float]:
    """Bandwidth samples in GB/s (1e9 bytes copied per second) of ``memcpy_seconds``."""
    samples = [nbytes / s / 1e9 for s in memcpy_seconds(nbytes, repeats)]
    log.info("memcpy: %d bytes x %d, median %.2f GB/s", nbytes, repeats, float(np.median(samples)))
    return samples
