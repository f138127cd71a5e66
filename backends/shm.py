"""``store="shm"``: this process's snapshots live in the node agent's shared memory and outlive the process.

Save path, zero extra copies: ``reserve`` asks the agent for a slot and returns the mmap of its shared segment
as the Slot's buffer, so the snapshot workers copy device bytes straight into the agent's memory; ``commit``
hands the agent the manifest. Restore reads the same way: ``open`` pins a committed step at the agent and the
view's buffer is the mmap of its segment. Segments are reused across steps, and this process keeps each one
mapped, so after warm-up a save costs two small messages on a Unix socket and nothing else. A restore on CPU
lends a committed segment to the restored arrays (``_View.lend``): the agent then unlinks it when the step is
freed instead of reusing it, and its pages live on in this process's mapping as long as the arrays do.

The agent is found through ``Config.shm_dir`` (or the per-job default); if none runs, this store spawns one,
detached (its lock keeps it to one per directory). If the agent dies, saves are skipped with a logged error and
counted in ``metrics["saves_skipped"]`` (never silently) while training goes on; the next save reconnects,
respawning the agent if needed, and an agent that restarts adopts the committed steps its predecessor left.
After ``close()`` this store holds nothing itself (``held_bytes() == 0``): the snapshots stay with the agent
for the next run of this process, which finds them with ``steps()``.
"""
from __future__ import annotations

import logging
import mmap
import os
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any

from jaxckpt.backends.agent.capacity import check_budget
from jaxckpt.backends.agent.protocol import (AgentConnection, agent_dir, default_log_path,
                                             open_segment, start_agent)
from jaxckpt.node_identity import local_process_count, node_identity
from jaxckpt.core.trim import trim
from jaxckpt.config import Config
from jaxckpt.errors import (AgentError, BudgetExceededError, ClosedError, StepError, StepNotFoundError,
                            StoreUnavailableError)
from jaxckpt.core.capabilities import AgentHolders, NodeAgent, ProtectionSlots
from jaxckpt.core.store import Slot, SnapshotView, Store

log = logging.getLogger("jaxckpt.backends.shm")

START_TIMEOUT_S = 30.0  # how long a blocking connect waits for a spawned agent to listen
RESPAWN_INTERVAL_S = 2.0  # a save while the agent is down respawns it at most this often
MAX_UNDELIVERED = 4096  # deletes kept for the next agent while none answers (one per decided step at most)


@dataclass(frozen=True)
class _SlotToken:
    generation: str  # the agent incarnation (and connection) the slot belongs to
    conn: int
    seg: str | None


class _View(SnapshotView):
    def __init__(self, store: "ShmStore", step: int, manifest: bytes, buffer: memoryview, conn: int) -> None:
        self._store, self._conn = store, conn
        self.step, self.manifest, self.buffer = step, manifest, buffer
        self._closed = False
        self._lent: bool | None = None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.buffer = memoryview(b"")
            self._store._unpin(self)

    def lend(self) -> bool:
        if self._lent is None:  # asked once per chunk by the restore's readers; one request is enough
            self._lent = self._store._lend(self)
        return self._lent


