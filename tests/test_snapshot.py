"""The snapshot engine: blocked copy + checksum, the in-flight byte budget, errors through the future."""
import threading

import ml_dtypes
import numpy as np
import pytest

from jaxckpt.core.checksum import crc32c
from jaxckpt.core.copier import BLOCK_BYTES, SMALL_BYTES, CopyTask, Copier, copy_and_checksum
from jaxckpt.core.store import Slot


@pytest.mark.parametrize("src", [
    np.arange(3 * BLOCK_BYTES // 4 + 7, dtype=np.float32).reshape(-1, 1) * 1.5,  # several blocks, ragged end
    np.arange(1 << 18, dtype=np.float64).reshape(512, 512)[:, 3:300],  # strided source
    np.full((BLOCK_BYTES,), 1.25, dtype=ml_dtypes.bfloat16),
    np.array(7, dtype=np.int8),  # 0-d
    np.zeros((0, 4), np.float32),
    np.arange(24, dtype=np.float32).reshape(4, 6) - 0.5,  # small and contiguous: the buffer protocol's copy
    np.arange(SMALL_BYTES // 4, dtype=np.float32) * 0.25,  # the largest chunk copied under the GIL
    np.arange(SMALL_BYTES // 4 + 1, dtype=np.float32) * 0.25,  # the smallest one both calls release it for
    np.array([True, False, True]),
    np.arange(5, dtype=">i4"),  # bytes as they are, whatever the byte order
    np.full((3, 5), -2.0, dtype=ml_dtypes.bfloat16),  # small, of a dtype numpy exports no buffer of
    np.arange(64, dtype=np.int16).reshape(8, 8)[:, ::2],  # small and strided
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


def test_a_chunk_table_lands_every_chunk_and_drops_each_source_after_its_last_chunk():
    """The copier's table form (``Chunks``, what a save hands it): several chunks read one source; each source
    is dropped once, after the last chunk that reads it is copied, and the slot holds every chunk bit for bit."""
    sources = [np.arange(4096, dtype=np.uint32) * (k + 1) for k in range(5)]
    chunks_of = [(k, lo) for k in range(5) for lo in range(0, 4096, 1024)]  # 4 chunks of 4 KiB per source
    log: list[tuple[str, int]] = []

    class Table:
        offsets = [i * 4096 for i in range(len(chunks_of))]
        sizes = [4096] * len(chunks_of)
        left = [4] * 5
        held = list(sources)

        def start(self, i):
            log.append(("start", i))

        def fetch(self, i):
            k, lo = chunks_of[i]
            assert self.held[k] is not None, f"source {k} dropped before its chunk {i} was copied"
            return self.held[k][lo:lo + 1024]

        def done(self, lo, hi):
            for i in range(lo, hi):
                k = chunks_of[i][0]
                self.left[k] -= 1
                if not self.left[k]:
                    log.append(("drop", k))
                    self.held[k] = None

    table = Table()
    buf = bytearray(len(chunks_of) * 4096)
    eng = Copier(workers=2, inflight_bytes=3 * 4096)  # a few chunks per batch: several batches in flight
    try:
        res = eng.submit(Slot(0, len(buf), memoryview(buf)), lambda: table).result(timeout=30)
    finally:
        eng.close()
    want = b"".join(s[lo:lo + 1024].tobytes() for s, lo in ((sources[k], lo) for k, lo in chunks_of))
    assert bytes(buf) == want
    assert res.crcs == [crc32c(sources[k][lo:lo + 1024]) for k, lo in chunks_of]
    assert [i for what, i in log if what == "start"] == list(range(len(chunks_of)))
    assert sorted(k for what, k in log if what == "drop") == list(range(5))
    assert table.held == [None] * 5


def test_snapshots_queued_back_to_back_all_land_and_close_stops_every_thread():
    """Several saves queued at once, each of many small chunks in several batches under a small budget, one of
    them failing: each lands bit for bit with its own crc32cs (the failed one fails alone), and close() finishes
    what was queued and ends the copier's threads."""
    before = set(threading.enumerate())
    rng = np.random.default_rng(1)
    eng = Copier(workers=3, inflight_bytes=64 << 10)
    saves = []
    for k in range(4):
        srcs = [rng.integers(0, 256, int(rng.integers(1, 9000)), dtype=np.uint8) for _ in range(300)]
        offsets = np.concatenate([[0], np.cumsum([s.nbytes for s in srcs])]).tolist()
        buf = bytearray(offsets[-1])
        tasks = [CopyTask(fetch=lambda s=s: s, offset=o, nbytes=s.nbytes) for s, o in zip(srcs, offsets)]
        if k == 2:
            tasks[150] = CopyTask(fetch=lambda: (_ for _ in ()).throw(OSError("shard 150 gone")), offset=offsets[150],
                                  nbytes=srcs[150].nbytes)
        saves.append((srcs, buf, eng.submit(Slot(k, len(buf), memoryview(buf)), tasks)))
    eng.close()
    for k, (srcs, buf, fut) in enumerate(saves):
        assert fut.done()
        if k == 2:
            with pytest.raises(OSError, match="shard 150 gone"):
                fut.result()
            continue
        assert bytes(buf) == b"".join(s.tobytes() for s in srcs)
        assert fut.result().crcs == [crc32c(s) for s in srcs]
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive()]
