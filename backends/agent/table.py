"""The agent's slot table: every snapshot slot of every process on the node, and the segments behind them.

Per-slot state machine (the Store contract of jaxckpt/core/store.py, enforced here for all trainers of a node)::

    reserve -> WRITING --commit--> COMMITTED --delete--> (doomed while pinned) --> FREED
                  \\--abort, or the writer's connection drops--------------------> FREED

A slot is keyed by (process, step). Only its writer's connection may commit or abort it; only COMMITTED,
undoomed slots are listed or pinned; a pinned slot's segment is never freed or reused. A freed slot's segment
goes back to its process's pool and serves a later step of the same process, so after warm-up a save creates
nothing; a slot whose writer vanished mid-write (connection dropped) has its segment unlinked instead, because
that writer's copy threads may still be writing into their mapping of it.

Commit order: the record file (segment, size, manifest) is written to a temporary name and renamed, and only
then is the slot COMMITTED and the trainer answered. An agent that restarts adopts every complete record whose
segment exists, and unlinks everything else (half-written slots are discarded, never served).
"""
from __future__ import annotations

import itertools
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass

import msgpack

from jaxckpt.backends.agent import cgroup
from jaxckpt.backends.agent.capacity import shortage
from jaxckpt.backends.agent.protocol import (MAX_MESSAGE_BYTES, PROTECT_BASE, REC_RE, SEG_RE, ProtocolError,
                                             check_name, read_private, record_name, remove_file, round_to_pages,
                                             segment_name, write_private)

log = logging.getLogger("jaxckpt.backends.agent.daemon")

WRITING, COMMITTED = "writing", "committed"


