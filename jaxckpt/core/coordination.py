"""Cross-process agreement through a key-value store, one code path for 1 and N processes.

A :class:`Coordinator` is the few key-value primitives jaxckpt needs; the JAX coordination service and
``torch.distributed``'s store each get a small adapter, and :class:`LocalCoordinator` serves a single process.
Nothing calls them directly but :class:`jaxckpt.core.collective.Collective`: every cross-process round
(commit, start-up adoption, agent discovery and the restorable step, protection's node agreement, decisions and
announcements, the persistent tier's decisions, the peer token and addresses, the close barrier) is a numbered
round of one of its channels, under the key prefix of one Checkpointer instance, and the keys of a round are
deleted once it is done: a job's live keys stay O(processes) whatever the number of steps.

Commit protocol for a step (:class:`CommitTracker`, channel ``commit``: one ``reduce`` round per step;
O(processes) key-value operations at process 0, two at every other process):
  0) (every process) after its chunks are in host memory, contributes 1 (or 0 on failure);
  1) (process 0)  reads (and deletes) the N-1 contributions, then publishes the round's result: committed
                  (all done) or aborted (a process failed, or did not finish within ``commit_timeout_s``);
  2) (every process) reads that one result; ``latest_step()`` then moves to the step on every process.
All of it runs on a background thread; the training thread never waits on the store unless it calls ``wait()``.
"""
from __future__ import annotations

import heapq
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Callable, Protocol

from jaxckpt.core.trim import STEPS_KEPT, trim
from jaxckpt.errors import CommitError, CoordinationError

if TYPE_CHECKING:
    from jaxckpt.core.collective import Channel

log = logging.getLogger("jaxckpt.core.coordination")

SAME_STEPS = "every process must save the same steps"  # what a round a process missed most often means

TIMES_KEPT = STEPS_KEPT  # steps whose commit timings a tracker keeps


class Coordinator(Protocol):
    """The key-value primitives jaxckpt needs from a job's coordination service."""

    process_index: int
    process_count: int

    def set(self, key: str, value: bytes) -> None:
        """Set ``key`` once (keys are never overwritten)."""

    def get(self, key: str, timeout_s: float) -> bytes:
        """Block until ``key`` is set, up to ``timeout_s``; raise TimeoutError after that."""

    def try_get(self, key: str) -> bytes | None:
        """The value of ``key`` now, or None."""

    def delete(self, key: str) -> None:
        """Remove ``key`` (no error if it is not set); it may be set again afterwards."""


class LocalCoordinator:
    """A single process's coordinator: a dict and a condition variable."""

    def __init__(self) -> None:
        self.process_index, self.process_count = 0, 1
        self._kv: dict[str, bytes] = {}
        self._cv = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._cv:
            self._kv[key] = bytes(value)
            self._cv.notify_all()

    def get(self, key: str, timeout_s: float) -> bytes:
        with self._cv:
            if not self._cv.wait_for(lambda: key in self._kv, timeout=timeout_s):
                raise TimeoutError(f"key {key!r} not set within {timeout_s}s")
            return self._kv[key]

    def try_get(self, key: str) -> bytes | None:
        with self._cv:
            return self._kv.get(key)

    def delete(self, key: str) -> None:
        with self._cv:
            self._kv.pop(key, None)

    def keys(self) -> list[str]:
        """The keys held now, sorted (rounds that are done leave none)."""
        with self._cv:
            return sorted(self._kv)


def _failed(oks: list[bool]) -> list[int]:
    return [q for q, ok in enumerate(oks) if not ok]


