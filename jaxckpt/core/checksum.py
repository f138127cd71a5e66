"""crc32c of byte buffers; the hardware-accelerated library releases the GIL on large buffers.

A range read of part of a chunk is verified against the whole chunk's crc32c without moving the rest of it: the
holder sends the crc32c of the bytes before and after the range, and :func:`span_crc` puts the chunk's crc32c
together from them and the range actually received. crc32c is affine over GF(2) in (state, data), so
``crc(B, v) == crc(0^n, v) ^ crc(B, 0) ^ crc(0^n, 0)`` for ``n = len(B)``: extending a crc by ``n`` zero bytes
is all :func:`combine` needs, and the hardware crc does that at memory speed from one small zero buffer.
"""
from __future__ import annotations

import crc32c as _crc32c

_ZEROS = bytes(1 << 20)


def crc32c(data, value: int = 0) -> int:
    """crc32c of any buffer (bytes, memoryview, contiguous numpy array), continuing from ``value``."""
    return _crc32c.crc32c(data, value)


def _over_zeros(nbytes: int, value: int) -> int:
    while nbytes > 0:
        n = min(nbytes, len(_ZEROS))
        value = _crc32c.crc32c(memoryview(_ZEROS)[:n], value)
        nbytes -= n
    return value


def combine(first: int, second: int, second_nbytes: int) -> int:
    """crc32c of ``A + B`` from ``first = crc32c(A)``, ``second = crc32c(B)`` and ``len(B)``."""
    return _over_zeros(second_nbytes, first) ^ second ^ _over_zeros(second_nbytes, 0)


def span_crc(before: int, data, after: int, after_nbytes: int) -> int:
    """crc32c of a whole chunk from the crc32c of its bytes before a span, the span's bytes ``data`` (checked
    here) and the crc32c of the ``after_nbytes`` bytes after it."""
    return combine(_crc32c.crc32c(data, before), after, after_nbytes)
