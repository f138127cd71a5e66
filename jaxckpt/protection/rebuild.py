"""The rebuild: after nodes are lost, which saved chunks can be rebuilt and from what; then the rebuild itself.

Planning (pure, every process gets the same answer from the step's :class:`~jaxckpt.protection.plan.ProtectionPlan`):
  1) a chunk must be rebuilt when its process's node is lost or it is known corrupt (``bad_chunks``);
  2) ``replica``: from any surviving, not known-bad copy block, nearest in the ring first; each copy holds the
     whole chunk and is checked against the chunk's crc32c, so a corrupt copy is skipped for the next one;
     ``whole``: from the same box saved whole on another surviving node (a chunk of the plan, not known bad),
     checked the same way;
  3) ``parity`` / ``xor-group``: each range of the chunk lies at unit bytes [a, b) of one unit of one stripe and
     is rebuilt as ``parity[a:b] ^ (every other unit)[a:b]`` (shorter units read as zeros) when the stripe's
     holder survives. Where another unit's bytes in [a, b) are lost too, exactly those bytes are missing: two
     losses in one stripe lose only the range they overlap in, not the whole stripe;
  4) what is left is raised as DataLossError naming the step, the lost nodes and the exact missing boxes
     (the flat byte ranges of each chunk mapped back to boxes of the array).
Execution: :class:`Rebuilder` asks the holder of each stripe's parity to rebuild the range there and send only the
result (``RebuildIO.rebuilt``: the lost bytes cross the network once); where it cannot, it reads surviving chunks,
parity and copies through the :class:`RebuildIO` the caller provides (local snapshot buffers, peers) and XORs
them itself. It verifies the rebuilt chunk against its manifest crc32c, and serves
rebuilt chunks as a :data:`~jaxckpt.core.fetch.ByteReader`, so the ordinary restore path reads a lost process's
chunks as if it were still there.
"""
from __future__ import annotations

import bisect
import collections
import functools
import itertools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol, Sequence, Union

import numpy as np

from jaxckpt.protection import parity
from jaxckpt.core.box import Box
from jaxckpt.core.checksum import crc32c
from jaxckpt.errors import ChecksumError, DataLossError, PeerError, PlanError, StepNotFoundError
from jaxckpt.core.fetch import ByteReader
from jaxckpt.protection.plan import CopyBlock, ProtectionPlan, SavedChunk, Stripe, Unit

log = logging.getLogger("jaxckpt.protection.rebuild")

# Arrays, and boxes per array, named in an error message; the exception's ``missing`` holds all of them.
MAX_LISTED = 16
MAX_BOXES = 4


@dataclass(frozen=True)
class FromCopy:
    """The chunk's bytes sit at ``position`` of copy block ``block``."""

    block: int
    position: int


@dataclass(frozen=True)
class FromStripe:
    """The part is bytes [unit_lo, unit_lo + len) of unit ``unit`` of ``stripe``: parity ^ the other units."""

    stripe: int
    unit: int
    unit_lo: int


@dataclass(frozen=True)
class FromTwin:
    """The chunk is saved whole, the same box, as chunk number ``chunk`` on another node (whole replicas)."""

    chunk: int


Source = Union[FromCopy, FromStripe, FromTwin]


@dataclass(frozen=True)
class Part:
    """Bytes [lo, hi) of a chunk and the ways to rebuild them, best first; none when they are lost."""

    lo: int
    hi: int
    sources: tuple[Source, ...]


@dataclass(frozen=True)
class ChunkRebuild:
    """How to rebuild chunk number ``chunk`` of the protection plan: its parts, in order, covering it."""

    chunk: int
    parts: tuple[Part, ...]


