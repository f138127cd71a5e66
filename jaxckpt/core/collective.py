"""Every cross-process round of jaxckpt: numbered rounds over a :class:`~jaxckpt.core.coordination.Coordinator`.

In the spirit of torch DCP's ``_DistWrapper``: one small wrapper turns "each process contributes a value, the
leader (process 0) decides, everyone gets the decision" into one call, with one code path for 1 and N processes
(one process touches no key at all), one time-out per round and one error raised on every process.

Names and keys. A :class:`Collective` belongs to one Checkpointer instance; its keys live under
``jaxckpt/<job_id>/<instance>/``. ``instance`` is the number of Collectives this process made before for the same
``job_id`` (:func:`instance_namespace`). Processes of an SPMD job create their Checkpointers in the same order, so
the numbers agree without a round (a round would need keys that are unique already): two Checkpointers with one
``job_id`` at once, one created after another's ``close()``, a ``TieredCheckpointManager`` beside a plain
``Checkpointer`` each get their own keys. A restarted job gets a new coordination service (or a new directory,
``jaxckpt.tools.filecoord``) and counts from 0 again. Within an instance, a :class:`Channel` is one thread's
sequence of rounds (``commit``, ``protect``, ``persist``, ``main``): its rounds are numbered 0, 1, 2, ... and
happen in the same order on every process; channels are independent, so the commit thread never waits for a
round of the protection thread.

One round ``n`` of channel ``ch`` (:meth:`Channel.reduce`; broadcast, all_gather and barrier are reductions;
``n`` is the channel's next number, or one the caller gives that every process agrees on, e.g. the step being
committed, so that a process that skipped a round fails only that one):
  0) (every follower) sets ``<ns>/<ch>/<n>/<process>`` to its contribution (the round's name, and its value or
     the error the callable it contributes raised);
  1) (leader)   reads and deletes those N-1 keys, waiting at most the round's time-out in all; computes the
                result (its reduce function over the N values) or the error (naming the failed processes,
                the round's name and number), and sets ``<ns>/<ch>/<n>/out``;
  2) (every follower) reads ``out`` (waiting up to twice the time-out: the leader may enter the round late) and
     returns the result or raises the same :class:`~jaxckpt.errors.CoordinationError` as the leader.
A follower sets its key of round ``n+1`` only after it has read ``out`` of round ``n``; so once the leader has
read every follower's key of round ``n+1``, ``out`` of round ``n`` is provably read and the leader deletes it.
A follower that missed a round (did not arrive in time) has its late key deleted once it is seen again; a
result some follower never acknowledges is deleted after ``MAX_UNACKED`` newer rounds. At ``close()`` each
channel that ran a round ends with a one-way :meth:`Channel.gather` (the followers' last acknowledgement), after
which the leader deletes what is left; a close in which a round failed where a peer may yet wait leaves one key
(``slow_wait.closed_key``: that peer's wait ends at once). So the live keys of an instance are O(processes)
whatever the number of steps: per channel at most N-1 contributions and one or two results. Per round the
leader does about 2(N-1) + 2 key-value operations and every follower 2 (one set, one blocking get):
:meth:`Collective.stats` counts them.

Slow waits (``jaxckpt.core.slow_wait``): a wait past its grace says which round it waits in and looks where the
process it waits for is; a round whose awaited process waits in a later one fails then ("skipped it: it waits in
round ..."), not at its time-out, and so does one whose awaited process is closing (:meth:`Collective.closing`:
it runs no more rounds but the close's; "is closing: it will not run this round"). A round that is not slow does
none of it.

Early answers (:meth:`Channel.answer_early`): the leader may settle a numbered round before it is due, with
the value it would broadcast (process 0's "skip" of a step whose protection retention made moot). It sets that
round's ``out`` at once, marked early, and never runs the round; a follower reaching the round reads ``out``
before it contributes (one ``try_get``), and one that contributed before the answer came deletes its own key
after reading it. Early results are retired as results are (deleted once every follower was seen in a later
round), but not by count: there are as many as rounds answered ahead of the leader's thread, which its owner
bounds (protection: the steps committed while one step is being protected).

Published state (:meth:`Collective.publish`, :meth:`Collective.peek`, :meth:`Collective.unpublish`) is for values
others poll when they need them (a restarted node agent's address, an early protection decision); its owners
keep it bounded (a fixed ring of two slots, or deletion once the matching round has run).

Values are msgpack (lists, dicts, str, bytes, int, float, bool, None), never pickle.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import defaultdict
from typing import Any, Callable, Protocol

import msgpack

from jaxckpt.core.coordination import Coordinator
from jaxckpt.core.slow_wait import Ahead, Closing, closed_key, closing_key, wait_for
from jaxckpt.errors import CoordinationError, named

log = logging.getLogger("jaxckpt.core.collective")

MAX_UNACKED = 64  # results kept for a follower that stopped answering before they are deleted anyway
_instances: dict[str, itertools.count] = defaultdict(itertools.count)
_instances_lock = threading.Lock()


def instance_namespace(job_id: str) -> str:
    """The key prefix of the next Checkpointer instance of ``job_id`` in this process (see the module docstring)."""
    with _instances_lock:
        return f"jaxckpt/{job_id}/{next(_instances[job_id])}"


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(raw: bytes) -> Any:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


class Collective:
    """The rounds of one Checkpointer instance over ``coordinator`` (see the module docstring)."""

    def __init__(self, coordinator: Coordinator, namespace: str, timeout_s: float) -> None:
        self.coordinator = coordinator
        self.namespace = namespace
        self.timeout_s = float(timeout_s)
        self.process_index, self.process_count = coordinator.process_index, coordinator.process_count
        self._channels: dict[str, Channel] = {}
        self._lock = threading.Lock()
        # "slow": the operations of waits past their grace (saying and reading where processes wait, polling
        # again), apart: the other counts are a round's own, whatever the processes' pace
        self._ops = {"sets": 0, "gets": 0, "try_gets": 0, "deletes": 0, "slow": 0}
        # leader: followers that missed their last round on some channel and were not seen since (a process that
        # died): close() does not wait for them
        self._absent: set[int] = set()
        self._closed = False
        self._closing = False
        # A round of this process's close failed where a peer may yet wait for this one (a follower: any round
        # once closing; the leader: a channel's last round a follower missed): close() then leaves closed_key
        self._unclean = False
        # Added to every numbered round's number (numbers derived from steps): raised when the job agreed to
        # forget steps (jaxckpt.core.fallback), so that saving those step numbers again gives new round numbers.
        self.number_shift = 0

    def shift_numbers(self, by: int) -> None:
        """Add ``by`` (> 0) to the numbers of all later numbered rounds; every process must do the same."""
        if by <= 0:
            raise ValueError(f"round numbers must grow: shift by {by}")
        with self._lock:
            self.number_shift += int(by)

    @classmethod
    def for_job(cls, coordinator: Coordinator, job_id: str, timeout_s: float) -> "Collective":
        """A Collective under a new instance namespace of ``job_id``."""
        return cls(coordinator, instance_namespace(job_id), timeout_s)

    def channel(self, name: str) -> "Channel":
        """The channel ``name`` (one thread's sequence of rounds), made on first use."""
        if "/" in name:
            raise ValueError(f"channel name {name!r} must not contain '/'")
        with self._lock:
            ch = self._channels.get(name)
            if ch is None:
                ch = self._channels[name] = Channel(self, name)
            return ch

    # ------------------------------------------------------------------------ counted key-value operations
    def count(self, op: str) -> None:
        """Count one key-value operation of kind ``op`` (a key of :meth:`stats`), done by a caller of
        ``coordinator`` (``jaxckpt.core.slow_wait``)."""
        with self._lock:
            self._ops[op] += 1

    def _set(self, key: str, value: bytes) -> None:
        self.count("sets")
        self.coordinator.set(key, value)

    def _get(self, key: str, timeout_s: float) -> bytes:
        self.count("gets")
        return self.coordinator.get(key, timeout_s)

    def _try_get(self, key: str) -> bytes | None:
        self.count("try_gets")
        return self.coordinator.try_get(key)

    def _delete(self, key: str, level: int = logging.WARNING) -> None:
        self.count("deletes")
        try:
            self.coordinator.delete(key)
        except Exception as e:  # noqa: BLE001 - a key left behind is a leak, not a failure of the round
            log.log(level, "could not delete coordination key %s: %s", key, e)

    def stats(self) -> dict[str, int]:
        """Key-value operations this process did so far (sets, gets, try_gets, deletes; slow: those of waits
        past their grace) and rounds run."""
        with self._lock:
            out = dict(self._ops)
            out["rounds"] = sum(ch.rounds for ch in self._channels.values())
        return out

    # ------------------------------------------------------------------------------------ published state
    def _pub_key(self, name: str) -> str:
        return f"{self.namespace}/pub/{name}"

    def publish(self, name: str, value: Any) -> None:
        """Set published value ``name`` (once; :meth:`unpublish` it before setting it again)."""
        self._set(self._pub_key(name), _pack(value))

    def peek(self, name: str) -> Any:
        """The published value ``name`` now, or None."""
        raw = self._try_get(self._pub_key(name))
        return None if raw is None else _unpack(raw)

    def unpublish(self, name: str) -> None:
        """Delete published value ``name`` (no error if it is not set)."""
        self._delete(self._pub_key(name))

    def publish_version(self, name: str, k: int, value: Any) -> None:
        """Publish version ``k`` (0, 1, 2, ... by one writer) of ``name`` in a ring of two slots: the slot of
        version k-2 is emptied first, so at most two keys exist and the newest complete one is always readable."""
        slot = f"{name}/{k % 2}"
        self.unpublish(slot)
        self.publish(slot, [int(k), value])

    def peek_versions(self, name: str, since: int = 0) -> list[tuple[int, Any]]:
        """The versions of ``name`` numbered ``since`` or more that are published now, oldest first (two at most:
        a reader that fell behind gets the newest two, which is what a "latest value" reader needs)."""
        out = []
        for slot in (0, 1):
            got = self.peek(f"{name}/{slot}")
            if got is not None and int(got[0]) >= since:
                out.append((int(got[0]), got[1]))
        return sorted(out, key=lambda kv: kv[0])

    def unpublish_versions(self, name: str) -> None:
        """Delete both slots of ``name``."""
        for slot in (0, 1):
            self.unpublish(f"{name}/{slot}")

    # ---------------------------------------------------------------------------------------------- close
    @property
    def is_closing(self) -> bool:
        """True once :meth:`closing` was called: this process runs no round but its close's."""
        return self._closing

    def closing(self) -> None:
        """Say that this process runs no more rounds but its close's (a barrier of its own, the channels' close):
        a peer's slow wait for a round this one never ran fails then instead of at its time-out. Call once the
        threads using the channels are done; :meth:`close` calls it first."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if self.process_count > 1:
            try:
                self._set(closing_key(self.namespace, self.process_index), _pack(True))
            except Exception as e:  # noqa: BLE001 - advice to the peers' waits: they time out without it
                log.info("could not say that process %d is closing: %s", self.process_index, e)

    def close(self, timeout_s: float | None = None) -> None:
        """End every channel that ran a round (see the module docstring); call once the threads using the
        channels are done. Waits at most ``timeout_s`` (default: the time-out) in all for the followers."""
        self.closing()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            channels = list(self._channels.values())
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        try:
            for ch in channels:
                ch._close(deadline)
        finally:
            if self.process_count > 1:
                if self._unclean:  # kept: one key a close that did not meet every peer, in its own namespace
                    try:
                        self._set(closed_key(self.namespace, self.process_index), _pack(True))
                    except Exception as e:  # noqa: BLE001 - advice to the peers' waits: they time out without it
                        log.info("could not say that process %d closed: %s", self.process_index, e)
                # at info: a service gone with the job takes its keys with it
                self._delete(closing_key(self.namespace, self.process_index), logging.INFO)


class Channel:
    """One thread's numbered rounds of a :class:`Collective` (see the module docstring)."""

    def __init__(self, collective: Collective, name: str) -> None:
        self._c = collective
        self.name = name
        self.rounds = 0  # rounds run
        self._next = 0  # the lowest number the next round may have
        self._lock = threading.Lock()
        self._unacked: list[tuple[str, set[int]]] = []  # leader: results and late keys -> followers to see first
        # leader: early results (answer_early): (round number, key, followers to see in a later round)
        self._early: list[tuple[int, str, set[int]]] = []
        self._early_lock = threading.Lock()  # not _lock: a round holds that while it waits for the followers
        self._closed = False

    @property
    def process_index(self) -> int:
        return self._c.process_index

    @property
    def process_count(self) -> int:
        return self._c.process_count

    def _describe(self, name: str, n: int) -> str:
        return f"round {name!r} #{n} of channel {self.name!r} ({self._c.namespace})"

    # ------------------------------------------------------------------------------------------ the rounds
    def reduce(self, name: str, value: Any, fn: Callable[[list], Any], timeout_s: float | None = None, *,
               number: int | None = None) -> Any:
        """Every process contributes ``value`` (or ``value()``'s result, when callable: an exception it raises
        is the contribution), the leader maps the N contributions (by process) to ``fn(values)``, every process
        returns that. Raises :class:`CoordinationError`, the same on every process, when a process raised, did
        not arrive within the time-out, or ``fn`` raised.

        ``number``: the round's number, when the caller has one every process agrees on (the step of a commit):
        larger than the channel's last, it may skip numbers, and a process that skipped a round then fails only
        that round instead of shifting every later one. Default: the channel's next number."""
        return self._round(name, value, fn, timeout_s, publish=True, number=number)

    def all_gather(self, name: str, value: Any, timeout_s: float | None = None, *, number: int | None = None
                   ) -> list:
        """Every process's ``value``, by process, on every process."""
        return self._round(name, value, list, timeout_s, publish=True, number=number)

    def broadcast(self, name: str, value: Any, timeout_s: float | None = None, *, number: int | None = None,
                  early: bool = False) -> Any:
        """The leader's ``value`` on every process (the followers' ``value`` is ignored; pass None).
        ``early``: the leader may have answered this round already (:meth:`answer_early`); a follower looks."""
        mine = value if self.process_index == 0 else None
        return self._round(name, mine, lambda xs: xs[0], timeout_s, publish=True, number=number, early=early)

    def barrier(self, name: str, timeout_s: float | None = None, *, number: int | None = None) -> None:
        """Return once every process has reached this round (or raise as :meth:`reduce` does)."""
        self._round(name, None, lambda xs: None, timeout_s, publish=True, number=number)

    def answer_early(self, name: str, value: Any, *, number: int) -> None:
        """Leader only: settle the future numbered round ``number`` (named ``name``) now with ``value``, as
        :meth:`broadcast` would return it; the leader must then not run that round itself. A follower's
        :meth:`broadcast` of it returns ``value`` without waiting (see the module docstring)."""
        if self.process_index != 0:
            raise ValueError(f"round {name!r}: only the leader (process 0) answers early")
        if self.process_count == 1:
            return
        with self._early_lock:
            n = number + self._c.number_shift
            if n < self._next:
                raise ValueError(f"{self._describe(name, n)}: answered early after it was due (next is {self._next})")
            key = f"{self._c.namespace}/{self.name}/{n}/out"
            self._c._set(key, _pack([True, value, name]))
            self._early.append((n, key, set(range(1, self.process_count))))

    def peek_early(self, name: str, *, number: int) -> tuple[bool, Any]:
        """Follower: (True, value) if the leader answered round ``number`` early, else (False, None)."""
        n = number + self._c.number_shift
        raw = self._c._try_get(f"{self._c.namespace}/{self.name}/{n}/out")
        if raw is None:
            return False, None
        got = _unpack(raw)
        return (True, got[1]) if len(got) == 3 and got[0] and got[2] == name else (False, None)

    def gather(self, name: str, value: Any, timeout_s: float | None = None) -> list | None:
        """One way: the leader returns every process's ``value``, the followers return None at once, without
        waiting (and so without learning of a failure: only the leader raises). For a decision every process
        needs, use :meth:`reduce`."""
        return self._round(name, value, list, timeout_s, publish=False)

    def _round(self, name: str, value: Any, fn: Callable[[list], Any], timeout_s: float | None,
               publish: bool, closing: bool = False, number: int | None = None, early: bool = False) -> Any:
        with self._lock:
            if self._closed:
                raise CoordinationError(f"{self._describe(name, self._next)}: the channel is closed")
            if number is not None and isinstance(number, int):
                number += self._c.number_shift
            if number is not None and (not isinstance(number, int) or number < self._next):
                raise ValueError(f"{self._describe(name, number)}: round numbers must grow (next is {self._next})")
            n = self._next if number is None else number
            self._next = n + 1
            self.rounds += 1
            timeout = self._c.timeout_s if timeout_s is None else float(timeout_s)
            ok, payload, mine = True, value, None
            if callable(value):
                try:
                    payload = value()
                except Exception as e:  # noqa: BLE001 - the contribution is the error, raised everywhere
                    ok, payload, mine = False, [type(e).__name__, str(e)], e
            try:
                if self.process_count == 1:
                    if not ok:
                        raise CoordinationError(f"{self._describe(name, n)}: process 0 raised {_said(payload)}",
                                                processes=(0,), round_name=name, round_number=n,
                                                errors={0: payload[0]})
                    return _apply(fn, [payload], self._describe(name, n), name, n)
                # the close round has keys of its own: the processes may have skipped different numbered rounds
                base = f"{self._c.namespace}/{self.name}/{'close' if closing else n}"
                if self.process_index == 0:
                    return self._lead(name, n, base, ok, payload, fn, timeout, publish, closing)
                return self._follow(name, n, base, ok, payload, timeout, publish, early)
            except CoordinationError as e:
                if self._c._closing and (closing or self.process_index != 0):
                    self._c._unclean = True
                if mine is not None:  # where it was raised, the original stays reachable as the cause
                    raise e from mine
                raise

    def _follow(self, name: str, n: int, base: str, ok: bool, payload: Any, timeout: float, publish: bool,
                early: bool = False) -> Any:
        c = self._c
        if early:  # the leader may have settled this round already (answer_early): then nothing to contribute
            raw = c._try_get(f"{base}/out")
            if raw is not None and len(got := _unpack(raw)) == 3 and got[0] and got[2] == name:
                return got[1]
        try:
            c._set(f"{base}/{self.process_index}", _pack([name, ok, payload]))
        except Exception as e:  # noqa: BLE001
            raise CoordinationError(f"{self._describe(name, n)}: process {self.process_index} could not send its "
                                    f"contribution: {e}", processes=(self.process_index,), round_name=name,
                                    round_number=n) from e
        if not publish:
            return None
        try:
            raw = wait_for(c, self.name, f"{base}/out", 2 * timeout, n, name, 0)
        except TimeoutError:
            raise CoordinationError(f"{self._describe(name, n)}: process 0 (the leader) published no result "
                                    f"within {2 * timeout:g}s", processes=(0,), round_name=name,
                                    round_number=n) from None
        except (Ahead, Closing) as a:  # the leader is past this round without a result: it never ran it
            c._delete(f"{base}/{self.process_index}")  # never to be read: take it back
            raise CoordinationError(f"{self._describe(name, n)}: process 0 (the leader) {a.why} (the processes ran "
                                    f"different rounds)", processes=(0,), round_name=name, round_number=n,
                                    errors={0: ""}) from None
        done, result, *answered = _unpack(raw)
        if answered:  # answered early: the leader never reads this round's contributions, so take ours back
            c._delete(f"{base}/{self.process_index}")
        if not done:
            failed, message, errors = result
            raise CoordinationError(message, processes=tuple(failed), round_name=name, round_number=n,
                                    errors={int(q): str(k) for q, k in errors.items()})
        return result

    def _lead(self, name: str, n: int, base: str, ok: bool, payload: Any, fn: Callable[[list], Any],
              timeout: float, publish: bool, closing: bool) -> Any:
        c, what = self._c, self._describe(name, n)
        values: list[Any] = [payload] + [None] * (self.process_count - 1)
        failures: list[tuple[int, str, str]] = [] if ok else [(0, f"raised {_said(payload)}", payload[0])]
        seen: set[int] = set()
        deadline = time.monotonic() + timeout
        for q in range(1, self.process_count):
            key = f"{base}/{q}"
            left = deadline - time.monotonic()
            try:
                # Once the time-out is spent, only look (at close: not at all for a follower gone already).
                if left > 0 and (not closing or q not in c._absent):
                    raw = wait_for(c, self.name, key, left, n, name, q, last=closing)
                else:
                    raw = c._try_get(key)
            except TimeoutError:
                raw = None
            except (Ahead, Closing) as a:  # it is past this round without its key: it would never have come
                failures.append((q, f"{a.why} (the processes ran different rounds)", ""))
                with c._lock:
                    c._absent.discard(q)
                continue
            except Exception as e:  # noqa: BLE001 - an unreachable service: this follower's part is missing
                log.warning("%s: could not read the contribution of process %d: %s", what, q, e)
                raw = None
            if raw is None:
                failures.append((q, f"did not arrive within {timeout:g}s", ""))
                with c._lock:
                    c._absent.add(q)
                self._unacked.append((key, {q}))  # its late key, deleted once it is seen again
                continue
            seen.add(q)
            with c._lock:
                c._absent.discard(q)
            c._delete(key)
            try:
                their_name, their_ok, their_payload = _unpack(raw)
            except Exception as e:  # noqa: BLE001
                failures.append((q, f"sent an unreadable contribution ({e})", ""))
                continue
            if their_name != name:
                failures.append((q, f"is in round {their_name!r} instead (the processes ran different rounds)", ""))
            elif not their_ok:
                failures.append((q, f"raised {_said(their_payload)}", str(their_payload[0])))
            else:
                values[q] = their_payload
        self._retire(seen, n)
        if failures:
            failed = tuple(q for q, _, _ in failures)
            message = f"{what}: " + "; ".join(f"process {q} {why}" for q, why, _ in failures)
            errors = {q: kind for q, _, kind in failures}
            out, error = [False, [list(failed), message, errors]], CoordinationError(
                message, processes=failed, round_name=name, round_number=n, errors=errors)
        else:
            try:
                result = _apply(fn, values, what, name, n)
            except CoordinationError as e:
                out, error = [False, [[0], str(e), e.errors]], e
            else:
                out, error = [True, result], None
        if publish:
            key = f"{base}/out"
            try:
                c._set(key, _pack(out))
            except Exception as e:  # noqa: BLE001 - the followers time out and raise naming the leader
                log.error("%s: could not publish the result: %s", what, e)
            else:
                self._unacked.append((key, set(range(1, self.process_count))))
            self._trim()
        if error is not None:
            raise error
        return out[1] if publish else values

    def _retire(self, seen: set[int], n: int) -> None:
        """Delete what the followers ``seen`` in round ``n`` have provably read (or set) by now: results of
        earlier rounds (an early answer of a later round is still to be read)."""
        keep = []
        for key, need in self._unacked:
            need -= seen
            if need:
                keep.append((key, need))
            else:
                self._c._delete(key)
        self._unacked = keep
        with self._early_lock:
            early = self._early
            self._early = [(k, key, need - seen if k < n else need) for k, key, need in early]
            done = [key for _, key, need in self._early if not need]
            self._early = [e for e in self._early if e[2]]
        for key in done:
            self._c._delete(key)

    def _trim(self) -> None:
        while len(self._unacked) > MAX_UNACKED:
            key, need = self._unacked.pop(0)
            log.warning("channel %r: deleting %s, never acknowledged by process(es) %s", self.name, key,
                        sorted(need))
            self._c._delete(key)

    def _close(self, deadline: float) -> None:
        if self.rounds == 0 or self.process_count == 1:
            self._closed = True
            return
        left = max(0.0, deadline - time.monotonic())
        try:
            self._round("close", None, list, left, publish=False, closing=True)
        except CoordinationError as e:  # a follower gone: what it never read goes anyway
            log.info("channel %r: %s", self.name, e)
        with self._lock:
            self._closed = True
            if self.process_index == 0:
                with self._early_lock:
                    early, self._early = self._early, []
                for key in [k for k, _ in self._unacked] + [k for _, k, _ in early]:
                    self._c._delete(key)
                self._unacked = []


class Rounds(Protocol):
    """Anything that runs ``all_gather`` rounds: a :class:`Channel`, a front end's restore collective."""

    def all_gather(self, name: str, value: Any) -> list:
        """Every process's ``value``, by process."""


def agree(rounds: Rounds, name: str, error: BaseException | None, value: Any = None) -> list:
    """Every process's ``value`` (one ``all_gather`` round ``name``), or, when a process failed, an error on every
    process: that process's own error, the others one of the same ``jaxckpt.errors`` class naming it. So a
    process that failed locally never leaves the others waiting in their next round."""
    got = rounds.all_gather(name, [None if error is None else [type(error).__name__, str(error)], value])
    if error is not None:
        raise error
    failed = [(p, e) for p, (e, _) in enumerate(got) if e is not None]
    if failed:
        p, (kind, message) = failed[0]
        more = f" ({len(failed) - 1} more process(es) failed)" if len(failed) > 1 else ""
        raise named(kind, f"process {p} failed in {name}{more}: {message}")
    return [v for _, v in got]


def _apply(fn: Callable[[list], Any], values: list, what: str, name: str, n: int) -> Any:
    try:
        return fn(values)
    except Exception as e:  # noqa: BLE001 - the leader's reduction failed: every process hears of it
        raise CoordinationError(f"{what}: process 0 raised {type(e).__name__}: {e} while reducing",
                                processes=(0,), round_name=name, round_number=n,
                                errors={0: type(e).__name__}) from e


def _said(payload: Any) -> str:
    """A contributed error ([exception class name, message]) as the message names it."""
    try:
        kind, text = payload
        return f"{kind}: {text}"
    except (TypeError, ValueError):
        return str(payload)
