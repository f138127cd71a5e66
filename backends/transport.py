"""The ZeroMQ peer transport ("zmq" in the registry's group "transport", ``Config.transport``'s default): a
process (or a node agent) serves committed snapshots; others fetch manifests and ranges.

It implements the interface of ``jaxckpt.core.transport`` (:class:`Transport` makes servers and clients; its
names are also importable from here). A server serves a ``ServedHolder``: one process's store
(:class:`StoreHolder`), or a node agent's memory holding the snapshots of every process of its node. Wire
protocol, version 1 (msgpack maps, never pickle):

  request (one frame)  {"v": 1, "id": n, "token": bytes, "op": "steps"|"manifest"|"read"|"spans"|"held", "step",
                        "offset", "nbytes", "process", "chunk", "spans"}
  reply (two frames)   {"v": 1, "id": n, "ok": bool, "code": "", "error": "", "steps": [...], "size", "held",
                        "rest", "rests"}, payload
A read may name the chunk that holds its range (``chunk``: [offset, nbytes]); its reply then carries ``rest``,
the crc32c of the chunk's bytes before and after the range, so that the client checks the bytes it got against
the chunk's crc32c without reading the whole chunk (``jaxckpt.core.checksum.span_crc``).
``spans`` asks for several small ranges in one request (``spans``: [[offset, nbytes] or [offset, nbytes, chunk
offset, chunk nbytes], ...], at most ``MAX_SPANS``, together at most a frame, the request within
``MAX_REQUEST_BYTES`` as every request): the payload is their bytes one after another, ``rests`` each one's
``rest`` (None where it names no chunk). A many-array read asks for thousands
of ranges of a few KiB, and a request each cost both ends more Python than the bytes cost to move.
A manifest is paged: each reply carries at most one frame from ``offset`` and the manifest's total ``size``.
``rebuild`` (a node agent holding a parity stripe, ``ServedHolder.rebuild``) asks for bytes [offset, offset +
nbytes) of unit ``unit`` of ``stripe``, whose parity is in protection slot ``process``, rebuilt there: the request
names where the other units' processes are (``agents``: [[address, token, CURVE key], ...]; ``sources``:
[[process, index in agents], ...]) and the milliseconds each of those reads may take (``timeout_ms``); the reply's
payload is the result alone. It runs on a worker thread of the server (it reads other servers, which may be
rebuilding from this one), and its reply is sent by the server thread once done.
``process`` (optional) names the saving process whose snapshot is meant; without it, a store's server means its
own process. ``held`` lists every (process, step) the source holds as ``jaxckpt.core.sources.HeldEntry`` wire lists;
``about`` says what serves (``ServedHolder.about``: a node agent's node, job and generation), for a peer that knows
only the address (``jaxckpt.backends.agent.rendezvous``).

Every request carries the job's shared token, compared with ``hmac.compare_digest``; a request with a wrong
or missing token is refused (logged, nothing served). With ``curve=True`` (``serve``) and a ``server_key``
(``connect``) the connection is ZeroMQ CURVE (``jaxckpt.backends.curve``): encrypted, the server proven by the
key published for its address (or, for a node agent reached by address alone, ``serve(token_key=True)``, the key
derived from the job's token), the client by the job's key, any other key refused in the handshake. ``serve(port=N)``
listens on a port known beforehand instead of an ephemeral one.
Requests are at most ``MAX_REQUEST_BYTES``; a read returns at most ``frame_bytes`` per reply and the client
splits larger ranges (bounded messages both ways).
Every wait has a time-out. The server thread sends zero-copy from a pinned ``store.open(step)`` view and keeps
the view pinned until ZeroMQ has finished with the bytes, so a step deleted meanwhile is never torn. The server
heartbeats its connections and drops a silent one; the client (``jaxckpt.backends.zmq_client``) sends the
requests a lost connection carried again on a fresh one.
"""
from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import zmq

