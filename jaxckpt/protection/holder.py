"""Snapshots rebuilt from protection data, as one more holder a restore reads from (kind ``rebuild``).

:class:`RebuildHolder` (last before persistent) reads the protection slots (``jaxckpt.protection.slot``) through
the job's agent holders (``jaxckpt.core.catalog``): for each step with a protection plan it works out which saving
processes no agent holds any more (their node is lost), plans the rebuild
(``jaxckpt.protection.rebuild.plan_rebuild``) and, when every byte can be rebuilt, lists every process of the
step, so the catalog counts the step complete: a lost process's chunks come back rebuilt
(``rebuild.Rebuilder``), and a surviving process's chunk is rebuilt too when its own copy fails its checksum (the
chunk reader falls back to this holder). A step that cannot be rebuilt is not listed; its DataLossError (step,
lost nodes, missing boxes) is kept in ``losses``.
"""
from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from jaxckpt.core import manifest as mf
from jaxckpt.protection import parity
from jaxckpt.core.checksum import crc32c
from jaxckpt.errors import ChecksumError, DataLossError, ManifestError, PeerError, StepNotFoundError
from jaxckpt.protection.plan import CopyBlock, ProtectionPlan, SavedChunk, Stripe
from jaxckpt.protection.plan_wire import decode_plan
from jaxckpt.protection.rebuild import Rebuilder, data_loss, plan_rebuild
from jaxckpt.protection.slot import PROTECT_BASE, BlockRef, SlotHeader, decode_header, decode_meta
from jaxckpt.core.manifest import ChunkMeta
from jaxckpt.core.sources import HeldEntry, Holder, Opened, RestoreReads

log = logging.getLogger("jaxckpt.protection.holder")


@dataclass
class _StepInfo:
    step: int
    plan: ProtectionPlan
    manifests: dict[int, bytes]
    # The crc32c of every chunk, from decoding every process's manifest: a rebuild needs them, a scan does not, and a
    # 4,096-leaf manifest takes a tenth of a second to decode, so they are decoded when a rebuild first asks.
    crcs_of: Callable[[], dict[tuple[int, int], int]]
    held: dict[int, list[Holder]]  # saving process -> agent holders that hold its snapshot
    blocks: dict[tuple[str, int], list[tuple[Holder, int, BlockRef]]]  # block -> (holder, pseudo process, ref)
    lost_nodes: tuple[int, ...]
    bad_blocks: tuple[tuple[str, int], ...]
    complete: bool = False  # every saving process's slot and every block are there, and no node is lost

    @functools.cached_property
    def crcs(self) -> dict[tuple[int, int], int]:
        """(saving process, offset) -> crc32c of every chunk of the step (ManifestError if a manifest is bad)."""
        return self.crcs_of()


