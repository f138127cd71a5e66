"""Config.protection at run time, trainer side: build each committed step's redundancy in the background.

The engine (a :class:`~jaxckpt.core.protect.ProtectionHost`: all this runtime asks of it) calls
:meth:`Protector.prepare` for a new layout, :meth:`on_save` when a save starts (``CheckpointEngine.start``), and
the commit hook when the step is decided; per step:
  0) ``prepare`` (once per layout; the first time, collectively) agrees on the node of every process (an
     ``all_gather`` round ``protection nodes`` of the engine's ``main`` channel, ``jaxckpt.core.collective``,
     of each process's node name (``jaxckpt.node_identity``: the failure domain, by which redundancy is placed,
     also when a node runs two agents) and agent generation: O(processes) at process 0) and
     computes the :class:`~jaxckpt.protection.plan.ProtectionPlan`; it asks the engine to also pin the local device
     shards this process's ``parity`` stripes read;
  1) ``on_save``: a background thread XORs this process's ``parity`` stripes from those device copies (REFT:
     zero bytes sent) and drops the views;
  2) when the step is committed everywhere, one bounded worker thread takes the steps in order; process 0
     decides for each whether it is protected or skipped (a ``broadcast`` round ``decide <step>`` of the
     ``protect`` channel, which only this worker uses): a step is skipped when
     ``Config.keep`` newer steps are committed already (retention lets it go: it can no longer be a restore
     target), so with a save every step protection trails by at most about ``keep`` steps instead of falling
     further behind; every process follows that one decision, so a step is protected by all or skipped by
     all. Process 0 answers a skip early (``Channel.answer_early``: that step's decision round is settled at
     once and process 0 runs no round for it) as soon as retention lets a queued step go; so a step skipped
     costs process 0 one key and every other process one read, not a round, and the worker does not fall
     behind the commits on skips. The other processes hold every queued step (``engine.pin``, past
     ``Config.keep``) until that decision says skip, so none drops the bytes of a step process 0 still protects. The step being protected is held until every node has pulled
     its bytes. For a protected step the worker: waits for its parity, reads the manifests of the processes
     of the ``copies`` preceding nodes (small), reserves the slot of pseudo process ``PROTECT_BASE + p`` in its
     node's agent (``jaxckpt.protection.slot``), writes the plan, the manifests and its parity stripes into
     it, and has the agent build there what this node holds for other nodes (``xor-group`` units XORed into
     parity, ``replica`` copy blocks; each block by one process of the holding node): the agent pulls the
     chunks from the other nodes' agents itself, verifies each by checksum, at most
     ``Config.protection_bandwidth`` bytes per second per request (``jaxckpt.backends.agent.protection_pull``), and
     replies with the blocks' checksums; the worker then commits the slot. The bytes never pass through the
     trainer process. Protection needs node agents (a store offering ``ProtectionSlots``); with another store the
     engine warns and keeps the snapshots unprotected.
  3) a ``reduce`` round ``announce <step>`` of the ``protect`` channel: every process contributes whether its
     part succeeded, every process gets whether all did. The step is then *protected* (:meth:`protected_steps`).
The pull replaces a push: the bytes cross the network once either way, the agent needs no write path from peers,
and a node that is being filled decides its own pace (one request per protecting process, one chunk at a time).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from jaxckpt.protection import parity
from jaxckpt.core.capabilities import NodeAgent, ProtectionSlots
from jaxckpt.core.checksum import crc32c
from jaxckpt.core.trim import trim
from jaxckpt.core.hostbuf import host_bytes
from jaxckpt.errors import AgentError, CommitError, PeerError
from jaxckpt.node_identity import node_identity
from jaxckpt.core.plan import ArrayLayout, SavePlan
from jaxckpt.core.protect import ProtectionHost
from jaxckpt.protection.plan import ProtectionPlan, SavedChunk, plan_for_config, range_from_copy, stripe_parity
from jaxckpt.protection.plan_wire import encode_plan
from jaxckpt.protection.holder import RebuildHolder
from jaxckpt.protection.slot import encode_meta, slot_header, slot_layout


log = logging.getLogger("jaxckpt.protection.runtime")


class Protector:
    """The trainer side of ``Config.protection`` for one engine (see the module docstring)."""

    def __init__(self, engine: ProtectionHost) -> None:
        self.engine, self.config = engine, engine.config
        # the store offers both (jaxckpt.core.capabilities): the engine creates a Protector only then
        self._agent = engine.store.capability(NodeAgent)
        self._slots = engine.store.capability(ProtectionSlots)
        self.p, self.n = engine.process_index, engine.process_count
        self.nodes: tuple[int, ...] | None = None  # node (failure domain) id of each process
        self.agents: tuple[int, ...] = ()  # agent id of each process (a node may run several: two pods of a host)
        self.generations: list[str] = []  # agent generation of each agent id
        self._plans: dict[tuple, ProtectionPlan] = {}
        self._devs: dict[tuple, dict] = {}  # layout -> (path, box) -> the local device holding that box
        self._need: dict[tuple, set] = {}  # layout -> the (path, device) views the parity stripes read
        self._encoded: dict[int, bytes] = {}
        self._steps: dict[int, tuple[ProtectionPlan, Future | None]] = {}
        self._protected: list[int] = []
        self._fallbacks: list[int] = []  # rebuildable-only steps held at start-up (see adopt)
        self._pending: set[int] = set()  # saved, not yet protected nor failed
        self._queued: set[int] = set()  # committed, waiting for the worker
        self._recent: list[int] = []  # the newest Config.keep committed steps: what retention keeps
        self._held: set[int] = set()  # steps this runtime holds in the store (engine.pin)
        self._skipped: set[int] = set()  # committed steps retention let go before their turn (never protected)
        # process 0: queued steps whose skip it answers early -> True once answered (False: being answered)
        self._told: dict[int, bool] = {}
        self._cond = threading.Condition()
        self._failed: dict[int, BaseException] = {}
        self._protected_at: dict[int, float] = {}  # step -> time.monotonic() when it was announced protected
        self._store = None
        self._parity_pool = ThreadPoolExecutor(1, thread_name_prefix="jaxckpt-parity")
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="jaxckpt-protect")
        self._closed = False
        self.last_pull: dict = {}  # the node agent's reply to the newest pull (crcs, bytes, bandwidth account)
        self.decisions: dict[int, bool] = {}  # step -> process 0's decision: protect (True) or skip (False)
        self._channel = engine.collective.channel("protect")  # the worker's rounds: decisions, announcements
        self.holder = RebuildHolder(self._agent_holders, workers=max(1, engine.config.workers))
        engine.catalog.add_holders(lambda: [self.holder])
        engine.add_commit_hook(self._on_commit)

    # ------------------------------------------------------------------------------------------- planning
    def _agent_holders(self):
        return [h for h in self.engine.catalog.holders() if h.kind in ("node", "remote")]

    def _agree_nodes(self) -> None:
        # an all_gather round of the main channel (prepare runs in save(), on the caller's thread): each process's
        # node (jaxckpt.node_identity: redundancy is placed by it) and agent generation
        got = self.engine.collective.channel("main").all_gather(
            "protection nodes", [node_identity(self.config).name, self._agent.generation()])
        names: dict[str, int] = {}
        gens: dict[str, int] = {}
        self.nodes = tuple(names.setdefault(str(name), len(names)) for name, _ in got)
        self.agents = tuple(gens.setdefault(str(g), len(gens)) for _, g in got)
        self.generations = list(gens)
        log.info("process %d: protection %r over %d node(s) %s, %d agent(s): %s", self.p, self.config.protection,
                 len(names), list(names), len(gens), self.nodes)

    def prepare(self, key: tuple, layouts: Sequence[ArrayLayout], plans: Sequence[SavePlan]
                ) -> dict[str, frozenset[int]]:
        """Plan the protection of a new layout; the local devices whose shards this process's parity reads."""
        if self.nodes is None:
            self._agree_nodes()
        plan = plan_for_config(layouts, plans, self.nodes, self.config, self.agents)
        self._plans[key] = plan
        self._encoded[id(plan)] = encode_plan(plan)
        mine = {(a.path, pl.box): pl.device for a in layouts for pl in a.placements if pl.process == self.p}
        self._devs[key] = mine
        extra: dict[str, set[int]] = {}
        for s in plan.parity_tasks(self.p):
            for u in s.units:
                for g in u.ranges:
                    c = plan.chunks[g.chunk]
                    extra.setdefault(c.path, set()).add(mine[(c.path, c.source)])
        self._need[key] = {(path, d) for path, devs in extra.items() for d in devs}
        return {k: frozenset(v) for k, v in extra.items()}

    # --------------------------------------------------------------------------------------------- saving
    def on_save(self, step: int, key: tuple, paths: Sequence[str], sources: Sequence[dict]) -> Future | None:
        """Start this process's parity of ``step`` from the device views ``sources`` (one dict per record); its
        future (None without parity stripes) is done once the views are no longer read."""
        plan = self._plans[key]
        tasks = plan.parity_tasks(self.p)
        fut = None
        if tasks:
            need = self._need[key]  # hold only these views: the others are released as their chunks are copied
            fetchers = {(path, dev): src[dev][0] for path, src in zip(paths, sources) for dev in src
                        if (path, dev) in need}
            fut = self._parity_pool.submit(self._parity, plan, tasks, fetchers, self._devs[key])
        with self._cond:
            self._steps[step] = (plan, fut)
            self._pending.add(step)
        return fut

    def _parity(self, plan: ProtectionPlan, tasks, fetchers: dict, devs: dict) -> list[tuple[str, int, np.ndarray]]:
        # one host read of our replica of each source box, then the XOR of each stripe
        shards: dict[tuple, np.ndarray] = {}

        def read(c: SavedChunk, lo: int, hi: int) -> np.ndarray:
            k = (c.path, c.source)
            if k not in shards:
                shards[k] = np.asarray(host_bytes(fetchers[(c.path, devs[k])]))
            return range_from_copy(c, lo, hi, shards[k], c.source)
        try:
            return [("stripe", s.id, stripe_parity(plan, s, read)) for s in tasks]
        finally:
            fetchers.clear()  # drop the views: the next donating step may reuse the buffers

    # --------------------------------------------------------------------------------------- after commit
    def _on_commit(self, step: int, committed: bool) -> None:
        with self._cond:
            entry = self._steps.pop(step, None) if not committed else self._steps.get(step)
            if not committed or self._closed:
                self._pending.discard(step)
                self._cond.notify_all()
            if entry is None or not committed or self._closed:
                return
            self._recent = sorted(self._recent + [step])[-self.config.keep:]
            # Queued steps retention now lets go will be skipped: do not keep them in memory. Only process 0's
            # decision counts, so process 0 publishes it now (staleness only grows: its worker would decide the
            # same) and the others let a step go only once that decision says skip; until then they hold it,
            # or process 0 might still protect it after their retention dropped its bytes.
            stale = [s for s in self._queued if self._stale(s)]
            tell: list[int] = []
            if self.p == 0 or self.n == 1:
                older = [s for s in stale if s in self._held]
                self._held.difference_update(older)
                tell = [s for s in stale if s not in self._told] if self.n > 1 else []
                self._told.update(dict.fromkeys(tell, False))
                ask = []
            else:
                older, ask = [], [s for s in stale if s in self._held]
            self._queued.add(step)
            self._held.add(step)
        self.engine.pin(step)  # before retention: the nodes pull this step's bytes while protecting it
        try:
            self._share_skips(tell, ask, older)
        finally:
            for s in older:
                self.engine.unpin(s)
            self._pool.submit(self._protect, step)

    def _share_skips(self, tell: list[int], ask: list[int], older: list[int]) -> None:
        """Process 0: publish the skip of ``tell``; the others: add to ``older`` the steps of ``ask`` whose skip
        is published (a step whose decision is not out yet stays held: its worker releases it)."""
        for s in tell:
            try:
                self._channel.answer_early(f"decide {s}", False, number=2 * s)
            except Exception as e:  # noqa: BLE001 - its worker runs the decision round instead
                with self._cond:
                    self._told.pop(s, None)
                    self._cond.notify_all()
                log.warning("step %d: could not publish its protection skip now: %s", s, e)
            else:
                with self._cond:
                    self._told[s] = True
                    self._cond.notify_all()
        for s in ask:
            try:
                answered, go = self._channel.peek_early(f"decide {s}", number=2 * s)
                skipped = answered and go is False
            except Exception as e:  # noqa: BLE001 - kept until its worker reads the decision
                log.warning("step %d: could not read its protection decision now: %s", s, e)
                continue
            if skipped:
                with self._cond:
                    mine = s in self._held  # the worker may have decided it meanwhile, and released it
                    self._held.discard(s)
                if mine:
                    older.append(s)

    def _stale(self, step: int) -> bool:
        """True when ``Config.keep`` newer steps are committed: retention lets ``step`` go (call locked)."""
        return len(self._recent) >= self.config.keep and step < self._recent[0]

    def _decide(self, step: int) -> bool | None:
        """Protect ``step`` (True) or skip it (False), as process 0 decides; None if it did not say in time."""
        with self._cond:
            self._queued.discard(step)
            stale = self._stale(step)
            # process 0: its skip is answered early (_on_commit); the worker runs no round for it then, so it
            # waits for an answer still being written (never runs the round while the answer may appear)
            deadline = time.monotonic() + self.config.commit_timeout_s
            while self._told.get(step) is False and time.monotonic() < deadline:
                self._cond.wait(1.0)
            told = self._told.pop(step, None) is True
        try:
            go = False if told else bool(self._channel.broadcast(
                f"decide {step}", not stale if self.p == 0 else None, number=2 * step, early=True))
        except CommitError as e:  # CoordinationError: process 0 (or another process) did not take part in time
            log.error("step %d: no protection decision on process %d: %s", step, self.p, e)
            return None
        with self._cond:
            self.decisions[step] = go
            while len(self.decisions) > 64:  # the recent ones only: memory stays bounded over a long job
                del self.decisions[next(iter(self.decisions))]
            self._cond.notify_all()
        return go

    def _skip(self, step: int) -> None:
        # its parity future runs on (not cancelled: a front end may wait for it before reusing its buffers)
        with self._cond:
            self._skipped.add(step)
            trim(self._skipped)
            self._pending.discard(step)
            self._cond.notify_all()
        log.debug("step %d: protection skipped: %d newer steps are committed", step, self.config.keep)

    def _protect(self, step: int) -> None:
        try:
            with self._cond:
                plan, fut = self._steps.pop(step)
            go = self._decide(step)
            if go is False:
                self._skip(step)
                return
            if go is None:  # process 0 is gone or stuck: no one would collect an announcement either
                e = CommitError(f"step {step}: process 0 did not decide on its protection within "
                                f"{self.config.commit_timeout_s * 2:g}s")
                log.error("step %d: protection failed on process %d: %s", step, self.p, e)
                with self._cond:
                    self._failed[step] = e
                    trim(self._failed)
                    self._pending.discard(step)
                    self._cond.notify_all()
                return
            with self._cond:
                hold = step not in self._held
                self._held.add(step)
            if hold:  # released as probably skipped; keep it now, if retention has not dropped it yet
                self.engine.pin(step)
            blocks = list(fut.result()) if fut is not None else []
            me = self.nodes[self.p]
            local = [q for q in range(self.n) if self.nodes[q] == me]
            stripes = [s for s in plan.stripes
                       if s.kind == "xor-group" and s.node == me and local[s.id % len(local)] == self.p]
            copies = [b for b in plan.copy_blocks if b.node == me and local[b.id % len(local)] == self.p]
            self.engine.catalog.begin(f"protection of step {step}")
            reader = _Sources(self, step)
            tasks, sources = [], {}
            try:
                ids = plan.node_ids
                at = ids.index(me)
                prev = {ids[(at - k) % len(ids)] for k in range(1, max(1, plan.copies) + 1)} - {me}
                manifests = {q: reader.manifest(q) for q in range(self.n) if self.nodes[q] in prev}
                # the node agent pulls and builds these blocks (backends/agent/protection_pull.py)
                tasks = [("stripe", s.id, s.nbytes) for s in stripes] + [("copy", b.id, b.nbytes) for b in copies]
                read = {plan.chunks[g.chunk].process for s in stripes for u in s.units for g in u.ranges}
                read |= {plan.chunks[i].process for b in copies for i in b.chunks}
                sources = {q: reader.address(q) for q in sorted(read)}
            finally:
                reader.close()
            self._write(step, plan, manifests, blocks, tasks, sources)
            self._announce(step, True)
        except BaseException as e:  # noqa: BLE001 - the step stays unprotected; training goes on
            log.error("step %d: protection failed on process %d: %s", step, self.p, e)
            with self._cond:
                self._failed[step] = e
                trim(self._failed)
            self._announce(step, False)
        finally:
            with self._cond:
                held = step in self._held
                self._held.discard(step)
            if held:
                self.engine.unpin(step)

    def _slot_store(self):
        if self._store is None:  # of the engine's store class (a subclass of ShmStore, say)
            self._store = self._slots.slot_store(self.p)
        return self._store

    def _write(self, step: int, plan: ProtectionPlan, manifests: dict[int, bytes], blocks, tasks=(),
               sources=None) -> None:
        """Commit the step's protection slot: ``blocks`` computed here, ``tasks`` ((kind, id, nbytes)) built into
        the slot by the node agent from ``sources`` ({process: [address, token] | None})."""
        meta = encode_meta(self._encoded[id(plan)], manifests)
        datas = [(kind, bid, parity.as_bytes(data)) for kind, bid, data in blocks]
        offsets, size = slot_layout(len(meta), [b.size for _, _, b in datas] + [n for _, _, n in tasks])
        refs = [[kind, int(bid), o, int(b.size), crc32c(b)] for o, (kind, bid, b) in zip(offsets, datas)]
        store = self._slot_store()
        if step in store.steps():  # an earlier incarnation's protection of this step number: stale now
            log.info("step %d: replacing the protection slot an earlier run of process %d left", step, self.p)
            store.delete(step)
        slot = store.reserve(step, size)
        try:
            buf = parity.as_bytes(np.frombuffer(slot.buffer, np.uint8)) if size else None
            if size:
                buf[:len(meta)] = np.frombuffer(meta, np.uint8)
            for o, (_, _, b) in zip(offsets, datas):
                buf[o:o + b.size] = b
            if tasks:
                at = offsets[len(datas):]
                try:
                    reply = store.capability(ProtectionSlots).pull(
                        slot, plan=self._encoded[id(plan)],
                        tasks=[[kind, int(bid), o] for o, (kind, bid, _) in zip(at, tasks)],
                        sources={str(q): v for q, v in (sources or {}).items()},
                        rate=int(self.config.protection_bandwidth or 0), timeout=float(self.config.peer_timeout_s))
                except AgentError:  # a peer the agent could not reach may have restarted elsewhere: look again
                    self.engine.catalog.suspect()
                    raise
                refs += [[kind, int(bid), o, int(n), int(crc)]
                         for o, (kind, bid, n), crc in zip(at, tasks, reply["crcs"])]
                self.last_pull = reply
            store.commit(slot, slot_header(step, self.p, meta, refs))
        except BaseException:
            store.abort(slot)
            raise
        keep = set(self.engine.store.steps()) | {step}  # committed, pending and held (the newest protected) steps
        for s in self._store.steps():
            if s not in keep and s < step:
                self._store.delete(s)

    def _announce(self, step: int, ok: bool) -> None:
        try:  # protected only when protected on every process (a reduce round of the protect channel)
            done = bool(self._channel.reduce(f"announce {step}", bool(ok), all, number=2 * step + 1))
        except CommitError as e:  # CoordinationError: a process did not announce in time
            log.error("step %d: protection not announced by every process: %s", step, e)
            done = False
        with self._cond:
            self._pending.discard(step)
            newest = max(self._protected, default=None)
            if done:
                self._protected = sorted(set(self._protected) | {step})
                trim(self._protected)
                self._protected_at[step] = time.monotonic()
                trim(self._protected_at)
            else:
                self._failed.setdefault(step, CommitError(f"step {step}: protection not complete on every node"))
                trim(self._failed)
            self._cond.notify_all()
        if done and (newest is None or step > newest):
            # Until a newer step is protected, this one is all a lost node can be rebuilt from: its local bytes
            # stay past Config.keep (its protection slots likewise, in _write) while newer steps are unprotected.
            self.engine.pin(step)
            if newest is not None:
                self.engine.unpin(newest)
            with self._cond:
                fallbacks, self._fallbacks = self._fallbacks, []
            for s in fallbacks:
                self.engine.unpin(s)
        if done:
            log.info("step %d is protected (%s)", step, self.config.protection)

    def adopt(self, step: int, *, complete: bool = True) -> None:
        """Take ``step`` as the newest protected one (found at start-up; the engine holds it): the next step
        protected releases it, as :meth:`_announce` does. ``complete=False``: a step that can only be rebuilt (a
        node of it was lost), held as the fallback all the same but not reported protected."""
        with self._cond:
            if complete:
                self._protected = sorted(set(self._protected) | {step})
                trim(self._protected)
            else:
                self._fallbacks.append(step)

    # ----------------------------------------------------------------------------------------------- API
    def protected_steps(self) -> list[int]:
        """Steps whose redundancy is in place on every node, ascending."""
        with self._cond:
            return list(self._protected)

    def protected_times(self) -> dict[int, float]:
        """The newest protected steps' ``time.monotonic()`` of their announcement here (commit -> protected is this
        minus the step's decided time in ``engine.commit_times()``)."""
        with self._cond:
            return dict(self._protected_at)

    def plans(self) -> dict[tuple, ProtectionPlan]:
        """The protection plan of each state layout saved so far, by layout key."""
        with self._cond:
            return dict(self._plans)

    def failures(self) -> dict[int, BaseException]:
        """The newest steps whose protection failed, with why."""
        with self._cond:
            return dict(self._failed)

    def skipped_steps(self) -> list[int]:
        """The newest committed steps retention let go before their turn came (never protected), ascending."""
        with self._cond:
            return sorted(self._skipped)

    def wait(self, step: int | None = None, timeout: float | None = None) -> bool:
        """Until ``step`` (default: every step handed to protection so far) is protected, failed, skipped
        (``Config.keep`` newer steps were committed before its turn) or dropped (not committed by every process:
        nothing to protect). False if ``timeout`` ran out first."""
        with self._cond:
            return self._cond.wait_for(lambda: step not in self._pending if step is not None else not self._pending,
                                       timeout)

    def close(self) -> None:
        self._closed = True
        self._parity_pool.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        if self._store is not None:
            self._store.close()