from jaxckpt.core.checksum import crc32c
from jaxckpt.core.store import SnapshotView, Store
from jaxckpt.core.transport import (PeerClient, PeerServer, ServedHolder, Span, Transport,  # noqa: F401 - kept names
                                    get_transport)
from jaxckpt.errors import PeerError, StepNotFoundError

log = logging.getLogger("jaxckpt.backends.transport")

VERSION = 1
MAX_REQUEST_BYTES = 4096  # a spans request too: the client packs as many ranges as fit
MAX_SPANS = 1024
DEFAULT_FRAME_BYTES = 16 << 20
HEADER_SLACK = 4096  # a reply header is far below this
OPS = ("steps", "manifest", "read", "spans", "held", "rebuild", "about")
WORKERS = 4  # rebuilds a server runs at once (each waits mostly for other servers)
# A request waits at most this long for a connection to exist: a restarted agent listens on a new port, and
# ZeroMQ would otherwise queue requests for the dead one's address until the whole peer time-out ran out.
CONNECT_TIMEOUT_S = 2.0
# A server pings each client connection this often and drops one that answers nothing for the time-out: a link
# that stopped passing bytes (a black-holed route, a stalled middlebox), whose client then sees its connection
# lost and sends its requests again on a fresh one (jaxckpt.backends.zmq_client) instead of waiting out its
# whole peer time-out. A pong queues behind the reply being sent, so the time-out is also what the slowest link
# may take to carry the last of a frame after a ping.
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 500, 2000