class Refused(Exception):
    """A request the table turns down; ``code`` becomes the reply's code (see agent_protocol.raise_for)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Segment:
    name: str
    process: int
    size: int


@dataclass
class SlotEntry:
    process: int
    step: int
    nbytes: int
    seg: Segment | None  # None for a zero-byte snapshot
    owner: int  # connection id of the writer (0 once adopted from a record)
    state: str = WRITING
    manifest: bytes = b""
    pins: int = 0
    doomed: bool = False
    created: float = 0.0
    committed_at: float = 0.0
    lent: bool = False  # its trainer's restored arrays use the segment's memory: unlinked when freed, never reused


@dataclass
class Limits:
    """What a trainer declared in its hello: its memory budget and how many steps its engine may keep."""

    budget: int = 0
    keep: int = 1
    pending: int = 2


class SlotTable:
    """All slots of the node, under one lock; file I/O only on segment and record files of ``directory``."""

    def __init__(self, directory: str, generation: str, *, node_budget: int = 0) -> None:
        self.dir = directory
        self.generation = generation
        self.node_budget = node_budget
        self._lock = threading.Lock()
        self._slots: dict[tuple[int, int], SlotEntry] = {}
        self._pools: dict[int, list[Segment]] = {}
        self._limits: dict[int, Limits] = {}
        self._counter = itertools.count()
        self._closed = False
        self.allocations = 0

    # ------------------------------------------------------------------------------------------- trainers
    def declare(self, process: int, limits: Limits) -> None:
        with self._lock:
            self._limits[process] = limits

    def reserve(self, process: int, step: int, nbytes: int, owner: int) -> tuple[SlotEntry, bool]:
        """A new WRITING slot and whether its segment was created now (False: reused from the pool)."""
        with self._lock:
            self._check_open()
            held = self._slots.get((process, step))
            if held is not None:
                raise Refused("step", f"step {step} is already held by the node agent for process {process} "
                                      f"({'deleted, still pinned' if held.doomed else held.state})")
            seg, created = None, False
            if nbytes:
                seg = self._take(process, nbytes)
                if seg is None:
                    size = round_to_pages(nbytes)
                    self._make_room(process, step, nbytes, size)
                    seg, created = self._create(process, step, size), True
            entry = SlotEntry(process, step, nbytes, seg, owner, created=time.time())
            self._slots[(process, step)] = entry
            log.debug("process %d step %d: reserved %d bytes in %s", process, step, nbytes, seg and seg.name)
            return entry, created

    def commit(self, process: int, step: int, manifest: bytes, owner: int) -> None:
        with self._lock:
            self._check_open()
            entry = self._writing(process, step, owner, "commit")
            entry.manifest = bytes(manifest)
            entry.committed_at = time.time()
            self._write_record(entry)  # before the state change and the reply: a restarted agent adopts it
            entry.state = COMMITTED
            log.debug("process %d step %d: committed", process, step)

    def writing(self, process: int, step: int, owner: int) -> SlotEntry:
        """The slot of ``step`` that connection ``owner`` is writing (Refused if it is not): the agent fills it."""
        with self._lock:
            return self._writing(process, step, owner, "fill")

    def abort(self, process: int, step: int, owner: int) -> None:
        with self._lock:
            entry = self._slots.get((process, step))
            if entry is None or entry.state != WRITING:
                return  # aborting a committed or unknown slot is a no-op (the Store contract)
            if entry.owner != owner:
                raise Refused("step", f"step {step} of process {process} is being written by another connection")
            self._free(entry, reuse=True)

    def steps(self, process: int) -> list[int]:
        with self._lock:
            return sorted(s for (p, s), e in self._slots.items() if p == process and self._visible(e))

    def pin(self, process: int, step: int) -> SlotEntry | None:
        with self._lock:
            self._check_open()
            entry = self._slots.get((process, step))
            if entry is None or not self._visible(entry):
                return None
            entry.pins += 1
            return entry

    def unpin(self, process: int, step: int) -> None:
        with self._lock:
            entry = self._slots.get((process, step))
            if entry is None or entry.pins == 0:
                return
            entry.pins -= 1
            if entry.doomed and entry.pins == 0:
                self._free(entry, reuse=True)

    def delete(self, process: int, step: int) -> None:
        with self._lock:
            entry = self._slots.get((process, step))
            if entry is None or not self._visible(entry):
                return
            self._delete(entry)

    def lend(self, process: int, step: int) -> bool:
        """Mark a committed slot's segment as memory the trainer's restored arrays use: once freed it is unlinked,
        never handed out again (its pages live on in the trainer's mapping). Recorded, so a restarted agent
        honours it too. False if the step is not held."""
        with self._lock:
            entry = self._slots.get((process, step))
            if entry is None or not self._visible(entry):
                return False
            if not entry.lent:
                entry.lent = True
                self._write_record(entry)
            return True

    def drop_owner(self, owner: int, process: int | None) -> None:
        """A connection went away: discard its half-written slots, then apply the dead trainer's retention cap."""
        with self._lock:
            for entry in [e for e in self._slots.values() if e.state == WRITING and e.owner == owner]:
                log.warning("process %d step %d: writer disconnected mid-write; slot discarded", entry.process,
                            entry.step)
                self._free(entry, reuse=False)
            if process is not None and not self._closed:
                lim = self._limits.get(process, Limits())
                # The engine keeps ``keep`` globally committed steps plus up to ``pending`` newer ones that are
                # committed here but may not be everywhere: only beyond that is a step surely not needed.
                visible = sorted(s for (p, s), e in self._slots.items() if p == process and self._visible(e))
                # A step this node holds protection slots of may be the newest protected one: until a newer
                # step is protected, a lost node is rebuilt from those and from this node's own bytes of it.
                protected = {s for (p, s), e in self._slots.items() if p >= PROTECT_BASE and self._visible(e)}
                for s in visible[:-(lim.keep + lim.pending)]:
                    if s in protected:
                        continue
                    log.info("process %d step %d: freed by the retention of a disconnected trainer", process, s)
                    self._delete(self._slots[(process, s)])

    # ---------------------------------------------------------------------------------------------- reads
    def held(self, process: int | None = None) -> int:
        with self._lock:
            return self._held(process)

    def segments(self, process: int) -> list[str]:
        with self._lock:
            names = [e.seg.name for (p, _), e in self._slots.items() if p == process and e.seg is not None]
            return names + [s.name for s in self._pools.get(process, [])]

    def committed(self) -> list[tuple[int, int, bytes]]:
        """(process, step, manifest) of every committed, readable slot of the node (what peers are served)."""
        with self._lock:
            return sorted((e.process, e.step, e.manifest) for e in self._slots.values() if self._visible(e))

    def manifest(self, process: int, step: int) -> bytes | None:
        with self._lock:
            entry = self._slots.get((process, step))
            return entry.manifest if entry is not None and self._visible(entry) else None

    def status(self) -> dict:
        """Everything ``jaxckpt ls`` shows: slots, pools and bytes, per process and for the node."""
        with self._lock:
            now = time.time()
            slots = [{"process": e.process, "step": e.step, "state": "deleted" if e.doomed else e.state,
                      "nbytes": e.nbytes, "segment_bytes": e.seg.size if e.seg else 0, "pins": e.pins,
                      "manifest_bytes": len(e.manifest),
                      "age_s": now - (e.committed_at or e.created)} for e in self._slots.values()]
            slots.sort(key=lambda d: (d["process"], d["step"]))
            return {"slots": slots,
                    "pooled": {str(p): sum(s.size for s in pool) for p, pool in self._pools.items() if pool},
                    "held_bytes": self._held(None),
                    "metadata_bytes": sum(len(e.manifest) for e in self._slots.values()),
                    "node_budget": self.node_budget,
                    "budgets": {str(p): lim.budget for p, lim in self._limits.items()},
                    "allocations": self.allocations}

    # ------------------------------------------------------------------------------------------- lifecycle
    def adopt(self) -> dict:
        """Take over the committed slots an earlier agent of this directory left; unlink everything else."""
        adopted: dict[int, list[int]] = {}
        dropped: list[str] = []
        names = sorted(os.listdir(self.dir))
        used: set[str] = set()
        with self._lock:
            for name in names:
                if REC_RE.match(name):
                    entry = self._read_record(name)
                    if entry is None:
                        dropped.append(name)
                        remove_file(os.path.join(self.dir, name))
                        continue
                    self._slots[(entry.process, entry.step)] = entry
                    adopted.setdefault(entry.process, []).append(entry.step)
                    if entry.seg is not None:
                        used.add(entry.seg.name)
            for name in names:
                if (SEG_RE.match(name) and name not in used) or name.startswith(".rec-"):
                    dropped.append(name)
                    remove_file(os.path.join(self.dir, name))
        for p, steps in adopted.items():
            log.info("process %d: adopted committed steps %s from an earlier agent", p, sorted(steps))
        if dropped:
            log.warning("discarded %d leftover files of an earlier agent (half-written or incomplete): %s",
                        len(dropped), ", ".join(dropped[:10]) + (" ..." if len(dropped) > 10 else ""))
        return {"adopted": {str(p): sorted(s) for p, s in adopted.items()}, "discarded": len(dropped)}

    def close(self) -> tuple[int, int]:
        """Unlink every segment and record (mappings trainers still hold stay valid until they unmap)."""
        with self._lock:
            self._closed = True
            segs = [e.seg for e in self._slots.values() if e.seg] + [s for p in self._pools.values() for s in p]
            nbytes = sum(s.size for s in segs)
            for e in self._slots.values():
                if e.state == COMMITTED:
                    remove_file(os.path.join(self.dir, record_name(e.process, e.step)))
            for s in segs:
                remove_file(os.path.join(self.dir, s.name))
            self._slots.clear()
            self._pools.clear()
            return len(segs), nbytes

    # ------------------------------------------------------------------------------------------ internals
    @staticmethod
    def _visible(e: SlotEntry) -> bool:
        return e.state == COMMITTED and not e.doomed

    def _check_open(self) -> None:
        if self._closed:
            raise Refused("closed", "the node agent is shutting down")

    def _writing(self, process: int, step: int, owner: int, what: str) -> SlotEntry:
        entry = self._slots.get((process, step))
        if entry is None or entry.state != WRITING:
            state = "not reserved or aborted" if entry is None else entry.state
            raise Refused("step", f"step {step} of process {process}: cannot {what}, the slot is not being written "
                                  f"({state})")
        if entry.owner != owner:
            raise Refused("step", f"step {step} of process {process} is being written by another connection")
        return entry

    def _held(self, process: int | None) -> int:
        segs = sum(e.seg.size for e in self._slots.values() if e.seg and process in (None, e.process))
        return segs + sum(s.size for p, pool in self._pools.items() if process in (None, p) for s in pool)

    def _take(self, process: int, nbytes: int) -> Segment | None:
        pool = self._pools.get(process, [])
        fits = [s for s in pool if s.size >= nbytes]
        if not fits:
            return None
        best = min(fits, key=lambda s: s.size)
        pool.remove(best)
        return best

    def _make_room(self, process: int, step: int, nbytes: int, size: int) -> None:
        budget = self._limits.get(process, Limits()).budget
        for limit, scope, mine in ((budget, f"process {process}", True), (self.node_budget, "the node", False)):
            if not limit or self._held(process if mine else None) + size <= limit:
                continue
            # Idle pooled segments are the first thing to give back (this process's, then any process's).
            for p in ([process] if mine else [process, *self._pools]):
                for s in self._pools.pop(p, []):
                    remove_file(os.path.join(self.dir, s.name))
            held = self._held(process if mine else None)
            if held + size > limit:
                kept = self._kept(process)
                raise Refused("budget", f"step {step} of process {process}: snapshot of {nbytes} bytes does not fit "
                                        f"the memory budget of {limit} bytes for {scope} ({held} held; committed "
                                        f"steps {kept} are kept)")
        # The memory cgroup's limit, which the kernel enforces by ending the agent: idle pooled segments go first.
        limited = cgroup.room()
        if limited is not None and size > limited.free:
            for p in [process, *self._pools]:
                for s in self._pools.pop(p, []):
                    remove_file(os.path.join(self.dir, s.name))
            limited = cgroup.room()
            if limited is not None and size > limited.free:
                kept = self._kept(process)
                raise Refused("budget", f"step {step} of process {process}: a segment of {size} bytes does not fit "
                                        f"the memory cgroup limit of the node agent ({limited.limit} bytes at "
                                        f"{limited.path}, {limited.used} in use): the kernel would end the agent, or "
                                        f"a process beside it, at this save; raise that limit (the agent's "
                                        f"container's; under SLURM the job's --mem, which its steps share), or set "
                                        f"Config.memory_budget_bytes to fit it (committed steps {kept} are kept)")

    def _kept(self, process: int) -> list[int]:
        """The committed steps of ``process`` a refusal leaves in place (named in its message)."""
        return sorted(s for (p, s), e in self._slots.items() if p == process and self._visible(e))

    def _create(self, process: int, step: int, size: int) -> Segment:
        name = segment_name(process, self.generation, next(self._counter))
        path = os.path.join(self.dir, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            # Reserve the pages now: a full /dev/shm is an error here, not a SIGBUS in the trainer's copy later.
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            os.close(fd)
            remove_file(path)
            raise Refused("budget", f"step {step} of process {process}: cannot allocate {size} bytes of shared "
                                    f"memory in {self.dir}: {e.strerror or e} ({shortage(self.dir)})") from None
        os.close(fd)
        self.allocations += 1
        log.info("process %d: new segment %s of %d bytes (held now %d)", process, name, size, self._held(None) + size)
        return Segment(name, process, size)

    def _delete(self, entry: SlotEntry) -> None:
        entry.doomed = True
        remove_file(os.path.join(self.dir, record_name(entry.process, entry.step)))  # no longer adoptable
        if entry.pins == 0:
            self._free(entry, reuse=True)

    def _free(self, entry: SlotEntry, *, reuse: bool) -> None:
        del self._slots[(entry.process, entry.step)]
        if entry.seg is None:
            return
        if reuse and not self._closed and not entry.lent:
            self._pools.setdefault(entry.process, []).append(entry.seg)
        else:
            remove_file(os.path.join(self.dir, entry.seg.name))

    def _write_record(self, e: SlotEntry) -> None:
        name = record_name(e.process, e.step)
        tmp = os.path.join(self.dir, f".{name}.tmp")
        data = msgpack.packb({"v": 1, "process": e.process, "step": e.step, "nbytes": e.nbytes,
                              "seg": e.seg.name if e.seg else None, "size": e.seg.size if e.seg else 0,
                              "manifest": e.manifest, "committed_at": e.committed_at, "lent": e.lent},
                             use_bin_type=True)
        write_private(os.path.join(self.dir, name), data, tmp)

    def _read_record(self, name: str) -> SlotEntry | None:
        path = os.path.join(self.dir, name)
        try:
            data = read_private(path, MAX_MESSAGE_BYTES)
            if data is None:
                raise ProtocolError(f"{path}: gone while listed")
            d = msgpack.unpackb(data, raw=False, max_bin_len=MAX_MESSAGE_BYTES)
            process, step = int(d["process"]), int(d["step"])
            if name != record_name(process, step) or d.get("v") != 1:
                raise ProtocolError(f"{path}: record names process {process} step {step}")
            nbytes, seg = int(d["nbytes"]), None
            if d["seg"] is not None:
                seg_name = check_name(d["seg"])
                if not seg_name.startswith(f"seg-p{process}-"):
                    raise ProtocolError(f"{path}: segment {seg_name} belongs to another process")
                st = os.stat(os.path.join(self.dir, seg_name), follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                    raise ProtocolError(f"{path}: segment {seg_name} is not a private regular file")
                size = st.st_size
                if size < nbytes:
                    raise ProtocolError(f"{path}: segment {seg_name} holds {size} bytes, record says {nbytes}")
                seg = Segment(seg_name, process, size)
            manifest = d["manifest"]
            if not isinstance(manifest, bytes):
                raise ProtocolError(f"{path}: manifest is not bytes")
            return SlotEntry(process, step, nbytes, seg, owner=0, state=COMMITTED, manifest=manifest,
                             created=float(d["committed_at"]), committed_at=float(d["committed_at"]),
                             lent=d.get("lent") is True)
        except Exception as e:  # noqa: BLE001 - any defect means the record is not adoptable; logged
            log.warning("not adopting %s: %s", name, e)
            return None
