"""Node agents' memory as a restoring process reads it: its own node's agent zero-copy, others over the network.

Both classes are ``jaxckpt.core.sources.Holder``:

* :class:`NodeAgentHolder` (kind ``node``) talks to the agent of this node on its Unix socket as a *reader* of
  the job, pins any process's committed slot there and maps its segment read-only: zero copies, and the pin
  keeps the agent from freeing or reusing the segment until the restore closes it.
* :class:`RemoteAgentHolder` (kind ``remote``) reads another node's agent through the peer transport with the
  agent's token; each reply is pinned at the agent while it is sent. A few clients per agent let the restore's
  fetch threads read one agent in parallel.

:func:`local_agents` finds the agents whose directories this process can read (its own node's and
``Config.agent_dirs``) from the ``peer.addr`` / ``peer.token`` files each agent writes (peer_files.py).
"""
from __future__ import annotations

import glob
import logging
import os
import queue
import threading
from typing import Any, Mapping, Sequence

from jaxckpt.backends.agent.protocol import PROTECT_BASE, AgentConnection, open_segment
from jaxckpt.backends.agent.peer_files import read_peer_info
from jaxckpt.errors import AgentError, PeerError, StepNotFoundError, StoreUnavailableError
from jaxckpt.core.capabilities import AgentInfo
from jaxckpt.core.fetch import buffer_reader
from jaxckpt.core.sources import HeldEntry, Holder, Opened

log = logging.getLogger("jaxckpt.backends.agent.readers")

MAX_CLIENTS = 4  # transport clients per remote agent (each serves one request at a time)


def expand_dirs(spec: str) -> list[str]:
    """The directories ``Config.agent_dirs`` names: comma-separated paths or glob patterns, existing ones only."""
    out: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        for d in sorted(glob.glob(part)) if glob.has_magic(part) else [part]:
            d = os.path.abspath(d)
            if os.path.isdir(d) and d not in out:
                out.append(d)
    return out


def local_agents(job: str, directories: list[str]) -> list[AgentInfo]:
    """Agents of ``job`` serving peers from ``directories`` (others, and directories without one, are skipped)."""
    out = []
    for d in directories:
        info = read_peer_info(d)
        if info is None:
            log.info("no agent serves peers from %s", d)
            continue
        if info.get("job") != job:
            log.warning("agent at %s serves job %r, not %r: not used", d, info.get("job"), job)
            continue
        out.append(AgentInfo(info["address"], info["node"], job, info["generation"], info["directory"],
                             info["token"], info.get("server_key", "")))
    return out


def _entries(raw: Any, where: str) -> list[HeldEntry]:
    if not isinstance(raw, list):
        raise PeerError(f"{where}: malformed index")
    out = []
    for v in raw:
        try:
            out.append(HeldEntry.from_wire(v))
        except Exception:  # noqa: BLE001 - one bad entry is skipped, the others are good
            log.warning("%s: skipping malformed held entry %r", where, v)
    return out


class NodeAgentHolder(Holder):
    """This node's agent, read zero-copy through its shared memory (see the module docstring)."""

    kind = "node"

    def __init__(self, directory: str, job: str, node: str, timeout_s: float = 30.0) -> None:
        self.directory, self.job, self.node = directory, job, node
        self.name = f"node agent at {directory}"
        self._timeout = timeout_s
        self._conn: AgentConnection | None = None
        self._lock = threading.Lock()

    def _call(self, op: str, **fields: Any) -> dict:
        with self._lock:
            try:
                if self._conn is None:
                    conn = AgentConnection(self.directory, timeout_s=self._timeout)
                    try:
                        conn.call("hello", job=self.job, role="reader")
                    except BaseException:
                        conn.close()
                        raise
                    self._conn = conn
                return self._conn.call(op, **fields)
            except StoreUnavailableError:
                self._conn = None  # the agent went away; the next call reconnects
                raise
            except AgentError as e:
                raise StoreUnavailableError(f"{self.name} refused {op}: {e}") from None

    def held(self) -> list[HeldEntry]:
        return _entries(self._call("index").get("held"), self.name)

    def open(self, process: int, step: int) -> Opened:
        r = self._call("open", process=process, step=step)
        if not r.get("found"):
            raise StepNotFoundError(f"step {step} of process {process} is not held by the {self.name} "
                                    f"(it holds steps {r.get('steps') or 'none'} of that process)")
        conn = self._conn

        def unpin() -> None:
            with self._lock:
                if self._conn is conn and conn is not None:  # pins of a dead connection died with it
                    try:
                        conn.call("unpin", process=process, step=step)
                    except (StoreUnavailableError, AgentError) as e:
                        log.warning("%s: unpin of step %d of process %d not delivered: %s", self.name, step,
                                    process, e)
        try:
            buf = memoryview(b"")
            if r["seg"]:
                try:
                    m = open_segment(self.directory, r["seg"], r["size"], writable=False)
                except AgentError as e:
                    if os.path.lexists(os.path.join(self.directory, r["seg"])):
                        raise
                    # the agent that named it died since, and its node's memory with it (or the agent after it
                    # would have adopted the committed slot): the step is missing here, not an error of the job;
                    # the next request reconnects, to the agent after it
                    with self._lock:
                        if self._conn is conn and conn is not None:
                            conn.close()
                            self._conn = None
                    raise StepNotFoundError(f"step {step} of process {process} is gone from the {self.name}: "
                                            f"{e} (the agent that named it was lost)") from None
                buf = memoryview(m)[:r["nbytes"]]
        except BaseException:
            unpin()
            raise
        return Opened(r["manifest"], buffer_reader(buf.toreadonly()), unpin)

    def manifest(self, process: int, step: int) -> bytes:
        # one request, no pin: the segment is not mapped
        r = self._call("manifest", process=process, step=step)
        if not r.get("found"):
            raise StepNotFoundError(f"step {step} of process {process} is not held by the {self.name}")
        return bytes(r["manifest"])

    def peer(self) -> tuple[str, bytes, str] | None:
        """Where other nodes read this agent (the peer files it published), None if it serves no peers."""
        info = read_peer_info(self.directory)
        return None if info is None else (info["address"], info["token"], info.get("server_key", ""))

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