class CommitTracker:
    """Runs the commit protocol above for each locally finished step, in order, on its own thread."""

    def __init__(self, channel: "Channel", timeout_s: float,
                 on_commit: Callable[[int, bool], None] | None = None) -> None:
        self._channel = channel
        self._timeout = timeout_s
        self._on_commit = on_commit
        self._cv = threading.Condition()
        self._latest: int | None = None
        self._outcome: dict[int, bool] = {}
        self._settled: set[int] = set()  # decided steps whose on_commit hook (retention) has run
        # Bounded (jaxckpt.core.trim): steps up to _floor were decided and trimmed; of those, the ones that
        # did not commit stay known in _old_failed (itself bounded: a failure that old is no one's concern).
        self._floor = -1
        self._old_failed: set[int] = set()
        # step -> (local done, decided) on time.monotonic(), which all processes of one host share: the commit
        # protocol's latency is read off these (jaxckpt bench scaling). Bounded: the newest TIMES_KEPT steps.
        self._times: dict[int, tuple[float, float]] = {}
        self._why: dict[int, str] = {}  # step -> why it did not commit, for its error (the newest TIMES_KEPT)
        self._queue: queue.Queue = queue.Queue()
        # Rounds are numbered by step and must grow, so outcomes are agreed in step order: a save refused at once
        # (its slot not reserved) reports its step while an earlier step's copy is still running here, and other
        # processes agree the earlier step first; taken out of order, each side waited commit_timeout_s in a
        # different round and both steps failed. An outcome waits (``_held``) while an earlier ``expect``ed step
        # has not reported.
        self._expected: set[int] = set()
        self._held: list[tuple[int, bool, float]] = []
        self._thread = threading.Thread(target=self._run, name="jaxckpt-commit", daemon=True)
        self._thread.start()

    def latest(self) -> int | None:
        with self._cv:
            return self._latest

    def decided(self, step: int) -> bool:
        with self._cv:
            return step in self._settled or step <= self._floor

    def _outcome_of(self, step: int) -> bool:
        out = self._outcome.get(step)
        return (step not in self._old_failed) if out is None else out

    def _trim(self) -> None:
        # Holding the condition. Settled steps only: an undecided step is never dropped.
        dropped = trim(self._settled)
        if dropped:
            self._floor = max(self._floor, dropped[-1])
            for s in dropped:
                if not self._outcome.pop(s, True):
                    self._old_failed.add(s)
            trim(self._old_failed)

    def adopt(self, step: int) -> None:
        """Take ``step`` as committed by every process (agreed at start-up from the steps a node agent held)."""
        with self._cv:
            self._outcome[step] = True
            self._settled.add(step)
            if self._latest is None or step > self._latest:
                self._latest = step
            self._cv.notify_all()

    def forget(self, step: int, latest: int | None) -> None:
        """Forget decided ``step`` (every process agreed it cannot be restored: ``jaxckpt.core.fallback``); the
        newest committed step becomes ``latest`` if ``step`` was the newest. A later save may reuse the number."""
        with self._cv:
            self._outcome.pop(step, None)
            self._settled.discard(step)
            self._times.pop(step, None)
            if self._latest == step:
                self._latest = latest
            self._cv.notify_all()

    def expect(self, step: int) -> None:
        """This process will report ``step``'s outcome (its copy is under way): later steps wait for it."""
        with self._cv:
            self._expected.add(step)

    def local_done(self, step: int, ok: bool) -> None:
        """Report this process's outcome for ``step`` (called from a snapshot thread)."""
        self._queue.put((step, ok, time.monotonic()))

    def why(self, step: int) -> str | None:
        """Why ``step`` did not commit (the processes that failed it, or the round's error), if known here."""
        with self._cv:
            return self._why.get(step)

    def times(self) -> dict[int, tuple[float, float]]:
        """For the newest decided steps: (local done, decided here), in ``time.monotonic()`` seconds."""
        with self._cv:
            return dict(self._times)

    def wait(self, step: int, timeout_s: float | None = None) -> bool:
        """Block until ``step`` is decided; True if it committed. Raises CommitError on time-out."""
        timeout_s = self._timeout * 2 if timeout_s is None else timeout_s
        with self._cv:
            # Settled, not just decided: after wait() the retention of the step is done and visible.
            if not self._cv.wait_for(lambda: step in self._settled or step <= self._floor, timeout=timeout_s):
                raise CommitError(f"step {step}: no commit decision within {timeout_s:.0f}s (process 0 decides: "
                                  f"still copying, stalled or gone, or it did not save step {step}; {SAME_STEPS})")
            return self._outcome_of(step)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            heapq.heappush(self._held, item)
            with self._cv:
                self._expected.discard(item[0])
                first = min(self._expected, default=None)
            while self._held and (first is None or self._held[0][0] < first):
                self._decide(*heapq.heappop(self._held))

    def _decide(self, step: int, ok: bool, t_done: float) -> None:
        try:
            failed = self._agree(step, ok)
            why = None if not failed else \
                f"process(es) {', '.join(map(str, failed))} did not save it (their snapshot failed or was refused)"
        except Exception as e:  # noqa: BLE001 - a failed agreement aborts the step, never the job
            log.error("step %d: commit agreement failed: %s", step, e)
            missed = isinstance(e, CoordinationError) and e.missed
            why = str(e.hinted(SAME_STEPS) if missed else e)
        committed = why is None
        with self._cv:
            self._times[step] = (t_done, time.monotonic())
            if len(self._times) > TIMES_KEPT:
                del self._times[min(self._times)]
            if why is not None:
                self._why[step] = why
                if len(self._why) > TIMES_KEPT:
                    del self._why[min(self._why)]
            self._outcome[step] = committed
            if committed and (self._latest is None or step > self._latest):
                self._latest = step
            self._cv.notify_all()
        if self._on_commit is not None:
            try:
                self._on_commit(step, committed)
            except Exception:  # noqa: BLE001
                log.exception("step %d: post-commit hook failed", step)
        with self._cv:
            self._settled.add(step)
            self._trim()
            self._cv.notify_all()

    def _agree(self, step: int, ok: bool) -> list[int]:
        """The processes that did not save ``step`` (empty: it commits)."""
        # Numbered by the step: a process that never reported a step (a save refused before it) fails that
        # step's round only.
        return list(self._channel.reduce(f"commit {step}", bool(ok), _failed, timeout_s=self._timeout, number=step))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=self._timeout * 2 + 5)