@dataclass(frozen=True)
class RebuildPlan:
    """The chunks of ``step`` lost with ``lost_nodes`` (or corrupt) and how each is rebuilt."""

    step: int
    lost_nodes: tuple[int, ...]
    protection: ProtectionPlan
    rebuilds: tuple[ChunkRebuild, ...]

    @property
    def lost_processes(self) -> tuple[int, ...]:
        """Processes that ran on the lost nodes."""
        return tuple(p for p, n in enumerate(self.protection.nodes) if n in self.lost_nodes)

    @property
    def nbytes(self) -> int:
        """Bytes to rebuild."""
        return sum(self.protection.chunks[r.chunk].nbytes for r in self.rebuilds)

    def missing(self) -> dict[str, tuple[Box, ...]]:
        """Array path -> the exact boxes no part can rebuild (empty when everything can be)."""
        out: dict[str, list[Box]] = {}
        for r in self.rebuilds:
            c = self.protection.chunks[r.chunk]
            for lo, hi in _merge([(p.lo, p.hi) for p in r.parts if not p.sources]):
                out.setdefault(c.path, []).extend(byte_range_boxes(c, lo, hi))
        return {k: coalesce(v) for k, v in out.items()}


def plan_rebuild(protection: ProtectionPlan, lost_nodes: Iterable[int], *, step: int,
                 bad_chunks: Iterable[tuple[int, int]] = (), bad_blocks: Iterable[tuple[str, int]] = (),
                 strict: bool = True) -> RebuildPlan:
    """How to rebuild what ``lost_nodes`` took (and the ``bad_chunks`` (process, offset) known to be corrupt).

    ``bad_blocks`` are ("stripe", id) or ("copy", id) blocks known to be corrupt. With ``strict`` (default) bytes
    that cannot be rebuilt raise DataLossError naming ``step`` and the missing boxes; otherwise they are left
    in the plan with no source (see :meth:`RebuildPlan.missing`).
    """
    lost = frozenset(int(n) for n in lost_nodes)
    unknown = sorted(lost - set(protection.node_ids))
    if unknown:
        raise PlanError(f"step {step}: lost node(s) {unknown} are not nodes of the saving job {protection.node_ids}")
    bad = frozenset((int(p), int(o)) for p, o in bad_chunks)
    bad_b = frozenset((str(k), int(i)) for k, i in bad_blocks)
    chunks = protection.chunks
    gone = [c.node in lost or c.key in bad for c in chunks]
    where: dict[int, list[tuple[Stripe, int, int, int, int]]] = {}  # chunk -> (stripe, unit, unit pos, lo, hi)
    blocked: dict[int, list[list[tuple[int, int]]]] = {}  # stripe -> per unit: lost unit ranges of the others
    for s in protection.stripes:
        lost_ranges = []
        for k, u in enumerate(s.units):
            pos, mine = 0, []
            for g in u.ranges:
                if gone[g.chunk]:
                    where.setdefault(g.chunk, []).append((s, k, pos, g.lo, g.hi))
                    mine.append((pos, pos + g.nbytes))
                pos += g.nbytes
            lost_ranges.append(mine)
        if any(lost_ranges):
            blocked[s.id] = [_merge([r for j, rs in enumerate(lost_ranges) if j != k for r in rs])
                             for k in range(len(s.units))]
    copies: dict[int, list[FromCopy]] = {}
    for b in protection.copy_blocks:
        if b.node not in lost and ("copy", b.id) not in bad_b:
            for i, pos in zip(b.chunks, b.positions):
                copies.setdefault(i, []).append(FromCopy(b.id, pos))
    twins: dict[tuple[str, Box], list[int]] = {}
    for i, c in enumerate(chunks):
        if c.policy == "whole" and not gone[i]:
            twins.setdefault((c.path, c.box), []).append(i)
    rebuilds = []
    for i, c in enumerate(chunks):
        if not gone[i] or c.nbytes == 0:
            continue
        if c.policy == "whole":
            parts = [Part(0, c.nbytes, tuple(FromTwin(j) for j in twins.get((c.path, c.box), ())))]
        elif c.policy in ("parity", "xor-group"):
            parts = []
            for s, k, pos, lo, hi in where.get(i, ()):
                parts += _stripe_parts(s, k, pos, lo, hi, blocked[s.id][k], lost, bad_b)
            parts.sort(key=lambda p: p.lo)
        else:
            parts = [Part(0, c.nbytes, tuple(copies.get(i, ())))]
        rebuilds.append(ChunkRebuild(i, tuple(parts)))
    plan = RebuildPlan(int(step), tuple(sorted(lost)), protection, tuple(rebuilds))
    missing = plan.missing()
    if missing and strict:
        raise data_loss(plan, missing)
    return plan


