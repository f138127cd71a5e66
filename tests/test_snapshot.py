"""The snapshot engine: blocked copy + checksum, the in-flight byte budget, errors through the future."""
import threading

import ml_dtypes
import numpy as np
import pytest

from jaxckpt.core.checksum import crc32c
from jaxckpt.core.copier import BLOCK_BYTES, CopyTask, Copier, copy_and_checksum
from jaxckpt.core.store import Slot


@pytest.mark.parametrize("src", [
    np.arange(3 * BLOCK_BYTES // 4 + 7, dtype=np.float32).reshape(-1, 1) * 1.5,  # several blocks, ragged end
    np.arange(1 << 18, dtype=np.float64).reshape(512, 512)[:, 3:300],  # strided source
    np.full((BLOCK_BYTES,), 1.25, dtype=ml_dtypes.bfloat16),
    np.array(7, dtype=np.int8),  # 0-d
    np.zeros((0, 4), np.float32),
])
def test_copy_and_checksum_matches_a_plain_copy(src):
    out = np.full(src.nbytes, 0xAB, dtype=np.uint8)
    crc = copy_and_checksum(out, src)
    expect = np.ascontiguousarray(src).tobytes()
    assert out.tobytes() == expect
    assert crc == crc32c(expect)


def test_inflight_budget_is_respected_and_every_chunk_lands():
    budget, chunk, n = 3 * 1000, 1000, 12
    buf = bytearray(n * chunk)
    started, in_flight, peak = [], [0], [0]
    lock = threading.Lock()
    srcs = [np.full(chunk, i, np.uint8) for i in range(n)]

    def start(i):
        def go():
            with lock:
                started.append(i)
                in_flight[0] += 1
                peak[0] = max(peak[0], in_flight[0])
        return go

    def fetch(i):
        def get():
            with lock:
                in_flight[0] -= 1
            return srcs[i]
        return get

    eng = Copier(workers=2, inflight_bytes=budget)
    try:
        tasks = [CopyTask(fetch=fetch(i), offset=i * chunk, nbytes=chunk, start=start(i)) for i in range(n)]
        res = eng.submit(Slot(0, len(buf), memoryview(buf)), tasks).result(timeout=30)
    finally:
        eng.close()
    assert started == list(range(n))  # transfers start in plan order
    assert peak[0] <= budget // chunk
    assert bytes(buf) == b"".join(s.tobytes() for s in srcs)
    assert res.crcs == [crc32c(s) for s in srcs]


def test_a_failing_fetch_fails_the_snapshot_future():
    eng = Copier(workers=2)
    buf = bytearray(16)

    def boom():
        raise ValueError("source gone")

    try:
        fut = eng.submit(Slot(0, 16, memoryview(buf)), [CopyTask(fetch=boom, offset=0, nbytes=16)])
        with pytest.raises(ValueError, match="source gone"):
            fut.result(timeout=30)
    finally:
        eng.close()