class _Sources:
    """The manifests of ``step`` and where the node agent finds each process's chunks (its pulls verify them)."""

    def __init__(self, prot: Protector, step: int) -> None:
        self.prot, self.step = prot, step
        self._opened: dict[int, Any] = {}

    def _holder(self, q: int):
        """(holder, AgentInfo or None for this node's agent) of the agent of process ``q``'s node."""
        gen = self.prot.generations[self.prot.agents[q]]
        found = self.prot.engine.catalog.agent_holder(gen)
        if found is None:
            raise PeerError(f"step {self.step}: no agent of the node of process {q} (generation "
                            f"{self.prot.engine.catalog.current_generation(gen)}) is known")
        return found

    def _open(self, q: int):
        o = self._opened.get(q)
        if o is None:
            o = self._opened[q] = self._holder(q)[0].open(q, self.step)
        return o

    def manifest(self, q: int) -> bytes:
        return bytes(self._open(q).manifest)

    def address(self, q: int) -> list | None:
        """Where the node agent finds process ``q``'s chunks: None (its own node) or [peer address, token, CURVE
        public key of that agent ("" without CURVE)]."""
        info = self._holder(q)[1]
        return None if info is None else [info.address, bytes(info.token), info.server_key]

    def close(self) -> None:
        for o in self._opened.values():
            try:
                o.close()
            except Exception as e:  # noqa: BLE001
                log.warning("step %d: could not close a source: %s", self.step, e)
