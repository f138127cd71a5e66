"""A loopback TCP proxy that delays or drops peer-transport traffic, for ``jaxckpt chaos``'s peer faults.

The chaos driver starts one in front of a node agent's peer endpoint and rewrites that agent's ``peer.addr``
(peer_files.py) to name the proxy, so that every other node's restore reads and protection pulls from that
node cross it. The proxy works on the TCP byte stream under ZeroMQ, so what it does is what a network does:

  delay   hold a piece of the stream for a random time before passing it on (the order is kept);
  reset   lose the piece and close both ends (ZeroMQ reconnects; requests in flight get no reply);
  stall   lose everything on the connection for a random time (an unreachable peer), then close it.

A proxy made with ``armed=False`` passes everything untouched until :meth:`PeerProxy.arm`. Everything is
bounded: at most ``max_connections`` proxied connections (two threads each; more are refused), at most
``max_drops`` resets and stalls in the proxy's life, every socket operation has a time-out, and
:meth:`PeerProxy.close` ends every thread. The random choices come from the ``seed``, so a trial's plan of
faults is reproducible (their timing follows the traffic).
"""
from __future__ import annotations

import logging
import random
import socket
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("jaxckpt.tools.chaos.proxy")

PIECE = 64 << 10
POLL_S = 0.1  # how often a blocked thread looks at the stop flag


@dataclass
class ProxyStats:
    """What crossed the proxy and what it did to it."""

    connections: int = 0
    refused: int = 0
    pieces: int = 0
    bytes: int = 0
    delayed: int = 0
    delay_s: float = 0.0
    resets: int = 0
    stalls: int = 0
    stall_s: float = 0.0  # the stalls' lengths as drawn (a stall also ends when either end closes the link)

    def summary(self) -> str:
        return (f"{self.connections} connections, {self.pieces} pieces ({self.bytes} bytes): {self.delayed} delayed "
                f"({self.delay_s:.2f} s in all), {self.resets} reset, {self.stalls} stalled")


@dataclass
class _Link:
    client: socket.socket
    server: socket.socket
    closed: threading.Event = field(default_factory=threading.Event)
    stall_until: float = 0.0  # while stalled, both directions lose what they read
    _ended: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def shutdown(self) -> None:
        """Wake both directions; the sockets are closed by the last one to end (never under a running recv)."""
        self.closed.set()
        for s in (self.client, self.server):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def ended(self) -> None:
        self.shutdown()
        with self._lock:
            self._ended += 1
            last = self._ended == 2
        if last:
            self.client.close()
            self.server.close()


def parse_tcp(address: str) -> tuple[str, int]:
    """("127.0.0.1", 5555) of "tcp://127.0.0.1:5555"."""
    if not address.startswith("tcp://") or ":" not in address[6:]:
        raise ValueError(f"not a tcp:// address: {address!r}")
    host, port = address[6:].rsplit(":", 1)
    return host, int(port)


