"""A replacement node's agent brings its node's share back before its trainers ask for it.

An agent started with the job's peers (``jaxckpt agent --agent-dirs``, ``Config.agent_dirs``: where the job's other
agents publish their peer files; across machines ``--peers``, ``Config.agent_peers``: where they listen,
``rendezvous.py``) on a directory that holds nothing of the job (a fresh node) looks, as soon as it
serves, for what a lost node took: it reads the other agents' protection slots (``jaxckpt.protection.holder``'s
``RebuildHolder`` over their peer transport), takes the newest step that every process can still be read or
rebuilt for, and, when exactly one node is missing from it (the node this one replaces: the relaunched job
keeps its process indices), rebuilds that node's processes' snapshots in bulk (``Rebuilder.read_into``: each
stripe's lost ranges where its parity lives, ``protection_rebuild.py``, a few requests per stripe, the copies'
ranges in one flight each; every chunk checked against its manifest's crc32c)
into ordinary committed slots of this agent. Meanwhile the trainers start (import JAX, build the model); a
trainer's ``hello`` waits for the recovery in flight (it joins it instead of fetching the same bytes again), so
its adoption and restore find the step in its node's memory and read it there, zero-copy.

More than one node missing, nothing missing, a step that cannot be rebuilt, or no peers: nothing is recovered
(logged), and restores rebuild what they need as before. ``Agent.recovery`` says what happened (the agent's
status reply): the step, the processes, the bytes of their chunks, the bytes received to rebuild them, seconds.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from jaxckpt.backends.agent.protocol import open_segment
from jaxckpt.backends.agent.table import Limits, Refused

log = logging.getLogger("jaxckpt.backends.agent.daemon")

OWNER = -1  # the slot table's writer id of the recovery (connections count from 1)
WAIT_S = 90.0  # a trainer's hello waits at most this long for the recovery in flight (its socket: 120 s)


class _Counts:
    """``jaxckpt.core.sources.RestoreReads`` for the rebuilds of a recovery: it reads nothing else, so it shares
    no chunks, and it counts what the rebuilds received and where the XOR ran."""

    def __init__(self) -> None:
        self.received = 0
        self.rebuilt_at: dict[str, int] = {}
        self._lock = threading.Lock()

    def lookup(self, step: int, path: str, chunk: Any) -> None:
        return None

    def account(self, step: int, kind: str, nbytes: int) -> None:
        with self._lock:
            self.received += nbytes

    def rebuilt(self, step: int, where: str, nbytes: int, fallback: str = "") -> None:
        with self._lock:
            self.rebuilt_at[where] = self.rebuilt_at.get(where, 0) + nbytes


class Recovery:
    """The recovery of one agent (see the module docstring): :meth:`start` once serving, :meth:`wait` from a
    trainer's hello."""

    def __init__(self, agent: Any, timeout_s: float = 20.0) -> None:
        self.agent, self.timeout = agent, timeout_s
        self.done = threading.Event()
        self.report: dict[str, Any] = {"state": "pending"}

    def start(self) -> None:
        threading.Thread(target=self._run, name="agent-recovery", daemon=True).start()

    def wait(self) -> None:
        """Until the recovery is over (at most ``WAIT_S``: a trainer then goes on without it)."""
        if not self.done.wait(WAIT_S):
            log.warning("agent: the recovery of the node's share is still running after %g s; a trainer goes on",
                        WAIT_S)

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            self.report = {"state": "running"}
            self.report = self._recover() | {"seconds": time.monotonic() - t0}
        except Exception as e:  # noqa: BLE001 - the trainers' restores rebuild what they need, as without it
            log.exception("agent: recovering the node's share failed")
            self.report = {"state": "failed", "error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
        finally:
            self.done.set()
        log.info("agent: recovery %s", self.report)

    def _recover(self) -> dict[str, Any]:
        from jaxckpt.backends.agent.readers import RemoteAgentHolder
        from jaxckpt.core import manifest as mf
        from jaxckpt.protection.holder import RebuildHolder

        a = self.agent
        if a.table.committed():
            return {"state": "skipped", "why": "the node's memory holds snapshots of the job"}
        peers = self._peers()
        if not peers:
            where = " or ".join(repr(w) for w in (a.agent_dirs, a.agent_peers) if w)
            return {"state": "skipped", "why": f"no peer agent serves from {where}"}
        holders = [RemoteAgentHolder(i, i.node, self.timeout, transport=a.transport) for i in peers]
        try:
            t0 = time.monotonic()
            rebuild = RebuildHolder(lambda: holders)
            steps = rebuild.scan()
            scan_s = time.monotonic() - t0
            lost = {s: info for s, info in steps.items() if info.lost_nodes}
            if not lost:
                return {"state": "skipped", "why": "no step misses a node"}
            step = max(lost)
            info = lost[step]
            if len(info.lost_nodes) != 1:
                return {"state": "skipped", "why": f"step {step} misses {len(info.lost_nodes)} nodes: which one this "
                                                   f"agent replaces is unknown"}
            processes = [q for q in range(len(info.plan.nodes)) if q not in info.held]
            counts, written = _Counts(), 0
            for q in processes:
                opened = rebuild.open(q, step)
                try:
                    opened.bind(counts)
                    m = mf.decode(opened.manifest, source=f"step {step} manifest of process {q}")
                    written += self._write(q, step, opened, m)
                finally:
                    opened.close()
            return {"state": "done", "step": step, "processes": processes, "bytes": written,
                    "received": counts.received, "rebuilt_at": counts.rebuilt_at, "scan_seconds": scan_s,
                    "peers": sorted(f"{i.node} at {i.address}" for i in peers)}
        finally:
            for h in holders:
                h.close()

    def _peers(self) -> list:
        """The job's other agents: from the directories it can read (``agent_dirs``), and by address
        (``agent_peers``, agent/rendezvous.py) for those it cannot."""
        from jaxckpt.backends.agent.readers import expand_dirs, local_agents
        from jaxckpt.config import peer_uses_curve

        a = self.agent
        peers = [i for i in local_agents(a.job, expand_dirs(a.agent_dirs)) if i.directory != a.dir]
        if a.agent_peers and a.token:
            from jaxckpt.backends.agent.rendezvous import discover

            known = {i.generation for i in peers}
            peers += [i for i in discover(a.job, a.agent_peers, a.agent_port, token=a.token,
                                          curve=peer_uses_curve(a.peer_bind or "127.0.0.1", a.peer_security),
                                          generation=a.generation, transport=a.transport, timeout_s=min(5.0, self.timeout))
                      if i.generation not in known]
        return peers

    def _write(self, q: int, step: int, opened: Any, m: Any) -> int:
        """Process ``q``'s snapshot of ``step``, from ``opened`` (in bulk where it can), as a committed slot here;
        the bytes of its chunks."""
        import numpy as np

        t = self.agent.table
        t.declare(q, Limits())  # its trainer's hello declares its own
        entry, _ = t.reserve(q, step, m.nbytes, OWNER)
        try:
            if entry.seg is not None:
                mapping = open_segment(self.agent.dir, entry.seg.name, entry.seg.size)
                try:
                    buf = np.frombuffer(mapping, np.uint8)
                    chunks = [c for arr in m.arrays for c in arr.chunks if c.nbytes]
                    # In bulk (a lost process's Opened from RebuildHolder): a stripe's lost unit rebuilt at its
                    # holder in one request, a surviving twin's ranges in one flight; a round trip per chunk made a
                    # 1,024-array share take seconds
                    opened.read_into(memoryview(buf), [(c.offset, c.nbytes) for c in chunks])
                    del buf
                finally:
                    try:
                        mapping.close()
                    except BufferError:  # a failed read's traceback still holds a view: the mapping goes with it
                        pass
            t.commit(q, step, opened.manifest, OWNER)
        except BaseException:
            try:
                t.abort(q, step, OWNER)
            except Refused:
                pass
            raise
        n = sum(c.nbytes for arr in m.arrays for c in arr.chunks)
        log.info("agent: step %d of process %d recovered (%d bytes of chunks)", step, q, n)
        return n
