"""Reading saved chunks back: from this process's store or from another process, verified once each."""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from jaxckpt.checksum import crc32c
from jaxckpt.errors import ChecksumError, PeerError, StepNotFoundError
from jaxckpt.manifest import ChunkMeta
from jaxckpt.plan import Assembly

# (offset, nbytes) -> the bytes of a process's snapshot buffer in that range
ByteSource = Callable[[int, int], memoryview]


def buffer_source(buf: memoryview) -> ByteSource:
    """A ByteSource over a local buffer: zero-copy slices, bounds-checked."""
    def read(offset: int, nbytes: int) -> memoryview:
        if offset + nbytes > len(buf):
            raise ChecksumError(f"range {offset}+{nbytes} runs past the end of a {len(buf)}-byte snapshot")
        return buf[offset:offset + nbytes]
    return read


class ChunkReader:
    """Host views of saved chunks, fetched from the process that holds them and verified once each."""

    def __init__(self, sources: Mapping[int, ByteSource], step: int, verify: bool = True) -> None:
        self._sources, self._step, self._verify = sources, step, verify
        self._cache: dict[tuple[int, int], memoryview] = {}
        self.bytes_by_process: dict[int, int] = {}

    def raw(self, path: str, chunk: ChunkMeta) -> memoryview:
        key = (chunk.process, chunk.offset)
        got = self._cache.get(key)
        if got is not None:
            return got
        source = self._sources.get(chunk.process)
        if source is None:
            raise StepNotFoundError(f"{path}: step {self._step} chunk {chunk.box.start}..{chunk.box.stop} is held "
                                    f"by process {chunk.process}, which this process cannot reach")
        try:
            raw = source(chunk.offset, chunk.nbytes)
        except (ChecksumError, PeerError, StepNotFoundError) as e:  # name the array the bytes were for
            raise type(e)(f"{path}: step {self._step} chunk of process {chunk.process}: {e}") from None
        if len(raw) != chunk.nbytes:
            raise ChecksumError(f"{path}: step {self._step} chunk of process {chunk.process} came back with "
                                f"{len(raw)} bytes, expected {chunk.nbytes}")
        if self._verify and crc32c(raw) != chunk.crc32c:
            raise ChecksumError(f"{path}: step {self._step} chunk {chunk.box.start}..{chunk.box.stop} of "
                                f"process {chunk.process} failed its crc32c check (corrupt)")
        self._cache[key] = raw
        self.bytes_by_process[chunk.process] = self.bytes_by_process.get(chunk.process, 0) + chunk.nbytes
        return raw

    def array(self, path: str, chunk: ChunkMeta, dtype: np.dtype) -> np.ndarray:
        raw = self.raw(path, chunk)
        return np.frombuffer(raw, dtype=dtype, count=chunk.box.size).reshape(chunk.box.shape)


def assemble(a: Assembly, dtype: np.dtype, reader: ChunkReader) -> np.ndarray:
    """The host array of one needed box; a view of the saved bytes when one chunk is exactly that box."""
    if a.whole_chunk:
        return reader.array(a.path, a.reads[0].chunk, dtype)
    out = np.empty(a.box.shape, dtype=dtype)
    for r in a.reads:
        src = reader.array(a.path, r.chunk, dtype)
        out[a.box.relative(r.part)] = src[r.chunk.box.relative(r.part)]
    return out
