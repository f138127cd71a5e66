"""The pyzmq peer client (``jaxckpt.backends.transport`` has the protocol, the interface and the server).

One DEALER socket per peer; every request carries an id, so a late reply to a request given up on is dropped.
A request in flight dies with its connection: ZeroMQ reconnects on its own but does not send again what the
lost connection carried, so the request would wait out the whole peer time-out. A monitor on the socket
reports each lost connection (``EVENT_DISCONNECTED``: a reset, or a heartbeat of either end giving up on a link
that stopped passing bytes). The client then closes that socket and sends the requests in flight again on a
fresh one, at most ``MAX_RESENDS`` times per call and always within the call's time-out. A fresh socket, not
the old one: the old socket's queue may still belong to the dying connection, which drops what it holds.
Every request is a read, so sending it twice is harmless.

A read's payload is received into the reader's own memory (``recv_into``), asked for ``READ_BYTES`` at a time: an
aligned buffer per range (``jaxckpt.core.hostbuf``), which a restore keeps as the
array's memory. libzmq's own copy of each frame is then freed at once and its memory reused by the next frame. Ranges smaller
than that go together, a frame's worth to one ``spans`` request (``read_spans``); a peer that refuses the op as
unknown (an older jaxckpt) is asked a range a request from then on.
"""
from __future__ import annotations

import itertools
import logging
import struct
import threading
import time
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import msgpack
import numpy as np
import zmq

from jaxckpt.backends.transport import (CONNECT_TIMEOUT_S, HEADER_SLACK, HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS,
                                        MAX_REQUEST_BYTES, MAX_SPANS, VERSION)
from jaxckpt.core.transport import PeerAddress, PeerClient, Span
from jaxckpt.core import hostbuf
from jaxckpt.core.manifest import MAX_MANIFEST_BYTES
from jaxckpt.errors import (PeerError, PeerHandshakeError, PeerTimeoutError, PeerUnreachableError,
                            StepNotFoundError)

log = logging.getLogger("jaxckpt.backends.zmq_client")

# A range is asked for in requests of at most this many bytes, each received into the reader's own buffer
# (``_payload``): libzmq allocates every frame it receives (malloc, in its I/O thread), and a frame of several
# MiB is a fresh mapping faulted page by page, then given back, so each restore would fault its frames anew
# (9,400 minor faults of a 128 MiB restore's first run, BENCHMARKS.md). Frames of 1 MiB, copied out at once,
# stay in libzmq's heap and are reused from frame to frame; the copy lands in memory of the reader's
# (core/hostbuf.py).
READ_BYTES = 1 << 20
MAX_RESENDS = 8  # lost connections one call lives through before it gives up on the peer
MAX_IN_FLIGHT = 64  # requests of one call in flight at most, however small (the window counts whole frames)
_MONITORS = itertools.count(1)  # inproc monitor endpoints must be unique in the process
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
# A connection refused this long (libzmq retries it every 100 ms) ends the request: nothing listens at the address
# (an agent gone, its stale address still published), so waiting out CONNECT_TIMEOUT_S only delays every caller
# (each protection round of a step paid 2 s while a killed agent's peer file stayed). An agent binds before it
# publishes its address, so one that is starting is not refused; the grace covers a peer reached by a known port
# (rendezvous) whose agent binds it a moment later.
REFUSED_GRACE_S = 0.25


_MANIFEST = (0, 0, None)  # the part of a pipeline that asks for the step's manifest (its first page)


class _Group(NamedTuple):
    """Small spans asked for in one ``spans`` request: [(span index, (offset, nbytes, chunk))], their bytes."""
    members: list
    nbytes: int


def _int_bytes(v: int) -> int:
    """Bytes msgpack packs a non-negative int into."""
    return 1 if v < 128 else 2 if v < 256 else 3 if v < 65536 else 5 if v < 1 << 32 else 9


class _Lost(Exception):
    """The connection that carried the requests in flight closed: they get no reply."""


class _NoSpans(Exception):
    """The peer does not know the ``spans`` op (an agent of an older jaxckpt): its ranges go one a request."""

    def __init__(self, rid: int) -> None:
        super().__init__(rid)
        self.rid = rid


