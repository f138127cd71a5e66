"""The catalog: every holder a restoring process can read snapshots from, found once, asked on each restore.

Holders (``jaxckpt.core.sources``), cheapest first: this process's store (``local``); with a store that has node
agents (its ``NodeAgent`` and ``AgentHolders`` capabilities, ``jaxckpt.core.capabilities``: ``store="shm"``) its
node's agent (``node``, zero-copy) and the other nodes' agents (``remote``, peer transport); in a multi-process job
without agents, the job's other processes (``peer``); and any holders registered with :meth:`Catalog.add_holders`
(protection's rebuild from parity or copies, the persistent directory).

Finding the agents (:meth:`Catalog.discover`, collective when the job has several processes: one ``reduce``
round ``discover agents`` of a channel of ``jaxckpt.core.collective``; O(processes) at the coordinator, like
the commit protocol):
  0) (every process) reads the peer files of its own node's agent and of ``Config.agent_dirs`` and contributes
     what it found (address, token, node, generation);
  1) (process 0)     reduces the N lists to their union;
  2) (every process) gets that union.
So a restarted job, even with another number of processes or nodes, finds every agent any of its processes can
see on its host: a job's node agents find each other without configuration, and ``Config.agent_dirs`` names the
old job's agents on nodes the new job does not use (simulated nodes on one host: ``<parent>/node*``).

Agreeing on the step to restore (:meth:`Catalog.agree_latest`, collective likewise): each process lists the steps
whose snapshot is held, at some holder it can reach, for every process of the saving job (from the agents'
commit records); an ``all_gather`` round ``restorable steps`` shares the lists, and every process takes the
newest step in every list.

Opening a step (:meth:`Catalog.open`): what every holder holds, asked anew (the first open after a scan takes the
agents' answers of that scan, if they list the step and are under ``SCAN_FRESH_S`` old: the restore right after
``Checkpointer()`` asks no agent twice; should a holder they name fail to open, the open asks anew); then for each process of the saving job, its
holders in cost order; the first that opens gives the manifest, the others stand by as fallbacks and are opened only if a read needs them. A
corrupt manifest in this process's own store is routed around the same way (another holder's copy, e.g. the one
kept with protection; the own bytes are still read first, each chunk checked against that copy).
A near open (a restore without the collective of a job with whole replicas, of a committed step this process
holds) opens only this node's snapshots: its own and those its node's agent holds for the node's other
processes, so a restore of the layout it saved asks no other node anything (every process's requests to every
agent were two thirds of such a restore at 32 MiB on 4 nodes: 16.6 of 25.1 ms); the restore driver opens the step
again, every manifest, when those do not cover what it needs (``jaxckpt.core.restore.restore_step``), and this
node's manifests are not decoded twice.

A remote agent that does not answer in time (a dead agent's stale address) is not asked again for the rest of the
operation (a restore, a scan, a protection pull: :meth:`Catalog.begin`), and that is logged once.

Following restarted agents (:meth:`Catalog.begin`, never collective): an agent restarted on the same node and
directory listens on a new address. At the start of each operation a process re-reads the peer files that
changed (its own node's, ``Config.agent_dirs``: a stat each otherwise), and publishes its own node's new agent
as version k (its k-th restart) of the collective's published state ``agent-of/<process>``, a ring of two keys
(:meth:`~jaxckpt.core.collective.Collective.publish_version`: two keys per process at most, the newest always
readable). After an operation in which an agent did not answer, it also reads the other processes' two keys
(O(processes) reads, once per such operation) and takes the versions newer than it saw. A
restarted agent replaces the one of the same node and directory; :meth:`current_generation` maps the old
generation to the new one (protection names a node's agent by generation).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Hashable, Iterable, Iterator

from jaxckpt.core import manifest as mf
from jaxckpt.core.checksum import crc32c
from jaxckpt.config import Config
from jaxckpt.core.capabilities import AgentHolders, AgentInfo, NodeAgent
from jaxckpt.core.collective import Channel, Collective
from jaxckpt.core.coordination import Coordinator
from jaxckpt.core.decodes import Decodes, Kept, key
from jaxckpt.errors import AgentError, ManifestError, PeerError, StepNotFoundError, StoreUnavailableError
from jaxckpt.core.fetch import buffer_reader
from jaxckpt.core.holders import Guarded, NotAsked, PeerHolder, lazy_source
from jaxckpt.core.sources import (HeldEntry, Holder, Opened, Source, Version, check_manifest,
                                  choose_version, complete_steps, missing_processes, newest_common, order_sources)
from jaxckpt.core.store import Store
from jaxckpt.core.timeline import Stopwatch

log = logging.getLogger("jaxckpt.core.catalog")

HOLDER_ERRORS = (PeerError, StepNotFoundError, StoreUnavailableError, AgentError, ManifestError, OSError)
AGENT_KINDS = ("node", "remote", "peer")  # holders asked over a socket or the agent's own channel
# How long a scan's answers stand in for asking again: a relaunched job restores within seconds of its
# Checkpointer(); a restore asked for much later asks the agents, whose holdings have moved on since.
SCAN_FRESH_S = 60.0


class Catalog:
    """Holders of this job's (and an earlier job's) snapshots for one process (see the module docstring)."""

    def __init__(self, config: Config, coordinator: Coordinator, store: Store, peers=None,
                 collective: Collective | None = None) -> None:
        self.config, self.coord, self.store, self.peers = config, coordinator, store, peers
        # the engine's (its instance's keys); a catalog on its own gets an instance of its own
        self.collective = collective or Collective.for_job(coordinator, config.job_id, config.commit_timeout_s)
        self.process_index, self.process_count = coordinator.process_index, coordinator.process_count
        # store="shm": its node agents (jaxckpt.core.capabilities); None for a store without them
        agents = store.supports(NodeAgent)
        self._agent: NodeAgent | None = store.capability(NodeAgent) if agents else None
        self._readers: AgentHolders | None = store.capability(AgentHolders) if agents else None
        self.agent_dir = self._agent.directory if self._agent is not None else None
        self.agents: dict[str, AgentInfo] = {}  # address -> AgentInfo, once discovered
        self._discovered = False
        self._holders: list[Holder] | None = None
        self._providers: list[Callable[[], Iterable[Holder]]] = []
        self._lock = threading.Lock()
        self._operation = "catalog scan"  # what a holder that stops answering is skipped for the rest of
        self.replaced: dict[str, str] = {}  # generation of a restarted agent -> of the one that replaced it
        self._published: str | None = None  # the generation of our node's agent the other processes know
        self._own_k = 0  # our next agent-of number (its ring slot: k % 2)
        self._probe: dict[int, int] = {}  # process -> the lowest agent-of number not read yet
        self._seen: dict[str, Hashable] = {}  # agent directory -> its NodeAgent.stamp() last read
        self._stale = False  # an agent did not answer in the last operation: read the other processes' keys
        # the agents' answers of the last scan and when it ended: taken by the next open, within SCAN_FRESH_S
        self._scanned: tuple[float, list[tuple[Holder, HeldEntry]]] | None = None
        # Manifests decoded before the next open, by (crc32c, size): this node's by the last near open (the open
        # that widens it, the restore needing more, decodes them again otherwise: 288 ms for a 4,096-leaf state's
        # manifest) and the adoption's of the step a relaunch restores next (keep_decoded)
        self._decoded: Kept = {}

    def keep_decoded(self, data: bytes | memoryview, manifest: mf.Manifest) -> None:
        """Hand the next open ``manifest``, the decoding of ``data``: an open that reads the same bytes takes it
        instead of decoding them (the adoption's decoding of the step a relaunch restores next)."""
        self._decoded[key(data)] = (bytes(data), manifest)

    @property
    def uses_agents(self) -> bool:
        """True when snapshots live with node agents (``store="shm"``): restores can read any node's memory."""
        return self.agent_dir is not None

    def add_holders(self, provider: Callable[[], Iterable[Holder]]) -> None:
        """Also read from the holders ``provider()`` returns (asked on every open; e.g. rebuild, persistent)."""
        self._providers.append(provider)

    def begin(self, operation: str) -> None:
        """Start ``operation`` (a restore, a scan): follow restarted agents (see the module docstring); agents
        that did not answer in the last one are asked again."""
        self._follow_restarts()
        with self._lock:
            self._operation = operation
            holders = list(self._holders or ())
        for h in holders:
            if isinstance(h, Guarded):
                h.dead = None

    def suspect(self) -> None:
        """An agent may have restarted elsewhere (someone else could not reach it): at the next operation, read
        the addresses the other processes published."""
        with self._lock:
            self._stale = True

    def _unresponsive(self, h: Guarded, e: Exception) -> None:
        with self._lock:
            self._stale = True
            if h.dead is not None:
                return
            h.dead = what = self._operation
        log.warning("process %d: %s (node %s) did not answer (%s); not asked again in this %s",
                    self.process_index, h.name, h.node, e, what)

    # ------------------------------------------------------------------------------------------ discovery
    def _own_node(self) -> str:
        return (self._agent.node() if self._agent is not None else "") or "this node"

    def _own_generation(self) -> str:
        return self._agent.generation() if self._agent is not None else ""

    def discover(self, channel: Channel | None = None) -> None:
        """Find the node agents (see the module docstring); a round of ``channel`` when it is given (every
        process calls it then). Without agents (``store="memory"``) there is nothing to find."""
        if self._agent is None:
            return
        dirs = self._agent.directories()
        seen = {d: self._agent.stamp(d) for d in dirs}
        found = [a.to_wire() for a in self._agent.find(dirs)]
        if channel is not None:
            found = channel.reduce("discover agents", found, lambda lists: [w for got in lists for w in got])
        agents = {}
        for w in found:
            a = AgentInfo.from_wire(w)
            agents.setdefault(a.address, a)
        with self._lock:
            self.agents, self._discovered, self._seen = agents, True, seen
            self._published = self._own_generation()
            self._close_holders()
        log.info("process %d found %d node agent(s): %s", self.process_index, len(agents),
                 ", ".join(f"{a.node} at {a.address}" for a in agents.values()) or "none")

    def _follow_restarts(self) -> None:
        if self._agent is None or not self._discovered:
            return
        changed = []
        for d in self._agent.directories():
            state = self._agent.stamp(d)
            if state is not None and self._seen.get(d) != state:
                self._seen[d] = state
                changed.append(d)
        found = self._agent.find(changed) if changed else []
        own_gen = self._own_generation()
        coll = self.collective
        if self.process_count > 1 and own_gen != self._published:
            own = next((a for a in found + list(self.agents.values()) if a.generation == own_gen), None)
            if own is not None:  # else the new agent does not serve peers yet: at the next operation
                try:
                    coll.publish_version(f"agent-of/{self.process_index}", self._own_k, own.to_wire())
                    self._own_k, self._published = self._own_k + 1, own_gen
                except Exception as e:  # noqa: BLE001 - the others find it after a time-out, or at the next start
                    log.warning("process %d: could not publish the address of its restarted node agent: %s",
                                self.process_index, e)
        if self._stale and self.process_count > 1:
            self._stale = False
            for q in range(self.process_count):
                if q == self.process_index:
                    continue
                try:
                    newer = coll.peek_versions(f"agent-of/{q}", self._probe.get(q, 0))
                except Exception as e:  # noqa: BLE001 - unreadable now: at the next such operation
                    log.warning("process %d: agent addresses of process %d unreadable: %s", self.process_index, q, e)
                    continue
                for k, wire in newer:
                    try:
                        found.append(AgentInfo.from_wire(wire))
                    except Exception as e:  # noqa: BLE001 - a bad value: the next restart publishes a good one
                        log.warning("process %d: agent address %d of process %d unusable: %s",
                                    self.process_index, k, q, e)
                    self._probe[q] = k + 1
        if found:
            self._replace_agents(found)

    def _replace_agents(self, found: list) -> None:
        gone: set[str] = set()
        with self._lock:
            for a in found:
                cur = self.agents.get(a.address)
                if cur is not None and cur.generation == a.generation:
                    continue
                for old in [x for x in self.agents.values() if (x.node, x.directory) == (a.node, a.directory)]:
                    del self.agents[old.address]
                    gone.add(old.address)
                    if old.generation != a.generation:
                        self.replaced[old.generation] = a.generation
                self.agents[a.address] = a
                gone.discard(a.address)
                log.info("process %d: the agent of node %s (%s) now listens at %s", self.process_index, a.node,
                         a.directory, a.address)
            if gone or found:
                self._rebuild_holders(gone)

    def current_generation(self, generation: str) -> str:
        """The generation of the agent serving now where the agent of ``generation`` was (it may have restarted)."""
        seen = {generation}
        while generation in self.replaced and self.replaced[generation] not in seen:
            generation = self.replaced[generation]
            seen.add(generation)
        return generation

    def agent_holder(self, generation: str) -> tuple[Holder, AgentInfo | None] | None:
        """The holder of the agent of ``generation`` (as it is now: see :meth:`current_generation`) and how other
        agents reach it: None for this node's agent (read locally), else its AgentInfo; None if none is known."""
        gen = self.current_generation(generation)
        own = gen == self._own_generation()
        for h in self.holders():
            if own and h.kind == "node":
                return h, None
            if isinstance(h, Guarded) and h.info.generation == gen:
                return h, h.info
        return None

    def holders(self) -> list[Holder]:
        """The agents' holders (node first), then the registered ones; built once per discovery."""
        if self.uses_agents and not self._discovered:
            self.discover()
        with self._lock:
            if self._holders is None:
                self._holders = self._make_holders()
            out = list(self._holders)
        for provider in self._providers:
            out += list(provider())
        return out

    def _rebuild_holders(self, gone: set[str]) -> None:
        """(locked) New holders for the agents now known; live ones are kept as they are (another thread may be
        reading through them), those of replaced agents closed."""
        self._scanned = None
        if self._holders is None:
            return
        keep: dict[str, Holder] = {}
        for h in self._holders:
            address = h.info.address if isinstance(h, Guarded) else None
            if h.kind == "remote" and address in gone:
                h.close()
            elif h.kind in ("node", "remote"):
                keep[address or ""] = h
        self._holders = self._make_holders(keep)

    def _make_holders(self, reuse: dict[str, Holder] | None = None) -> list[Holder]:
        if self._readers is None:
            return []
        reuse = reuse or {}
        own_gen = self._own_generation()
        infos = list(self.agents.values())
        names = [a.node for a in infos]
        label = {a.address: a.node if names.count(a.node) == 1 else f"{a.node}:{os.path.basename(a.directory)}"
                 for a in infos}
        own = next((a for a in infos if a.generation == own_gen), None)
        out: list[Holder] = [reuse.get("") or self._readers.node_holder(label[own.address] if own else
                                                                        self._own_node())]
        for a in infos:
            if a is not own:
                out.append(reuse.get(a.address) or Guarded(self._readers.remote_holder(a, label[a.address]), self._unresponsive, a))
        for address, h in reuse.items():
            if h not in out:
                h.close()  # e.g. our own restarted agent's old address, known as a remote one until now
        return out

    def index(self, agents_said: list[tuple[Holder, HeldEntry]] | None = None, watch: Stopwatch | None = None
              ) -> list[tuple[Holder, HeldEntry]]:
        """What every holder holds now; a holder that cannot answer is logged and left out. ``agents_said``: the
        agents' answers to use instead of asking them (the registered holders list from them too). ``watch``
        times its parts as stages (a start-up's: ``CheckpointEngine.startup``)."""
        watch = watch or Stopwatch()
        with watch.stage("agent clients"):  # made once per discovery: the transport's import, a client per agent
            holders = self.holders()

        def ask(h: Holder, said: list[tuple[Holder, HeldEntry]] | None) -> list[tuple[Holder, HeldEntry]]:
            try:
                return [(h, e) for e in (h.held() if said is None else h.held_given(said))]
            except NotAsked as e:
                log.debug("process %d: %s", self.process_index, e)
                return []
            except HOLDER_ERRORS as e:
                log.warning("process %d: %s did not list its snapshots: %s", self.process_index, h.name, e)
                return []

        def ask_all(hs: list[Holder], said: list[tuple[Holder, HeldEntry]] | None = None
                    ) -> list[tuple[Holder, HeldEntry]]:
            if len(hs) <= 1:
                return [x for h in hs for x in ask(h, said)]
            with ThreadPoolExecutor(max_workers=min(len(hs), self.config.restore_workers)) as ex:
                return [x for got in ex.map(lambda h: ask(h, said), hs) for x in got]
        # The agents first: the registered holders (rebuild) list from what they said (Holder.held_given) instead
        # of asking them again, and skip one that did not answer instead of waiting for it a second time. Answers
        # given (the start-up scan's) are the ones the registered holders listed from at that scan: a holder that
        # then cannot open the step sends the restore back to asking everyone anew (open).
        agents = [h for h in holders if h.kind in AGENT_KINDS]
        with watch.stage("agent listings"):
            said = ask_all(agents) if agents_said is None else agents_said
        with watch.stage("registered listings"):  # protection's: its slots' headers, read from every agent
            return said + ask_all([h for h in holders if h.kind not in AGENT_KINDS], said)

    def agree_latest(self, channel: Channel, watch: Stopwatch | None = None) -> int | None:
        """The newest step whose snapshot every process of this job can obtain, agreed by all (a round of
        ``channel``). ``watch`` times its parts as stages (the scan's, and the round's)."""
        watch = watch or Stopwatch()
        self.begin("catalog scan")
        listed = self.index(watch=watch)
        with self._lock:  # the restore that usually follows at once reads the same answers
            self._scanned = (time.monotonic(), [(h, e) for h, e in listed if h.kind in AGENT_KINDS])
        complete = complete_steps(e for _, e in listed)
        with watch.stage("restorable round"):
            return newest_common(channel.all_gather("restorable steps", complete))

    # ------------------------------------------------------------------------------------------------ open
    @contextlib.contextmanager
    def open(self, step: int, near: bool = False) -> Iterator[tuple[list[mf.Manifest], dict[int, list[Source]]]]:
        """The manifests of every process that saved ``step`` and, per process, its sources cheapest first.

        ``near`` (a step this job committed): when this process holds its own snapshot of it, only the manifests
        of this node (its own, and those of the other processes its node's agent holds) are opened, so that a
        restore that reads only this node's memory asks no other node anything; fewer manifests than the saving
        job's processes say so, and the caller opens the step again without ``near`` if they do not suffice."""
        self.begin(f"restore of step {step}")  # a restarted agent found here drops the scan's answers
        with self._lock:
            taken = self._scanned
        scanned = taken[1] if taken is not None and time.monotonic() - taken[0] <= SCAN_FRESH_S else None
        if scanned is not None and not any(e.step == step for _, e in scanned):
            scanned = None
        opened: list[Opened] = []
        try:
            try:
                got = self._open(step, opened, scanned, near)
            except HOLDER_ERRORS as e:
                if scanned is None:
                    raise
                log.info("process %d: step %d did not open from the holders of the last scan (%s); asking anew",
                         self.process_index, step, e)
                self._close_opened(step, opened)
                scanned = None
                got = self._open(step, opened)
            manifests = got[0]
            if not manifests or len(manifests) >= manifests[0].process_count:
                # the scan's answers serve the near opens and the first open of every process's manifests
                with self._lock:
                    if self._scanned is taken:
                        self._scanned = None
            yield got
        finally:
            self._close_opened(step, opened)

    @staticmethod
    def _close_opened(step: int, opened: list[Opened]) -> None:
        for o in opened:
            try:
                o.close()
            except Exception as e:  # noqa: BLE001 - closing one must not keep the others pinned
                log.warning("step %d: could not close a source: %s", step, e)
        opened.clear()

    def _open(self, step: int, opened: list[Opened], scanned: list[tuple[Holder, HeldEntry]] | None = None,
              near: bool = False) -> tuple[list[mf.Manifest], dict[int, list[Source]]]:
        me = self.process_index
        decodes, self._decoded = Decodes(self._decoded, keep=near), {}
        own_error: StepNotFoundError | None = None
        view = None
        try:
            view = self.store.open(step)
        except StepNotFoundError as e:  # e.g. the agent that held it lost its memory: the store says so
            own_error = e
        own: tuple[mf.Manifest, HeldEntry] | None = None
        own_bad: ManifestError | None = None
        if view is not None:
            opened.append(Opened(view.manifest, buffer_reader(view.buffer), view.close, view.lend))
            try:
                m = decodes.decode(view.manifest, f"step {step} manifest of process {me}")
            except ManifestError as e:  # routed around like a corrupt chunk: another holder's copy, if any
                own_bad = ManifestError(f"step {step}: the manifest of process {me} held by {self._own_name()} "
                                        f"is corrupt and no other holder has a good copy ({e})")
                log.warning("step %d: the manifest of process %d held by %s is corrupt; looking for another "
                            "copy (%s)", step, me, self._own_name(), e)
            else:
                own = (m, HeldEntry(step, m.process, m.process_count, m.layout, crc32c(view.manifest)))
        index: list[tuple[Holder, HeldEntry]] = []
        prefer = Version(step, own[0].process_count, own[0].layout) if own else None
        if near and own is not None and prefer is not None and prefer.process_count > 1:
            mark = len(opened)
            try:
                return self._open_near(step, prefer, own, opened, scanned, decodes)
            except HOLDER_ERRORS as e:  # another process's snapshot on this node did not open: ask everyone
                log.info("process %d: step %d: this node's snapshots did not open (%s); asking every holder",
                         self.process_index, step, e)
                for o in opened[mark:]:
                    o.close()
                del opened[mark:]
        if prefer is not None and prefer.process_count == 1 and not self._providers:
            version = prefer  # everything is in our own memory: ask no one
        else:
            if self.uses_agents or self._providers:
                index = [(h, e) for h, e in self.index(scanned) if e.step == step]
            if not self.uses_agents and prefer is not None and self.peers is not None:
                # a job without agents: the other processes of the same job serve their own stores
                index += [(PeerHolder(self.peers, q), HeldEntry(step, q, prefer.process_count, prefer.layout, 0))
                          for q in range(prefer.process_count) if q != me]
            entries = [e for _, e in index] + ([own[1]] if own else [])
            if not entries:
                if own_bad is not None:
                    raise own_bad
                if self._providers:  # say where else it was looked for (the persistent directory, rebuilds)
                    raise self._missing(step, [], None)
                raise own_error or self._not_held(step)
            version = choose_version(entries, step, prefer)
            if version is None:
                raise self._missing(step, entries, own_bad or own_error)
        local = own if own is not None and prefer == version else None
        manifests, sources = self._open_sources(step, version, index, local, opened)
        if own_bad is not None and self.config.verify_on_restore and me in sources:
            # the bytes in our own memory are still read first: each chunk is checked against the good manifest
            sources[me].insert(0, Source("local", f"own memory of process {me}", self._local_node(),
                                         opened[0].read))
        return manifests, sources

    def _open_near(self, step: int, version: Version, own: tuple[mf.Manifest, HeldEntry], opened: list[Opened],
                   scanned: list[tuple[Holder, HeldEntry]] | None, decodes: Decodes
                   ) -> tuple[list[mf.Manifest], dict[int, list[Source]]]:
        """This node's snapshots of ``version``: our own and those of the other processes our node's agent
        holds (from the scan's answers, else asked: one request to our own node's agent)."""
        node = next((h for h in self.holders() if h.kind == "node"), None) if self.uses_agents else None
        index: list[tuple[Holder, HeldEntry]] = []
        if node is not None:
            said = [e for h, e in scanned if h is node] if scanned is not None else node.held()
            index = [(node, e) for e in said if e.step == step and e.process != self.process_index
                     and (e.process_count, e.layout) == (version.process_count, version.layout)]
        got = self._open_sources(step, version, index, own, opened, only={e.process for _, e in index},
                                 decodes=decodes)
        self._decoded = decodes.kept
        return got

    def _open_sources(self, step: int, version: Version, index: list[tuple[Holder, HeldEntry]],
                      local: tuple[mf.Manifest, HeldEntry] | None, opened: list[Opened],
                      only: set[int] | None = None, decodes: Decodes | None = None
                      ) -> tuple[list[mf.Manifest], dict[int, list[Source]]]:
        decodes = decodes or Decodes({}, keep=False)
        by_q: dict[int, list[tuple[Holder, HeldEntry]]] = {}
        for h, e in index:
            if (e.process_count, e.layout) == (version.process_count, version.layout) or h.kind == "peer":
                by_q.setdefault(e.process, []).append((h, e))
        manifests: dict[int, mf.Manifest] = {}
        sources: dict[int, list[Source]] = {}
        if local is not None:
            m, e = local
            q = m.process
            sources[q] = [Source("local", f"own memory of process {self.process_index}", self._local_node(),
                                 opened[0].read, opened[0].lend)]
            manifests[q] = m
            # the node agent holds the same memory as our own store: no fallback there
            others = [(h, x) for h, x in by_q.get(q, []) if h.kind != "node" and x.crc == e.crc]
            sources[q] += [lazy_source(h, q, step, e.crc, opened) for h in order_sources(others)]

        def first(q: int) -> tuple[int, mf.Manifest, list[Source]]:
            holders = order_sources(by_q.get(q, []))
            failures: list[tuple[Holder, Exception]] = []
            for i, h in enumerate(holders):
                try:
                    o = h.open(q, step)
                except HOLDER_ERRORS as e:
                    failures.append((h, e))
                    continue
                opened.append(o)
                try:
                    m = decodes.decode(o.manifest, f"step {step} manifest of process {q} from {h.name}")
                    check_manifest(m, version, q, f"step {step} manifest of process {q} from {h.name}")
                except ManifestError as e:
                    failures.append((h, e))
                    continue
                crc = crc32c(o.manifest)
                alts = [h2 for h2 in holders[i + 1:]
                        if h2.kind == "peer" or any(x.crc == crc for hh, x in by_q[q] if hh is h2)]
                return q, m, [Source(h.kind, h.name, h.node, o.read, o.lend, o.bind, o.read_spans)] + \
                    [lazy_source(h2, q, step, crc, opened) for h2 in alts]
            if len(failures) == 1:  # the one holder's own error (a refused token, a gone step), unchanged
                h, e = failures[0]
                if isinstance(e, (PeerError, StepNotFoundError, ManifestError)):
                    raise e
                raise StepNotFoundError(f"step {step}: the snapshot of process {q} cannot be read from {h.name}: {e}")
            said = "; ".join(f"{h.kind} {h.name}: {e}" for h, e in failures) or "no holder lists it"
            raise StepNotFoundError(f"step {step}: the snapshot of process {q} (of {version.process_count}) could "
                                    f"not be opened at any holder ({said})")
        todo = [q for q in (sorted(only) if only is not None else range(version.process_count)) if q not in manifests]
        if todo:
            workers = min(len(todo), self.config.restore_workers)
            if workers <= 1:
                got = [first(q) for q in todo]
            else:
                with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="jaxckpt-manifests") as ex:
                    got = list(ex.map(first, todo))
            for q, m, s in got:
                manifests[q], sources[q] = m, s
        return [manifests[q] for q in sorted(manifests)], sources

    def _local_node(self) -> str:
        if not self.uses_agents:
            return ""
        with self._lock:
            node = next((h.node for h in self._holders or () if h.kind == "node"), None)
        return node or self._own_node()

    def _own_name(self) -> str:
        return f"the node agent at {self.agent_dir}" if self.agent_dir else f"store {self.config.store!r}"

    def _not_held(self, step: int) -> StepNotFoundError:
        return StepNotFoundError(f"step {step} is not held by store {self.config.store!r} "
                                 f"(held: {self.store.steps() or 'none'})")

    def _missing(self, step: int, entries: list[HeldEntry], own_error: Exception | None) -> Exception:
        gaps = missing_processes(entries, step)
        if not gaps:
            if own_error is not None:
                return own_error
            asked = ", ".join(h.name for h in self.holders()) or "none"
            return StepNotFoundError(f"step {step} is not held by store {self.config.store!r} (held: "
                                     f"{self.store.steps() or 'none'}) nor by any holder this process can reach "
                                     f"(asked: {asked})")
        said = "; ".join(f"saved by {v.process_count} processes: no holder has processes {p[:16]}"
                         f"{' ...' if len(p) > 16 else ''}" for v, p in gaps.items())
        return StepNotFoundError(f"step {step} cannot be restored: {said}"
                                 + (f" ({own_error})" if own_error else ""))

    # ----------------------------------------------------------------------------------------------- close
    def _close_holders(self) -> None:
        self._scanned = None
        if self._holders:
            for h in self._holders:
                h.close()
        self._holders = None

    def close(self) -> None:
        """Drop every holder's connections and this process's published agent addresses."""
        with self._lock:
            self._close_holders()
        if self._own_k:
            self.collective.unpublish_versions(f"agent-of/{self.process_index}")

