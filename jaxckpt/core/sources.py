"""Where a restore reads saved bytes from: holders of snapshots, their cost order, and the restore report.

Numpy only: the holder interface, the source records and report, and the pure decisions over them (which
version, which holders, cheapest first: the fetch plan); no I/O of its own. A *holder* holds whole snapshot
buffers, each one process's saved bytes of one step, and reads ranges of them; it lists what it holds as :class:`HeldEntry` records. Kinds, cheapest first:

  ``local``       this process's own store (the same process index of the saving job): zero-copy
  ``node``        this node's agent, for the node's other processes: zero-copy from its shared memory
  ``remote``      another node's agent, over the peer transport
  ``peer``        another process of the same job serving its own (in-process) store, over the peer transport
  ``rebuild``     bytes rebuilt from parity or copies on surviving nodes (jaxckpt.protection.plan, added later)
  ``persistent``  the persistent directory (last)

For one step a restoring process needs, for every process ``q`` of the saving job, that process's manifest (its
chunk table) and a source of its bytes; :func:`choose_version` picks the saved version every process of the
saving job is held for, and :func:`order_sources` ranks the holders of each ``q``. The fetch plan then takes,
for every chunk the target needs, the first source in that order; a source that fails or returns corrupt bytes
is replaced by the next one holding the same chunk (``jaxckpt.core.fetch.ChunkReader``). The outcome is a
:class:`RestoreReport`: bytes per source kind, per node and per source, and every fallback taken.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Protocol, Sequence

from jaxckpt.core.checksum import crc32c
from jaxckpt.errors import ManifestError, PeerError
from jaxckpt.core.manifest import ChunkMeta, Manifest, decode
from jaxckpt.core.timeline import RestoreTimeline

KINDS = ("local", "node", "remote", "peer", "rebuild", "persistent")
RANK = {k: i for i, k in enumerate(KINDS)}

# (offset, nbytes) -> the bytes of one process's snapshot buffer in that range
ByteReader = Callable[[int, int], memoryview]


class RestoreReads(Protocol):
    """What a restore offers a source that reads other bytes to make its own (protection's rebuild):
    ``jaxckpt.core.fetch.ChunkReader`` is one."""

    def lookup(self, step: int, path: str, chunk: ChunkMeta) -> memoryview | None:
        """The verified bytes of ``chunk`` as this restore has them (fetched once per restore), or None where the
        caller must read them on its own."""

    def account(self, step: int, kind: str, nbytes: int) -> None:
        """Count ``nbytes`` the caller read on its own from a holder of ``kind`` (e.g. a parity block)."""

    def rebuilt(self, step: int, where: str, nbytes: int, fallback: str = "") -> None:
        """Count ``nbytes`` of lost chunks rebuilt from parity ``where`` the XOR ran: "holder" (the parity's
        holder XORed and sent only the result) or "here" (the parity and the other units were read here);
        ``fallback``: why the holder did not, when it was asked."""


@dataclass(frozen=True, order=True)
class HeldEntry:
    """A holder holds process ``process``'s snapshot of ``step`` from a saving job of ``process_count`` processes
    whose save plan is ``layout``; ``crc`` is the crc32c of the encoded manifest (equal crc: the same snapshot)."""

    step: int
    process: int
    process_count: int
    layout: str
    crc: int

    def to_wire(self) -> list:
        return [self.process, self.step, self.process_count, self.layout, self.crc]

    @classmethod
    def from_wire(cls, v: Sequence) -> "HeldEntry":
        process, step, count, layout, crc = v
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (process, step, count, crc)) \
                or not isinstance(layout, str):
            raise ManifestError(f"malformed held entry {v!r}")
        return cls(step, process, count, layout, crc)


def held_entry(manifest: bytes | memoryview, *, source: str = "manifest") -> HeldEntry:
    """The HeldEntry of an encoded manifest (decoded and validated)."""
    m = decode(manifest, source=source)
    return HeldEntry(m.step, m.process, m.process_count, m.layout, crc32c(manifest))


@dataclass(frozen=True)
class Version:
    """One saved snapshot of a step: ``process_count`` processes saved it with save plan ``layout``."""

    step: int
    process_count: int
    layout: str


def versions(entries: Iterable[HeldEntry], step: int) -> dict[Version, set[int]]:
    """For each saved version of ``step``, the processes of the saving job some holder holds."""
    out: dict[Version, set[int]] = {}
    for e in entries:
        if e.step == step and e.process < e.process_count:
            out.setdefault(Version(step, e.process_count, e.layout), set()).add(e.process)
    return out


def complete_steps(entries: Iterable[HeldEntry]) -> list[int]:
    """Steps of which some version is held for every process of its saving job, ascending."""
    entries = list(entries)
    steps = sorted({e.step for e in entries})
    return [s for s in steps if any(len(p) == v.process_count for v, p in versions(entries, s).items())]


def choose_version(entries: Iterable[HeldEntry], step: int, prefer: Version | None = None) -> Version | None:
    """The complete version of ``step`` (``prefer`` if it is complete), or None if no version is complete."""
    done = sorted((v for v, p in versions(entries, step).items() if len(p) == v.process_count),
                  key=lambda v: (v != prefer, -v.process_count, v.layout))
    return done[0] if done else None


def missing_processes(entries: Iterable[HeldEntry], step: int) -> dict[Version, list[int]]:
    """For each incomplete version of ``step``, the processes of its saving job no holder holds."""
    return {v: sorted(set(range(v.process_count)) - p) for v, p in versions(entries, step).items()
            if len(p) < v.process_count}


def newest_common(complete: Sequence[Sequence[int]]) -> int | None:
    """The newest step in every process's list of complete steps (the agreed restore step), or None."""
    if not complete:
        return None
    common = set(complete[0])
    for c in complete[1:]:
        common &= set(c)
    return max(common) if common else None


# -------------------------------------------------------------------------------------------------- holders
@dataclass
class Opened:
    """One process's snapshot of one step, opened at a holder: its manifest and its bytes (until ``close``)."""

    manifest: bytes
    read: ByteReader
    close: Callable[[], None] = lambda: None
    lend: Callable[[], bool] | None = None  # see Source.lend
    bind: Callable[[RestoreReads], None] | None = None  # see Source.bind
    # Several (offset, nbytes) ranges in one flight, yielded (index, bytes) as they come: a holder across a network
    # offers it (a round trip per range, one after another, was what moved a many-array share slowly); None where
    # ``read`` per range is as good.
    read_spans: Callable[[Sequence[tuple[int, int]]], Iterable[tuple[int, memoryview]]] | None = None
    # Every chunk (offset, nbytes) of the buffer written into ``out`` (a writable buffer of its size) in as few
    # requests as the holder can, each chunk checked against its crc32c: a rebuilt process's whole share at once
    # (protection.rebuild.Rebuilder.read_into); None where the caller reads chunk by chunk.
    read_into: Callable[[memoryview, Sequence[tuple[int, int]]], None] | None = None


class Holder(abc.ABC):
    """Something that holds whole snapshot buffers of (process, step) and reads them (see the module docstring).

    ``kind`` is one of KINDS (its cost rank), ``name`` says where for messages, ``node`` is the node label the
    restore report counts bytes under. Every call may raise PeerError, StepNotFoundError or StoreUnavailableError.
    """

    kind: str
    name: str
    node: str

    @abc.abstractmethod
    def held(self) -> list[HeldEntry]:
        """Everything this holder holds now."""

    def held_given(self, agents_said: list[tuple["Holder", HeldEntry]]) -> list[HeldEntry]:
        """:meth:`held`, where the node agents' holders just said what they hold (``agents_said``: the catalog
        asked them): a holder that lists from the agents (protection's rebuild) takes that instead of asking
        them again. The default asks."""
        return self.held()

    @abc.abstractmethod
    def open(self, process: int, step: int) -> Opened:
        """Open process ``process``'s snapshot of ``step``: its manifest and a byte source, pinned until closed."""

    def manifest(self, process: int, step: int) -> bytes:
        """The manifest alone of process ``process``'s snapshot of ``step`` (StepNotFoundError where it is not
        held). The default opens and closes it; a holder whose open maps memory or connects every client reads
        the manifest alone."""
        o = self.open(process, step)
        try:
            return bytes(o.manifest)
        finally:
            o.close()

    def peer(self) -> tuple[str, bytes, str] | None:
        """(address, token, CURVE key) where other nodes read this holder's memory over the peer transport; None
        where they cannot (the default)."""
        return None

    def rebuild(self, process: int, step: int, stripe: int, unit: int, lo: int, hi: int,
                sources: Mapping[int, tuple[str, bytes, str]]) -> memoryview:
        """Bytes [lo, hi) of unit ``unit`` of parity stripe ``stripe``, rebuilt by this holder, which holds the
        stripe's parity in protection slot ``process`` of ``step``, from the other units read at ``sources``
        (saving process -> :meth:`peer` of its holder): only the result crosses to the caller. PeerError or
        StepNotFoundError where it cannot; the default holder cannot."""
        raise PeerError(f"{self.name} does not rebuild bytes where it holds them")

    def close(self) -> None:
        """Drop connections; the default holds none."""


@dataclass(frozen=True)
class Source:
    """One place the bytes of a saving process can be read from, as the chunk reader uses it."""

    kind: str
    name: str
    node: str
    read: ByteReader = field(compare=False, repr=False)
    # Only a source whose memory is never rewritten while it is referenced has one (SnapshotView.lend): then the
    # restored arrays may use the bytes read from it as their own memory. True when it agreed.
    lend: Callable[[], bool] | None = field(default=None, compare=False, repr=False)
    # A source that reads other saving processes' chunks to make its own (protection's rebuild) has one: the
    # chunk reader that reads it hands itself over, so a chunk the restore fetches anyway is fetched once, and
    # what the source reads on its own (parity, copies) counts in the restore's report.
    bind: Callable[[RestoreReads], None] | None = field(default=None, compare=False, repr=False)
    # A source across a network has one (Opened.read_spans): many small chunks asked for in one flight.
    read_spans: Callable[[Sequence[tuple[int, int]]], Iterable[tuple[int, memoryview]]] | None = field(
        default=None, compare=False, repr=False)


def order_sources(holders: Iterable[tuple[Holder, HeldEntry]]) -> list[Holder]:
    """Holders of one process's snapshot, cheapest first (kind rank, then name: the order is deterministic)."""
    return [h for h, _ in sorted(holders, key=lambda he: (RANK.get(he[0].kind, len(KINDS)), he[0].name))]


def check_manifest(m: Manifest, version: Version, process: int, source: str) -> None:
    """Raise ManifestError unless ``m`` is process ``process``'s manifest of ``version``."""
    if m.step != version.step or m.process != process or m.process_count != version.process_count or \
            (version.layout and m.layout != version.layout):
        raise ManifestError(f"{source}: describes step {m.step} of process {m.process}/{m.process_count} "
                            f"(layout {m.layout}), expected step {version.step} of process {process}/"
                            f"{version.process_count} (layout {version.layout})")


# --------------------------------------------------------------------------------------------- the plan
@dataclass
class RestoreReport:
    """Where one process's restore of ``step`` read its bytes: the plan (first choices) and what happened."""

    step: int
    process: int
    chunks: int = 0  # distinct saved chunks fetched (each once)
    planned_by_kind: dict[str, int] = field(default_factory=dict)
    planned_by_node: dict[str, int] = field(default_factory=dict)
    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    bytes_by_node: dict[str, int] = field(default_factory=dict)
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    bytes_by_process: dict[int, int] = field(default_factory=dict)  # by saving process
    fallbacks: list[str] = field(default_factory=list)  # one line per failed read that another source replaced
    seconds: float = 0.0
    # Multi-process restores (jaxckpt.core.routes): each routed array's path -> "collective" or "fetch: <why>",
    # and the bytes of this process's target shards that the collective brought from other processes.
    routes: dict[str, str] = field(default_factory=dict)
    collective_bytes: int = 0
    # Bytes rebuilds read on their own (parity and copy blocks, chunks this restore does not otherwise read), by
    # the kind of holder they came from; the chunks they share with this restore are counted above, once.
    rebuild_reads: dict[str, int] = field(default_factory=dict)
    # Bytes of lost chunks rebuilt from parity, by where the XOR ran: "holder" (where the parity lives: only the
    # result was received) or "here" (the parity and the other units were read here: the fallback).
    rebuilt_at: dict[str, int] = field(default_factory=dict)
    # Newer steps a restore of the newest one passed over (jaxckpt.core.fallback): one line each, saying why.
    skipped: list[str] = field(default_factory=list)
    # The saving processes whose manifests this restore opened, by the kind of holder each came from ("local",
    # "node", "remote", ...): a restore that reads only this node's memory opens only this node's.
    manifests_by_kind: dict[str, int] = field(default_factory=dict)
    # Why a restore that first opened only this node's manifests opened every process's ("" when it did not).
    widened: str = ""
    # Bytes and seconds per phase (discover, plan, reads by source kind, rebuild, device put, ...).
    timeline: RestoreTimeline = field(default_factory=RestoreTimeline, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_kind.values())

    @property
    def transport_bytes(self) -> int:
        """Bytes this process fetched over the host transport (another node's agent, another process): chunks,
        and what rebuilds read on their own."""
        return sum(d.get(k, 0) for d in (self.bytes_by_kind, self.rebuild_reads) for k in ("remote", "peer"))

    @property
    def rebuild_received(self) -> int:
        """Bytes this process received over the host transport to rebuild lost chunks (rebuilt ranges from the
        parity's holders; parity, copies and chunks it read on its own), against :attr:`rebuilt_bytes`."""
        return sum(self.rebuild_reads.get(k, 0) for k in ("remote", "peer"))

    @property
    def rebuilt_bytes(self) -> int:
        """Bytes of lost chunks this restore got rebuilt (from parity or copies)."""
        return self.bytes_by_kind.get("rebuild", 0)

    def summary(self) -> str:
        """One line for the log."""
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.bytes_by_kind.items(), key=lambda kv: RANK.get(kv[0], 99)))
        nodes = ", ".join(f"{k} {v}" for k, v in sorted(self.bytes_by_node.items()))
        fb = f"; {len(self.fallbacks)} fallback(s): {self.fallbacks[0]}" if self.fallbacks else ""
        if self.rebuild_reads:
            fb += "; rebuilds read " + ", ".join(f"{k} {v}" for k, v in sorted(self.rebuild_reads.items()))
        if self.rebuilt_at:
            fb += "; rebuilt from parity " + ", ".join(f"at {k} {v}" for k, v in sorted(self.rebuilt_at.items()))
        if self.widened:
            fb += f"; this node's manifests did not suffice ({self.widened})"
        if self.skipped:
            fb += f"; passed over {len(self.skipped)} newer step(s): {'; '.join(self.skipped)}"
        if self.routes:
            n = sum(1 for r in self.routes.values() if r == "collective")
            fb = f"; {n} of {len(self.routes)} routed array(s) by collective ({self.collective_bytes} bytes " \
                 f"brought), host transport {self.transport_bytes} bytes" + fb
        return (f"step {self.step} on process {self.process}: {self.chunks} chunks, {self.nbytes} bytes in "
                f"{self.seconds:.3f}s; by source kind: {kinds or 'none'}; by node: {nodes or 'none'}; phases: "
                f"{self.timeline.summary()}{fb}")

    def to_dict(self) -> dict:
        """A JSON-able form (tests and tools)."""
        return {"step": self.step, "process": self.process, "chunks": self.chunks, "nbytes": self.nbytes,
                "planned_by_kind": dict(self.planned_by_kind), "planned_by_node": dict(self.planned_by_node),
                "bytes_by_kind": dict(self.bytes_by_kind), "bytes_by_node": dict(self.bytes_by_node),
                "bytes_by_source": dict(self.bytes_by_source),
                "bytes_by_process": {str(k): v for k, v in self.bytes_by_process.items()},
                "fallbacks": list(self.fallbacks), "seconds": self.seconds, "timeline": self.timeline.to_dict(),
                "routes": dict(self.routes), "collective_bytes": self.collective_bytes, "skipped": list(self.skipped),
                "rebuild_reads": dict(self.rebuild_reads), "rebuilt_at": dict(self.rebuilt_at),
                "rebuild_received": self.rebuild_received, "rebuilt_bytes": self.rebuilt_bytes,
                "transport_bytes": self.transport_bytes, "manifests_by_kind": dict(self.manifests_by_kind),
                "widened": self.widened}


def plan_fetch(chunks: Iterable[tuple[str, ChunkMeta]], sources: Mapping[int, Sequence[Source]],
               report: RestoreReport) -> list[tuple[str, ChunkMeta]]:
    """The distinct chunks to fetch (each once, in a stable order); fills the report's planned bytes by the
    first-choice source of each chunk."""
    seen: dict[tuple[int, int], tuple[str, ChunkMeta]] = {}
    for path, c in chunks:
        seen.setdefault((c.process, c.offset), (path, c))
    out = [seen[k] for k in sorted(seen)]
    for _, c in out:
        first = next(iter(sources.get(c.process, ())), None)
        kind, node = (first.kind, first.node) if first is not None else ("unavailable", "")
        report.planned_by_kind[kind] = report.planned_by_kind.get(kind, 0) + c.nbytes
        report.planned_by_node[node] = report.planned_by_node.get(node, 0) + c.nbytes
    return out
