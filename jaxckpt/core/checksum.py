"""crc32c of byte buffers; the hardware-accelerated library releases the GIL on large buffers."""
from __future__ import annotations

import crc32c as _crc32c


def crc32c(data, value: int = 0) -> int:
    """crc32c of any buffer (bytes, memoryview, contiguous numpy array), continuing from ``value``."""
    return _crc32c.crc32c(data, value)
