"""A restore's timeline: bytes and seconds per phase, as ``last_restore_report.timeline`` carries them; and a
start-up's (``Checkpointer()``'s stages, :class:`Stopwatch`).

Phases, in the order a restore meets them (numpy only, no I/O):

  ``discover``          pin the step: find its manifests and the sources of every saving process (engine.open)
  ``plan``              for every array, the saved chunks that cover the boxes this process needs (once each)
  ``local_reads``       chunk bytes read from this process's store or this node's agent (source kinds
                        ``local``, ``node``), verified
  ``collective``        bytes of this process's target shards the framework's collective brought (jaxckpt.core.routes)
  ``peer_fetches``      chunk bytes fetched from another node's agent or another process (``remote``, ``peer``)
  ``rebuild``           chunk bytes rebuilt from parity or copies on surviving nodes (``rebuild``)
  ``persistent_reads``  chunk bytes read from the persistent tier through a chunk reader (``persistent``)
  ``assemble``          host boxes cut and copied out of the fetched chunks
  ``device_put``        the front end's arrays made from the host boxes (transfer to devices, wrapping)

Reads run on several threads at once, so phases overlap: ``seconds`` is the wall-clock span from a phase's
first operation's start to its last one's end, ``busy_s`` the operations' durations summed (it may exceed
``seconds``). A failed read that another source replaced counts its time, not its bytes, in its own phase.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

PHASES = ("discover", "plan", "local_reads", "collective", "peer_fetches", "rebuild", "persistent_reads",
          "assemble", "device_put")
# The phase a source kind's reads count under (jaxckpt.core.sources.KINDS); a kind not listed gets a phase of
# its own name, so its bytes are never silently lost from the sum.
KIND_PHASE = {"local": "local_reads", "node": "local_reads", "remote": "peer_fetches", "peer": "peer_fetches",
              "rebuild": "rebuild", "persistent": "persistent_reads"}
READ_PHASES = ("local_reads", "collective", "peer_fetches", "rebuild", "persistent_reads")


@dataclass
class Phase:
    """One phase: wall-clock span, summed durations, bytes and operations (chunks, arrays or boxes)."""

    seconds: float = 0.0
    busy_s: float = 0.0
    nbytes: int = 0
    count: int = 0
    _first: float | None = field(default=None, repr=False, compare=False)
    _last: float | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, "busy_s": self.busy_s, "nbytes": self.nbytes, "count": self.count}

    @property
    def span(self) -> tuple[float, float] | None:
        """(first start, last end) in ``time.perf_counter`` seconds, or None for a phase that did nothing. On
        Linux that clock is CLOCK_MONOTONIC, one clock for every process of a host: spans of processes on one
        host compare (``jaxckpt bench cluster`` adds the transport's bytes of all processes over their union)."""
        return None if self._first is None else (self._first, self._last)


class RestoreTimeline:
    """Per-phase bytes and seconds of one restore (see the module docstring); safe to record from threads."""

    def __init__(self) -> None:
        self.phases: dict[str, Phase] = {name: Phase() for name in PHASES}
        self._lock = threading.Lock()

    def record(self, name: str, start: float, end: float, nbytes: int = 0, count: int = 1) -> None:
        """Add one operation of phase ``name`` that ran from ``start`` to ``end`` (``time.perf_counter``)."""
        self.add(name, start, end, max(0.0, end - start), nbytes, count)

    def add(self, name: str, first: float, last: float, busy_s: float, nbytes: int, count: int) -> None:
        """Add ``count`` operations of phase ``name`` that ran between ``first`` and ``last`` for ``busy_s``
        seconds in all (a caller's own tally of many small operations, recorded once)."""
        with self._lock:
            p = self.phases.setdefault(name, Phase())
            p.busy_s += busy_s
            p.nbytes += nbytes
            p.count += count
            p._first = first if p._first is None else min(p._first, first)
            p._last = last if p._last is None else max(p._last, last)
            p.seconds = max(0.0, p._last - p._first)

    def read(self, kind: str, start: float, end: float, nbytes: int, count: int = 1) -> None:
        """Record a chunk read from a source of ``kind`` under its phase."""
        self.record(KIND_PHASE.get(kind, kind), start, end, nbytes, count)

    def __getitem__(self, name: str) -> Phase:
        return self.phases[name]

    @property
    def read_bytes(self) -> int:
        """Chunk bytes read in every reading phase (what the report's ``bytes_by_kind`` adds up to)."""
        return sum(p.nbytes for n, p in self.phases.items() if n in READ_PHASES or n not in PHASES)

    def to_dict(self) -> dict:
        """A JSON-able form: every phase, in order, with seconds, busy_s, nbytes and count."""
        with self._lock:
            return {name: p.to_dict() for name, p in self.phases.items()}

    def summary(self) -> str:
        """The phases that did something, for one log line."""
        parts = []
        with self._lock:
            for name, p in self.phases.items():
                if p.count or p.nbytes:
                    size = f"{p.nbytes} bytes " if p.nbytes else ""
                    parts.append(f"{name} {size}{p.seconds:.3f}s")
        return ", ".join(parts) or "none"


class Tally:
    """Operations of one phase timed on one thread, recorded into a timeline at once (``flush``)."""

    __slots__ = ("name", "first", "last", "busy_s", "nbytes", "count")

    def __init__(self, name: str) -> None:
        self.name, self.first, self.last, self.busy_s, self.nbytes, self.count = name, None, 0.0, 0.0, 0, 0

    def add(self, start: float, end: float, nbytes: int) -> None:
        if self.first is None:
            self.first = start
        self.last = end
        self.busy_s += end - start
        self.nbytes += nbytes
        self.count += 1

    def flush(self, timeline: "RestoreTimeline") -> None:
        if self.count:
            timeline.add(self.name, self.first, self.last, self.busy_s, self.nbytes, self.count)
        self.first, self.busy_s, self.nbytes, self.count = None, 0.0, 0, 0


class Stopwatch:
    """Wall-clock and CPU seconds of the named stages of one thread's work, in order: a ``Checkpointer()``'s
    start-up (``CheckpointEngine.startup``). Wall beyond CPU is waiting (a round for the slowest process, an
    agent's reply, a recovery joined); CPU is work (imports, scans)."""

    def __init__(self) -> None:
        self.stages: dict[str, dict[str, float]] = {}

    @contextlib.contextmanager
    def stage(self, name: str):
        """Time the block as stage ``name`` (added to it if it ran before)."""
        w, c = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.record(name, time.perf_counter() - w, time.thread_time() - c)

    def record(self, name: str, seconds: float, cpu_s: float, first: bool = False) -> None:
        """Add ``seconds`` of wall and ``cpu_s`` of CPU time to stage ``name`` (work timed outside a block);
        ``first``: a new stage goes before the others (work done before the watch began)."""
        if first and name not in self.stages:
            self.stages = {name: {"seconds": 0.0, "cpu_s": 0.0}, **self.stages}
        st = self.stages.setdefault(name, {"seconds": 0.0, "cpu_s": 0.0})
        st["seconds"] += max(0.0, seconds)
        st["cpu_s"] += max(0.0, cpu_s)

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {k: dict(v) for k, v in self.stages.items()}