class StoreHolder(ServedHolder):
    """One process's Store as a ServedHolder (its own process only)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.label = f"process {store.process_index}"
        self._entries: dict[tuple[int, int], list] = {}  # (step, manifest crc) -> entry

    def steps(self, process: int | None) -> list[int]:
        return self.store.steps() if process in (None, self.store.process_index) else []

    def open(self, process: int | None, step: int) -> SnapshotView | None:
        return self.store.open(step) if process in (None, self.store.process_index) else None

    def held(self) -> list[list]:
        from jaxckpt.core.checksum import crc32c
        from jaxckpt.errors import ManifestError
        from jaxckpt.core.sources import held_entry

        out = []
        for step in self.store.steps():
            view = self.store.open(step)
            if view is None:
                continue
            with view:
                key = (step, crc32c(view.manifest))
                if key not in self._entries:
                    try:
                        self._entries[key] = held_entry(view.manifest).to_wire()
                    except ManifestError:  # not a jaxckpt manifest (a raw store in a test): listed, unusable
                        self._entries[key] = [self.store.process_index, step, 0, "", key[1]]
                out.append(self._entries[key])
        return out


# --------------------------------------------------------------------------------------------------- zmq
class ZmqTransport(Transport):
    """ROUTER server, DEALER clients, over TCP (loopback unless told otherwise)."""

    name = "zmq"

    def __init__(self, frame_bytes: int = DEFAULT_FRAME_BYTES, window: int = 4) -> None:
        self.frame_bytes = frame_bytes
        self.window = window

    def serve(self, store: Store | ServedHolder, *, token: bytes, host: str = "127.0.0.1",
              curve: bool = False, port: int = 0, token_key: bool = False) -> "ZmqServer":
        source = store if isinstance(store, ServedHolder) else StoreHolder(store)
        return ZmqServer(source, token=token, host=host, frame_bytes=self.frame_bytes, curve=curve, port=port,
                         token_key=token_key)

    def rendezvous_key(self, token: bytes) -> str:
        from jaxckpt.backends import curve

        return curve.rendezvous_keys(token)[0].decode()

    def connect(self, address: str, *, token: bytes, timeout_s: float, server_key: str = "") -> PeerClient:
        from jaxckpt.backends.zmq_client import ZmqClient  # it imports this module's protocol constants

        return ZmqClient(address, token=token, timeout_s=timeout_s, frame_bytes=self.frame_bytes,
                         window=self.window, server_key=server_key)


class _Refused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class ZmqServer(PeerServer):
    """One thread owning a ROUTER socket; reads are served zero-copy from pinned snapshot views."""

    POLL_MS = 100

    def __init__(self, source: ServedHolder, *, token: bytes, host: str, frame_bytes: int,
                 curve: bool = False, port: int = 0, token_key: bool = False) -> None:
        if not token:
            raise PeerError("a peer server needs a non-empty token")
        self._source, self._token, self._frame_bytes = source, bytes(token), frame_bytes
        self.refused_tokens = 0  # requests refused for a bad token (only the server thread counts)
        self.refused_keys = 0  # CURVE handshakes refused for a key outside the job (only the ZAP thread counts)
        self._domain = ""
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve:
            self._curve(host, token_key)
        # Larger requests make ZeroMQ drop the connection before anything is buffered; smaller but still
        # oversized ones get a clear "too-large" reply below.
        self._sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        try:
            if port:
                self._sock.bind(f"tcp://{host}:{port}")
            else:
                port = self._sock.bind_to_random_port(f"tcp://{host}")
        except BaseException:
            self._sock.close(linger=0)
            self._forget_domain()
            raise
        # A wildcard bind is reached from other hosts under this host's name.
        self.address = f"tcp://{socket.gethostname() if host in ('*', '0.0.0.0') else host}:{port}"
        self._stop = threading.Event()
        self._pinned: list[tuple[zmq.MessageTracker, SnapshotView]] = []
        self.served = 0
        # Rebuilds run on workers; each hands its reply to the server thread (the socket's only user) through
        # ``_done`` and wakes it through a pipe its poller watches.
        self._work: ThreadPoolExecutor | None = None
        self._done: deque = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)  # a full pipe already wakes the server
        self._wake_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="jaxckpt-peer-server", daemon=True)
        self._thread.start()
        log.info("serving snapshots of %s at %s%s", source.label, self.address,
                 f" (CURVE, key {self.public_key})" if curve else "")

    @property
    def refused(self) -> int:
        """Requests and connections refused: a wrong or missing token, or a CURVE key outside the job."""
        return self.refused_tokens + self.refused_keys

    def _curve(self, host: str, token_key: bool) -> None:
        from jaxckpt.backends import curve

        curve.require_curve(f"a CURVE peer server on {host!r}")
        # the secret goes into the socket only; derived from the token where peers reach us by address alone
        public, secret = curve.rendezvous_keys(self._token) if token_key else zmq.curve_keypair()
        self._sock.curve_server = True
        self._sock.curve_secretkey = secret
        self._sock.curve_publickey = public
        self.public_key = public.decode()
        self._domain = curve.register_domain(curve.client_keys(self._token)[0], self._refuse_key)
        self._sock.zap_domain = self._domain.encode()

    def _refuse_key(self, key: bytes) -> None:
        self.refused_keys += 1
        if self.refused_keys <= 10 or self.refused_keys % 1000 == 0:
            log.warning("peer server at %s refused a CURVE client key outside the job (%s; %d keys refused so "
                        "far)", getattr(self, "address", "?"), key.decode(errors="replace"), self.refused_keys)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                self._release_sent()
                if not poller.poll(self.POLL_MS):
                    continue
                self._send_done()
                while True:
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(frames)
        except Exception:  # noqa: BLE001 - a dead server thread must at least say why
            log.exception("peer server at %s stopped", self.address)
        finally:
            if self._work is not None:
                self._work.shutdown(wait=False, cancel_futures=True)
            self._sock.close(linger=0)
            for _, view in self._pinned:
                view.close()
            self._pinned.clear()

    def _release_sent(self) -> None:
        if self._pinned:
            keep = []
            for tracker, view in self._pinned:
                if tracker.done:
                    view.close()
                else:
                    keep.append((tracker, view))
            self._pinned = keep

    def _handle(self, frames: list[zmq.Frame]) -> None:
        ident, body = frames[0], frames[1:]
        rid = None
        try:
            if len(body) != 1:
                raise _Refused("bad-request", f"expected one request frame, got {len(body)}")
            raw = body[0].buffer
            if len(raw) > MAX_REQUEST_BYTES:
                raise _Refused("too-large", f"request of {len(raw)} bytes exceeds the {MAX_REQUEST_BYTES}-byte limit")
            try:
                req = msgpack.unpackb(raw, raw=False, max_bin_len=MAX_REQUEST_BYTES, max_str_len=MAX_REQUEST_BYTES)
            except Exception as e:  # msgpack raises several unrelated types on garbage
                raise _Refused("bad-request", f"request is not msgpack ({type(e).__name__})") from None
            if not isinstance(req, dict):
                raise _Refused("bad-request", "request is not a msgpack map")
            rid = req.get("id") if isinstance(req.get("id"), int) else None
            token = req.get("token")
            if not isinstance(token, bytes) or not hmac.compare_digest(token, self._token):
                self.refused_tokens += 1
                if self.refused_tokens <= 10 or self.refused_tokens % 1000 == 0:
                    log.warning("refused a request from %s: wrong or missing token (%d refused so far)",
                                _peer_address(ident), self.refused_tokens)
                raise _Refused("auth", "refused: wrong or missing token")
            self._serve(ident, rid, req)
        except _Refused as e:
            self._reply(ident, rid, ok=False, code=e.code, error=str(e))
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the server
            log.exception("peer request from %s failed", _peer_address(ident))
            self._reply(ident, rid, ok=False, code="internal", error=f"{type(e).__name__}: {e}")

    def _serve(self, ident: zmq.Frame, rid: int | None, req: dict) -> None:
        if req.get("v") != VERSION:
            raise _Refused("bad-request", f"protocol version {req.get('v')!r} is not supported (this is {VERSION})")
        op = req.get("op")
        if op not in OPS:
            raise _Refused("bad-request", f"unknown op {op!r}")
        process = req.get("process")
        if process is not None:
            process = _nonneg(req, "process")
        if op == "steps":
            self._reply(ident, rid, ok=True, steps=self._source.steps(process))
            return
        if op == "held":
            self._reply(ident, rid, ok=True, held=self._source.held())
            return
        if op == "about":
            self._reply(ident, rid, ok=True, about=self._source.about())
            return
        step = _nonneg(req, "step")
        if op == "rebuild":
            self._rebuild(ident.bytes, rid, process, step, req)
            return
        view = self._source.open(process, step)
        if view is None:
            whose = self._source.label if process is None else f"{self._source.label} for process {process}"
            raise _Refused("not-found", f"step {step} is not held by {whose} "
                                        f"(held: {self._source.steps(process) or 'none'})")
        if op == "spans":
            self._spans(ident, rid, view, step, req)
            return
        size = rest = None
        try:
            if op == "manifest":  # paged like reads, so that no reply exceeds a frame
                manifest = memoryview(view.manifest)
                size, offset = len(manifest), req.get("offset", 0)
                if not isinstance(offset, int) or not 0 <= offset <= size:
                    raise _Refused("bad-request", f"manifest offset {offset!r} outside 0..{size}")
                payload: Any = manifest[offset:offset + self._frame_bytes]
            else:
                offset, nbytes = _nonneg(req, "offset"), _nonneg(req, "nbytes")
                if nbytes > self._frame_bytes:
                    raise _Refused("too-large", f"read of {nbytes} bytes exceeds the {self._frame_bytes}-byte frame")
                if offset + nbytes > len(view.buffer):
                    raise _Refused("bad-request", f"range {offset}+{nbytes} runs past the end of step {step}'s "
                                                  f"{len(view.buffer)}-byte snapshot")
                payload = view.buffer[offset:offset + nbytes]
                rest = _rest_crcs(req["chunk"], view.buffer, offset, nbytes) if "chunk" in req else None
            self.served += 1  # before the reply: a client that has it sees it counted
            tracker = self._reply(ident, rid, ok=True, payload=payload, size=size, rest=rest)
        except BaseException:
            view.close()
            raise
        self._pinned.append((tracker, view))  # unpinned once ZeroMQ no longer needs the bytes

    def _spans(self, ident: zmq.Frame, rid: int | None, view: SnapshotView, step: int, req: dict) -> None:
        """Reply to a ``spans`` request from ``view``: the ranges' bytes in one payload (copied: they are small,
        and one frame of them costs less than a reply each), each one's ``rest`` beside."""
        try:
            spans, buffer = req.get("spans"), view.buffer
            if not (isinstance(spans, list) and 0 < len(spans) <= MAX_SPANS):
                raise _Refused("bad-request", f"spans must be a list of 1..{MAX_SPANS} ranges")
            parts, rests, total = [], [], 0
            for sp in spans:
                if not (isinstance(sp, list) and len(sp) in (2, 4) and all(type(v) is int and v >= 0 for v in sp)):
                    raise _Refused("bad-request", f"a span must be [offset, nbytes] or [offset, nbytes, chunk "
                                                  f"offset, chunk nbytes] of non-negative ints, got {sp!r}")
                offset, nbytes = sp[0], sp[1]
                total += nbytes
                if total > self._frame_bytes:
                    raise _Refused("too-large", f"spans of more than {self._frame_bytes} bytes exceed the "
                                                f"{self._frame_bytes}-byte frame")
                if offset + nbytes > len(buffer):
                    raise _Refused("bad-request", f"range {offset}+{nbytes} runs past the end of step {step}'s "
                                                  f"{len(buffer)}-byte snapshot")
                parts.append(buffer[offset:offset + nbytes])
                rests.append(_rest_crcs(sp[2:], buffer, offset, nbytes) if len(sp) == 4 else None)
            payload = b"".join(parts)
            self.served += 1  # before the reply: a client that has it sees it counted
            self._reply(ident, rid, ok=True, payload=payload, rests=rests)
        finally:
            view.close()

    def _rebuild(self, ident: bytes, rid: int | None, process: int | None, step: int, req: dict) -> None:
        """Start a rebuild (see the module docstring) on a worker; its reply is sent by :meth:`_send_done`."""
        if process is None:
            raise _Refused("bad-request", "a rebuild names the protection slot holding the parity (process)")
        offset, nbytes = _nonneg(req, "offset"), _nonneg(req, "nbytes")
        stripe, unit, timeout_ms = _nonneg(req, "stripe"), _nonneg(req, "unit"), _nonneg(req, "timeout_ms")
        if nbytes > self._frame_bytes:
            raise _Refused("too-large", f"rebuild of {nbytes} bytes exceeds the {self._frame_bytes}-byte frame")
        agents, pairs = req.get("agents"), req.get("sources")
        if not (isinstance(agents, list) and isinstance(pairs, list)
                and all(isinstance(a, list) and len(a) == 3 and isinstance(a[0], str) and isinstance(a[1], bytes)
                        and isinstance(a[2], str) for a in agents)
                and all(isinstance(p, list) and len(p) == 2 and all(type(v) is int for v in p)
                        and p[0] >= 0 and 0 <= p[1] < len(agents) for p in pairs)):
            raise _Refused("bad-request", "rebuild sources must be [[process, agent]] over agents [[address, token, "
                                          "CURVE key]]")
        sources = {q: tuple(agents[i]) for q, i in pairs}

        def work() -> None:
            try:
                out = self._source.rebuild(process, step, stripe, unit, offset, offset + nbytes, sources,
                                           timeout_ms / 1000)
                done = (ident, rid, True, "", "", out)
            except NotImplementedError as e:
                done = (ident, rid, False, "not-supported", str(e), b"")
            except Exception as e:  # noqa: BLE001 - the requester falls back; it gets the reason
                code = "not-found" if isinstance(e, StepNotFoundError) else "rebuild"
                if code == "rebuild":
                    log.warning("rebuild of step %d stripe %d unit %d bytes %d+%d failed: %s: %s", step, stripe,
                                unit, offset, nbytes, type(e).__name__, e)
                done = (ident, rid, False, code, f"{type(e).__name__}: {e}", b"")
            self._done.append(done)
            self._wake()
        if self._work is None:
            self._work = ThreadPoolExecutor(WORKERS, thread_name_prefix="jaxckpt-peer-rebuild")
        self._work.submit(work)

    def _wake(self) -> None:
        """Wake the server thread's poll now (a rebuild's reply to send, or a close)."""
        with self._wake_lock:  # never a write to a closed pipe's number, which another file may hold now
            try:
                if self._wake_w >= 0:
                    os.write(self._wake_w, b"\0")
            except BlockingIOError:  # a full pipe: the server wakes anyway
                pass

    def _send_done(self) -> None:
        """Send the replies of the rebuilds done since the last look (server thread)."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while self._done:
            ident, rid, ok, code, error, payload = self._done.popleft()
            self.served += ok
            self._reply(ident, rid, ok=ok, code=code, error=error, payload=payload)

    def _reply(self, ident: zmq.Frame | bytes, rid: int | None, *, ok: bool, code: str = "", error: str = "",
               steps: list[int] | None = None, payload: Any = b"", size: int | None = None,
               held: list[list] | None = None, rest: list[int] | None = None,
               about: dict | None = None, rests: list | None = None) -> zmq.MessageTracker:
        fields = {"v": VERSION, "id": rid, "ok": ok, "code": code, "error": error, "steps": steps or [], "size": size}
        if held is not None:
            fields["held"] = held
        if about is not None:
            fields["about"] = about
        if rest is not None:
            fields["rest"] = rest
        if rests is not None:
            fields["rests"] = rests
        header = msgpack.packb(fields, use_bin_type=True)
        try:
            return self._sock.send_multipart([ident if isinstance(ident, bytes) else ident.bytes, header, payload],
                                             copy=False, track=True,
                                             flags=zmq.NOBLOCK)
        except zmq.Again:
            # The peer's queue is full (it stopped reading): drop the reply, the peer times out.
            log.warning("dropped a reply to %s: its queue is full", _peer_address(ident))
            return _DONE

    def close(self) -> None:
        """Stop serving; in-flight replies are dropped (clients time out or retry elsewhere)."""
        self._stop.set()
        self._wake()  # not a poll interval later: every agent's stop and every closed store waits for this join
        self._thread.join(timeout=5)
        self._forget_domain()
        if not self._thread.is_alive():  # else the pipe stays open with the thread that polls it
            with self._wake_lock:
                if self._wake_w >= 0:  # closed once (close may be called again)
                    os.close(self._wake_r)
                    os.close(self._wake_w)
                    self._wake_r = self._wake_w = -1

    def _forget_domain(self) -> None:
        if self._domain:
            from jaxckpt.backends import curve

            curve.unregister_domain(self._domain)
            self._domain = ""


class _Done:
    done = True


_DONE: Any = _Done()


def _peer_address(ident: zmq.Frame | bytes) -> str:
    try:
        return ident.get("Peer-Address")
    except Exception:  # noqa: BLE001 - only for log messages
        return "an unknown peer"


def _rest_crcs(chunk: Any, buffer: Any, offset: int, nbytes: int) -> list[int]:
    """[crc32c before, crc32c after] the range within the chunk ``chunk`` ([offset, nbytes]) that holds it: what
    the client needs to check the range against the chunk's own crc32c (jaxckpt.core.checksum.span_crc)."""
    if not (isinstance(chunk, list) and len(chunk) == 2 and all(type(v) is int and v >= 0 for v in chunk)):
        raise _Refused("bad-request", f"chunk must be [offset, nbytes], got {chunk!r}")
    lo, n = chunk
    if not lo <= offset <= offset + nbytes <= lo + n <= len(buffer):
        raise _Refused("bad-request", f"range {offset}+{nbytes} is not inside chunk {lo}+{n} of the "
                                      f"{len(buffer)}-byte snapshot")
    return [crc32c(buffer[lo:offset]), crc32c(buffer[offset + nbytes:lo + n])]


def _nonneg(req: dict, key: str) -> int:
    v = req.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise _Refused("bad-request", f"field {key!r} must be a non-negative int, got {v!r}")
    return v
