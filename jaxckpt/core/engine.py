"""The framework-neutral checkpointer core every front end drives: plan cache, snapshots, commit, retention.

Save: the face every front end shares (``jaxckpt.frontend.checkpointer``) calls :meth:`CheckpointEngine.begin`
(reserves the slot; a refusal leaves nothing behind), has its front end take what must be taken now, then calls
:meth:`CheckpointEngine.start` with the shard reads (one :class:`ArrayRecord` per array leaf, plus plain values).
The engine plans, numbers and commits steps across processes; the slot each step's bytes go into is reserved,
written, committed and retained by its :class:`~jaxckpt.core.slots.SlotWriter` (``slots``), the path DCP's
storage writes through too.
:meth:`CheckpointEngine.save` does both for a caller whose records are ready (tests, engines without a face).
Restore: the one restore driver (``jaxckpt.core.restore.restore_step``) and the persistent writer read a
committed step through :meth:`CheckpointEngine.open`: its manifests and a
:class:`~jaxckpt.core.fetch.ChunkReader` over its sources, pinned until the block ends; the front end makes its
arrays from the host boxes the driver assembles.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Protocol

import numpy as np

from jaxckpt.core import manifest as mf
from jaxckpt.config import Config
from jaxckpt.core.adoption import Adoption, decide
from jaxckpt.core.advise import IntervalAdvice, SaveCosts
from jaxckpt.core.collective import Collective
from jaxckpt.core.coordination import SAME_STEPS, CommitTracker, Coordinator
from jaxckpt.errors import (ClosedError, CommitError, ConfigError, CoordinationError, NoCheckpointError, StepError,
                            StepOutOfRangeError, StoreUnavailableError, brief)
from jaxckpt.core.capabilities import NodeAgent, ProtectionSlots
from jaxckpt.core.catalog import Catalog
from jaxckpt.core.timeline import Stopwatch
from jaxckpt.core.fetch import ChunkReader
from jaxckpt.core.sources import Holder
from jaxckpt.core.protect import Protection, ProtectionFactory
from jaxckpt.node_identity import node_identity
from jaxckpt.registry import get_part, get_store_class
from jaxckpt.core.copier import SnapshotResult
from jaxckpt.core.slots import SlotWriter
from jaxckpt.core.trim import ENV_STEPS_KEPT, STEPS_KEPT
# ArrayRecord and ShardReads: the front ends' names for what they hand a save (defined with the chunk table)
from jaxckpt.core.save_table import ArrayRecord, Prepared, SaveChunks, ShardReads, prepare

log = logging.getLogger("jaxckpt.core.engine")
PLAN_CACHE = 64  # save plans kept, one per state layout (tree structure, shapes, dtypes, shardings)
MAX_STEP = 1 << 62  # the largest step number: agents' records and messages carry steps up to it

class Tier(Protocol):
    """What the engine reads of the persistent tier (``jaxckpt.persistent.Persister``): its directory, the steps
    it holds and the holder the catalog reads them through."""

    directory: Any
    holder: Holder

    def steps(self) -> list[int]:
        """Persisted steps a restore can read, ascending."""


@dataclass
class Reservation:
    """A save that passed every check and holds its slot: :meth:`CheckpointEngine.start` or ``cancel`` it."""

    step: int
    prep: Prepared
    slot: Any
    t0: float


class SaveHandle:
    """The outcome of one ``save()``: ``done()`` once decided, ``result()`` waits and raises on failure."""

    def __init__(self, step: int, tracker: CommitTracker) -> None:
        self.step = step
        self._tracker = tracker
        self._local = threading.Event()
        self.error: BaseException | None = None
        self.snapshot_seconds: float | None = None
        self.save_call_seconds: float = 0.0
        self.nbytes = 0
        self.skipped = False  # the store was unreachable: nothing saved, counted in the store's metrics
        # Config.protection: the future of this process's parity stripes, which read the saved buffers after the
        # local copy; a front end whose buffers are written in place (torch) waits for it too.
        self.parity: Future | None = None

    def local_done(self) -> bool:
        """True once this process's chunks are in host memory (or the snapshot failed)."""
        return self._local.is_set()

    def wait_local(self, timeout: float | None = None) -> bool:
        """Block until this process's chunks are in host memory (or failed); False on time-out."""
        return self._local.wait(timeout)

    def done(self) -> bool:
        """True once the step is decided (committed everywhere, or failed)."""
        return self._local.is_set() and (self.error is not None or self._tracker.decided(self.step))

    def result(self, timeout: float | None = None) -> None:
        """Wait until the step is committed by every process; raise its error if it was not."""
        if not self._local.wait(timeout):
            raise CommitError(f"step {self.step}: snapshot not finished within {timeout}s")
        if self.error is not None:
            raise self.error
        if not self._tracker.wait(self.step, timeout):
            why = self._tracker.why(self.step) or "a process failed or timed out"
            raise CommitError(f"step {self.step}: not committed by every process: {why}")


