"""The host transport beside raw loopback TCP, measured in the same run (``jaxckpt bench cluster``).

Probes, ``streams`` senders at once over 127.0.0.1:

  * raw TCP between processes: ``streams`` sender processes and ``streams`` receiver processes, each pair one
    plain socket, ``sendall`` of one buffer, received with ``recv_into`` straight into a preallocated buffer,
    all started together: the ceiling any host transport on this machine can reach (a restore's bytes also
    cross between processes: node agents to trainers);
  * raw TCP within one process (threads), as before: the GIL and one process's scheduling share show in it;
  * the peer transport (``jaxckpt.backends.transport``, ZeroMQ, as restores use it): a peer server over an
    in-memory snapshot, ``streams`` clients each reading ranges of ``chunk_bytes``, as a restore's fetch threads do.

Each returns bytes, seconds and GB/s; the bench reports the transport's share of the raw bandwidth.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

__all__ = ["tcp_gbps", "tcp_gbps_processes", "transport_gbps"]


def tcp_gbps(nbytes: int = 256 << 20, streams: int = 4, piece: int = 4 << 20) -> dict[str, Any]:
    """Raw loopback TCP: ``streams`` connections each carrying ``nbytes / streams``, received into a buffer."""
    per = max(piece, nbytes // streams)
    src = np.random.default_rng(0).integers(0, 255, per, dtype=np.uint8).tobytes()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.listen(streams)
    port = listener.getsockname()[1]
    errors: list[BaseException] = []

    def send() -> None:
        try:
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(src)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def receive(conn: socket.socket) -> None:
        try:
            with conn:
                _receive_into(conn, per, piece)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    try:
        t0 = time.perf_counter()
        senders = [threading.Thread(target=send, daemon=True) for _ in range(streams)]
        for t in senders:
            t.start()
        receivers = []
        for _ in range(streams):
            conn, _ = listener.accept()
            r = threading.Thread(target=receive, args=(conn,), daemon=True)
            r.start()
            receivers.append(r)
        for t in senders + receivers:
            t.join(120)
        seconds = time.perf_counter() - t0
    finally:
        listener.close()
    if errors:
        raise RuntimeError(f"loopback TCP probe failed: {errors[0]}")
    total = per * streams
    return {"bytes": total, "seconds": seconds, "gbps": total / seconds / 1e9, "streams": streams}


def _receive_into(conn: socket.socket, nbytes: int, piece: int) -> None:
    view, got = memoryview(bytearray(nbytes)), 0
    while got < nbytes:
        n = conn.recv_into(view[got:], min(piece, nbytes - got))
        if n == 0:
            raise ConnectionError(f"stream ended after {got} of {nbytes} bytes")
        got += n


def _pair_main(role: str, port: int, nbytes: int, piece: int) -> None:
    """One process of :func:`tcp_gbps_processes` (``python -m jaxckpt.tools.bench.loopback ROLE ...``).

    receiver: listen, print the port, accept, print "ready", wait for "go" on stdin, send one byte to the
    sender, receive ``nbytes``, print the monotonic start and end. sender: connect, wait for that byte, send."""
    if role == "receiver":
        with socket.create_server(("127.0.0.1", 0)) as listener:
            print(listener.getsockname()[1], flush=True)
            conn, _ = listener.accept()
        with conn:
            print("ready", flush=True)
            sys.stdin.readline()
            t0 = time.monotonic()
            conn.sendall(b"g")
            _receive_into(conn, nbytes, piece)
            print(f"{t0} {time.monotonic()}", flush=True)
    else:
        src = bytes(nbytes)
        with socket.create_connection(("127.0.0.1", port)) as s:
            if s.recv(1) != b"g":
                raise ConnectionError("no start byte")
            s.sendall(src)


def tcp_gbps_processes(nbytes: int = 256 << 20, streams: int = 4, piece: int = 4 << 20,
                       timeout_s: float = 120.0) -> dict[str, Any]:
    """Raw loopback TCP between processes: ``streams`` sender/receiver process pairs, released together, each
    carrying ``nbytes / streams``; GB/s over the span from the first start to the last end."""
    per = max(piece, nbytes // streams)
    cmd = [sys.executable, "-m", "jaxckpt.tools.bench.loopback"]
    procs: list[subprocess.Popen] = []
    try:
        receivers = [subprocess.Popen([*cmd, "receiver", "0", str(per), str(piece)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True) for _ in range(streams)]
        procs += receivers
        ports = [int(r.stdout.readline()) for r in receivers]
        procs += [subprocess.Popen([*cmd, "sender", str(p), str(per), str(piece)]) for p in ports]
        for r in receivers:
            if r.stdout.readline().strip() != "ready":
                raise RuntimeError("loopback TCP probe: a receiver did not get its connection")
        for r in receivers:
            r.stdin.write("go\n")
            r.stdin.flush()
        spans = []
        for r in receivers:
            line = r.stdout.readline().split()
            if len(line) != 2:
                raise RuntimeError("loopback TCP probe: a receiver ended early")
            spans.append((float(line[0]), float(line[1])))
        for p in procs:
            if p.wait(timeout_s) != 0:
                raise RuntimeError(f"loopback TCP probe: a process exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    seconds = max(e for _, e in spans) - min(s for s, _ in spans)
    total = per * streams
    return {"bytes": total, "seconds": seconds, "gbps": total / seconds / 1e9, "streams": streams,
            "processes": 2 * streams}


def _snapshot_source(buf: memoryview) -> Any:
    """One immutable snapshot held in memory (process 0, step 1), as the peer server serves a store's."""
    from jaxckpt.core.transport import ServedHolder
    from jaxckpt.core.store import SnapshotView

    class View(SnapshotView):
        def __init__(self) -> None:
            self.step, self.manifest, self.buffer = 1, b"", buf

        def close(self) -> None:
            pass

    class Served(ServedHolder):
        label = "loopback probe"

        def steps(self, process: int | None) -> list[int]:
            return [1]

        def open(self, process: int | None, step: int) -> SnapshotView | None:
            return View() if step == 1 else None

        def held(self) -> list[list]:
            return []
    return Served()


