"""The node agent's part of protection: build a step's ``xor-group`` and ``replica`` blocks into a trainer's slot.

A trainer's protection worker (``jaxckpt.protection.runtime``) decides, coordinates and announces; the bytes move
here, in the agent, after the local commit: the trainer reserves its protection slot, writes the meta and the
parity stripes it computed from its own device copies, and sends ``pull`` on that slot with

  plan      the encoded protection plan of the step (``jaxckpt.protection.plan_wire.encode_plan``);
  tasks     ``[[kind, id, offset], ...]``: the ``xor-group`` stripes and ``replica`` copy blocks this process
            builds, and where each goes in the slot;
  sources   ``{process: [address, token] | [address, token, CURVE key] | None}``: where each saving process's
            chunks are (None: this node), with the CURVE public key its agent published ("" or absent: none);
  rate      bytes per second the pulls of this slot's owner may take (``Config.protection_bandwidth``;
            0: unlimited), through one token bucket per owner that the agent keeps across pulls
            (:class:`Buckets`): a bucket per pull would start each one with a full burst, so frequent small
            pulls would never be held to the rate;
  timeout   seconds a peer may take to answer one request.

The agent reads each needed chunk once (this node's from its own memory, zero-copy; other nodes' through the
peer transport, only the span of it the blocks use, with the holder's crc32c of the rest), checks it against
the crc32c of its process's manifest, XORs or copies it into place and replies with the crc32c of each block,
which the trainer writes into the slot header when it commits, and the pull's seconds (``times``). The spans of
one source are asked for several at a time, the sources in parallel behind the build, which XORs a stripe as
soon as its units are in. So the trainer process never holds the pulled bytes, and a node that is being filled
sets its own pace (one request per protecting trainer connection, a few spans in flight).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from jaxckpt.core import manifest as mf
from jaxckpt.protection import parity
from jaxckpt.core.checksum import crc32c, span_crc
from jaxckpt.errors import ChecksumError, PeerError
from jaxckpt.protection.plan import SavedChunk, copy_block, stripe_parity
from jaxckpt.protection.plan_wire import decode_plan

log = logging.getLogger("jaxckpt.backends.agent.protection_pull")

MAX_TASKS = 1 << 16


_clients: dict[tuple[str, bytes, str], Any] = {}  # one client per peer agent, kept across requests (connections)
# One reader per saving process of the manifests a pull checks chunks against, kept across pulls: each step's
# manifest of a process has the layout of the last one, read at its crc32c's places (ChunkCrcs)
_crc_readers: dict[int, mf.ChunkCrcs] = {}
MAX_CRC_READERS = 1024
_clients_lock = threading.Lock()
MAX_CLIENTS = 64
FETCH_THREADS = 4
PARALLEL_BYTES = 8 << 20  # below this a pull fetches its sources one after another


def _client(address: str, token: bytes, timeout_s: float, server_key: str = "", transport: str = "zmq"):
    from jaxckpt.core.transport import get_transport

    with _clients_lock:
        c = _clients.get((address, token, server_key))
        if c is None:
            if len(_clients) >= MAX_CLIENTS:  # the oldest goes: a job's peers are few, stale ones pile up
                _clients.pop(next(iter(_clients))).close()
            c = _clients[(address, token, server_key)] = get_transport(transport).connect(
                address, token=token, timeout_s=timeout_s, server_key=server_key)
        return c


def _forget(address: str, token: bytes, client) -> None:
    with _clients_lock:
        for key in [k for k, v in _clients.items() if v is client]:
            del _clients[key]
    client.close()


class ChunkSpans:
    """Verified bytes of the chunks of one step a pull needs, from this node's memory or from the agents of other
    nodes: of each chunk the span its blocks use (a unit of an ``xor-group`` stripe may cover part of a chunk),
    checked against the chunk's crc32c; each source's spans fetched by one thread with several requests in
    flight, the sources in parallel."""

    def __init__(self, local, sources: dict[int, Any], step: int, timeout_s: float,
                 bucket: "TokenBucket | None", transport: str = "zmq", *,
                 crcs: dict[tuple[int, int], int] | None = None, known: set[int] | None = None) -> None:
        self.local, self.sources, self.step, self.timeout = local, sources, step, timeout_s
        self.transport = transport  # Config.transport of the agent (the one its peers serve with)
        self.bucket = bucket
        self.pulled = 0
        self.slept = 0.0  # this pull's share of the bucket's sleep
        self._views: dict[int, Any] = {}
        # the crc32c of every chunk of the manifests decoded, and whose: given, they are kept across several
        # fetches of one step (the agent's rebuilds, protection_rebuild.py), each manifest asked for once
        self._crcs: dict[tuple[int, int], int] = {} if crcs is None else crcs
        self._chunks: dict[tuple[int, int], tuple[int, np.ndarray]] = {}  # key -> (lo, bytes lo..hi of the chunk)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pool: ThreadPoolExecutor | None = None
        self._running: dict[int, Future] = {}  # source process -> its fetch running behind the build
        self._known: set[int] = set() if known is None else known  # source processes whose crc32c are in

    def _remote(self, q: int):
        where = self.sources[q]
        return where[0], where[1], _client(where[0], where[1], self.timeout, where[2] if len(where) > 2 else "",
                                           self.transport)

    def _open_local(self, q: int) -> None:
        """This node's snapshot of process ``q``: its view (zero-copy) and its manifest's crc32c."""
        if q in self._views:
            return
        view = self.local.open(q, self.step) if self.local is not None else None
        if view is None:
            raise PeerError(f"step {self.step} of process {q} is not held by this node's agent")
        with self._lock:
            self._views[q] = view
        self._decode(q, bytes(view.manifest))

    def _decode(self, q: int, raw: bytes) -> None:
        with _clients_lock:
            read = _crc_readers.get(q)
            if read is None:
                if len(_crc_readers) >= MAX_CRC_READERS:  # bounded: a job has fewer processes than this
                    _crc_readers.pop(next(iter(_crc_readers)))
                read = _crc_readers[q] = mf.ChunkCrcs()
        crcs = read(raw, source=f"step {self.step} manifest of process {q}")
        with self._lock:
            self._crcs.update(crcs)
            self._known.add(q)

    def _crc(self, c: SavedChunk, q: int) -> int:
        crc = self._crcs.get(c.key)
        if crc is None:
            raise ChecksumError(f"{c.path}: step {self.step} has no chunk at offset {c.offset} of process {q}")
        return crc

    def _keep(self, c: SavedChunk, lo: int, data: np.ndarray) -> None:
        with self._cond:
            self._chunks[c.key] = (lo, data)
            self._cond.notify_all()

    def _fetch(self, q: int, needs: list[tuple[SavedChunk, int, int]]) -> None:
        if q not in self.sources:
            raise PeerError(f"step {self.step}: no source named for process {q}")
        if self.sources[q] is None:  # this node's memory: the whole chunk is checked, it costs no transfer
            self._open_local(q)
            buf = self._views[q].buffer
            for c, lo, hi in needs:
                data = np.frombuffer(buf[c.offset:c.offset + c.nbytes], np.uint8)
                if crc32c(data) != self._crc(c, q):  # the name made only for the error (a pull checks thousands)
                    parity.check(data, self._crc(c, q), f"{c.path}: step {self.step} chunk of process {q}")
                self._keep(c, lo, data[lo:hi])
            return
        from jaxckpt.core.transport import Span

        spans = [Span(c.offset + lo, hi - lo, None if (lo, hi) == (0, c.nbytes) else (c.offset, c.nbytes))
                 for c, lo, hi in needs]
        # A paced pull admits each span before it is asked for (one in flight); an unpaced one keeps the window full
        batches = [[i] for i in range(len(spans))] if self.bucket is not None else [list(range(len(spans)))]
        address, token, client = self._remote(q)
        early: list[tuple[int, np.ndarray, Any]] = []  # spans in before the manifest that checks them
        try:
            for batch in batches or [[]]:
                if self.bucket is not None and batch:
                    wait = self.bucket.take(sum(spans[i].nbytes for i in batch))
                    with self._lock:
                        self.slept += wait
                # the manifest (its crc32c) is asked for in the same flight as the first spans: no round trip
                ask = q not in self._known
                for k, buf, rest in client.read_spans(self.step, [spans[i] for i in batch], q, manifest=ask):
                    if k == -1:
                        self._decode(q, bytes(buf))
                        for j, data, r in early:
                            self._check_remote(q, needs[j], data, r, address)
                        early.clear()
                    elif q not in self._known:
                        early.append((batch[k], np.frombuffer(buf, np.uint8), rest))
                    else:
                        self._check_remote(q, needs[batch[k]], np.frombuffer(buf, np.uint8), rest, address)
        except PeerError:
            _forget(address, token, client)
            raise

    def _check_remote(self, q: int, need: tuple[SavedChunk, int, int], data: np.ndarray, rest, address: str) -> None:
        c, lo, hi = need
        if rest is None:
            if crc32c(data) != self._crc(c, q):  # the name made only for the error (a pull checks thousands)
                parity.check(data, self._crc(c, q), f"{c.path}: step {self.step} chunk of process {q}")
        elif span_crc(rest[0], data, rest[1], c.nbytes - hi) != self._crc(c, q):
            raise ChecksumError(f"{c.path}: step {self.step} chunk of process {q} (bytes {lo}..{hi} read from "
                                f"{address}) failed its crc32c check: the chunk is corrupt at that holder")
        self._keep(c, lo, data)
        with self._lock:
            self.pulled += hi - lo

    def start(self, needs: list[tuple[SavedChunk, int, int]]) -> None:
        """Fetch and verify bytes ``lo..hi`` of each chunk of ``needs``: each source's by one thread, the sources
        in parallel and behind the caller, who builds blocks as their bytes arrive (:meth:`read` waits for them);
        a small pull, or one from a single source, is fetched here and now (threads would cost more)."""
        by: dict[int, list] = {}
        for n in sorted(needs, key=lambda n: (n[0].process, n[0].offset)):  # stream order: first stripes first
            by.setdefault(n[0].process, []).append(n)
        if len(by) <= 1 or sum(hi - lo for _, lo, hi in needs) < PARALLEL_BYTES:
            for q, ns in by.items():
                self._fetch(q, ns)
            return
        self._pool = ThreadPoolExecutor(min(FETCH_THREADS, len(by)), thread_name_prefix="jaxckpt-pull")
        for q, ns in by.items():
            self._running[q] = f = self._pool.submit(self._fetch, q, ns)
            f.add_done_callback(self._wake)

    def _wake(self, _f: Any) -> None:
        with self._cond:
            self._cond.notify_all()

    def finish(self) -> None:
        """Wait for every fetch; raise the first one's error."""
        for f in list(self._running.values()):
            f.result()

    def read(self, c: SavedChunk, lo: int, hi: int) -> np.ndarray:
        running = self._running.get(c.process)
        with self._cond:  # its source's fetch ends (bounded by the peer time-out) with the bytes or an error
            self._cond.wait_for(lambda: c.key in self._chunks or running is None or running.done())
            got = self._chunks.get(c.key)
        if got is None and running is not None:
            running.result()  # the fetch's error, if it failed
        if got is None or lo < got[0] or hi > got[0] + got[1].size:
            self._fetch(c.process, [(c, lo, hi)])
            got = self._chunks[c.key]
        return got[1][lo - got[0]:hi - got[0]]

    def close(self) -> None:
        if self._pool is not None:  # a failed build: its fetches end within their time-out
            self._pool.shutdown(wait=True)
        self._chunks.clear()
        for v in self._views.values():
            v.close()