class CheckpointEngine:
    """Snapshots of neutral array records into a store, committed across processes, kept ``config.keep`` deep."""

    def __init__(self, config: Config, coordinator: Coordinator, framework: str, *,
                 protection: ProtectionFactory | None = None) -> None:
        if config.keep + config.max_pending_saves > STEPS_KEPT // 2:
            # a restorable or pending step's records (its commit outcome, its protection) must never be trimmed
            raise ConfigError(f"Config.keep={config.keep} with max_pending_saves={config.max_pending_saves}: more "
                              f"steps than the per-step records keep ({STEPS_KEPT // 2} at most; "
                              f"{ENV_STEPS_KEPT}={STEPS_KEPT}, jaxckpt.core.trim)")
        self.config = config
        self.framework = framework
        self.coordinator = coordinator
        self.process_index, self.process_count = coordinator.process_index, coordinator.process_count
        # where the constructor's time goes, stage by stage (the front end adds its own): bench cluster's timeline
        self.startup = Stopwatch()
        # Every cross-process round of this instance (jaxckpt.core.collective): its own keys, deleted when done.
        self.collective = Collective.for_job(coordinator, config.job_id, config.commit_timeout_s)
        with self.startup.stage("store"):  # its import, and with node agents the hello (a recovery it joins)
            store_cls = get_store_class(config.store)
            self.store = store_cls(config, process_index=self.process_index, process_count=self.process_count)
        self._peers = None
        # Restore needs chunks that other processes hold: node agents serve them (store="shm"), else each process.
        if self.process_count > 1 and not self.store.supports(NodeAgent):
            try:
                peers_cls = get_part("peers", "default")  # jaxckpt.backends.peers: the core imports no backend
                self._peers = peers_cls(config, coordinator, self.store, channel=self.collective.channel("main"))
            except BaseException:
                self.store.close()
                raise
        self.catalog = Catalog(config, coordinator, self.store, self._peers,  # where restores read from
                               collective=self.collective)
        self.last_restore_report = None  # jaxckpt.core.sources.RestoreReport of the last open() (restore)
        # Every step's slot: reserved, written, committed and kept config.keep deep (jaxckpt.core.slots).
        self.slots = SlotWriter(self.store, config.keep, workers=config.workers, inflight_bytes=config.inflight_bytes)
        self.costs = SaveCosts()  # this job's measured save costs: what advise_interval reads
        self._tracker = CommitTracker(self.collective.channel("commit"), config.commit_timeout_s,
                                      on_commit=self._after_commit)
        self._prepared: dict[tuple, Prepared] = {}
        self._last_prep: Prepared | None = None
        self._nodes: tuple[int, ...] | None = None  # node of each process (Config.replicas="whole")
        self._pending: deque[SaveHandle] = deque()
        self._last_step: int | None = None
        self._lock = threading.Lock()
        self._closed = False
        # Commit hooks (the persistent tier, protection) run on the commit thread before retention; a pinned step
        # (a pending persist, protection's guard) outlives ``keep`` until its last pin goes.
        self._commit_hooks: list[Callable[[int, bool], None]] = []
        self.tier: Tier | None = None  # the persistent tier, once attached (attach_tier)
        # Config.protection (``protection``: jaxckpt.protection.runtime.Protector, given by the front end's face):
        # needs node agents; registers its rebuild holder before _adopt so that a restarted job counts steps it
        # can rebuild from protection.
        self.protection: Protection | None = None
        if config.protection != "none" and self.store.supports(ProtectionSlots):
            if protection is None:
                self.store.close()
                raise ConfigError(f"Config.protection={config.protection!r}: this engine was given no protection "
                                  f"to run (build it through a Checkpointer, or pass protection="
                                  f"jaxckpt.protection.runtime.Protector)")
            try:
                with self.startup.stage("protection"):
                    self.protection = protection(self)
            except BaseException:
                self.store.close()
                raise
        elif config.protection != "none":
            log.warning("Config.protection=%r needs node agents (store='shm'); store %r keeps snapshots unprotected",
                        config.protection, config.store)
        if self.store.survives_process:
            try:
                self._adopt()
            except BaseException:
                self.close()
                raise

    # ----------------------------------------------------------------------------------------------- save
    def save(self, step: int, records: list[ArrayRecord], values: list[mf.LeafMeta], order: tuple[str, ...],
             t0: float | None = None) -> SaveHandle:
        """Start the snapshot of ``records`` (and plain ``values``) as ``step``; returns at once."""
        t0 = time.perf_counter() if t0 is None else t0
        begun = self.begin(step, tuple((r.path, r.layout_key) for r in records), lambda: records, t0)
        if isinstance(begun, SaveHandle):
            return begun
        reads = [r.reads(devs) if devs else {} for r, devs in zip(records, begun.prep.devices)]
        return self.start(begun, lambda: reads, values, order)

    def begin(self, step: int, key: Hashable, records: Callable[[], list[ArrayRecord]], t0: float | None = None
              ) -> "Reservation | SaveHandle":
        """The part of a save that can refuse it, run first so that a refusal leaves nothing behind: checks the
        step and that the engine is open, waits for room (``max_pending_saves``), plans (once per ``key``:
        ``records()`` is called only for a layout not seen before; equal keys promise equal records) and
        reserves the store's slot (BudgetExceededError). Returns a :class:`Reservation` for :meth:`start` or
        :meth:`cancel`, or an already decided (skipped) handle when the store is unreachable."""
        t0 = time.perf_counter() if t0 is None else t0
        self.check_open()
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
            raise StepError(f"step must be a non-negative int, got {brief(step)}")
        step = int(step)
        if step > MAX_STEP:
            raise StepError(f"step {step} is out of range: steps are at most {MAX_STEP}")
        if self._last_step is not None and step <= self._last_step:
            raise StepError(f"step {step} is not newer than the newest saved step {self._last_step}")
        self._throttle()
        prep = self._prepare(key, records)
        try:
            slot = self.slots.reserve(step, prep.plan.nbytes)
        except StoreUnavailableError as e:  # logged and counted by the store; training goes on
            self._tracker.local_done(step, False)
            self._last_step = step  # the step is decided (aborted) for every process: never reuse it
            handle = SaveHandle(step, self._tracker)
            handle.error, handle.skipped = e, True
            handle._local.set()
            handle.save_call_seconds = time.perf_counter() - t0
            return handle
        except Exception:
            self._tracker.local_done(step, False)  # the other processes must not wait for us
            raise
        return Reservation(step, prep, slot, t0)

    def last_chunk_sizes(self) -> list[int]:
        """The byte sizes of the newest save's chunks on this process, in slot order (what benchmarks compare a
        snapshot against: the copy of the same bytes in the same pieces)."""
        prep = self._last_prep
        return [c[4] for c in prep.copies] if prep is not None else []

    def last_devices(self) -> list[frozenset[int]]:
        """Per array leaf of the newest save, the local devices its chunks were read from."""
        prep = self._last_prep
        return list(prep.devices) if prep is not None else []

    @property
    def peers(self) -> Any:
        """The peer server and client of a job of several processes without node agents (None otherwise)."""
        return self._peers

    def start(self, res: "Reservation", reads: Callable[[], list[ShardReads]], values: list[mf.LeafMeta],
              order: tuple[str, ...]) -> SaveHandle:
        """Hand a reserved save to the copy workers and return its handle.

        ``reads()`` gives each record's ShardReads for the devices ``res.prep.devices`` names; it runs on the
        copier's dispatcher thread (or here, when protection needs the views now), so whatever it returns must
        already be safe from later writes (views pinned or copies taken by the caller before this call)."""
        step, prep = res.step, res.prep
        self._last_prep = prep
        handle = SaveHandle(step, self._tracker)
        handle.nbytes = prep.plan.nbytes
        if self.protection is not None:
            got = reads()
            handle.parity = self.protection.on_save(step, prep.key, [m.path for m in prep.metas], got)
            reads = lambda got=got: got  # noqa: E731
        self._last_step = step
        with self._lock:
            self._pending.append(handle)
        handle.save_call_seconds = time.perf_counter() - res.t0
        self.costs.record(step, time.monotonic() - handle.save_call_seconds, handle.save_call_seconds)
        # Last: from here the dispatcher runs (and on a loaded machine may take the caller's core for a while).
        self._tracker.expect(step)  # its on_done reports it; a later step refused at once is agreed after it
        self.slots.write(res.slot, functools.partial(SaveChunks, prep, reads),
                         manifest=lambda r: self._manifest(prep, step, r, values, order),
                         on_done=lambda f: self._local_finished(f, handle))
        return handle

    def cancel(self, res: "Reservation", error: BaseException) -> SaveHandle:
        """Give up a reserved save (what was to be saved could not be produced): its slot is freed, the other
        processes learn that the step failed, and the returned handle (also raised by :meth:`wait`) holds
        ``error``. The step number is used up, as for any step the commit protocol decided."""
        self.slots.abort(res.slot)
        self._tracker.local_done(res.step, False)
        self._last_step = res.step
        handle = SaveHandle(res.step, self._tracker)
        handle.error = error
        handle._local.set()
        handle.save_call_seconds = time.perf_counter() - res.t0
        with self._lock:
            self._pending.append(handle)
        return handle

    def _throttle(self) -> None:
        while True:
            with self._lock:
                while self._pending and self._pending[0].done():
                    self._pending.popleft()
                # Undecided, not just unfinished: a process must not run ahead of the commit protocol (its node
                # agent keeps only keep + max_pending_saves steps of a trainer that dies: agent_table.drop_owner).
                running = [h for h in self._pending if not h.done()]
                if len(running) < self.config.max_pending_saves:
                    return
            running[0]._local.wait()
            try:
                running[0]._tracker.wait(running[0].step)
            except CommitError:  # decided as failed in the end; the loop looks again
                pass

    def _prepare(self, key: Hashable, make_records: Callable[[], list[ArrayRecord]]) -> Prepared:
        prep = self._prepared.get(key)
        if prep is not None:
            return prep
        prep = prepare(key, make_records(), self.process_index, self.process_count, self.config.chunk_bytes,
                       self.protection, nodes=self._save_nodes())
        if len(self._prepared) >= PLAN_CACHE:  # a job that keeps changing its layout: forget the oldest
            self._prepared.pop(next(iter(self._prepared)))
        self._prepared[key] = prep
        return prep

    def _save_nodes(self) -> tuple[int, ...] | None:
        """With ``Config.replicas="whole"`` in a job of several processes, the node (failure domain) of every
        process, agreed once in a round of the main channel (``jaxckpt.node_identity``; the first save of every
        process plans, so all take part); None for split replicas, where the plan needs no nodes."""
        if self.config.replicas != "whole" or self.process_count <= 1:
            return None
        if self._nodes is None:
            try:
                got = self.collective.channel("main").all_gather("save nodes", node_identity(self.config).name)
            except CoordinationError as e:  # a process that missed it most often does not save (only process 0 does)
                if e.missed:
                    raise e.hinted(f"{SAME_STEPS}: the first save plans on all of them together") from e
                raise
            names: dict[str, int] = {}
            self._nodes = tuple(names.setdefault(str(n), len(names)) for n in got)
            log.info("process %d: whole replicas over %d node(s) %s", self.process_index, len(names), list(names))
        return self._nodes

    def _manifest(self, prep: Prepared, step: int, res: SnapshotResult, values: list[mf.LeafMeta],
                  order: tuple[str, ...]) -> bytes:
        """The manifest of a written slot, on the copier's thread: O(1) Python objects whatever the chunk count
        (the layout's template is made once, the crc32cs filled in; objects per chunk here set off the collector
        while the training thread waits for the GIL)."""
        template = prep.template(self.process_index, self.process_count, self.framework, order)
        return template.encode(step, res.crcs, values)

    def _local_finished(self, fut, handle: SaveHandle) -> None:
        """The slot of ``handle``'s step is committed here (or failed and freed): tell the commit protocol."""
        try:
            res: SnapshotResult = fut.result()
            handle.snapshot_seconds = res.seconds
        except BaseException as e:  # noqa: BLE001 - reported through the handle and the commit protocol
            log.error("step %d: snapshot failed on process %d: %s", handle.step, self.process_index, e,
                      exc_info=not isinstance(e, StoreUnavailableError))
            handle.error = e
            handle.skipped = isinstance(e, StoreUnavailableError)
            self._tracker.local_done(handle.step, False)
        else:
            self._tracker.local_done(handle.step, True)
        finally:
            handle._local.set()

    def _after_commit(self, step: int, committed: bool) -> None:
        for hook in list(self._commit_hooks):
            try:
                hook(step, committed)
            except Exception:  # noqa: BLE001 - a hook must not stop retention
                log.exception("step %d: commit hook failed", step)
        if not committed:
            log.warning("step %d was not committed by every process; dropping it", step)
            self.slots.discard(step)
            return
        self.slots.count(step)

    # ------------------------------------------------------------------------- commit hooks, pins, the tier
    def add_commit_hook(self, hook: Callable[[int, bool], None]) -> None:
        """Call ``hook(step, committed)`` on the commit thread for every decided step, before retention."""
        self._commit_hooks.append(hook)

    def pin(self, step: int) -> None:
        """Keep ``step`` in the store past ``Config.keep`` until :meth:`unpin` (call from a commit hook)."""
        self.slots.pin(step)

    def unpin(self, step: int) -> None:
        """Drop one pin of ``step``; a step retention already let go is freed with its last pin."""
        self.slots.unpin(step)

    def newest_begun(self) -> int | None:
        """The newest step this process began to save (or adopted); later saves must be newer."""
        with self._lock:
            return self._last_step

    def forget_newer(self, restored: int, steps: list[int], begun: int | None) -> None:
        """Forget the committed ``steps`` (newer than ``restored``) and free their bytes here: every process
        agreed they cannot be restored bit for bit (``jaxckpt.core.fallback``), so the job goes on from
        ``restored`` and may save those numbers again. ``begun`` is the newest step any process began to save:
        rounds numbered by step (commit, protection, persist) are shifted past every number used so far."""
        self.slots.forget(steps)
        with self._lock:
            self._pending = deque(h for h in self._pending if h.step not in steps)  # decided long ago
            if self._last_step is not None and begun is not None and self._last_step <= begun:
                self._last_step = restored  # no newer save began here: the next one may be restored + 1
        top = max(begun if begun is not None else restored, *steps)
        # Protection numbers its rounds 2 * step and 2 * step + 1: the shift covers both.
        self.collective.shift_numbers(2 * (top - restored) + 2)
        for s in steps:
            self._tracker.forget(s, restored)
            self.store.delete(s)
        log.warning("process %d forgot step(s) %s, which no process could restore; the job goes on from step %d",
                    self.process_index, sorted(steps), restored)

    # ----------------------------------------------------------------------------------------------- wait
    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far is decided; raise the first failure."""
        with self._lock:
            handles = list(self._pending)
        for h in handles:
            try:
                h.result(timeout)
            except StoreUnavailableError:
                if not h.skipped:
                    raise
                # a skipped save (the store's agent was gone) is logged and counted, not a failure of wait()
        if self.protection is not None:  # ... and protected (or its protection failed, which is logged)
            self.protection.wait(timeout=timeout)

    def advise_interval(self, mtbf_node_s: float, nodes: int, **given: float) -> IntervalAdvice:
        """The snapshot interval that minimises expected lost time (jaxckpt.core.advise: Young/Daly) for nodes
        failing every ``mtbf_node_s`` seconds, from this job's measured save costs unless ``given``
        (``step_time_s``, ``overhead_s``, ``latency_s``, ``restart_s``)."""
        return self.costs.advise(self._tracker.times(), mtbf_node_s=mtbf_node_s, nodes=nodes, **given)

    def commit_times(self) -> dict[int, tuple[float, float]]:
        """Newest steps' (local done, decided here) in ``time.monotonic()`` seconds (the commit protocol's latency)."""
        return self._tracker.times()

    def latest_step(self) -> int | None:
        """The newest step committed by every process, or None."""
        return self._tracker.latest()

    def committed_steps(self) -> list[int]:
        """Committed steps, ascending, without asking the store (whose agent may be down) whether it holds them."""
        return self.slots.counted()

    def pinned_steps(self) -> list[int]:
        """Steps pinned past retention (protection's guard, adoption's rebuildable fallbacks), ascending: a restore
        may fall back to them when the newer steps' bytes are proven bad (``jaxckpt.core.fallback``)."""
        return self.slots.pinned()

    def attach_tier(self, tier: "Tier") -> None:
        """Read steps from the persistent tier too: its holder joins the catalog (ranked last), and its steps are
        restore targets and fallbacks like the committed ones (``restorable_steps``)."""
        self.tier = tier
        self.catalog.add_holders(lambda: [tier.holder])

    def restorable_steps(self) -> list[int]:
        """Committed steps and, with a persistent tier, persisted ones, ascending, without asking the store."""
        steps = set(self.committed_steps())
        if self.tier is not None:
            steps.update(self.tier.steps())
        return sorted(steps)

    def newest_step(self) -> int | None:
        """What a restore of the newest step restores: the newest committed step, else the newest persisted."""
        step = self.latest_step()
        if step is None and self.tier is not None:
            steps = self.tier.steps()
            step = steps[-1] if steps else None
        return step

    def all_steps(self) -> list[int]:
        """Committed steps still held, ascending."""
        committed = self.slots.counted()
        held = set(self.store.steps())  # a step deleted from the store directly (e.g. by the Orbax handler)
        return [s for s in committed if s in held]

    # ---------------------------------------------------------------------------------------------- adoption
    def _adopt(self) -> None:
        """Adopt the steps a store that survives the process (a node agent) kept from an earlier run of it: what
        ``jaxckpt.core.adoption.decide`` decides (see there), applied here."""
        a = decide(self)
        with self.startup.stage("apply adoption"):  # deletes, pins, and the newest step's bytes made ready
            self._apply(a)

    def _apply(self, a: Adoption) -> None:
        for s in a.delete:
            self.store.delete(s)
        for step, complete in a.holds:
            # not agreed: freed with its last pin, or given up for a save's room (a spare: jaxckpt.core.slots)
            self.slots.pin(step, let_go=step not in a.agreed, spare="guard" if complete else "fallback")
            self.protection.adopt(step, complete=complete)
            log.info("process %d keeps step %d, the newest %s, until a newer step is protected", self.process_index,
                     step, "protected one" if complete else "older one that can be rebuilt")
        if a.newest is not None:
            self.slots.adopt(a.agreed)
            self._last_step = a.newest
            self._tracker.adopt(a.newest)
            self.store.prefetch(a.newest)  # what a relaunch restores next: pinned and mapped meanwhile (shm)
            if a.newest_manifest is not None:  # and its manifest, decoded above, not decoded again by it
                self.catalog.keep_decoded(*a.newest_manifest)
            log.info("process %d adopted steps %s held by store %r from an earlier run (latest %d%s)",
                     self.process_index, list(a.agreed), self.config.store, a.newest,
                     ", restorable from the node agents" if a.newest not in a.agreed else "")
        elif a.held:
            log.warning("process %d: steps %s held by store %r are not held by every process; dropped",
                        self.process_index, list(a.held), self.config.store)

    # -------------------------------------------------------------------------------------------- restore
    def resolve_step(self, step: int | None) -> int:
        if step is not None:
            if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
                raise StepError(f"step must be a non-negative int, got {brief(step)}")  # never int(2.5) or "../x"
            if step > MAX_STEP:  # no store could hold it; stores' wire formats need not represent it
                raise StepOutOfRangeError(f"step {step} is not held by store {self.config.store!r} (held: "
                                          f"{self.all_steps() or 'none'}): it is out of range (steps are at most "
                                          f"{MAX_STEP})")
            return int(step)
        latest = self.newest_step()
        if latest is None and self.protection is not None and self.protection.holder.losses:
            raise self.protection.holder.losses[max(self.protection.holder.losses)]
        if latest is None:
            where = f" nor in {self.tier.directory}" if self.tier is not None else ""
            raise NoCheckpointError(f"nothing has been committed yet (store {self.config.store!r}, "
                                    f"job {self.config.job_id!r}){where}")
        return latest

    @contextlib.contextmanager
    def open(self, step: int | None, *, report: bool = True, near: bool = False
             ) -> Iterator[tuple[int, list[mf.Manifest], ChunkReader]]:
        """Open ``step`` (default: the newest, :meth:`newest_step`) and yield (step, manifests of every process
        that saved it, a verified chunk reader over the cheapest sources of each: jaxckpt.core.catalog); its
        holders keep the bytes until the block ends. With ``report``, the reader's report (bytes per source kind
        and node, fallbacks) is logged and kept as ``last_restore_report`` (the persistent tier's reads are not).

        ``near``: for a committed step this process holds, only this node's manifests (``Catalog.open``): fewer
        manifests than the saving job's processes, and the caller opens again without ``near`` if the restore
        needs more (``jaxckpt.core.restore.restore_step``)."""
        self.check_open()
        t0 = time.perf_counter()
        step = self.resolve_step(step)
        near = near and step in self.slots.counted()
        with self.catalog.open(step, near=near) as (manifests, sources):
            reader = ChunkReader(sources, step, self.config.verify_on_restore, workers=self.config.restore_workers,
                                 process=self.process_index)
            for q in sources.values():  # the first source of each saving process is where its manifest came from
                if q:
                    reader.report.manifests_by_kind[q[0].kind] = reader.report.manifests_by_kind.get(q[0].kind, 0) + 1
            reader.report.timeline.record("discover", t0, time.perf_counter())
            try:
                yield step, manifests, reader
            finally:
                done = reader.finish()
                if report:
                    self.last_restore_report = done
                    if done.chunks:
                        log.info("restored %s", done.summary())

    # ---------------------------------------------------------------------------------------------- close
    def close(self) -> None:
        """Finish in-flight saves, stop the threads and free the store."""
        if self._closed:
            return
        try:
            self.wait(timeout=self.config.commit_timeout_s * 2)
        except Exception as e:  # noqa: BLE001 - closing must not fail because a save did
            log.warning("close: a pending save did not commit: %s", e)
        self._closed = True
        self.slots.close()
        self._tracker.close()
        if self.protection is not None:
            self.protection.close()
        self.catalog.close()
        # From here this process runs only its close's rounds: a peer waiting in one it never ran fails at once.
        self.collective.closing()
        if self._peers is not None:
            self._close_barrier()
            self._peers.close()
        self.collective.close()
        self.store.close()

    def _close_barrier(self) -> None:
        """Wait (bounded) until every process is closing: until then another may still restore from this one.

        A ``barrier`` round of the ``main`` channel. A process that died is waited for at most ``peer_timeout_s``;
        then this one closes anyway.
        """
        timeout = self.config.peer_timeout_s
        try:
            self.collective.channel("main").barrier("close", timeout_s=timeout)
        except Exception as e:  # noqa: BLE001 - closing must not hang or fail on a dead peer
            log.warning("close: not every process reached close (%s); closing anyway", e)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise ClosedError("checkpointer is closed")