class RemoteAgentHolder(Holder):
    """Another node's agent, read over the peer transport (see the module docstring)."""

    kind = "remote"

    def __init__(self, info: AgentInfo, node: str, timeout_s: float, clients: int = MAX_CLIENTS, *,
                 transport: str = "zmq", connect_at_open: bool = True) -> None:
        from jaxckpt.core.transport import get_transport

        self.info, self.node = info, node
        self.name = f"agent of node {info.node} at {info.address}"
        self._transport, self._timeout = get_transport(transport), timeout_s
        self._idle: queue.LifoQueue = queue.LifoQueue()
        self._made, self._max = 0, max(1, clients)
        self._all: list = []
        self._lock = threading.Lock()
        self._closed = False
        # Where a restore's fetch threads' clients are made (see _connect_all): at the open, or at the first read
        self._connect_at_open = connect_at_open

    @property
    def clients(self) -> int:
        """Transport clients made so far (each connecting or connected to the agent)."""
        return self._made

    def _connect(self):
        """A new client (under ``_lock``): its connection (and CURVE handshake) is made in the background."""
        self._made += 1
        c = self._transport.connect(self.info.address, token=self.info.token, timeout_s=self._timeout,
                                    server_key=self.info.server_key)
        self._all.append(c)
        return c

    def _client(self):
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._closed:
                raise PeerError(f"{self.name}: closed")
            if self._made < self._max:
                return self._connect()
        try:
            return self._idle.get(timeout=self._timeout * 2)
        except queue.Empty:
            raise PeerError(f"{self.name}: no free client within {self._timeout * 2:g}s") from None

    def _with_client(self, fn):
        c = self._client()
        try:
            return fn(c)
        finally:
            self._idle.put(c)

    def held(self) -> list[HeldEntry]:
        return _entries(self._with_client(lambda c: c.held()), self.name)

    def open(self, process: int, step: int) -> Opened:
        manifest = self._with_client(lambda c: c.manifest(step, process))
        if self._connect_at_open:
            self._connect_all()

        def read(offset: int, nbytes: int) -> memoryview:
            if process < PROTECT_BASE:  # a restore's, on its fetch threads at once; not a protection slot's
                self._connect_all()     # (a start-up scan reads its header's metadata: one client does)
            return self._with_client(lambda c: c.read(step, offset, nbytes, process))

        def read_spans(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, memoryview]]:
            from jaxckpt.core.transport import Span

            spans = [Span(o, n) for o, n in ranges]
            return self._with_client(lambda c: [(i, b) for i, b, _ in c.read_spans(step, spans, process)])

        # Each read returns memory of its own (received frames), never rewritten: the restored arrays may keep
        # it instead of a copy (Source.lend).
        return Opened(manifest, read, lend=lambda: True, read_spans=read_spans)

    def manifest(self, process: int, step: int) -> bytes:
        return self._with_client(lambda c: c.manifest(step, process))  # one client: no restore reads follow

    def _connect_all(self) -> None:
        """Every client: a restore that reads this agent reads it on ``clients`` fetch threads at once, and their
        connections are set up together instead of one per thread's first request. Made at the open (their set-up
        then overlaps the restore's planning and its reads of this node's memory: a relaunched process's first
        restore with split replicas, which reads every other node, waited for them) or, with
        ``connect_at_open=False``, at the first read: with whole replicas and the agents alive a restore opens
        every agent for its manifest and reads none of them, and each client is a connection and a CURVE
        handshake on both sides (the first restore of 4 nodes cost 1.24-1.29x a later one with them, 1.02-1.04x
        without: BENCHMARKS.md)."""
        if self._made >= self._max:
            return
        with self._lock:
            while not self._closed and self._made < self._max:
                self._idle.put(self._connect())

    def peer(self) -> tuple[str, bytes, str]:
        return self.info.address, self.info.token, self.info.server_key

    def rebuild(self, process: int, step: int, stripe: int, unit: int, lo: int, hi: int,
                sources: Mapping[int, tuple[str, bytes, str]]) -> memoryview:
        return self._with_client(lambda c: c.rebuild(step, process, stripe, unit, lo, hi, dict(sources)))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._all = self._all, []
        for c in clients:
            c.close()