def _stripe_parts(s: Stripe, k: int, pos: int, lo: int, hi: int, blocked: list[tuple[int, int]],
                  lost: frozenset[int], bad_b: frozenset[tuple[str, int]]) -> list[Part]:
    """Parts of chunk bytes [lo, hi), which are bytes [pos, pos + hi - lo) of unit ``k`` of stripe ``s``;
    ``blocked`` are the (merged, sorted) unit ranges where another unit of the stripe is lost too."""
    a, b = pos, pos + hi - lo
    if s.node in lost or ("stripe", s.id) in bad_b:
        return [Part(lo, hi, ())]
    parts, at = [], a
    first = max(bisect.bisect_right(blocked, (a, a)) - 1, 0)
    for x, y in blocked[first:]:
        if x >= b:
            break
        x, y = max(x, a), min(y, b)
        if y <= x:
            continue
        if x > at:
            parts.append(Part(lo + at - a, lo + x - a, (FromStripe(s.id, k, at),)))
        parts.append(Part(lo + x - a, lo + y - a, ()))
        at = y
    if at < b:
        parts.append(Part(lo + at - a, hi, (FromStripe(s.id, k, at),)))
    return parts


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for x, y in sorted(ranges):
        if out and x <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], y))
        else:
            out.append((x, y))
    return out


def coalesce(boxes: Iterable[Box], limit: int = 256) -> tuple[Box, ...]:
    """The same index set in fewer boxes: neighbours that differ along one axis only are joined (up to ``limit``)."""
    out = sorted(set(boxes))
    joined = True
    while joined and len(out) <= limit:
        joined = False
        for i, j in ((i, j) for i in range(len(out)) for j in range(i + 1, len(out))):
            m = _join(out[i], out[j])
            if m is not None:
                out[i] = m
                del out[j]
                joined = True
                break
    return tuple(sorted(out))


def _join(a: Box, b: Box) -> Box | None:
    diff = [d for d in range(a.ndim) if (a.start[d], a.stop[d]) != (b.start[d], b.stop[d])]
    if len(diff) != 1:
        return None
    d = diff[0]
    if a.stop[d] == b.start[d]:
        return Box(a.start, a.stop[:d] + (b.stop[d],) + a.stop[d + 1:])
    if b.stop[d] == a.start[d]:
        return Box(b.start, b.stop[:d] + (a.stop[d],) + b.stop[d + 1:])
    return None


def data_loss(plan: RebuildPlan, missing: Mapping[str, tuple[Box, ...]]) -> DataLossError:
    """The error for bytes of ``plan.step`` that nothing can rebuild, naming the step, nodes, arrays and boxes."""
    paths = sorted(missing)
    listed = []
    for path in paths[:MAX_LISTED]:
        boxes = missing[path]
        shown = "; ".join(f"{list(b.start)}..{list(b.stop)}" for b in boxes[:MAX_BOXES])
        extra = len(boxes) - MAX_BOXES
        listed.append(f"{path} {shown}" + (f" (+{extra} more boxes)" if extra > 0 else ""))
    more = f"; and {len(paths) - MAX_LISTED} more arrays" if len(paths) > MAX_LISTED else ""
    n = sum(len(v) for v in missing.values())
    lost = ", ".join(map(str, plan.lost_nodes)) or "none"
    return DataLossError(f"step {plan.step}: protection {plan.protection.policy!r} cannot rebuild what was lost "
                         f"with node(s) {lost}: {n} box(es) of {len(paths)} array(s) missing: "
                         f"{', '.join(listed)}{more}",
                         step=plan.step, lost_nodes=plan.lost_nodes, missing=dict(missing))


def byte_range_boxes(chunk: SavedChunk, lo: int, hi: int) -> list[Box]:
    """The boxes of the array elements that bytes [lo, hi) of ``chunk`` (row-major) belong to."""
    size = chunk.itemsize
    a, b = lo // size, -(-hi // size)
    return [Box(s, e) for s, e in _flat_boxes(chunk.box.start, chunk.box.shape, a, b)]