def pull_into(buffer: memoryview, msg: dict, step: int, local, *, buckets: "Buckets", owner: int,
              transport: str = "zmq") -> tuple[list[int], int, dict]:
    """Build the blocks ``msg`` asks for (see the module docstring) into ``buffer``, the writing slot of ``step``
    that process ``owner`` writes, its pulls from other nodes paced by ``owner``'s bucket in ``buckets``;
    returns the crc32c of each block in task order, the bytes pulled from other nodes, and the bandwidth
    account of a limited pull: the owner's bucket since its first admission (rate, burst, bytes admitted,
    seconds of sleep asked for, span) and this pull's share (``pull_bytes``, ``pull_slept``). ``transport``: the
    peer transport's name (``Config.transport``) its reads from other nodes go through."""
    tasks = msg["tasks"]
    if not isinstance(tasks, list) or len(tasks) > MAX_TASKS:
        raise ValueError(f"step {step}: tasks must be a list of at most {MAX_TASKS} [kind, id, offset]")
    raw = msg["sources"]
    if not isinstance(raw, dict):
        raise TypeError(f"step {step}: sources must be a map")
    sources: dict[int, Any] = {}
    for k, v in raw.items():
        q = int(k)
        if v is not None and not (isinstance(v, list) and len(v) in (2, 3) and isinstance(v[0], str)
                                  and v[0].startswith("tcp://") and isinstance(v[1], bytes) and v[1]
                                  and (len(v) == 2 or isinstance(v[2], str))):
            raise TypeError(f"step {step}: the source of process {q} must be [tcp address, token(, CURVE key)] "
                            f"or nil")
        sources[q] = v
    plan = decode_plan(msg["plan"], source=f"step {step} protection plan")
    timeout, rate = float(msg.get("timeout", 30.0)), float(msg.get("rate", 0) or 0)
    stripes = {s.id: s for s in plan.stripes}
    blocks = {b.id: b for b in plan.copy_blocks}
    out = np.frombuffer(buffer, np.uint8)
    src = ChunkSpans(local, sources, step, timeout, buckets.get(owner, rate), transport)
    crcs = []
    times = {"start": time.monotonic()}
    try:
        need: dict[int, tuple[int, int]] = {}  # chunk index -> the span of it the blocks read
        for kind, bid, _ in tasks:
            if kind == "stripe" and bid in stripes:
                got = [(g.chunk, g.lo, g.hi) for u in stripes[bid].units for g in u.ranges]
            else:
                got = [(i, 0, plan.chunks[i].nbytes) for i in blocks[bid].chunks] if kind == "copy" and bid in blocks \
                    else []
            for i, lo, hi in got:
                was = need.get(i, (lo, hi))
                need[i] = (min(was[0], lo), max(was[1], hi))
        todo = []
        for kind, bid, offset in tasks:
            if kind == "stripe" and bid in stripes:
                n = stripes[bid].nbytes
            elif kind == "copy" and bid in blocks:
                n = blocks[bid].nbytes
            else:
                raise ValueError(f"step {step}: no {kind!r} block {bid!r} in the plan")
            if not 0 <= int(offset) <= out.size - n:
                raise ValueError(f"step {step}: {kind} block {bid} of {n} bytes does not fit the slot at {offset}")
            todo.append((kind, bid, out[int(offset):int(offset) + n]))  # built in place: no block-sized temporary
        src.start([(plan.chunks[i], lo, hi) for i, (lo, hi) in need.items()])
        for kind, bid, region in todo:
            if kind == "stripe":
                stripe_parity(plan, stripes[bid], src.read, out=region)
            else:
                copy_block(plan, blocks[bid], src.read, out=region)
            crcs.append(crc32c(region))
        times["built"] = time.monotonic()
        src.finish()
        times["fetched"] = time.monotonic()
    finally:
        src.close()
    b = src.bucket
    account = {} if b is None or b.started is None else {
        "rate": b.rate, "burst": b.burst, "admitted": b.admitted, "slept": b.slept,
        "span": time.monotonic() - b.started, "pull_bytes": src.pulled, "pull_slept": src.slept}
    times = {"pull_s": times["fetched"] - times["start"]}
    return crcs, src.pulled, account, times


