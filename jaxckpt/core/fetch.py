"""Reading saved chunks back from the cheapest source that holds them, verified once each, in parallel.

Each saving process's bytes may be held by several sources (``jaxckpt.core.sources``: own memory, the node's agent,
another node's agent, ...), cheapest first. A chunk is read from the first; a source that fails (unreachable,
step gone, wrong length) or returns bytes that fail the chunk's crc32c is logged as a fallback and the next
source is tried. When every source fails, the error names the array path, step, chunk box and saving process,
and what each source said. Every chunk is fetched at most once per reader (whole chunks: the checksum covers the
whole chunk); :meth:`ChunkReader.prefetch` fetches a list of chunks on a bounded thread pool.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Mapping, Sequence

import numpy as np

from jaxckpt.core import hostbuf
from jaxckpt.core.checksum import crc32c
from jaxckpt.errors import ChecksumError, DataLossError, PeerError, StepNotFoundError, StoreUnavailableError
from jaxckpt.core.manifest import ChunkMeta
from jaxckpt.core.copier import copy_and_checksum
from jaxckpt.core.plan import Assembly
from jaxckpt.core.sources import RANK, ByteReader, RestoreReport, Source, plan_fetch

log = logging.getLogger("jaxckpt.core.fetch")

__all__ = ["ByteReader", "ChunkReader", "Source", "assemble", "buffer_reader"]

# A chunk under this size read from this node's memory is read on the calling thread during a prefetch.
INLINE_BYTES = 256 << 10
# Chunks under this size whose first source reads ranges in bulk (Source.read_spans: another node's agent) are
# asked for together, at most BULK_BATCH_BYTES a flight: a many-array restore over the network asked for thousands
# of chunks of a few KiB a request each (12 MiB of 1,024 arrays at 0.02 GB/s).
BULK_BYTES = 1 << 20
BULK_BATCH_BYTES = 8 << 20
# Fetch threads of one prefetch at most (``workers`` per source read over the transport).
MAX_FETCH_THREADS = 32

# What a failing source raises; anything else is a bug and propagates at once.
SOURCE_ERRORS = (ChecksumError, PeerError, StepNotFoundError, StoreUnavailableError, OSError)


def buffer_reader(buf: memoryview) -> ByteReader:
    """A ByteReader over a local buffer: zero-copy slices, bounds-checked."""
    def read(offset: int, nbytes: int) -> memoryview:
        if offset + nbytes > len(buf):
            raise ChecksumError(f"range {offset}+{nbytes} runs past the end of a {len(buf)}-byte snapshot")
        return buf[offset:offset + nbytes]
    return read


class ChunkReader:
    """Host views of saved chunks, fetched from the first healthy source of the process that saved them.

    ``sources`` maps each saving process to its sources, cheapest first (a bare ByteReader is one source of
    kind ``"process"``). ``workers`` bounds the threads of :meth:`prefetch`.
    """

    def __init__(self, sources: Mapping[int, ByteReader | Sequence[Source]], step: int, verify: bool = True, *,
                 workers: int = 1, process: int = 0) -> None:
        self._sources: dict[int, list[Source]] = {
            p: list(s) if isinstance(s, (list, tuple)) else [Source("process", f"process {p}", "", s)]
            for p, s in sources.items()}
        self._step, self._verify, self._workers = step, verify, max(1, workers)
        # Keyed by the chunk's whole identity (see _key), never by its place alone: bytes cached for one chunk
        # must not be handed out for another that happens to sit at the same offset of the same process.
        self._cache: dict[tuple, memoryview] = {}
        self._bad: set[tuple] = set()  # (chunk key, source name) that failed
        # chunks being fetched; a second reader of one makes the event it waits on (most chunks have one reader:
        # no event for them)
        self._inflight: dict[tuple, threading.Event | None] = {}
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self.report = RestoreReport(step, process)
        # When the restored arrays need memory of their own anyway (JAX on CPU aliases the host arrays it is
        # given), each chunk is copied out of its source and checksummed in the same pass; ``take`` then hands
        # that private copy to one assembly instead of copying it again. A source that can lend its memory
        # (``Source.lend``: the in-process store, whose snapshot buffers are immutable once committed) is only
        # verified, and its bytes are handed over as they are.
        self.private_copies = False
        self._owned: set[tuple] = set()
        # Chunks the current prefetch reads (what ``lookup`` serves), and those being fetched through a source
        # that rebuilds them from other chunks (a ``lookup`` never waits for one: see there).
        self._planned: set[tuple] = set()
        self._rebuilding: set[tuple] = set()
        # A chunk no source gave: its error, raised again to every later reader of it (the assembly reads what
        # the prefetch behind it could not fetch; it must see why, not only that every source failed before).
        self._errors: dict[tuple, Exception] = {}
        # A chunk a bulk read did not give good bytes of: each source's error, which the chunk's own fetch counts
        # as that source's failure (never asking it again, naming it if every source fails).
        self._prior: dict[tuple, list[tuple[Source, Exception]]] = {}
        for ss in self._sources.values():
            for src in ss:
                if src.bind is not None:
                    src.bind(self)

    def _key(self, chunk: ChunkMeta) -> tuple[int, int, int, int, int]:
        """(step, saving process, offset, nbytes, crc32c): which snapshot's bytes, and which bytes of it."""
        return self._step, chunk.process, chunk.offset, chunk.nbytes, chunk.crc32c

    @property
    def bytes_by_process(self) -> dict[int, int]:
        """Bytes fetched so far per saving process."""
        return self.report.bytes_by_process

    def raw(self, path: str, chunk: ChunkMeta) -> memoryview:
        """The verified bytes of ``chunk`` (of array ``path``), from the first source that gives them."""
        key = self._key(chunk)
        while True:
            with self._lock:
                got = self._cache.get(key)
                if got is not None:
                    return got
                failed = self._errors.get(key)
                if failed is not None:  # every source failed for another reader of it: the same error
                    raise failed
                busy = self._waiter(key)
                if busy is None:
                    break
            busy.wait()  # another thread fetches it
        failed: Exception | None = None
        try:
            return self._fetch(path, chunk, key)
        except SOURCE_ERRORS + (DataLossError,) as e:
            failed = e
            raise
        finally:
            self._release([key], failed)

    def _waiter(self, key: tuple) -> threading.Event | None:
        """Under the lock: None when this thread is now the one fetching ``key``, else the event it waits on."""
        if key not in self._inflight:
            self._inflight[key] = None
            return None
        busy = self._inflight[key]
        if busy is None:
            busy = self._inflight[key] = threading.Event()
        return busy

    def lookup(self, step: int, path: str, chunk: ChunkMeta) -> memoryview | None:
        """For a source that rebuilds chunks from other chunks (protection): the verified bytes of ``chunk`` as
        this restore has them, fetched here once (never through a rebuild) and kept for the restore's own reads;
        None when the caller must read it on its own: this restore does not read it (no memory is held for
        it past the rebuild), or it is being rebuilt itself (waiting for that could wait for the caller).

        Only a caller inside a rebuild waits here, and only for a fetch not (yet) rebuilding when it began to
        wait; a fetch that waits has switched to rebuilding before it does. So a wait never closes a cycle."""
        key = self._key(chunk)
        if step != self._step or all(s.kind == "rebuild" for s in self._sources.get(chunk.process, ())):
            return None
        while True:
            with self._lock:
                got = self._cache.get(key)
                if got is not None:
                    return got
                if key not in self._planned or key in self._rebuilding or key in self._errors:
                    return None
                busy = self._waiter(key)
                if busy is None:
                    break
            busy.wait()
        try:
            return self._fetch(path, chunk, key, rebuilds=False)
        finally:
            self._release([key])

    def account(self, step: int, kind: str, nbytes: int) -> None:
        """A rebuild read ``nbytes`` on its own from a holder of ``kind``: counted in ``report.rebuild_reads``."""
        if step == self._step:
            with self._lock:
                self.report.rebuild_reads[kind] = self.report.rebuild_reads.get(kind, 0) + nbytes

    def rebuilt(self, step: int, where: str, nbytes: int, fallback: str = "") -> None:
        """``nbytes`` of lost chunks were rebuilt from parity ``where``: counted in ``report.rebuilt_at``; a
        ``fallback`` (why the parity's holder did not rebuild them) goes to ``report.fallbacks``."""
        if step == self._step:
            with self._lock:
                self.report.rebuilt_at[where] = self.report.rebuilt_at.get(where, 0) + nbytes
                if fallback:
                    self.report.fallbacks.append(fallback)

    def _fetch(self, path: str, chunk: ChunkMeta, key: tuple, rebuilds: bool = True) -> memoryview:
        sources = self._sources.get(chunk.process)
        if not sources:
            raise StepNotFoundError(f"{_where(path, self._step, chunk)} is held by process {chunk.process}, which "
                                    f"this process cannot reach")
        with self._lock:
            failures: list[tuple[Source, Exception]] = self._prior.pop(key, [])
        timeline = self.report.timeline
        for src in sources:
            if (key, src.name) in self._bad:
                continue
            if src.kind == "rebuild":
                if not rebuilds:
                    continue
                with self._lock:
                    self._rebuilding.add(key)
            t0 = time.perf_counter()
            try:
                raw = self._read(src, chunk, path)
            except SOURCE_ERRORS as e:
                failures.append((src, e))
                with self._lock:
                    self._bad.add((key, src.name))
                timeline.read(src.kind, t0, time.perf_counter(), 0, 0)  # its time counts, not its bytes
                continue
            timeline.read(src.kind, t0, time.perf_counter(), chunk.nbytes)
            self._account(key, raw, src, chunk, path, failures)
            return raw
        raise self._failed(_where(path, self._step, chunk), failures)

    def _read(self, src: Source, chunk: ChunkMeta, path: str) -> memoryview:
        try:
            raw = src.read(chunk.offset, chunk.nbytes)
        except DataLossError:
            raise  # already names the step and the missing boxes, and carries them
        except SOURCE_ERRORS as e:
            raise _named(e, _where(path, self._step, chunk), src) from None
        raw, owned = self._checked(src, chunk, raw, path)
        if owned:
            with self._lock:
                self._owned.add(self._key(chunk))
        return raw

    def _checked(self, src: Source, chunk: ChunkMeta, raw: memoryview, path: str) -> tuple[memoryview, bool]:
        """``raw``, read from ``src`` for ``chunk`` (of array ``path``), verified (and copied where the restore
        needs its own), and whether it is the restore's own memory (the caller notes it in ``_owned``)."""
        if len(raw) != chunk.nbytes:
            raise ChecksumError(f"{_where(path, self._step, chunk)} came back from {src.name} with {len(raw)} "
                                f"bytes, expected {chunk.nbytes}")
        if self.private_copies and src.lend is not None:
            if self._verify and crc32c(raw) != chunk.crc32c:
                raise ChecksumError(f"{_where(path, self._step, chunk)} failed its crc32c check (corrupt) at "
                                    f"{src.name}")
            if src.lend():  # memory that is never rewritten while the restored arrays live: no copy needed
                return raw, True
        if self.private_copies:
            out = hostbuf.empty(chunk.nbytes, np.uint8)
            crc = copy_and_checksum(out, np.frombuffer(raw, dtype=np.uint8))
            if self._verify and crc != chunk.crc32c:
                raise ChecksumError(f"{_where(path, self._step, chunk)} failed its crc32c check (corrupt) at "
                                    f"{src.name}")
            return memoryview(out), True
        if self._verify and crc32c(raw) != chunk.crc32c:
            raise ChecksumError(f"{_where(path, self._step, chunk)} failed its crc32c check (corrupt) at {src.name}")
        return raw, False

    def _account(self, key: tuple, raw: memoryview, src: Source, chunk: ChunkMeta, path: str,
                 failures: list[tuple[Source, Exception]]) -> None:
        r = self.report
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = raw
            r.chunks += 1
            n = chunk.nbytes
            r.bytes_by_kind[src.kind] = r.bytes_by_kind.get(src.kind, 0) + n
            r.bytes_by_node[src.node] = r.bytes_by_node.get(src.node, 0) + n
            r.bytes_by_source[src.name] = r.bytes_by_source.get(src.name, 0) + n
            r.bytes_by_process[chunk.process] = r.bytes_by_process.get(chunk.process, 0) + n
            self._say_fallbacks(path, src, chunk, failures)

    def _say_fallbacks(self, path: str, src: Source, chunk: ChunkMeta, failures: list[tuple[Source, Exception]]
                       ) -> None:
        """Under the lock: the report's and the log's line for each source that failed ``chunk`` before ``src``
        gave it."""
        for bad, e in failures:
            line = f"{path}: step {self._step} chunk of process {chunk.process}: {bad.kind} source {bad.name} " \
                   f"failed ({type(e).__name__}: {e}); read from {src.kind} source {src.name}"
            self.report.fallbacks.append(line)
            log.warning("%s", line)

    def _failed(self, where: str, failures: list[tuple[Source, Exception]]) -> Exception:
        if len(failures) == 1:  # the single source's own error, unchanged
            return failures[0][1]
        if not failures:
            return StepNotFoundError(f"{where}: every source of the process failed earlier in this restore")
        said = "; ".join(f"{s.kind} {s.name}: {e}" for s, e in failures)
        corrupt = any(isinstance(e, ChecksumError) for _, e in failures)
        cls = ChecksumError if corrupt else type(failures[-1][1])
        return cls(f"{where}: no source gave good bytes ({said})")

    def _bulk_from(self, process: int, items: list[tuple[str, ChunkMeta]]) -> None:
        """Fetch ``items`` (chunks of ``process``) in flights from its sources in order, each taking what the ones
        before did not give, as long as they read in bulk."""
        for src in self._sources[process]:
            with self._lock:
                left = [(p, c) for p, c in items if self._key(c) not in self._cache
                        and self._key(c) not in self._errors and (self._key(c), src.name) not in self._bad]
            # a rebuild reads other chunks through this reader, which would wait on the flight's claims
            if not left or src.read_spans is None or src.kind == "rebuild":
                return
            self._bulk(src, left)

    def _bulk(self, src: Source, items: list[tuple[str, ChunkMeta]]) -> None:
        """Fetch ``items`` (chunks of one saving process) from ``src`` in one flight of its ``read_spans``. A chunk
        it gives no good bytes of (the flight failed, or its bytes fail their check) is left to its own fetch,
        which counts the failure as that source's and goes on to the next source (raw)."""
        if src.read_spans is None:
            return
        claimed = self._claim(src, items)
        done: set[int] = set()
        t0, got = time.perf_counter(), 0
        try:
            for i, raw in src.read_spans([(c.offset, c.nbytes) for _, c, _ in claimed]):
                path, c, key = claimed[i]
                try:
                    raw, owned = self._checked(src, c, raw, path)
                except ChecksumError as e:
                    with self._lock:
                        self._bad.add((key, src.name))
                        self._prior.setdefault(key, []).append((src, e))
                    continue
                with self._lock:
                    failures = self._prior.pop(key, [])  # an earlier source's, in bulk too
                    if owned:
                        self._owned.add(key)
                self._account(key, raw, src, c, path, failures)
                done.add(i)
                got += c.nbytes
        except DataLossError:
            raise
        except SOURCE_ERRORS as e:
            log.info("step %d: a bulk read of %d chunks from %s failed (%s: %s); the %d not in are read one by one",
                     self._step, len(claimed), src.name, type(e).__name__, e, len(claimed) - len(done))
            with self._lock:
                for i, (path, c, key) in enumerate(claimed):
                    if i not in done and (key, src.name) not in self._bad:
                        self._bad.add((key, src.name))
                        self._prior.setdefault(key, []).append((src, _named(e, _where(path, self._step, c), src)))
        finally:
            self.report.timeline.read(src.kind, t0, time.perf_counter(), got)
            self._release([key for _, _, key in claimed])

    def _claim(self, src: Source, items: list[tuple[str, ChunkMeta]]) -> list[tuple[str, ChunkMeta, tuple]]:
        """The chunks of ``items`` no one has, is fetching or gave up on, nor ``src`` failed, marked in flight
        (a run of one source, bulk or near): a fetch of the same chunk meanwhile waits for the run's release."""
        claimed: list[tuple[str, ChunkMeta, tuple]] = []
        with self._lock:
            for path, c in items:
                key = self._key(c)
                if key not in self._cache and key not in self._inflight and key not in self._errors \
                        and (key, src.name) not in self._bad:
                    self._inflight[key] = None
                    claimed.append((path, c, key))
        return claimed

    def _release(self, keys: list[tuple], failed: Exception | None = None) -> None:
        """End the claims on ``keys`` (a fetch's rebuild with them) and wake the fetches that waited on them
        (outside the lock); ``failed``: every source failed, the error those fetches raise too."""
        with self._lock:
            for key in keys:
                self._rebuilding.discard(key)
                if failed is not None:
                    self._errors[key] = failed
            events = [self._inflight.pop(key) for key in keys]
        for ev in events:
            if ev is not None:
                ev.set()

    def _near(self, items: list[tuple[str, ChunkMeta]]) -> None:
        """Read and check ``items`` (small chunks whose first source is this node's memory) on this thread, a
        run of one source at a time under one claim: per chunk what it must cost (a slice and its crc32c), not a
        lock round, a timeline entry and a report update each (a third of a 1,024-array restore's own Python).
        A chunk the run gives no good bytes of is left to :meth:`raw`, which tries its other sources."""
        start = 0
        while start < len(items):
            src = self._first(items[start][1])
            end = start + 1
            while end < len(items) and self._first(items[end][1]) is src:
                end += 1
            self._near_run(src, items[start:end])
            start = end

    def _near_run(self, src: Source, items: list[tuple[str, ChunkMeta]]) -> None:
        claimed = self._claim(src, items)
        good: list[tuple[tuple, memoryview, bool, ChunkMeta, str]] = []
        bad: list[tuple[tuple, Exception]] = []
        t0 = time.perf_counter()
        try:
            for path, c, key in claimed:
                try:
                    raw = src.read(c.offset, c.nbytes)
                except DataLossError:
                    raise
                except SOURCE_ERRORS as e:  # as _read names it
                    bad.append((key, _named(e, _where(path, self._step, c), src)))
                    continue
                try:
                    raw, owned = self._checked(src, c, raw, path)
                except ChecksumError as e:
                    bad.append((key, e))
                    continue
                good.append((key, raw, owned, c, path))
        finally:
            got = sum(c.nbytes for _, _, _, c, _ in good)
            self.report.timeline.read(src.kind, t0, time.perf_counter(), got, len(good))
            r = self.report
            with self._lock:
                for key, e in bad:
                    self._bad.add((key, src.name))
                    self._prior.setdefault(key, []).append((src, e))
                for key, raw, owned, c, path in good:
                    if key in self._cache:
                        continue
                    if owned:
                        self._owned.add(key)
                    self._cache[key] = raw
                    r.chunks += 1
                    r.bytes_by_process[c.process] = r.bytes_by_process.get(c.process, 0) + c.nbytes
                    if key in self._prior:  # an earlier source failed it (a bulk flight): the fallback is said
                        self._say_fallbacks(path, src, c, self._prior.pop(key))
                r.bytes_by_kind[src.kind] = r.bytes_by_kind.get(src.kind, 0) + got
                r.bytes_by_node[src.node] = r.bytes_by_node.get(src.node, 0) + got
                r.bytes_by_source[src.name] = r.bytes_by_source.get(src.name, 0) + got
            self._release([key for _, _, key in claimed])

    def _batches(self, todo: list[tuple[str, ChunkMeta]], pooled: list[int]) -> tuple[list[int], list[tuple]]:
        """Of ``pooled`` (indices into ``todo``), the chunks read in bulk (small, their first source has
        read_spans) as batches (saving process, items) of at most BULK_BATCH_BYTES, and the rest."""
        by: dict[int, list[list[tuple[str, ChunkMeta]]]] = {}
        filled: dict[int, int] = {}
        rest = []
        for i in pooled:
            c = todo[i][1]
            src = self._first(c)
            if src is None or src.read_spans is None or src.kind == "rebuild" or c.nbytes >= BULK_BYTES:
                rest.append(i)
                continue
            batches = by.setdefault(c.process, [[]])
            if batches[-1] and filled[c.process] + c.nbytes > BULK_BATCH_BYTES:
                batches.append([])
                filled[c.process] = 0
            batches[-1].append(todo[i])
            filled[c.process] = filled.get(c.process, 0) + c.nbytes
        return rest, [(q, b) for q, bs in by.items() for b in bs]

    def take(self, chunk: ChunkMeta) -> bool:
        """True once for a chunk whose fetched bytes are a private copy nobody else was given."""
        with self._lock:
            key = self._key(chunk)
            if key in self._owned:
                self._owned.discard(key)
                return True
            return False

    def array(self, path: str, chunk: ChunkMeta, dtype: np.dtype) -> np.ndarray:
        raw = self.raw(path, chunk)
        return np.frombuffer(raw, dtype=dtype, count=chunk.box.size).reshape(chunk.box.shape)

    def prefetch(self, chunks: Iterable[tuple[str, ChunkMeta]]) -> None:
        """Fetch ``chunks`` (path, chunk) now, each once, ``workers`` at a time; the plan goes to the report and
        the log. Raises the first failure after every fetch has ended."""
        todo = plan_fetch(chunks, self._sources, self.report)
        with self._lock:
            todo = [(p, c) for p, c in todo if self._key(c) not in self._cache]
            self._planned.update(self._key(c) for _, c in todo)
        if not todo:
            return
        log.info("step %d: fetching %d chunks (%d bytes) on process %d; planned bytes by source kind %s, by node %s",
                 self._step, len(todo), sum(c.nbytes for _, c in todo), self.report.process,
                 self.report.planned_by_kind, self.report.planned_by_node)
        inline = [self._cheap(c) for _, c in todo]
        if self._workers == 1 or len(todo) == 1:
            for process, items in self._batches(todo, list(range(len(todo))))[1]:
                self._bulk_from(process, items)
            self._near([x for x, cheap in zip(todo, inline) if cheap])
            for path, c in todo:
                self.raw(path, c)
            return
        # A small chunk from this node's memory costs less to read than to hand to a thread: those are read
        # here while the pool fetches the rest.
        pooled = [i for i, cheap in enumerate(inline) if not cheap]
        # Every source at once: chunks are handed out round-robin over their first sources (the plan lists them
        # by saving process), and ``workers`` requests are in flight per source over the transport.
        first = [self._first(todo[i][1]) for i in pooled]
        far = {f for f in first if f is not None and f.kind not in ("local", "node")}
        threads = min(len(pooled), MAX_FETCH_THREADS, self._workers * max(1, len(far)))
        errors: dict[int, BaseException] = {}
        single, bulk = self._batches(todo, pooled)
        index = {id(todo[i][1]): i for i in pooled}

        def batch(process: int, items: list[tuple[str, ChunkMeta]]) -> dict[int, BaseException]:
            self._bulk_from(process, items)
            failed = {}
            for path, c in items:  # what no flight gave: each on its own, with its fallbacks
                try:
                    self.raw(path, c)
                except Exception as e:  # noqa: BLE001 - raised below, in plan order
                    failed[index[id(c)]] = e
            return failed
        ex = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="jaxckpt-fetch") if pooled else None
        try:
            batches = [ex.submit(batch, process, items) for process, items in bulk] if ex is not None else []
            futures = {i: ex.submit(self.raw, *todo[i])
                       for i in _round_robin(single, [self._first(todo[i][1]) for i in single])} \
                if ex is not None else {}
            self._near([x for x, cheap in zip(todo, inline) if cheap])
            for i, ((path, c), cheap) in enumerate(zip(todo, inline)):
                if cheap:
                    try:
                        self.raw(path, c)
                    except Exception as e:  # noqa: BLE001 - raised below, in plan order, once all have ended
                        errors[i] = e
        finally:
            if ex is not None:
                ex.shutdown(wait=True)
        for i, f in futures.items():
            if f.exception() is not None:
                errors[i] = f.exception()
        for f in batches:
            if f.exception() is not None:
                raise f.exception()  # not a source's failure (those are each chunk's): a bug
            errors.update(f.result())
        if errors:
            raise errors[min(errors)]  # the first failure, in plan order

    def near(self, chunks: Iterable[tuple[str, ChunkMeta]]) -> bool:
        """Whether every chunk's first source is this node's memory (kinds local and node): reads that only copy,
        with nothing to wait for."""
        return all((f := self._first(c)) is not None and f.kind in ("local", "node") for _, c in chunks)

    def local_processes(self) -> list[int]:
        """The saving processes whose bytes this reader reads first from this node's memory (source kinds
        ``local`` and ``node``): what this process can contribute to a collective restore without transport."""
        return sorted(q for q, s in self._sources.items() if s and s[0].kind in ("local", "node"))

    def process_costs(self) -> dict[int, int]:
        """Saving process -> how dear its bytes are to read first: 0 from this node's memory (kinds local and
        node), then by the rank of its first source kind (another node, a rebuild, ...); a process with no
        source at all ranks last. What the restore plan orders copies of one box by (whole replicas)."""
        near = RANK["node"]
        return {q: max(0, RANK.get(s[0].kind, len(RANK)) - near) if s else len(RANK)
                for q, s in self._sources.items()}

    def _first(self, chunk: ChunkMeta) -> Source | None:
        sources = self._sources.get(chunk.process)
        return sources[0] if sources else None

    def _cheap(self, chunk: ChunkMeta) -> bool:
        """Whether ``chunk`` is small and its first source is this node's memory (kinds local and node)."""
        sources = self._sources.get(chunk.process)
        return chunk.nbytes < INLINE_BYTES and bool(sources) and sources[0].kind in ("local", "node")

    def finish(self) -> RestoreReport:
        """The report, with the time since this reader was made."""
        self.report.seconds = time.perf_counter() - self._t0
        return self.report