def _flat_boxes(start: tuple[int, ...], shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple, tuple]]:
    """Row-major elements [lo, hi) of the box at ``start`` with ``shape``, as at most 2*ndim-1 boxes."""
    if lo >= hi:
        return []
    if not shape:
        return [((), ())]
    inner = int(np.prod(shape[1:], dtype=np.int64))
    if inner == 0:
        return []
    r0, c0 = divmod(lo, inner)
    r1, c1 = divmod(hi, inner)

    def row(r: int, x: int, y: int) -> list[tuple[tuple, tuple]]:
        return [((start[0] + r,) + s, (start[0] + r + 1,) + e) for s, e in _flat_boxes(start[1:], shape[1:], x, y)]

    if r0 == r1:
        return row(r0, c0, c1)
    out = []
    if c0:
        out += row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        rest = tuple(s + n for s, n in zip(start[1:], shape[1:]))
        out.append(((start[0] + r0,) + start[1:], (start[0] + r1,) + rest))
    if c1:
        out += row(r1, 0, c1)
    return out


# ------------------------------------------------------------------------------------------------------- rebuild
# Requests of a bulk rebuild (Rebuilder.read_into) in flight at once: a remote agent's holder has as many transport
# clients (backends/agent/readers.MAX_CLIENTS)
READERS = 4
RUN_BYTES = 8 << 20  # at most this many bytes in one bulk request: several in flight, none holding a share whole


def _runs(parts: list[tuple[int, int, int, "ChunkRebuild"]], touching: bool = True
          ) -> list[list[tuple[int, int, int, "ChunkRebuild"]]]:
    """``parts`` ((source lo, source hi, ...)) in runs of at most RUN_BYTES each, of touching source ranges (one
    request for a run) or, not ``touching``, of any (one flight of ranges)."""
    out: list[list] = []
    size = 0
    for p in sorted(parts, key=lambda x: x[0]):
        n = p[1] - p[0]
        if out and (not touching or out[-1][-1][1] == p[0]) and size + n <= RUN_BYTES:
            out[-1].append(p)
            size += n
        else:
            out.append([p])
            size = n
    return out


class RebuildIO(Protocol):
    """Where a rebuild reads from; each method raises PeerError/StepNotFoundError when unreachable."""

    def chunk(self, chunk: SavedChunk) -> parity.Buffer:
        """The whole saved ``chunk`` from its (surviving) process, verified (ChecksumError when corrupt)."""

    def chunk_range(self, chunk: SavedChunk, lo: int, hi: int) -> parity.Buffer:
        """Bytes [lo, hi) of saved ``chunk`` from its (surviving) process, unverified (the rebuilt chunk's
        crc32c checks them)."""

    def spans(self, process: int, ranges: Sequence[tuple[int, int]]) -> list[parity.Buffer]:
        """The (offset, nbytes) ranges of surviving ``process``'s buffer, in order, unverified (the rebuilt chunks'
        crc32cs check them): many at once, where one round trip each would be the cost."""

    def parity(self, stripe: Stripe, lo: int, hi: int) -> parity.Buffer:
        """Bytes [lo, hi) of ``stripe``'s parity block from ``stripe.node`` (verified by its holder)."""

    def copy(self, block: CopyBlock, lo: int, hi: int) -> parity.Buffer:
        """Bytes [lo, hi) of copy ``block`` from ``block.node``."""

    def rebuilt(self, stripe: Stripe, unit: int, lo: int, hi: int) -> parity.Buffer | None:
        """Bytes [lo, hi) of unit ``unit`` of ``stripe`` rebuilt where the stripe's parity lives (its holder XORs
        the parity with the other units and sends only the result), unverified like a range; None where the
        holder cannot (the rebuild then reads the parity and the other units itself)."""


_UNAVAILABLE = (ChecksumError, PeerError, StepNotFoundError)


@functools.lru_cache(maxsize=1)
def _readers() -> ThreadPoolExecutor:
    """Threads that read parity blocks while a rebuild gathers the other units (each read only waits for I/O)."""
    return ThreadPoolExecutor(max_workers=8, thread_name_prefix="jaxckpt-rebuild-read")