class Buckets:
    """The node agent's token bucket of each slot owner (a trainer process), kept across that owner's pulls so
    that ``Config.protection_bandwidth`` holds per process over time, not per pull. A changed rate (a trainer
    restarted with another config) starts a new bucket; the owners of a node are few, so none is dropped."""

    def __init__(self) -> None:
        self._buckets: dict[int, TokenBucket] = {}
        self._lock = threading.Lock()

    def get(self, owner: int, rate: float) -> "TokenBucket | None":
        """``owner``'s bucket at ``rate`` bytes per second (None: unlimited)."""
        if rate <= 0:
            return None
        with self._lock:
            b = self._buckets.get(owner)
            if b is None or b.rate != float(rate):
                b = self._buckets[owner] = TokenBucket(rate)
            return b


class TokenBucket:
    """``rate`` bytes per second with a burst of ``burst`` bytes (default: a tenth of a second's worth).

    :meth:`take` admits its bytes at once and then sleeps off any debt, outside the lock: over any span from
    the first take, at most ``burst + rate * span`` bytes are admitted. ``admitted`` and ``slept`` (the total
    sleep asked for) account for it.
    """

    def __init__(self, rate: int, burst: int | None = None) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate!r}")
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(1.0, rate / 10))
        self.admitted = 0
        self.slept = 0.0
        self.started: float | None = None  # time.monotonic() of the first take
        self._tokens = self.burst
        self._t = 0.0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> float:
        """Admit ``nbytes``; sleep until the bucket is out of debt. Returns the seconds slept."""
        with self._lock:
            now = time.monotonic()
            if self.started is None:
                self.started = self._t = now
            self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate) - nbytes
            self._t = now
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
            self.admitted += nbytes
            self.slept += wait
        if wait > 0:
            time.sleep(wait)
        return wait