def transport_gbps(nbytes: int = 256 << 20, streams: int = 4, chunk_bytes: int = 16 << 20) -> dict[str, Any]:
    """The peer transport: ``streams`` clients reading ``nbytes`` in ``chunk_bytes`` ranges from one server."""
    from jaxckpt.core.transport import get_transport

    buf = memoryview(np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8))
    source = _snapshot_source(buf)
    token = os.urandom(16)
    transport = get_transport()
    server = transport.serve(source, token=token)
    clients = [transport.connect(server.address, token=token, timeout_s=60.0, server_key=getattr(server, "public_key",
                                                                                                   ""))
               for _ in range(streams)]
    ranges = [(o, min(chunk_bytes, nbytes - o)) for o in range(0, nbytes, chunk_bytes)]
    errors: list[BaseException] = []

    def pull(i: int) -> None:
        try:
            for o, n in ranges[i::streams]:
                got = clients[i].read(1, o, n)
                if len(got) != n:
                    raise RuntimeError(f"range {o}+{n}: {len(got)} bytes")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    try:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=pull, args=(i,), daemon=True) for i in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        seconds = time.perf_counter() - t0
    finally:
        for c in clients:
            c.close()
        server.close()
    if errors:
        raise RuntimeError(f"peer transport probe failed: {errors[0]}")
    return {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9, "streams": streams,
            "chunk_bytes": chunk_bytes}


def probe(nbytes: int = 256 << 20, streams: int = 4) -> dict[str, Any]:
    """The probes; ``tcp`` is the faster raw TCP (between processes, or within one), the ceiling; the
    transport's share is of that."""
    between = tcp_gbps_processes(nbytes, streams)
    within = tcp_gbps(nbytes, streams)
    raw = max(between, within, key=lambda r: r["gbps"])
    zmq = transport_gbps(nbytes, streams)
    return {"tcp": raw, "tcp_processes": between, "tcp_threads": within, "transport": zmq,
            "transport_over_tcp": zmq["gbps"] / raw["gbps"]}


if __name__ == "__main__":
    _pair_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
