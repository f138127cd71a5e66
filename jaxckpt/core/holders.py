"""Holders the catalog makes of what it finds: a peer process serving its own store, a remote agent that is not
asked again in an operation once it failed to answer, and a fallback source opened at its holder on its first read.
"""
from __future__ import annotations

import threading
from typing import Callable, Iterable, Sequence

from jaxckpt.core.capabilities import AgentInfo
from jaxckpt.core.checksum import crc32c
from jaxckpt.core.sources import HeldEntry, Holder, Opened, RestoreReads, Source
from jaxckpt.core.transport import Span
from jaxckpt.errors import AgentError, ManifestError, PeerError, PeerTimeoutError, StepNotFoundError, \
    StoreUnavailableError


class PeerHolder(Holder):
    """Process ``q`` of this job serving its own store (jobs without node agents)."""

    kind = "peer"
    node = ""

    def __init__(self, peers, q: int) -> None:
        self._peers, self._q = peers, q
        self.name = f"process {q}"

    def held(self) -> list[HeldEntry]:
        return [HeldEntry.from_wire(v) for v in self._peers.client(self._q).held()]

    def open(self, process: int, step: int) -> Opened:
        c = self._peers.client(self._q)
        self.name = f"process {self._q} ({c.address})"
        def read_spans(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, memoryview]]:
            return [(i, b) for i, b, _ in c.read_spans(step, [Span(o, n) for o, n in ranges])]
        return Opened(c.manifest(step), lambda offset, nbytes: c.read(step, offset, nbytes),
                      lend=lambda: True, read_spans=read_spans)  # each read is memory of its own (received frames)


class _Lazy:
    """A fallback source: opened at its holder on the first read, checked to hold the same snapshot."""

    def __init__(self, holder: Holder, process: int, step: int, crc: int, opened: list[Opened]) -> None:
        self._h, self._q, self._step, self._crc, self._opened = holder, process, step, crc, opened
        self._o: Opened | None = None
        self._reads: RestoreReads | None = None
        self._lock = threading.Lock()

    def bind(self, reads: RestoreReads) -> None:
        """Source.bind, for when (and if) the holder is opened."""
        self._reads = reads

    def __call__(self, offset: int, nbytes: int) -> memoryview:
        return self._open().read(offset, nbytes)

    def spans(self, ranges: Sequence[tuple[int, int]]) -> Iterable[tuple[int, memoryview]]:
        """Source.read_spans: the holder's own bulk read where it has one, else a read per range."""
        o = self._open()
        if o.read_spans is not None:
            return o.read_spans(ranges)
        return ((i, o.read(offset, nbytes)) for i, (offset, nbytes) in enumerate(ranges))

    def _open(self) -> Opened:
        with self._lock:
            if self._o is None:
                try:
                    o = self._h.open(self._q, self._step)
                except (AgentError, ManifestError) as e:
                    raise StoreUnavailableError(f"{self._h.name}: {e}") from None
                self._opened.append(o)
                if crc32c(o.manifest) != self._crc:
                    raise StepNotFoundError(f"{self._h.name} holds another snapshot of step {self._step} of "
                                            f"process {self._q} (its manifest differs)")
                if o.bind is not None and self._reads is not None:
                    o.bind(self._reads)
                self._o = o
            return self._o


def lazy_source(h: Holder, process: int, step: int, crc: int, opened: list[Opened]) -> Source:
    """A fallback Source of ``process``'s snapshot of ``step`` at ``h``, opened on its first read."""
    lazy = _Lazy(h, process, step, crc, opened)
    return Source(h.kind, h.name, h.node, lazy, bind=lazy.bind, read_spans=lazy.spans)


class NotAsked(PeerError):
    """A holder skipped because it did not answer earlier in the same operation."""


class Guarded(Holder):
    """A remote agent's holder that is not asked again in the current operation (a restore, a scan) once it
    failed to answer in time: a dead agent's stale address would otherwise cost ``Config.peer_timeout_s`` on
    every request (each listing, manifest and chunk read) of that operation. ``unresponsive(holder, error)``
    is told of each time-out (the catalog marks it ``dead`` for the operation)."""

    def __init__(self, holder: Holder, unresponsive: Callable[["Guarded", Exception], None], info: AgentInfo
                 ) -> None:
        self._h, self._unresponsive, self.info = holder, unresponsive, info
        self.kind, self.name, self.node = holder.kind, holder.name, holder.node
        self.dead: str | None = None  # the operation in which it did not answer

    def _call(self, fn: Callable, *args):
        if self.dead is not None:
            raise NotAsked(f"{self.name}: not asked, it did not answer earlier in this {self.dead}")
        try:
            return fn(*args)
        except PeerTimeoutError as e:
            self._unresponsive(self, e)
            raise

    def held(self) -> list[HeldEntry]:
        return self._call(self._h.held)

    def open(self, process: int, step: int) -> Opened:
        o = self._call(self._h.open, process, step)
        spans, into = o.read_spans, o.read_into  # every capability of the holder's, guarded alike
        return Opened(o.manifest, lambda offset, nbytes: self._call(o.read, offset, nbytes), o.close, o.lend, o.bind,
                      read_spans=(lambda ranges: self._call(spans, ranges)) if spans is not None else None,
                      read_into=(lambda out, chunks: self._call(into, out, chunks)) if into is not None else None)

    def manifest(self, process: int, step: int) -> bytes:
        return self._call(self._h.manifest, process, step)

    def peer(self) -> tuple[str, bytes, str] | None:
        return self._h.peer()

    def rebuild(self, *args) -> memoryview:
        return self._call(self._h.rebuild, *args)

    def close(self) -> None:
        self._h.close()
