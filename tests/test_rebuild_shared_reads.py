"""A rebuild reads the surviving chunks it XORs through the restore that reads it (ChunkReader.lookup): what
users rely on is a node-loss restore that is bit for bit, fetches each surviving chunk over the transport once
(not once for the arrays and once more for every rebuild), and never hangs when rebuilds need each other."""
import threading

import numpy as np
import pytest

from jaxckpt.core.box import Box
from jaxckpt.core.checksum import crc32c
from jaxckpt.core.fetch import ChunkReader, Source
from jaxckpt.core.manifest import ArrayMeta, ChunkMeta
from jaxckpt.core.restore import ArrayRequest, restore_leaves
from jaxckpt.errors import ChecksumError, DataLossError, StepNotFoundError

STEP = 7


def snapshot(n: int = 3, rows: int = 64):
    """``n`` processes each saved one row block of a float32 array (one chunk at offset 0), and their parity."""
    rng = np.random.default_rng(n)
    full = rng.standard_normal((n * rows, 32)).astype(np.float32)
    bufs, chunks = [], []
    for p in range(n):
        b = np.frombuffer(np.ascontiguousarray(full[p * rows:(p + 1) * rows]).tobytes(), np.uint8)
        bufs.append(b)
        chunks.append(ChunkMeta(Box((p * rows, 0), ((p + 1) * rows, 32)), 0, b.nbytes, crc32c(b), p))
    parity = np.bitwise_xor.reduce(np.stack(bufs), axis=0)
    return full, bufs, parity, ArrayMeta("w", (), full.shape, "float32", "numpy", chunks=tuple(chunks))


class Counted:
    """A holder's reads over a buffer, counted (``corrupt`` flips a byte of what it returns)."""

    def __init__(self, buf: np.ndarray, corrupt: bool = False) -> None:
        self.buf, self.corrupt, self.reads, self._lock = buf, corrupt, 0, threading.Lock()

    def __call__(self, offset: int, nbytes: int) -> memoryview:
        with self._lock:
            self.reads += 1
        out = self.buf[offset:offset + nbytes].copy()
        if self.corrupt:
            out[0] ^= 0xFF
        return memoryview(out)


class ParityRebuild:
    """A rebuild source of one chunk: the parity XOR every other process's chunk, read through the bound lookup
    when the restore has one (else straight from ``direct``, as a rebuild without a restore does)."""

    def __init__(self, lost: int, parity: Counted, meta: ArrayMeta, direct: dict[int, Counted]) -> None:
        self.lost, self.parity, self.meta, self.direct = lost, parity, meta, direct
        self.reads = None
        self.looked_up = 0

    def bind(self, reads) -> None:
        self.reads = reads

    def __call__(self, offset: int, nbytes: int) -> memoryview:
        out = np.frombuffer(self.parity(0, nbytes), np.uint8).copy()
        if self.reads is not None:
            self.reads.account(STEP, "remote", nbytes)
        for c in self.meta.chunks:
            if c.process == self.lost:
                continue
            got = self.reads.lookup(STEP, self.meta.path, c) if self.reads is not None else None
            if got is None:
                got = self.direct[c.process](c.offset, c.nbytes)
                if self.reads is not None:
                    self.reads.account(STEP, "remote", c.nbytes)
                if crc32c(got) != c.crc32c:
                    raise ChecksumError(f"chunk of process {c.process} is corrupt")
            else:
                self.looked_up += 1
            out ^= np.frombuffer(got, np.uint8)
        want = next(c for c in self.meta.chunks if c.process == self.lost).crc32c
        if crc32c(out) != want:
            raise DataLossError(f"step {STEP}: the chunk of process {self.lost} cannot be rebuilt", step=STEP,
                                lost_nodes=(self.lost,), missing={self.meta.path: ()})
        return memoryview(out)


def rebuild_source(r: ParityRebuild) -> Source:
    return Source("rebuild", f"rebuild of process {r.lost}", "rebuild", r, bind=r.bind)


