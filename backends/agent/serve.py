"""The node agent's memory served to peers: every committed snapshot of the node, zero-copy, pinned while sent.

The agent serves its whole node (every process's committed slots) over the peer transport
(``jaxckpt.backends.transport``), token-authenticated, bound to ``Config.peer_bind`` (loopback by default); it
publishes its address and token in its directory (``peer_files.py``), where restoring processes read them.
"""
from __future__ import annotations

import logging
import mmap
import threading
from typing import Any

from jaxckpt.backends.agent.protocol import SEG_RE, open_segment
from jaxckpt.backends.agent.table import SlotTable
from jaxckpt.core.checksum import crc32c
from jaxckpt.core.transport import PeerAddress, ServedHolder
from jaxckpt.errors import ManifestError
from jaxckpt.core.sources import held_entry
from jaxckpt.core.store import SnapshotView

log = logging.getLogger("jaxckpt.backends.agent.daemon")


# ------------------------------------------------------------------------------------------ the snapshots
class _View(SnapshotView):
    def __init__(self, step: int, manifest: bytes, buffer: memoryview, unpin) -> None:
        self.step, self.manifest, self.buffer = step, manifest, buffer
        self._unpin = unpin

    def close(self) -> None:
        if self._unpin is not None:
            unpin, self._unpin = self._unpin, None
            self.buffer = memoryview(b"")
            unpin()


class AgentSnapshots(ServedHolder):
    """The committed slots of every process of the node, for the peer server: pinned in the slot table while a
    reply is in flight, their segments mapped read-only once and shared by all replies."""

    def __init__(self, table: SlotTable, directory: str, transport: str = "zmq",
                 about: dict[str, Any] | None = None) -> None:
        self.table, self.dir = table, directory
        self._about = dict(about or {})  # node, job, generation, directory: what a rendezvous asks (agent/rendezvous.py)
        self.transport = transport  # Config.transport: what a rebuild here reads other nodes' agents through
        self.label = f"node agent at {directory}"
        self._maps: dict[str, mmap.mmap] = {}
        self._entries: dict[tuple[int, int, int], list] = {}
        self._lock = threading.Lock()

    def steps(self, process: int | None) -> list[int]:
        if process is None:
            return sorted({s for _, s, _ in self.table.committed()})
        return self.table.steps(process)

    def open(self, process: int | None, step: int) -> SnapshotView | None:
        if process is None:
            return None  # a node holds many processes: the request must say which
        entry = self.table.pin(process, step)
        if entry is None:
            return None
        try:
            buf = self._buffer(entry.seg.name, entry.seg.size, entry.nbytes) if entry.seg else memoryview(b"")
        except BaseException:
            self.table.unpin(process, step)
            raise
        return _View(step, entry.manifest, buf, lambda: self.table.unpin(process, step))

    def _buffer(self, name: str, size: int, nbytes: int) -> memoryview:
        with self._lock:
            m = self._maps.get(name)
            if m is None:
                self._prune()
                m = self._maps[name] = open_segment(self.dir, name, size, writable=False)
            return memoryview(m)[:nbytes].toreadonly()

    def _prune(self) -> None:
        # Mappings of segments the table let go (unlinked) would keep their memory allocated: drop them.
        # Replies still in flight hold their own references to the mapping.
        procs = {int(SEG_RE.match(n).group(1)) for n in self._maps}
        live = {n for p in procs for n in self.table.segments(p)}
        for n in [n for n in self._maps if n not in live]:
            del self._maps[n]

    def about(self) -> dict[str, Any]:
        return {"label": self.label, **self._about}

    def rebuild(self, process: int, step: int, stripe: int, unit: int, lo: int, hi: int,
                sources: dict[int, PeerAddress], timeout_s: float) -> Any:
        """ServedHolder.rebuild: a lost range rebuilt here, where its parity is (protection_rebuild.py)."""
        from jaxckpt.backends.agent.protection_rebuild import rebuild_range

        return rebuild_range(self, process, step, stripe, unit, lo, hi, sources, timeout_s, self.transport)

    def held(self) -> list[list]:
        out, keys = [], set()
        for p, s, manifest in self.table.committed():
            key = (p, s, crc32c(manifest))
            keys.add(key)
            with self._lock:
                e = self._entries.get(key)
            if e is None:
                try:
                    h = held_entry(manifest, source=f"manifest of process {p} step {s} at {self.dir}")
                    # a record whose manifest names another slot is listed but never counted complete
                    e = h.to_wire() if (h.process, h.step) == (p, s) else [p, s, 0, "", key[2]]
                except ManifestError:
                    e = [p, s, 0, "", key[2]]
                with self._lock:
                    self._entries[key] = e
            out.append(e)
        with self._lock:
            for k in [k for k in self._entries if k not in keys]:
                del self._entries[k]
        return out