def _where(path: str, step: int, chunk: ChunkMeta) -> str:
    return f"{path}: step {step} chunk {chunk.box.start}..{chunk.box.stop} of process {chunk.process}"


def _named(e: Exception, where: str, src: Source) -> Exception:
    """A source's error naming the array and chunk the bytes were for, and where they were read."""
    if isinstance(e, (ChecksumError, PeerError, StepNotFoundError)):
        return type(e)(f"{where} from {src.name}: {e}")
    return StepNotFoundError(f"{where} from {src.name}: {e}")  # the holder went away: its bytes cannot be had


def _round_robin(items: list[int], keys: list[Source | None]) -> list[int]:
    """``items`` reordered to take one of each key in turn (keeping their order within a key)."""
    groups: dict[str, list[int]] = {}
    for i, k in zip(items, keys):
        groups.setdefault(k.name if k is not None else "", []).append(i)
    out: list[int] = []
    queues = [iter(g) for g in groups.values()]
    while queues:
        alive = []
        for q in queues:
            i = next(q, None)
            if i is not None:
                out.append(i)
                alive.append(q)
        queues = alive
    return out


def assemble(a: Assembly, dtype: np.dtype, reader: ChunkReader, private: bool = False,
             out: np.ndarray | None = None) -> np.ndarray:
    """The host array of one needed box; a view of the saved bytes when one chunk is exactly that box, unless
    ``private`` asks for memory of its own (a copy). With ``out`` (an array of the box's shape, e.g. a view of
    the target's memory), the box is written into it and ``out`` is returned."""
    if a.whole_chunk and out is None:
        arr = reader.array(a.path, a.reads[0].chunk, dtype)
        if private and not reader.take(a.reads[0].chunk):
            return hostbuf.copy(arr)
        return arr
    if out is None:
        out = hostbuf.empty(a.box.shape, dtype)
    for r in a.reads:
        src = reader.array(a.path, r.chunk, dtype)
        out[a.box.relative(r.part)] = src[r.chunk.box.relative(r.part)]
    return out