class _IO:
    """rebuild.RebuildIO over the agents: surviving chunks, parity and copies, opened lazily, closed together."""

    def __init__(self, info: _StepInfo) -> None:
        self.info, self._opened, self._lock = info, {}, threading.Lock()
        self.reads: RestoreReads | None = None
        self._peers: dict[int, tuple[str, bytes, str] | None] = {}  # saving process -> where its agent serves

    def bind(self, reads: RestoreReads) -> None:
        """Read surviving chunks through the restore that reads this rebuild (Source.bind): a chunk that restore
        needs anyway is then fetched once, not once for it and once more for every rebuild that XORs it; what
        is read here on its own counts in that restore's report."""
        self.reads = reads

    def _count(self, h: Holder, nbytes: int) -> None:
        if self.reads is not None:
            self.reads.account(self.info.step, h.kind, nbytes)

    def _shared(self, c: SavedChunk) -> np.ndarray | None:
        """The verified bytes of ``c`` as the restore reading this rebuild has them, if it reads ``c`` anyway."""
        crc = self.info.crcs.get(c.key)
        if self.reads is None or crc is None:
            return None
        got = self.reads.lookup(self.info.step, c.path, ChunkMeta(c.box, c.offset, c.nbytes, crc, c.process))
        return None if got is None else np.frombuffer(got, np.uint8)

    def _open(self, h: Holder, q: int) -> Opened:
        with self._lock:
            o = self._opened.get((id(h), q))
            if o is None:
                o = self._opened[(id(h), q)] = h.open(q, self.info.step)
            return o

    def chunk(self, c: SavedChunk) -> np.ndarray:
        crc = self.info.crcs.get(c.key)
        got = self._shared(c)
        if got is not None:
            return parity.as_bytes(got)
        errors = []
        for h in self.info.held.get(c.process, ()):
            try:
                data = parity.as_bytes(np.frombuffer(self._open(h, c.process).read(c.offset, c.nbytes), np.uint8))
                self._count(h, c.nbytes)
                if crc is not None:
                    parity.check(data, crc, f"{c.path}: step {self.info.step} chunk of process {c.process} at "
                                            f"{h.name}")
                return data
            except (ChecksumError, PeerError, StepNotFoundError, OSError) as e:
                errors.append(str(e))
        raise ChecksumError(f"step {self.info.step}: no good copy of chunk {c.box} of {c.path} (process "
                            f"{c.process}): {'; '.join(errors) or 'no holder'}")

    def chunk_range(self, c: SavedChunk, lo: int, hi: int) -> np.ndarray:
        got = self._shared(c)
        if got is not None:
            return got[lo:hi]
        errors = []
        for h in self.info.held.get(c.process, ()):
            try:
                data = np.frombuffer(self._open(h, c.process).read(c.offset + lo, hi - lo), np.uint8)
                self._count(h, hi - lo)
                return data
            except (PeerError, StepNotFoundError, OSError) as e:
                errors.append(str(e))
        raise PeerError(f"step {self.info.step}: bytes {lo}..{hi} of chunk {c.box} of {c.path} (process "
                        f"{c.process}) cannot be read: {'; '.join(errors) or 'no holder'}")

    def spans(self, process: int, ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """RebuildIO.spans: the (offset, nbytes) ranges of surviving ``process``'s buffer, in one flight where its
        holder reads several at once, unverified."""
        errors = []
        for h in self.info.held.get(process, ()):
            try:
                o = self._open(h, process)
                if o.read_spans is None:
                    out = [np.frombuffer(o.read(off, n), np.uint8) for off, n in ranges]
                else:
                    out = [np.empty(0, np.uint8)] * len(ranges)
                    for i, data in o.read_spans(ranges):
                        out[i] = np.frombuffer(data, np.uint8)
                    if any(x.size != n for x, (_, n) in zip(out, ranges)):
                        raise PeerError(f"{h.name}: a range of process {process} came back short or not at all")
                self._count(h, sum(n for _, n in ranges))
                return out
            except (PeerError, StepNotFoundError, OSError) as e:
                errors.append(str(e))
        raise PeerError(f"step {self.info.step}: {len(ranges)} range(s) of process {process} cannot be read: "
                        f"{'; '.join(errors) or 'no holder'}")

    def _block(self, kind: str, bid: int, lo: int, hi: int, what: str) -> np.ndarray:
        errors = []
        for h, pp, ref in self.info.blocks.get((kind, bid), ()):
            try:
                data = np.frombuffer(self._open(h, pp).read(ref.offset + lo, hi - lo), np.uint8)
                self._count(h, hi - lo)
                if (lo, hi) == (0, ref.nbytes):
                    parity.check(data, ref.crc, f"step {self.info.step} {what} at {h.name}")
                return data
            except (ChecksumError, PeerError, StepNotFoundError, OSError) as e:
                errors.append(str(e))
        raise PeerError(f"step {self.info.step}: {what} cannot be read: {'; '.join(errors) or 'no holder'}")

    def parity(self, stripe: Stripe, lo: int, hi: int) -> np.ndarray:
        return self._block("stripe", stripe.id, lo, hi, f"parity stripe {stripe.id} of node {stripe.node}")

    def copy(self, block: CopyBlock, lo: int, hi: int) -> np.ndarray:
        return self._block("copy", block.id, lo, hi, f"copy block {block.id} on node {block.node}")

    def rebuilt(self, stripe: Stripe, unit: int, lo: int, hi: int) -> np.ndarray | None:
        """RebuildIO.rebuilt: asks the other nodes' agents holding the stripe's parity (a parity on this node is
        read here at memory speed), naming where each process of the other units' bytes in [lo, hi) is served;
        None, counted and reported, where none can."""
        what = f"step {self.info.step}: bytes {lo}..{hi} of unit {unit} of parity stripe {stripe.id}"
        holders = [(h, pp) for h, pp, _ in self.info.blocks.get(("stripe", stripe.id), ()) if h.kind == "remote"]
        errors: list[str] = []
        if holders:
            sources, plan = {}, self.info.plan
            for k, u in enumerate(stripe.units):
                pos = 0
                for g in u.ranges:
                    q = plan.chunks[g.chunk].process
                    if k != unit and pos < hi and pos + g.nbytes > lo and q not in sources:
                        where = self._peers.get(q)
                        if where is None:  # looked up once per restore (this node's agent: its peer files)
                            where = self._peers[q] = next(
                                (p for h in self.info.held.get(q, ()) if (p := h.peer()) is not None), None)
                        if where is None:
                            errors.append(f"no agent of process {q} serves peers")
                            break
                        sources[q] = where
                    pos += g.nbytes
            for h, pp in holders if not errors else ():
                try:
                    data = np.frombuffer(h.rebuild(pp, self.info.step, stripe.id, unit, lo, hi, sources), np.uint8)
                    self._count(h, hi - lo)
                    if self.reads is not None:
                        self.reads.rebuilt(self.info.step, "holder", hi - lo)
                    return data
                except (ChecksumError, PeerError, StepNotFoundError, OSError) as e:
                    errors.append(f"{h.name}: {e}")
        line = f"{what}: rebuilt here from the parity and the other units ({'; '.join(errors)})" if errors else ""
        if line:
            log.warning("%s", line)
        if self.reads is not None:
            self.reads.rebuilt(self.info.step, "here", hi - lo, line)
        return None

    def close(self) -> None:
        with self._lock:
            opened, self._opened = list(self._opened.values()), {}
        for o in opened:
            try:
                o.close()
            except Exception as e:  # noqa: BLE001
                log.warning("step %d: could not close a protection source: %s", self.info.step, e)


class RebuildHolder(Holder):
    """Snapshots rebuilt from protection data held by the agents (see the module docstring)."""

    kind = "rebuild"
    node = "rebuild"
    name = "rebuild from protection"

    def __init__(self, agent_holders: Callable[[], list[Holder]], workers: int = 1) -> None:
        self._agents, self._workers = agent_holders, workers
        self._meta: dict[tuple, tuple[SlotHeader, bytes, dict[int, bytes]]] = {}
        self._steps: dict[int, _StepInfo] = {}
        self.losses: dict[int, DataLossError] = {}
        self._crcs: dict[tuple, dict[tuple[int, int], int]] = {}  # _chunk_crcs's, for the steps of the last scan
        self._lock = threading.Lock()

    def _header(self, h: Holder, pp: int, step: int, crc: int) -> tuple[SlotHeader, bytes, dict[int, bytes]]:
        key = (h.name, pp, step, crc)
        got = self._meta.get(key)
        if got is None:
            o = h.open(pp, step)
            try:
                hdr = decode_header(o.manifest, source=f"protection slot {pp - PROTECT_BASE} step {step} at {h.name}")
                off, n, mcrc = hdr.meta
                raw = bytes(o.read(off, n))
                if crc32c(raw) != mcrc:
                    raise ChecksumError(f"protection meta of step {step} at {h.name} is corrupt")
                plan, man = decode_meta(raw, source=f"protection meta of step {step} at {h.name}")
            finally:
                o.close()
            got = self._meta[key] = (hdr, plan, man)
        return got

    def scan(self, agents_said: list[tuple[Holder, HeldEntry]] | None = None) -> dict[int, _StepInfo]:
        """Look at every agent again; the steps that can be restored with rebuilding, by step. ``agents_said``:
        what the agents' holders just said they hold (Holder.held_given); an agent not among them is asked."""
        given: dict[int, list[HeldEntry]] = {}
        for h, e in agents_said or ():
            given.setdefault(id(h), []).append(e)
        real: dict[int, list[tuple[Holder, HeldEntry]]] = {}
        prot: dict[int, list[tuple[Holder, HeldEntry]]] = {}
        unreadable: dict[int, list[tuple[Holder, HeldEntry]]] = {}  # held, but its manifest does not decode
        failed: dict[tuple, Exception] = {}  # slots whose header could not be read, reported below

        def listing(h: Holder) -> list[HeldEntry] | None:
            """One agent's listing and the headers of its protection slots not read yet (cached by _header):
            a start-up's scan waits for the slowest agent's round trips, not for the sum of every agent's."""
            try:
                entries = given.get(id(h)) or h.held()
            except Exception as e:  # noqa: BLE001 - an unreachable agent is a lost node
                log.info("%s did not list its snapshots: %s", h.name, e)
                return None
            for e in entries:
                if e.process >= PROTECT_BASE:
                    try:
                        self._header(h, e.process, e.step, e.crc)
                    except (ManifestError, ChecksumError, PeerError, StepNotFoundError, OSError) as err:
                        failed[(h.name, e.process, e.step, e.crc)] = err
            return entries

        agents = self._agents()
        if len(agents) > 1:  # each agent's requests stay on one thread, in order, as a sequential scan makes them
            with ThreadPoolExecutor(min(len(agents), 16), thread_name_prefix="jaxckpt-scan") as ex:
                listed = list(zip(agents, ex.map(listing, agents)))
        else:
            listed = [(h, listing(h)) for h in agents]
        for h, entries in listed:
            if entries is None:
                continue
            for e in entries:
                if e.process >= PROTECT_BASE:
                    prot.setdefault(e.step, []).append((h, e))
                elif e.process < e.process_count:
                    real.setdefault(e.step, []).append((h, e))
                else:
                    unreadable.setdefault(e.step, []).append((h, e))
        out, losses = {}, {}
        for step, slots in prot.items():
            plan_bytes, manifests, blocks, writers = None, {}, {}, set()
            for h, e in slots:
                try:
                    err = failed.get((h.name, e.process, step, e.crc))
                    if err is not None:
                        raise err
                    hdr, pb, man = self._header(h, e.process, step, e.crc)
                except (ManifestError, ChecksumError, PeerError, StepNotFoundError, OSError) as err:
                    log.warning("step %d: protection slot at %s unusable: %s", step, h.name, err)
                    continue
                writers.add(e.process - PROTECT_BASE)
                plan_bytes = plan_bytes or pb
                manifests.update(man)
                for ref in hdr.blocks:
                    blocks.setdefault((ref.kind, ref.id), []).append((h, e.process, ref))
            if plan_bytes is None:
                continue
            try:
                plan = decode_plan(plan_bytes, source=f"protection plan of step {step}")
            except ManifestError as err:
                log.warning("%s", err)
                continue
            n_proc = len(plan.nodes)
            # An agent that still holds this step's protection but lists nothing of its own processes for the
            # step was not lost: retention dropped the step there. Such a step is simply gone, no warning.
            alive = {plan.agent_of(e.process - PROTECT_BASE) for _, e in slots if e.process - PROTECT_BASE < n_proc}
            listed = {e.process for _, e in real.get(step, ()) if e.process_count == n_proc} | \
                {e.process for _, e in unreadable.get(step, ())}
            dropped = sorted(q for q in range(n_proc) if plan.agent_of(q) in alive and q not in listed)
            if dropped:
                log.debug("step %d: no longer held for processes %s (retention); not rebuilt", step, dropped[:16])
                continue
            held: dict[int, list[Holder]] = {}
            for h, e in real.get(step, ()):
                if e.process_count == n_proc and (not plan.layout or e.layout == plan.layout):
                    held.setdefault(e.process, []).append(h)
                    if e.process not in manifests:
                        try:  # the manifest alone: an open of the node's agent maps and faults in the snapshot
                            manifests[e.process] = h.manifest(e.process, step)
                        except Exception as err:  # noqa: BLE001
                            log.info("step %d: manifest of process %d at %s: %s", step, e.process, h.name, err)
            lost_p = [q for q in range(n_proc) if q not in held]
            lost_nodes = tuple(sorted({plan.nodes[q] for q in lost_p}))
            bad = tuple([("stripe", s.id) for s in plan.stripes if ("stripe", s.id) not in blocks] +
                        [("copy", b.id) for b in plan.copy_blocks if ("copy", b.id) not in blocks])
            rp = plan_rebuild(plan, lost_nodes, step=step, bad_blocks=bad, strict=False)
            missing = rp.missing()
            no_manifest = [q for q in range(n_proc) if q not in manifests]
            if missing:
                losses[step] = data_loss(rp, missing)
                continue
            if no_manifest:
                losses[step] = DataLossError(f"step {step}: the manifests of processes {no_manifest[:16]} were lost "
                                             f"with node(s) {list(lost_nodes)}", step=step, lost_nodes=lost_nodes)
                continue
            complete = not lost_nodes and not bad and writers >= set(range(n_proc))
            out[step] = _StepInfo(step, plan, manifests, functools.partial(self._chunk_crcs, step, manifests), held,
                                  blocks, lost_nodes, bad, complete)
        with self._lock:
            new = [s for s in losses if s not in self.losses]
            self._steps, self.losses = out, losses
            for key in [k for k in self._crcs if k[0] not in out]:
                del self._crcs[key]
        for s in new:
            log.warning("%s", losses[s])
        return out

    def _chunk_crcs(self, step: int, manifests: dict[int, bytes]) -> dict[tuple[int, int], int]:
        """(saving process, offset) -> crc32c of every chunk of ``step``, from its processes' manifests: decoded
        once per set of manifests (a scan runs at every restore; a many-leaf manifest takes long to decode)."""
        key = (step, tuple(sorted((q, crc32c(raw)) for q, raw in manifests.items())))
        with self._lock:
            got = self._crcs.get(key)
        if got is None:
            got = {}
            for q, raw in manifests.items():
                got.update(mf.chunk_crcs(raw, source=f"step {step} manifest of process {q} (kept with protection)"))
            with self._lock:
                self._crcs[key] = got
        return got

    def protected_steps(self) -> list[int]:
        """The steps of the last :meth:`scan` whose protection is complete (every process wrote its slot, every
        parity stripe and copy block is held, no node is lost): each survives the loss of a node now."""
        with self._lock:
            return sorted(s for s, info in self._steps.items() if info.complete)

    def rebuildable_steps(self) -> list[int]:
        """The steps of the last :meth:`scan` whose every process can be read or rebuilt (complete or not)."""
        with self._lock:
            return sorted(self._steps)

    def held(self) -> list[HeldEntry]:
        return self._entries(self.scan())

    def held_given(self, agents_said: list[tuple[Holder, HeldEntry]]) -> list[HeldEntry]:
        return self._entries(self.scan(agents_said))

    @staticmethod
    def _entries(steps: dict[int, _StepInfo]) -> list[HeldEntry]:
        out = []
        for step, info in steps.items():
            n = len(info.plan.nodes)
            for q in range(n):
                out.append(HeldEntry(step, q, n, info.plan.layout, crc32c(info.manifests[q])))
        return out

    def open(self, process: int, step: int) -> Opened:
        with self._lock:
            info = self._steps.get(step)
        if info is None:
            info = self.scan().get(step)
        if info is None or process not in info.manifests:
            loss = self.losses.get(step)
            if loss is not None:
                raise loss
            raise StepNotFoundError(f"step {step}: no protection data can rebuild process {process}")
        io = _IO(info)
        lost = process not in info.held
        if lost:
            rb = Rebuilder(plan_rebuild(info.plan, info.lost_nodes, step=step, bad_blocks=info.bad_blocks),
                           io, info.crcs, workers=self._workers)
            log.warning("step %d: process %d was lost with node(s) %s; its chunks are rebuilt from protection "
                        "%r", step, process, list(info.lost_nodes), info.plan.policy)
            return Opened(info.manifests[process], rb.reader(process), io.close, bind=io.bind,
                          read_into=functools.partial(rb.read_into, process))

        def read(offset: int, nbytes: int) -> memoryview:
            # a surviving process's chunk failed at its holders: rebuild it as if it were lost
            rp = plan_rebuild(info.plan, info.lost_nodes, step=step, bad_chunks=[(process, offset)],
                              bad_blocks=info.bad_blocks)
            return Rebuilder(rp, io, info.crcs, workers=self._workers).reader(process)(offset, nbytes)
        return Opened(info.manifests[process], read, io.close, bind=io.bind)