class ShmStore(Store):
    """Snapshots in the node agent's POSIX shared memory (see the module docstring)."""

    name = "shm"
    survives_process = True
    capabilities = frozenset({NodeAgent, AgentHolders, ProtectionSlots})  # backends/agent/handle.py

    def __init__(self, config: Config, *, process_index: int = 0, process_count: int = 1) -> None:
        super().__init__(config, process_index=process_index, process_count=process_count)
        self.directory = agent_dir(config)
        # A too-small /dev/shm (a container's 64 MB) fails here, naming the sizes and the fix, not at a save.
        check_budget(self.directory, config.memory_budget_bytes, local_process_count() or 1,
                     node_identity(config).name)
        # agent_requests / agent_request_ns: round trips to the agent and their time, every thread's
        self.metrics: dict[str, int] = {"saves_skipped": 0, "reconnects": 0, "agent_spawns": 0, "agent_requests": 0,
                                        "agent_request_ns": 0}
        self.allocations = 0  # segments the agent created for this process through this store
        self.agent: dict[str, Any] = {}  # the hello reply of the agent we are connected to
        self._lock = threading.RLock()
        self._conn: AgentConnection | None = None
        self._conn_id = 0  # bumped on every (re)connection: slots and pins of an older one are void
        self._maps: dict[str, mmap.mmap] = {}
        self._writing: dict[int, Slot] = {}
        self._views: set[_View] = set()
        self._known: dict[int, str] = {}  # step -> generation of the agent that held it when we last looked
        # Deletes the agent never got (it was down): sent again to the next agent, which adopts the dead one's
        # committed slots, deleted ones included: kept, they filled the budget of a job whose engine no longer
        # counted them (jaxckpt chaos --profile long, kill-agent: every later save refused).
        self._undelivered: set[int] = set()
        self._spawned: subprocess.Popen | None = None
        self._last_spawn = 0.0
        self._closed = False
        self._handle = None  # backends/agent/handle.AgentHandle, made on first ask
        self._connect(block=True)

    def _capability(self, kind: type) -> Any:
        if self._handle is None:
            from jaxckpt.backends.agent.handle import AgentHandle
            self._handle = AgentHandle(self)
        return self._handle

    # ------------------------------------------------------------------------------------------- the agent
    def _connect(self, *, block: bool) -> AgentConnection:
        """The live connection, (re)connecting and spawning the agent if needed; StoreUnavailableError if not."""
        if self._conn is not None:
            return self._conn
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            conn = None
            try:
                conn = AgentConnection(self.directory)
                # A SIGKILLed agent's socket can still accept until the process is gone, then reset us: the
                # hello is part of the handshake that is retried, not a failure of the agent that comes next.
                hello = conn.call("hello", job=self.config.job_id, role="trainer", process=self.process_index,
                                  process_count=self.process_count, keep=self.config.keep,
                                  pending=self.config.max_pending_saves, budget=self.config.memory_budget_bytes,
                                  pid=os.getpid())
                break
            except StoreUnavailableError as e:
                if conn is not None:
                    conn.close()
                self._maybe_spawn()
                if not block or time.monotonic() > deadline:
                    raise StoreUnavailableError(f"{e} (job {self.config.job_id!r}, process {self.process_index}; "
                                                f"agent log: {default_log_path(self.directory)})") from None
                time.sleep(0.02)
            except BaseException:
                if conn is not None:
                    conn.close()
                raise
        previous = self.agent.get("generation")
        if previous is not None:
            self.metrics["reconnects"] += 1
            log.warning("process %d: reconnected to the node agent at %s (pid %d%s)", self.process_index,
                        self.directory, hello["pid"],
                        ", a new one" if hello["generation"] != previous else "")
        self._conn, self._conn_id, self.agent = conn, self._conn_id + 1, hello
        self._last_spawn = 0.0  # an agent served us: if it dies later, respawning at once is no spawn loop
        self._note_steps(hello["steps"])
        self._redeliver(conn, hello["steps"])
        for view in list(self._views):  # pins died with the old connection: take them again
            try:
                r = conn.call("open", step=view.step)
                view._conn = self._conn_id if r["found"] else view._conn
            except StoreUnavailableError:
                break
        return conn

    def _redeliver(self, conn: AgentConnection, held: list[int]) -> None:
        """Send the deletes the last agent never got to ``conn``'s agent, for the steps it holds."""
        for step in sorted(self._undelivered & set(held)):
            try:
                conn.call("delete", step=step)
            except StoreUnavailableError:
                return  # this agent went too: the next connection sends them
            log.info("step %d: delete delivered to the node agent that came back", step)
        self._undelivered.clear()

    def _maybe_spawn(self) -> None:
        if self._spawned is not None and self._spawned.poll() is None and \
                time.monotonic() - self._last_spawn < START_TIMEOUT_S:
            return  # the one we started is still coming up
        if time.monotonic() - self._last_spawn < RESPAWN_INTERVAL_S:
            return
        self._last_spawn = time.monotonic()
        self._spawned = start_agent(self.config, self.directory)
        self.metrics["agent_spawns"] += 1
        log.info("process %d: started a node agent for job %s in %s (pid %d)", self.process_index,
                 self.config.job_id, self.directory, self._spawned.pid)
        # Reap it if it exits while we live (a lost lock race, a shutdown): no zombie.
        threading.Thread(target=self._spawned.wait, name="jaxckpt-agent-reaper", daemon=True).start()

    def _call(self, op: str, *, block: bool, retry: bool = True, **fields: Any) -> dict:
        """One request. If the connection turns out dead (the agent went away since the last request), a
        ``retry`` request is sent once more on a new one: at once if an agent listens again (restarted by a
        launcher, or by us), else after waiting for one (``block``) or not at all. Requests about a slot or a
        pin of the old connection never retry: those died with it."""
        for attempt in (0, 1):
            fresh = self._conn is None
            conn = self._connect(block=block)
            t0 = time.perf_counter_ns()
            try:
                return conn.call(op, **fields)
            except StoreUnavailableError:
                self._disconnect()
                if not retry or fresh or attempt:
                    raise
            finally:
                self.metrics["agent_requests"] += 1
                self.metrics["agent_request_ns"] += time.perf_counter_ns() - t0
        raise AssertionError("unreachable")

    def _disconnect(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _note_steps(self, steps: list[int]) -> None:
        gen = self.agent.get("generation", "")
        for s in steps:
            self._known[s] = gen
        trim(self._known)

    def _skip(self, step: int, e: Exception) -> StoreUnavailableError:
        self.metrics["saves_skipped"] += 1
        log.error("step %d: save skipped on process %d (%d skipped so far): %s", step, self.process_index,
                  self.metrics["saves_skipped"], e)
        return StoreUnavailableError(f"step {step}: save skipped on process {self.process_index}: {e}")

    def _map(self, seg: str, size: int) -> mmap.mmap:
        """Segment ``seg`` mapped (once per segment: a later restore reuses the mapping and its pages). A new
        mapping's pages fault in where the restore reads them, on its reading threads at once: mapped ahead in one
        call (``MADV_POPULATE_READ``, 2026-12-03 until stop 64) they were mapped by one thread, under the store's
        lock, and a relaunched process's first restore of 1 GiB took 135-174 ms instead of 79-102 (BENCHMARKS.md,
        "The agent's pages faulted in by the restore's readers")."""
        m = self._maps.get(seg)
        if m is None or len(m) < size:
            m = self._maps[seg] = open_segment(self.directory, seg, size)
        return m

    def _map_handed(self, r: dict) -> mmap.mmap:
        """The segment an agent's reply names, mapped; StoreUnavailableError if it is gone: the agent that named
        it died before we mapped it, and the agent after it unlinked it (it adopts committed slots only, and a
        node whose memory went with its agent has none)."""
        try:
            return self._map(r["seg"], r["size"])
        except AgentError as e:
            if os.path.lexists(os.path.join(self.directory, r["seg"])):
                raise
            self._disconnect()  # the connection was to the dead agent: the next request finds the new one
            raise StoreUnavailableError(f"{e} (the node agent that named it was lost)") from None

    # ------------------------------------------------------------------------------------------- the Store
    def reserve(self, step: int, nbytes: int) -> Slot:
        with self._lock:
            self._check_open()
            try:
                try:
                    r = self._call("reserve", block=False, step=step, nbytes=nbytes)
                except BudgetExceededError:
                    # The pages of segments the agent unlinked live on while this process maps them, and count
                    # against a full filesystem or the agent's memory cgroup; only a reserve that succeeds says
                    # which went. Let every cached mapping go (the slots and views in use keep their own) and ask
                    # once more: a refusal then stands for what is really held.
                    if not self._maps:
                        raise
                    self._maps.clear()
                    r = self._call("reserve", block=False, step=step, nbytes=nbytes)
            except StoreUnavailableError as e:
                raise self._skip(step, e) from None
            if r["created"]:
                self.allocations += 1
            for name in set(self._maps) - set(r["segs"]):  # segments the agent unlinked; our views keep theirs
                del self._maps[name]
            try:
                buf = memoryview(self._map_handed(r))[:nbytes] if r["seg"] else memoryview(bytearray(0))
            except StoreUnavailableError as e:  # the agent was lost mid-save
                raise self._skip(step, e) from None
            slot = Slot(step, nbytes, buf, token=_SlotToken(r["generation"], self._conn_id, r["seg"]))
            self._writing[step] = slot
            return slot

    def commit(self, slot: Slot, manifest: bytes) -> None:
        with self._lock:
            self._check_open()
            tok: _SlotToken = slot.token
            if self._writing.get(slot.step) is not slot:
                raise StepError(f"step {slot.step}: slot is not being written (committed or aborted already)")
            if self._conn is None or tok.conn != self._conn_id:
                del self._writing[slot.step]
                raise self._skip(slot.step, StoreUnavailableError(
                    f"the node agent at {self.directory} was lost while step {slot.step} was being written"))
            try:
                self._call("commit", block=False, retry=False, step=slot.step, manifest=bytes(manifest))
            except StoreUnavailableError as e:
                del self._writing[slot.step]
                raise self._skip(slot.step, e) from None
            del self._writing[slot.step]
            self._known[slot.step] = tok.generation
            trim(self._known)

    def pull(self, slot: Slot, **fields: Any) -> dict:
        """Have the agent build protection blocks into ``slot`` (backends/agent/protection_pull.py); its reply (one crc32c
        per block). AgentError if it could not (a peer failed, a chunk was bad): the slot stays being written."""
        with self._lock:
            self._check_open()
            if self._writing.get(slot.step) is not slot or self._conn is None or slot.token.conn != self._conn_id:
                raise StoreUnavailableError(f"step {slot.step}: the slot is not being written on a live connection "
                                            f"to the node agent at {self.directory}")
            return self._call("pull", block=False, retry=False, step=slot.step, **fields)

    def abort(self, slot: Slot) -> None:
        with self._lock:
            if self._writing.get(slot.step) is not slot:
                return
            del self._writing[slot.step]
            if self._conn is None or slot.token.conn != self._conn_id:
                return  # the agent discarded it when the connection dropped
            try:
                self._call("abort", block=False, retry=False, step=slot.step)
            except StoreUnavailableError as e:
                log.warning("step %d: abort not delivered (the agent discards the slot anyway): %s", slot.step, e)

    def steps(self) -> list[int]:
        with self._lock:
            if self._closed:
                return []
            steps = self._call("steps", block=True)["steps"]
            self._note_steps(steps)
            return steps

    def _pin(self, step: int) -> dict | None:
        """The agent's ``open`` of ``step`` (it pins it for this connection); None where it is not held."""
        self._check_open()
        try:
            r = self._call("open", block=True, step=step)
        except StoreUnavailableError as e:
            raise StepNotFoundError(f"step {step} of process {self.process_index}: the node agent holding it "
                                    f"is unreachable ({e}); its snapshots cannot be read") from None
        if not r["found"]:
            self._explain_missing(step, r["steps"])
            return None
        return r

    def open(self, step: int) -> SnapshotView | None:
        with self._lock:
            r = self._pin(step)
            if r is None:
                return None
            try:
                buf = memoryview(self._map_handed(r))[:r["nbytes"]] if r["seg"] else memoryview(b"")
            except StoreUnavailableError as e:
                raise StepNotFoundError(f"step {step} of process {self.process_index} is gone: {e}") from None
            view = _View(self, step, r["manifest"], buf.toreadonly(), self._conn_id)
            self._views.add(view)
            return view

    def manifest(self, step: int) -> bytes | None:
        """The manifest alone: pinned and unpinned at once, the segment not mapped (a start-up
        adopting its held steps needs their manifests alone, and most of those steps are then deleted)."""
        with self._lock:
            r = self._pin(step)
            if r is None:
                return None
            try:
                self._call("unpin", block=False, retry=False, step=step)
            except StoreUnavailableError as e:  # the pin went with the connection
                log.warning("step %d: unpin not delivered: %s", step, e)
            return r["manifest"]

    def prefetch(self, step: int) -> None:
        """Pin and map ``step``'s segment on a thread of its own: the restore that follows a start-up finds the
        mapping made; its pages fault in as the restore reads them (see ``_map``)."""
        def run() -> None:
            try:
                view = self.open(step)
            except Exception as e:  # noqa: BLE001 - closed, unreachable, gone: the restore reports it itself
                log.debug("step %d: not prefetched: %s", step, e)
                return
            if view is not None:
                view.close()

        threading.Thread(target=run, name="jaxckpt-prefetch", daemon=True).start()

    def _explain_missing(self, step: int, held: list[int]) -> None:
        gen = self._known.get(step)
        if gen is not None and gen != self.agent["generation"]:
            raise StepNotFoundError(
                f"step {step} of process {self.process_index} is gone: the node agent that held it (generation "
                f"{gen}) died and its memory was lost; the agent now at {self.directory} (pid {self.agent['pid']}) "
                f"holds steps {held or 'none'} of this process")

    def _unpin(self, view: _View) -> None:
        with self._lock:
            self._views.discard(view)
            if self._conn is not None and view._conn == self._conn_id:
                try:
                    self._call("unpin", block=False, retry=False, step=view.step)
                except StoreUnavailableError as e:
                    log.warning("step %d: unpin not delivered: %s", view.step, e)
            if self._closed and not self._views:
                self._disconnect()

    def _lend(self, view: _View) -> bool:
        """Ask the agent never to reuse ``view``'s segment (restored arrays keep using its mapping)."""
        with self._lock:
            if self._closed or self._conn is None or view._conn != self._conn_id:
                return False
            try:
                return bool(self._call("lend", block=False, retry=False, step=view.step).get("lent"))
            except StoreUnavailableError as e:
                log.warning("step %d: the node agent did not take the lend (the restore copies instead): %s",
                            view.step, e)
                return False

    def delete(self, step: int) -> None:
        with self._lock:
            if self._closed:
                return  # the next run's engine recovery applies the retention
            try:
                self._call("delete", block=False, step=step)
            except StoreUnavailableError as e:
                self._undelivered.add(step)
                if len(self._undelivered) > MAX_UNDELIVERED:  # an agent down for long: the oldest are moot
                    self._undelivered.discard(min(self._undelivered))
                log.warning("step %d: delete not delivered (sent again to the agent that comes back): %s", step, e)
            else:
                self._undelivered.discard(step)

    def held_bytes(self) -> int:
        with self._lock:
            if self._closed and not self._views:
                return 0
            return self._call("held", block=False)["bytes"]

    def close(self) -> None:
        """Abort slots being written and disconnect (once no view is open); the agent keeps committed steps."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for slot in list(self._writing.values()):
                self.abort(slot)
            self._maps.clear()  # open views keep their own mappings alive
            if not self._views:
                self._disconnect()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"shm store of process {self.process_index} (job {self.config.job_id!r}) is closed")