class ZmqClient(PeerClient):
    """A DEALER socket to one peer (see the module docstring)."""

    def __init__(self, address: str, *, token: bytes, timeout_s: float, frame_bytes: int, window: int,
                 server_key: str = "") -> None:
        self.address = address
        self._token, self._timeout, self._frame_bytes, self._window = bytes(token), timeout_s, frame_bytes, window
        self._read_bytes = min(frame_bytes, READ_BYTES)
        self.server_key = server_key
        self._keys: tuple[bytes, bytes] | None = None
        if server_key:
            from jaxckpt.backends import curve

            curve.require_curve(f"a CURVE client of {self.address}")
            if not curve.valid_public_key(server_key):
                raise PeerError(f"peer {self.address}: published CURVE key {server_key[:48]!r} is not a Z85 "
                                f"public key")
            self._keys = curve.client_keys(self._token)
        self._failed: set[int] = set()  # handshake failures seen and not yet reported
        self.disconnects = 0  # connections lost so far
        self.resent = 0  # requests sent again after their connection was lost
        self._ids = itertools.count(1)
        self._spans = True  # the peer serves ``spans`` requests (until it refuses one as an unknown op)
        self._lock = threading.Lock()
        self._closed = False
        self._open()

    def _open(self) -> None:
        """A fresh socket and its monitor, connecting to the peer."""
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, self._frame_bytes + HEADER_SLACK)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only on a live connection: see _send
        # A link that stops passing bytes is dropped from this end too: the server's drop may never arrive.
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        if self._keys is not None:
            self._sock.curve_serverkey = self.server_key.encode()
            self._sock.curve_publickey, self._sock.curve_secretkey = self._keys
        # Lost connections (and CURVE's failed handshakes) are events, not errors: the monitor reports them.
        events = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | \
            (_HANDSHAKE_FAILED if self._keys is not None else 0)
        self._monitor = self._sock.get_monitor_socket(events, addr=f"inproc://jaxckpt-peer-monitor-{next(_MONITORS)}")
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._out = zmq.Poller()  # _send: room to send (a live connection), or the monitor's news
        self._out.register(self._sock, zmq.POLLOUT)
        self._out.register(self._monitor, zmq.POLLIN)
        self._lost = False  # a lost connection seen by the monitor and not yet told to _recv
        self._refused_since: float | None = None  # the first refusal of the connection not followed by one
        self._sock.connect(self.address)

    def _shut(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

    def _events(self) -> None:
        """Take in the monitor's events."""
        while self._monitor.poll(0):
            # zmq_socket_monitor(3): a 16-bit event and a 32-bit value, then the endpoint. Parsed here because
            # pyzmq's zmq.utils.monitor imports asyncio (4 MiB of modules in every process that connects).
            frames = self._monitor.recv_multipart()
            event = struct.unpack("=H", frames[0][:2])[0] if frames and len(frames[0]) >= 6 else 0
            if event == zmq.EVENT_DISCONNECTED:
                self.disconnects += 1
                self._lost = True
            elif event == zmq.EVENT_CONNECT_RETRIED:
                if self._refused_since is None:
                    self._refused_since = time.monotonic()
            elif event == zmq.EVENT_CONNECTED:
                self._refused_since = None
            else:
                self._failed.add(event)

    def _drain(self) -> bool:
        """Take in the monitor's events; whether the socket's connection was lost since the last look."""
        self._events()
        lost, self._lost = self._lost, False
        return lost

    def _handshake_failure(self, what: str) -> PeerHandshakeError | None:
        """The error for the CURVE handshakes that failed since the last look, None if none did."""
        self._events()
        seen, self._failed = self._failed, set()
        if zmq.EVENT_HANDSHAKE_FAILED_AUTH in seen:
            return PeerHandshakeError(f"peer {self.address} refused the CURVE key of this job for {what}: it serves "
                                      f"another job (another peer token)")
        if seen:
            return PeerHandshakeError(f"peer {self.address} failed the CURVE handshake for {what}: the server there "
                                      f"does not hold the key {self.server_key} published for that address (or "
                                      f"does not speak CURVE, or it closed during the handshake); nothing was "
                                      f"sent to it")
        return None

    def _send(self, op: str, what: str, **fields: Any) -> int:
        rid = next(self._ids)
        fields = {k: v for k, v in fields.items() if v is not None}
        wait = min(self._timeout, CONNECT_TIMEOUT_S)
        try:
            self._wait_connected(time.monotonic() + wait, what)
            self._sock.send(msgpack.packb({"v": VERSION, "id": rid, "token": self._token, "op": op, **fields},
                                          use_bin_type=True), zmq.NOBLOCK)
        except zmq.Again:
            failed = self._handshake_failure(what)
            if failed is not None:
                raise failed from None
            raise PeerUnreachableError(f"peer {self.address}: no reply to {what} within {wait:g}s: nothing accepted "
                                       f"a connection at that address") from None
        return rid

    def _wait_connected(self, deadline: float, what: str) -> None:
        """Until the socket can send (a live connection); zmq.Again at ``deadline``, PeerUnreachableError once the
        connection was refused for REFUSED_GRACE_S."""
        while True:
            left = deadline - time.monotonic()
            ready = dict(self._out.poll(max(1, int(left * 1000)))) if left > 0 else {}
            if ready.get(self._sock, 0) & zmq.POLLOUT:
                return
            if self._monitor in ready:
                self._events()
                since = self._refused_since
                if since is not None and time.monotonic() - since >= REFUSED_GRACE_S:
                    raise PeerUnreachableError(f"peer {self.address}: {what}: the connection was refused for "
                                               f"{REFUSED_GRACE_S:g}s: nothing listens at that address")
                continue
            if left <= 0:
                raise zmq.Again()

    def _reopen(self, what: str, resends: int) -> int:
        """Replace the socket whose connection was lost; raise once the call has lost too many connections."""
        if resends >= MAX_RESENDS:
            raise PeerUnreachableError(f"peer {self.address}: {what}: the connection was lost {resends + 1} times "
                                       f"within one request")
        log.info("peer %s: the connection carrying %s was lost; sending it again on a fresh one", self.address, what)
        failed = self._handshake_failure(what)
        if failed is not None:
            raise failed
        self._shut()
        self._open()
        return resends + 1

    def _recv(self, want: set[int], deadline: float, what: str, into: Callable[[int], Any] | None = None
              ) -> tuple[int, dict, memoryview | None]:
        """The reply to one of ``want``; _Lost once the socket's connection was lost. ``into(rid)``: a writable
        buffer of the payload's expected size, received into it (None: the payload stays libzmq's frame)."""
        while True:
            if self._lost:  # seen while a request was being sent (_wait_connected takes the monitor's events too)
                self._lost = False
                raise _Lost()
            left = deadline - time.monotonic()
            ready = dict(self._poller.poll(max(1, int(left * 1000)))) if left > 0 else {}
            if self._monitor in ready and self._drain():
                raise _Lost()
            if self._sock not in ready:
                if left > 0 and self._monitor in ready:
                    continue  # an event that was not a lost connection
                failed = self._handshake_failure(what)  # the server changed under a live connection
                if failed is not None:
                    raise failed
                raise PeerTimeoutError(f"peer {self.address}: no reply to {what} within {self._timeout:g}s")
            first = self._sock.recv(copy=False)
            try:
                header = msgpack.unpackb(first.buffer, raw=False)
            except Exception:  # noqa: BLE001
                self._discard(first)
                raise PeerError(f"peer {self.address}: malformed reply to {what}") from None
            if not isinstance(header, dict) or header.get("v") != VERSION:
                self._discard(first)
                raise PeerError(f"peer {self.address}: malformed reply to {what} (not protocol {VERSION})")
            rid = header.get("id")
            if rid not in want:
                self._discard(first)
                continue  # a late reply to a request that timed out earlier
            if not header.get("ok"):
                self._discard(first)
                code, error = header.get("code"), header.get("error")
                if code == "bad-request" and str(error).startswith("unknown op 'spans'"):
                    raise _NoSpans(rid)
                if code == "not-found":
                    raise StepNotFoundError(f"peer {self.address}: {error}")
                raise PeerError(f"peer {self.address} refused {what}: {error} ({code})")
            return rid, header, self._payload(first, into(rid) if into is not None else None, what)

    def _payload(self, first: zmq.Frame, dest: Any, what: str) -> memoryview | None:
        """The payload frame after the header ``first``: received into ``dest`` when given (memory of the
        caller's, faulted once and kept: libzmq's own buffer for it is freed at once and reused by the next
        frame, where a frame kept as it came is memory fresh from the kernel each time), else libzmq's frame."""
        if not first.more:
            return None
        if dest is None:
            frame = self._sock.recv(copy=False)
            self._discard(frame)
            return frame.buffer
        view = memoryview(dest).cast("B")
        got = self._sock.recv_into(view)
        more = self._sock.get(zmq.RCVMORE)
        if more:
            self._discard(None)
        if got != len(view):
            raise PeerError(f"peer {self.address}: {what}: reply has {got} bytes, expected {len(view)}")
        return view

    def _discard(self, frame: zmq.Frame | None) -> None:
        """Receive and drop what is left of the message whose last frame received was ``frame``."""
        more = frame.more if frame is not None else True
        while more:
            more = self._sock.recv(copy=False).more

    def _call(self, op: str, what: str, **fields: int | None) -> tuple[dict, zmq.Frame | None]:
        with self._lock:
            self._check_open()
            deadline, resends = time.monotonic() + self._timeout, 0
            while True:
                if self._drain():  # lost while idle: its queue may hold nothing live
                    resends = self._reopen(what, resends)
                rid = self._send(op, what, **fields)
                try:
                    _, header, payload = self._recv({rid}, deadline, what)
                    return header, payload
                except _Lost:
                    resends = self._reopen(what, resends)
                    self.resent += 1

    def steps(self) -> list[int]:
        header, _ = self._call("steps", "a steps request")
        steps = header.get("steps", [])
        if not isinstance(steps, list) or not all(type(s) is int and s >= 0 for s in steps):
            raise PeerError(f"peer {self.address}: malformed reply to a steps request")
        return steps

    def held(self) -> list[list]:
        header, _ = self._call("held", "a held request")
        held = header.get("held")
        if not isinstance(held, list):
            raise PeerError(f"peer {self.address}: malformed reply to a held request")
        return held

    def about(self) -> dict[str, Any]:
        header, _ = self._call("about", "an about request")
        about = header.get("about")
        if not isinstance(about, dict):
            raise PeerError(f"peer {self.address}: malformed reply to an about request")
        return about

    def manifest(self, step: int, process: int | None = None) -> bytes:
        parts: list[bytes] = []
        got, size = 0, None
        what = f"the manifest of step {step}" + (f" of process {process}" if process is not None else "")
        while size is None or got < size:
            header, payload = self._call("manifest", what, step=step, offset=got, process=process)
            size, part = header.get("size"), bytes(payload) if payload is not None else b""
            if not isinstance(size, int) or size > MAX_MANIFEST_BYTES or (got + len(part) < size and not part):
                raise PeerError(f"peer {self.address}: malformed manifest reply for step {step} (size {size!r})")
            parts.append(part)
            got += len(part)
        return b"".join(parts)

    def read(self, step: int, offset: int, nbytes: int, process: int | None = None) -> memoryview:
        what = f"step {step} range {offset}+{nbytes}" + (f" of process {process}" if process is not None else "")
        parts = self._parts(offset, nbytes, None)
        # Frames land in one aligned buffer of the range's own (a restore keeps it as the array's memory: lent)
        out = memoryview(hostbuf.empty(nbytes, np.uint8))
        for _ in self._pipeline(step, [(0, p) for p in parts], process, what,
                                into=lambda _, part: out[part[0] - offset:part[0] - offset + part[1]]):
            pass
        return out

    def read_spans(self, step: int, spans: Sequence[Span], process: int | None = None, *, manifest: bool = False
                   ) -> Iterator[tuple[int, memoryview, tuple[int, int] | None]]:
        what = f"step {step}: {len(spans)} range(s)" + (f" of process {process}" if process is not None else "")
        parts = self._group([(i, p) for i, sp in enumerate(spans) for p in self._parts(sp.offset, sp.nbytes, sp.chunk)],
                            spans, self._request_room(step, process))
        if manifest:
            parts.insert(0, (-1, _MANIFEST))
        whole: dict[int, list] = {}  # a span of several frames: [buffer, parts left, before, after]
        paged = False

        def into(i: int, part: Any) -> memoryview | None:
            if i == -1:
                return None
            if isinstance(part, _Group):
                return memoryview(hostbuf.empty(part.nbytes, np.uint8))
            sp, (o, n, _) = spans[i], part
            if n == sp.nbytes:
                return memoryview(hostbuf.empty(n, np.uint8))
            w = whole.setdefault(i, [hostbuf.empty(sp.nbytes, np.uint8), -(-sp.nbytes // self._read_bytes), 0, 0])
            return memoryview(w[0])[o - sp.offset:o - sp.offset + n]
        for i, part, header, buf in self._pipeline(step, parts, process, what, into=into):
            if i == -1:
                size = header.get("size")
                if not isinstance(size, int) or size > MAX_MANIFEST_BYTES or size < len(buf):
                    raise PeerError(f"peer {self.address}: malformed manifest reply for step {step} (size {size!r})")
                if size == len(buf):
                    yield -1, buf, None
                else:  # longer than a frame: paged once the spans are in
                    paged = True
                continue
            if isinstance(part, _Group):
                rests = header.get("rests")
                if not (isinstance(rests, list) and len(rests) == len(part.members)):
                    raise PeerError(f"peer {self.address}: {what}: malformed reply to a spans request")
                at = 0
                for (j, (o, n, chunk)), rest in zip(part.members, rests):
                    yield j, buf[at:at + n], self._rest(rest, chunk, o, n, what)
                    at += n
                continue
            o, n, part_chunk = part
            sp = spans[i]
            rest = self._rest(header.get("rest"), part_chunk, o, n, what)
            if n == sp.nbytes:
                yield i, buf, rest
                continue
            w = whole[i]  # the frame was received into its place (into)
            w[1] -= 1
            if rest is not None:  # the span's: before its first frame, after its last
                w[2] = rest[0] if o == sp.offset else w[2]
                w[3] = rest[1] if o + n == sp.offset + sp.nbytes else w[3]
            if not w[1]:
                del whole[i]
                yield i, memoryview(w[0]), ((w[2], w[3]) if sp.chunk is not None else None)
        if paged:
            yield -1, memoryview(self.manifest(step, process)), None

    def _rest(self, rest: Any, chunk: Any, o: int, n: int, what: str) -> tuple[int, int] | None:
        """A reply's crc32c of the rest of the chunk of range ``o``+``n``, checked (None where it names no chunk)."""
        if chunk is None:
            return None
        if not (isinstance(rest, list) and len(rest) == 2 and all(type(v) is int and 0 <= v < 1 << 32 for v in rest)):
            raise PeerError(f"peer {self.address}: {what}: the reply for {o}+{n} lacks the crc32c of the rest of "
                            f"its chunk")
        return rest[0], rest[1]

    def _request_room(self, step: int, process: int | None) -> int:
        """Bytes left for the ranges of a ``spans`` request of ``step`` within MAX_REQUEST_BYTES."""
        fields = {"v": VERSION, "id": 1 << 62, "token": self._token, "op": "spans", "step": step, "spans": []}
        if process is not None:
            fields["process"] = process
        return MAX_REQUEST_BYTES - len(msgpack.packb(fields, use_bin_type=True)) - 4  # the list's longer header

    def _group(self, parts: list, spans: Sequence[Span], room: int) -> list:
        """``parts`` with the spans smaller than a frame taken together: a ``spans`` request for each frame's worth
        of them, as many as its ``room`` bytes (and MAX_SPANS) hold; a span of a frame or more keeps its requests
        (the server sends those zero-copy)."""
        out: list = []
        run: list = []
        nbytes = packed = 0

        def close() -> None:
            if len(run) == 1:
                out.append(run[0])
            elif run:
                out.append((-2, _Group(list(run), nbytes)))
            run.clear()
        for key, part in parts:
            n = part[1]
            if n >= self._read_bytes or n != spans[key].nbytes:
                out.append((key, part))
                continue
            size = 1 + sum(map(_int_bytes, (part[0], n, *(part[2] or ()))))  # its msgpack list
            if nbytes + n > self._read_bytes or packed + size > room or len(run) == MAX_SPANS:
                close()
                nbytes = packed = 0
            run.append((key, part))
            nbytes += n
            packed += size
        close()
        return out

    def rebuild(self, step: int, process: int, stripe: int, unit: int, lo: int, hi: int,
                sources: dict[int, PeerAddress]) -> memoryview:
        what = f"a rebuild of step {step} stripe {stripe} unit {unit} bytes {lo}..{hi}"
        agents: dict[PeerAddress, int] = {}
        pairs = [[int(q), agents.setdefault(tuple(a), len(agents))] for q, a in sorted(sources.items())]
        # the peer's own reads of the other units must end (and say why) before this request times out
        extra = {"stripe": stripe, "unit": unit, "timeout_ms": int(self._timeout * 800),
                 "agents": [list(a) for a in agents], "sources": pairs}
        out = memoryview(hostbuf.empty(hi - lo, np.uint8))
        # A rebuild's parts stay whole frames: each part is a rebuild at the holder, which reads and checks every
        # other unit's span of it; smaller parts would repeat that work
        parts = [(0, p) for p in self._parts(lo, hi - lo, None, self._frame_bytes)]
        for _ in self._pipeline(step, parts, process, what, op="rebuild", extra=extra,
                                into=lambda _, part: out[part[0] - lo:part[0] - lo + part[1]]):
            pass
        return out

    def _parts(self, offset: int, nbytes: int, chunk, size: int = 0) -> list[tuple[int, int, list | None]]:
        """The requests of one range: at most ``size`` (default ``_read_bytes``) each. Of a range checked against its chunk, only the
        first part asks for the crc32c of the chunk's bytes before the range and only the last for those after
        it (each names as its chunk the chunk's part up to, or from, its own bytes): every part naming the whole
        chunk would make the server checksum nearly the whole chunk once per part."""
        end, step = offset + nbytes, size or self._read_bytes
        if chunk is None or nbytes <= step:
            c = list(chunk) if chunk is not None else None
            return [(o, min(step, end - o), c) for o in range(offset, end, step)] or [(offset, 0, c)]
        lo, hi = chunk[0], chunk[0] + chunk[1]
        out = []
        for o in range(offset, end, step):
            n = min(step, end - o)
            c = [lo, o + n - lo] if o == offset else [o, hi - o] if o + n == end else None
            out.append((o, n, c))
        return out

    def _pipeline(self, step: int, parts: list, process: int | None, what: str, *, op: str = "read",
                  extra: dict | None = None, into: Callable[[Any, tuple], Any] | None = None) -> Iterator[tuple]:
        """Send ``parts`` ([(key, (offset, nbytes, chunk))]), at most the window in flight, the next ones sent
        before a reply is handed on (the peer sends while the caller works); yields (key, part, header, payload
        buffer) as replies arrive. ``into(key, part)``: where a part's payload is received (None: libzmq's frame).
        A lost connection sends what was in flight again on a fresh one."""
        with self._lock:
            self._check_open()
            deadline, resends = time.monotonic() + self._timeout, 0
            pending: dict[int, tuple] = {}
            todo = iter(parts)

            def send(key, part) -> None:
                if part is _MANIFEST:
                    pending[self._send("manifest", what, step=step, offset=0, process=process)] = (key, part)
                    return
                if isinstance(part, _Group):
                    if not self._spans:  # a peer of an older jaxckpt: a request per range
                        for member in part.members:
                            send(*member)
                        return
                    ranges = [[o, n, *c] if c is not None else [o, n] for _, (o, n, c) in part.members]
                    pending[self._send("spans", what, step=step, spans=ranges, process=process)] = (key, part)
                    return
                o, n, chunk = part
                pending[self._send(op, what, step=step, offset=o, nbytes=n, process=process, chunk=chunk,
                                   **(extra or {}))] = (key, part)
            if self._drain():
                resends = self._reopen(what, resends)
            # At most the window's count of requests in flight, or more of small ones as long as their bytes stay
            # within the window's count of whole frames: a many-array read asks for thousands of ranges of a few
            # KiB, and 4 of them in flight at a time left it waiting a round trip per 4 ranges.
            budget, inflight = self._window * self._frame_bytes, 0
            ahead = next(todo, None)

            def size(item: tuple) -> int:
                part = item[1]
                return self._frame_bytes if part is _MANIFEST else part.nbytes if isinstance(part, _Group) else part[1]

            def fill() -> None:
                nonlocal ahead, inflight
                while ahead is not None and (len(pending) < self._window or (
                        len(pending) < MAX_IN_FLIGHT and inflight + size(ahead) <= budget)):
                    send(*ahead)
                    inflight += size(ahead)
                    ahead = next(todo, None)
            while True:
                fill()
                if not pending:
                    return
                try:
                    rid, header, payload = self._recv(set(pending), deadline, what,
                                                      (lambda r: into(*pending[r])) if into is not None else None)
                except _Lost:
                    resends = self._reopen(what, resends)
                    again = list(pending.values())
                    self.resent += len(again)
                    pending.clear()
                    for key, part in again:
                        send(key, part)
                    continue
                except _NoSpans as e:
                    if self._spans:
                        log.info("peer %s serves no spans requests (an older jaxckpt): a request per range",
                                 self.address)
                    self._spans = False
                    send(*pending.pop(e.rid))  # its ranges one a request; their bytes stay counted in flight
                    continue
                key, part = pending.pop(rid)
                inflight -= size((key, part))
                buf = payload if payload is not None else memoryview(b"")
                if part is not _MANIFEST and len(buf) != size((key, part)):
                    raise PeerError(f"peer {self.address}: {what}: reply has {len(buf)} bytes, expected {part[1]}")
                fill()
                deadline = time.monotonic() + self._timeout  # progress resets the clock
                yield key, part, header, buf

    def _check_open(self) -> None:
        if self._closed:
            raise PeerError(f"client of peer {self.address} is closed")

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._shut()