@pytest.mark.parametrize("workers", [1, 4])
def test_a_lost_chunk_is_rebuilt_from_the_chunks_the_restore_fetches_anyway_each_fetched_once(workers):
    full, bufs, parity, meta = snapshot(4)
    remote = {p: Counted(bufs[p]) for p in range(4)}
    rb = ParityRebuild(3, Counted(parity), meta, remote)
    sources = {0: [Source("local", "own", "n0", remote[0])],
               1: [Source("remote", "agent n1", "n1", remote[1])],
               2: [Source("remote", "agent n2", "n2", remote[2])],
               3: [rebuild_source(rb)]}
    reader = ChunkReader(sources, STEP, workers=workers, process=0)
    got = restore_leaves([ArrayRequest.whole(meta, lambda h: h.copy())], reader, step=STEP, process=0)[0]
    np.testing.assert_array_equal(got.view(np.uint8), full.view(np.uint8))
    assert [remote[p].reads for p in range(3)] == [1, 1, 1]  # once each, for the array and the rebuild together
    assert rb.looked_up == 3 and rb.parity.reads == 1
    report = reader.finish()
    n = bufs[0].nbytes
    assert report.bytes_by_kind == {"local": n, "remote": 2 * n, "rebuild": n}, report.bytes_by_kind
    assert report.rebuild_reads == {"remote": n} and report.transport_bytes == 3 * n  # + the parity block


def test_a_chunk_the_restore_does_not_read_is_read_by_the_rebuild_itself_and_not_kept():
    full, bufs, parity, meta = snapshot(3)
    remote = {p: Counted(bufs[p]) for p in range(3)}
    rb = ParityRebuild(2, Counted(parity), meta, remote)
    sources = {0: [Source("local", "own", "n0", remote[0])], 1: [Source("remote", "agent n1", "n1", remote[1])],
               2: [rebuild_source(rb)]}
    reader = ChunkReader(sources, STEP, workers=2, process=0)
    rows = meta.chunks[2].box  # this process needs the lost rows only
    got = restore_leaves([ArrayRequest.whole(meta, lambda h: h.copy(), box=rows)], reader, step=STEP, process=0)[0]
    np.testing.assert_array_equal(got.view(np.uint8), full[rows.slices()].view(np.uint8))
    assert rb.looked_up == 0 and [remote[0].reads, remote[1].reads] == [1, 1]
    report, n = reader.finish(), bufs[0].nbytes
    assert report.bytes_by_kind == {"rebuild": n} and report.rebuild_reads == {"remote": 3 * n}
    assert report.transport_bytes == 3 * n  # the parity and both chunks, read by the rebuild and let go


def test_rebuilds_that_need_each_other_end_in_a_clear_error_not_a_hang():
    """Process 2 is lost and process 1's only copy is corrupt: each one's rebuild needs the other's bytes. Both
    are two losses in one stripe: the restore raises (naming the chunk) within its bounds instead of waiting."""
    full, bufs, parity, meta = snapshot(3)
    direct = {0: Counted(bufs[0]), 1: Counted(bufs[1], corrupt=True), 2: Counted(np.zeros_like(bufs[2]))}
    rb1 = ParityRebuild(1, Counted(parity), meta, direct)
    rb2 = ParityRebuild(2, Counted(parity), meta, direct)
    sources = {0: [Source("local", "own", "n0", direct[0])],
               1: [Source("remote", "agent n1", "n1", direct[1]), rebuild_source(rb1)],
               2: [rebuild_source(rb2)]}
    for workers in (1, 3):
        reader = ChunkReader(sources, STEP, workers=workers, process=0)
        errors: list[BaseException] = []

        def run():
            try:
                restore_leaves([ArrayRequest.whole(meta, lambda h: h.copy())], reader, step=STEP, process=0)
            except BaseException as e:  # noqa: BLE001 - checked below
                errors.append(e)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), f"the restore with {workers} worker(s) hung"
        assert len(errors) == 1 and isinstance(errors[0], (ChecksumError, DataLossError, StepNotFoundError)), errors
        assert "process 1" in str(errors[0]) or "process 2" in str(errors[0]), errors[0]