class Rebuilder:
    """Rebuilds the chunks of a RebuildPlan through ``io``; ``crcs`` maps (process, offset) to the manifest crc32c."""

    def __init__(self, plan: RebuildPlan, io: RebuildIO, crcs: Mapping[tuple[int, int], int] | None = None,
                 *, workers: int = 1) -> None:
        self.plan, self._io, self._crcs, self._workers = plan, io, dict(crcs or {}), workers
        self._by_key = {plan.protection.chunks[r.chunk].key: r for r in plan.rebuilds}

    def chunk(self, process: int, offset: int) -> np.ndarray:
        """The rebuilt bytes of the chunk at ``offset`` of lost ``process``'s buffer, checked against its crc32c."""
        r = self._by_key.get((process, offset))
        prot = self.plan.protection
        if r is None:
            raise StepNotFoundError(f"step {self.plan.step}: process {process} has no lost chunk at offset {offset}")
        c = prot.chunks[r.chunk]
        crc = self._crcs.get(c.key)
        what = f"{c.path}: step {self.plan.step} chunk {list(c.box.start)}..{list(c.box.stop)} of process {process}"
        if crc is not None:
            # First from the byte ranges the stripes need, each read once and checked only through the rebuilt
            # chunk's crc32c: reading (and verifying) every other unit's whole chunk again for each lost chunk
            # multiplied a node loss's transport. Should that fail, the whole verified chunks say which source
            # is bad and route around it.
            try:
                return self._rebuild(r, c, crc, what, None)
            except (*_UNAVAILABLE, DataLossError) as e:
                log.warning("%s: rebuilding from byte ranges failed (%s); again from whole verified chunks", what, e)
        return self._rebuild(r, c, crc, what, {})

    def _rebuild(self, r: ChunkRebuild, c: SavedChunk, crc: int | None, what: str,
                 cache: dict[int, np.ndarray] | None) -> np.ndarray:
        """Chunk ``c`` from its parts' sources; ``cache`` holds the whole verified chunks read (None: ranges)."""
        prot = self.plan.protection
        whole = r.parts[0].sources if len(r.parts) == 1 and (r.parts[0].lo, r.parts[0].hi) == (0, c.nbytes) else ()
        failed: dict[int, str] = {}  # id of a source that failed here -> why (not asked again below)
        for src in itertools.takewhile(lambda x: isinstance(x, FromTwin), whole):  # the cheapest sources, in order
            # A whole copy (a replica of the chunk on another node, say): its bytes are the chunk, verified once,
            # and handed over as they are, without copying them into a buffer of their own to verify them again.
            # Its readers copy what they keep (the restore's chunk reader owns no rebuilt bytes; the recovery
            # writes them into its slot).
            twin = prot.chunks[src.chunk]
            try:
                data = parity.as_bytes(self._io.chunk(twin))  # checked there against the copy's own crc32c
                if crc is not None and self._crcs.get(twin.key) != crc:
                    parity.check(data, crc, f"{what}, its copy on node {twin.node}")
                return data
            except _UNAVAILABLE as e:  # the next copy, then the part's other sources below
                log.warning("%s: source %s failed, trying the next: %s", what, src, e)
                failed[id(src)] = f"{src}: {e}"
        out = np.empty(c.nbytes, dtype=np.uint8)
        for part in r.parts:
            errors = []
            for src in part.sources:
                if id(src) in failed:
                    errors.append(failed[id(src)])
                    continue
                try:
                    if isinstance(src, FromTwin):  # verified against its own crc32c, then against ours
                        data = parity.as_bytes(self._io.chunk(prot.chunks[src.chunk]))
                        if crc is not None:
                            parity.check(data, crc, f"{what}, its copy on node {prot.chunks[src.chunk].node}")
                        out[part.lo:part.hi] = data
                    elif isinstance(src, FromCopy):
                        b = prot.copy_blocks[src.block]
                        data = parity.as_bytes(self._io.copy(b, src.position + part.lo, src.position + part.hi))
                        if crc is not None and (part.lo, part.hi) == (0, c.nbytes):
                            parity.check(data, crc, f"{what}, copy on node {b.node}")
                        out[part.lo:part.hi] = data
                    else:
                        self._from_stripe(src, part, out, cache)
                    break
                except _UNAVAILABLE as e:
                    log.warning("%s: source %s failed, trying the next: %s", what, src, e)
                    errors.append(f"{src}: {e}")
            else:
                missing = {c.path: tuple(byte_range_boxes(c, part.lo, part.hi))}
                err = data_loss(self.plan, missing)
                raise DataLossError(f"{err}" + (f" (sources failed: {'; '.join(errors)})" if errors else ""),
                                    step=self.plan.step, lost_nodes=self.plan.lost_nodes, missing=missing)
        if crc is not None:
            parity.check(out, crc, f"{what}, rebuilt from protection")
        return out

    def _from_stripe(self, src: FromStripe, part: Part, out: np.ndarray,
                     cache: dict[int, np.ndarray] | None) -> None:
        s = self.plan.protection.stripes[src.stripe]
        a, b = src.unit_lo, src.unit_lo + part.hi - part.lo
        if cache is None:
            # The lost bytes move once: rebuilt where the parity lives, only the result comes here. (Not when
            # whole verified chunks are read: a rebuild from ranges, this one included, failed its crc32c.)
            got = self._io.rebuilt(s, src.unit, a, b)
            if got is not None:
                out[part.lo:part.hi] = parity.as_bytes(got)
                return
        # The parity block comes from one holder and the units from others (or from the restore's own fetches,
        # under way): the parity is read on a thread of its own while the units are gathered here.
        pending = _readers().submit(self._io.parity, s, a, b)
        try:
            units = [self._unit_range(u, a, b, cache) for k, u in enumerate(s.units) if k != src.unit]
        finally:
            wait([pending])  # no read outlives the rebuild that asked for it
        parity.encode([pending.result()] + units, out[part.lo:part.hi], length=b - a, workers=self._workers)

    def _unit_range(self, u: Unit, a: int, b: int, cache: dict[int, np.ndarray] | None) -> list[np.ndarray]:
        """Bytes [a, b) of unit ``u`` (fewer where it ends), from verified whole chunks, or (``cache`` None) as
        byte ranges of the chunks."""
        out, pos = [], 0
        for g in u.ranges:
            x, y = max(a, pos), min(b, pos + g.nbytes)
            if y > x and cache is None:
                chunk = self.plan.protection.chunks[g.chunk]
                out.append(parity.as_bytes(self._io.chunk_range(chunk, g.lo + x - pos, g.lo + y - pos)))
            elif y > x:
                if g.chunk not in cache:
                    cache[g.chunk] = parity.as_bytes(self._io.chunk(self.plan.protection.chunks[g.chunk]))
                out.append(cache[g.chunk][g.lo + x - pos:g.lo + y - pos])
            pos += g.nbytes
        return out

    def read_into(self, process: int, out: memoryview, chunks: Sequence[tuple[int, int]], *,
                  readers: int = READERS) -> None:
        """Rebuild lost ``process``'s ``chunks`` ((offset, nbytes) of its buffer) into ``out``, its buffer, each
        checked against its crc32c. In bulk: each part's first source, ranges of one stripe's unit, one copy block
        or one surviving process merged where they touch, so that a share of many small chunks is a few
        requests (a rebuild at a stripe's holder, a flight of ranges) instead of one round trip per chunk. A
        chunk whose bulk request fails, or whose bytes fail their crc32c, is rebuilt alone (:meth:`chunk`, with
        every fallback); a chunk no plan covers raises there as it does."""
        buf = np.frombuffer(out, np.uint8)
        prot = self.plan.protection
        # source key -> [(source lo, source hi, where in out, rebuild)] of the parts it serves first
        groups: dict[tuple, list[tuple[int, int, int, ChunkRebuild]]] = collections.defaultdict(list)
        alone: list[tuple[int, int]] = []
        for offset, nbytes in chunks:
            r = self._by_key.get((process, offset))
            if r is None or any(not p.sources for p in r.parts) or prot.chunks[r.chunk].nbytes != nbytes:
                alone.append((offset, nbytes))
                continue
            for p in r.parts:
                src, n = p.sources[0], p.hi - p.lo
                if isinstance(src, FromStripe):
                    groups[("stripe", src.stripe, src.unit)].append((src.unit_lo, src.unit_lo + n, offset + p.lo, r))
                elif isinstance(src, FromCopy):
                    lo = src.position + p.lo
                    groups[("copy", src.block)].append((lo, lo + n, offset + p.lo, r))
                else:
                    twin = prot.chunks[src.chunk]
                    groups[("twin", twin.process)].append((twin.offset + p.lo, twin.offset + p.hi, offset + p.lo, r))
        runs = [(key, run) for key, parts in groups.items() for run in _runs(parts, touching=key[0] != "twin")]
        runs.sort(key=lambda kr: -sum(hi - lo for lo, hi, *_ in kr[1]))  # the biggest first, as chunk by chunk did
        done = {id(r): r for parts in groups.values() for *_, r in parts}
        parts_left = collections.Counter(id(r) for parts in groups.values() for *_, r in parts)
        failed: set[int] = set()  # ids of the ChunkRebuilds to rebuild alone
        lock = threading.Lock()

        def settle(run: list[tuple[int, int, int, ChunkRebuild]], ok: bool) -> None:
            """Count ``run``'s parts in; a chunk whose last part came is checked here, on the reading thread, while
            other reads are under way."""
            complete = []
            with lock:
                for *_, r in run:
                    if not ok:
                        failed.add(id(r))
                    parts_left[id(r)] -= 1
                    if not parts_left[id(r)] and id(r) not in failed:
                        complete.append(r)
            for r in complete:
                c = prot.chunks[r.chunk]
                crc = self._crcs.get(c.key)
                if crc is not None and crc32c(buf[c.offset:c.offset + c.nbytes]) != crc:
                    log.warning("step %d: chunk at %d of process %d failed its crc32c rebuilt in bulk; again alone",
                                self.plan.step, c.offset, process)
                    with lock:
                        failed.add(id(r))

        def fetch(key: tuple, run: list[tuple[int, int, int, ChunkRebuild]]) -> None:
            a, b = run[0][0], run[-1][1]
            try:
                if key[0] == "twin":
                    for (lo, hi, at, _), data in zip(run, self._io.spans(key[1], [(x[0], x[1] - x[0]) for x in run])):
                        buf[at:at + hi - lo] = parity.as_bytes(data)
                    return settle(run, True)
                if key[0] == "stripe":
                    got = self._io.rebuilt(prot.stripes[key[1]], key[2], a, b)
                else:
                    got = self._io.copy(prot.copy_blocks[key[1]], a, b)
            except (*_UNAVAILABLE, OSError) as e:
                log.warning("step %d: %d bytes of %s for process %d: %s; their chunks are rebuilt one by one",
                            self.plan.step, b - a, key, process, e)
                got = None
            if got is None:  # no holder rebuilds there: each chunk alone reads the parity and XORs here
                return settle(run, False)
            got = parity.as_bytes(got)
            for lo, hi, at, _ in run:
                buf[at:at + hi - lo] = got[lo - a:hi - a]
            settle(run, True)

        with ThreadPoolExecutor(max(1, min(readers, len(runs))), thread_name_prefix="jaxckpt-rebuild-bulk") as ex:
            for f in [ex.submit(fetch, key, run) for key, run in runs]:
                f.result()
        alone += [(prot.chunks[r.chunk].offset, prot.chunks[r.chunk].nbytes) for rid, r in done.items()
                  if rid in failed]

        def one(offset: int, nbytes: int) -> None:
            buf[offset:offset + nbytes] = self.reader(process)(offset, nbytes)

        with ThreadPoolExecutor(max(1, min(readers, len(alone))), thread_name_prefix="jaxckpt-rebuild-one") as ex:
            for f in [ex.submit(one, o, n) for o, n in alone]:
                f.result()

    def reader(self, process: int) -> ByteReader:
        """A ByteReader for lost ``process``: reads of whole chunks come back rebuilt (for ChunkReader)."""
        def read(offset: int, nbytes: int) -> memoryview:
            data = self.chunk(process, offset)
            if data.size != nbytes:
                raise StepNotFoundError(f"step {self.plan.step}: process {process} chunk at offset {offset} has "
                                        f"{data.size} bytes, {nbytes} were asked for")
            return memoryview(data)
        return read