class PeerProxy:
    """Forward ``127.0.0.1:<port>`` (``.address``) to ``target``, delaying or dropping pieces of the stream.

    ``delay_p``: chance that a piece is held back, for up to ``delay_max_s``; ``drop_p``: chance that a piece
    is dropped, while fewer than ``max_drops`` were (half of the drops reset the connection, half stall it for
    up to ``stall_max_s`` before closing it; ``drops`` names the one kind to use instead of both).
    """

    def __init__(self, target: str, *, seed: int, delay_p: float = 0.0, delay_max_s: float = 0.0,
                 drop_p: float = 0.0, max_drops: int = 0, stall_max_s: float = 0.0, max_connections: int = 64,
                 io_timeout_s: float = 10.0, armed: bool = True,
                 drops: tuple[str, ...] = ("reset", "stall")) -> None:
        if not drops or set(drops) - {"reset", "stall"}:
            raise ValueError(f"drops must name 'reset' and/or 'stall', got {drops!r}")
        self.drops = tuple(drops)
        self.target = parse_tcp(target)
        self.delay_p, self.delay_max_s, self.drop_p, self.max_drops = delay_p, delay_max_s, drop_p, max_drops
        self.stall_max_s, self.max_connections, self.io_timeout_s = stall_max_s, max_connections, io_timeout_s
        self.stats = ProxyStats()
        self._armed = threading.Event()  # until armed, everything passes untouched
        if armed:
            self._armed.set()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._links: list[_Link] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(POLL_S)
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._spawn(self._accept_loop, "jaxckpt-chaos-proxy")

    def _spawn(self, fn, name: str, *args) -> None:
        t = threading.Thread(target=fn, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)
        t.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                break  # closed
            with self._lock:
                live = sum(not link.closed.is_set() for link in self._links)
            if live >= self.max_connections:
                self.stats.refused += 1
                client.close()
                continue
            try:
                server = socket.create_connection(self.target, timeout=self.io_timeout_s)
            except OSError as e:  # the endpoint is gone: the client sees a closed connection, as it would
                log.info("proxy %s: cannot reach %s:%d: %s", self.address, *self.target, e)
                client.close()
                continue
            link = _Link(client, server)
            for s in (client, server):
                s.settimeout(POLL_S)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._links = [x for x in self._links if not x.closed.is_set()] + [link]
                self.stats.connections += 1
            self._spawn(self._pump, "jaxckpt-chaos-proxy-up", link, client, server)
            self._spawn(self._pump, "jaxckpt-chaos-proxy-down", link, server, client)

    def arm(self) -> None:
        """Start delaying and dropping (a proxy made with ``armed=False`` passes everything until then)."""
        self._armed.set()

    def _decide(self) -> tuple[str, float]:
        """("pass" | "delay" | "reset" | "stall", seconds) for the next piece."""
        if not self._armed.is_set():
            return "pass", 0.0
        with self._lock:
            x = self._rng.random()
            if x < self.drop_p and self.stats.resets + self.stats.stalls < self.max_drops:
                reset = self._rng.random() < 0.5 if len(self.drops) == 2 else self.drops[0] == "reset"
                if reset:
                    self.stats.resets += 1
                    return "reset", 0.0
                self.stats.stalls += 1
                seconds = self._rng.uniform(0, self.stall_max_s)
                self.stats.stall_s += seconds
                return "stall", seconds
            if self._rng.random() < self.delay_p:
                d = self._rng.uniform(0, self.delay_max_s)
                self.stats.delayed += 1
                self.stats.delay_s += d
                return "delay", d
            return "pass", 0.0

    def _pump(self, link: _Link, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not (self._stop.is_set() or link.closed.is_set()):
                if link.stall_until and time.monotonic() >= link.stall_until:
                    break  # the end of a stall: the connection goes
                try:
                    piece = src.recv(PIECE)
                except socket.timeout:
                    continue
                if not piece:
                    break
                if link.stall_until:
                    continue  # lost
                with self._lock:
                    self.stats.pieces += 1
                    self.stats.bytes += len(piece)
                what, seconds = self._decide()
                if what == "reset":
                    break
                if what == "stall":
                    link.stall_until = time.monotonic() + seconds
                    continue
                if what == "delay" and self._stop.wait(seconds):
                    break
                self._send(dst, piece)
        except OSError:
            pass  # the other direction closed the link, or a peer reset it
        finally:
            link.ended()

    def _send(self, dst: socket.socket, piece: bytes) -> None:
        deadline = time.monotonic() + self.io_timeout_s
        view = memoryview(piece)
        while view:
            if self._stop.is_set() or time.monotonic() > deadline:
                raise OSError("the receiver stopped reading")
            try:
                view = view[dst.send(view):]
            except socket.timeout:
                continue

    def close(self) -> None:
        """Stop: close the listener and every proxied connection, and end every thread."""
        self._stop.set()
        self._listener.close()
        with self._lock:
            links, threads = list(self._links), list(self._threads)
        for link in links:
            link.shutdown()
        for t in threads:
            t.join(timeout=self.io_timeout_s + 1)
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            log.warning("proxy %s: threads still running after close: %s", self.address, alive)

    def __enter__(self) -> "PeerProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
