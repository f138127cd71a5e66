"""A round's wait that outlasts its grace: where each process waits, so a round that can never end fails at once.

A channel's rounds run in the same order on every process (``jaxckpt.core.collective``). A wait in round ``n``
that passes its grace (``SLOW_WAIT_S``, or a quarter of its time-out) sets ``<ns>/<channel>/at/<process>`` to the
round it waits in, deletes it when the wait ends, and meanwhile looks at that key of the process it waits for (the
leader: the follower's; a follower: the leader's). A peer waiting in a later round is past round ``n`` without the
key awaited (looked at once more), so the key would never come and the wait could only have run out: :class:`Ahead`
is raised then. Processes saving different steps (a user's bug) learn it in about a grace, not at the commit
time-out. These operations are counted apart (``slow`` in ``Collective.stats``); at most one such key lives per
process and channel, and a wait that ends within its grace does none of them.

A process that closes runs no round after its last save but the close's own: it says so first
(:func:`closing_key`, set by ``Collective.closing``), and a follower's closed channel leaves its close round's
key. A slow wait of a process that is not closing itself also looks at those: the awaited process is closing
and the key is still unset (looked at once more), so it would never come, and :class:`Closing` is raised. A
process whose peer saved a step it did not and then finished learns it at once instead of at the time-out.

Two processes that are both closing meet in the close's own rounds (the Checkpointer's close barrier, then each
channel's last round), so there a peer's closing key says nothing; what does: a follower's closed channel (it
ran every round of that channel it will run), the leader waiting in a channel's last round (the wait's key says
so: it runs no numbered round of that channel again), and a process that closed after a round of its close
failed (:func:`closed_key`, left by ``Collective.close``: a peer may still wait in a round it will never run).
Without them a close after processes ran different rounds (one process saving steps the others did not) waited
out the time-out of each round it met: 30-60 s at the defaults.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import msgpack

if TYPE_CHECKING:
    from jaxckpt.core.collective import Collective

log = logging.getLogger("jaxckpt.core.slow_wait")

__all__ = ["Ahead", "Closing", "SLOW_WAIT_S", "closed_key", "closing_key", "wait_for"]

SLOW_WAIT_S = 1.0  # a wait past this (or a quarter of its time-out) says where it waits


class Ahead(Exception):
    """The awaited peer waits in a later round (``number``, ``name``): it is past the one being waited in."""

    def __init__(self, number: int, name: str) -> None:
        super().__init__(number, name)
        self.number, self.name = number, name
        self.why = f"skipped it: it waits in round {name!r} #{number} already"  # said of the peer in the error


class Closing(Exception):
    """The awaited peer is closing (or closed the channel, or closed): it runs no more rounds of the channel but
    the close's (``why``: said of the peer in the error)."""

    def __init__(self, why: str = "is closing: it will not run this round") -> None:
        super().__init__(why)
        self.why = why


def closing_key(namespace: str, process: int) -> str:
    """The key ``process`` sets under ``namespace`` once it runs no more rounds but its close's."""
    return f"{namespace}/pub/closing/{process}"


def closed_key(namespace: str, process: int) -> str:
    """The key ``process`` leaves under ``namespace`` when its close ended after one of its rounds failed: it runs
    no round at all any more, and a peer may still wait in one."""
    return f"{namespace}/pub/closed/{process}"


def wait_for(c: "Collective", channel: str, key: str, timeout: float, n: int, name: str, peer: int,
             last: bool = False) -> bytes:
    """``key``'s value, set within ``timeout`` (else TimeoutError), for round ``n`` (named ``name``) of
    ``channel``; :class:`Ahead` once ``peer`` waits in a later round and ``key`` is still unset, :class:`Closing`
    once it is closing (see the module docstring). ``last``: the leader's wait in the channel's last round (at
    close), whose number says nothing of the others' and which only a closed peer never joins."""
    grace = min(SLOW_WAIT_S, timeout / 4)
    deadline = time.monotonic() + timeout
    c.count("gets")  # the round's own wait: only what follows is a slow wait's
    try:
        return c.coordinator.get(key, grace)
    except TimeoutError:
        pass
    here = f"{c.namespace}/{channel}/at/{c.process_index}"
    _slow(c, c.coordinator.delete, here)  # one left by a wait whose last step failed
    _slow(c, c.coordinator.set, here, msgpack.packb([n, name, last]))
    try:
        while True:
            at = _waiting_in(c, f"{c.namespace}/{channel}/at/{peer}")
            ahead = at is not None and at[0] > n and not at[2] and not last
            gone = None if ahead else _gone(c, channel, peer, at, last)
            if ahead or gone:
                c.count("slow")
                mine = c.coordinator.try_get(key)  # set just before it moved on? (an error: raised as is)
                if mine is not None:
                    return mine
                raise Ahead(at[0], at[1]) if ahead else Closing(gone)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(key)
            c.count("slow")
            try:
                return c.coordinator.get(key, min(grace, left))
            except TimeoutError:
                continue
    finally:
        _slow(c, c.coordinator.delete, here)


def _waiting_in(c: "Collective", key: str) -> tuple[int, str, bool] | None:
    """(number, name, in the channel's last round?) of the round the process of ``key`` says it waits in now, or
    None (not waiting, not said)."""
    raw = _slow(c, c.coordinator.try_get, key)
    try:
        number, name, last = msgpack.unpackb(raw, raw=False)
    except Exception:  # noqa: BLE001 - nothing said (None), or not what a wait says: no conclusion
        return None
    return (number, str(name), last is True) if isinstance(number, int) and not isinstance(number, bool) else None


def _gone(c: "Collective", channel: str, peer: int, at: tuple[int, str, bool] | None, last: bool) -> str | None:
    """Why ``peer`` will never set the awaited key of ``channel`` (said of it in the error), or None: it closed
    after a failed round; (unless this process is closing too) it is closing; it closed ``channel`` (a follower:
    its last round's key is set), or waits in that last round (the leader). In the leader's own last round only the
    first tells: the follower's last-round key is the one awaited."""
    if _slow(c, c.coordinator.try_get, closed_key(c.namespace, peer)) is not None:
        return "has closed: it will not run this round"
    if last:
        return None
    said = Closing().why
    if not c.is_closing and _slow(c, c.coordinator.try_get, closing_key(c.namespace, peer)) is not None:
        return said
    if peer == 0:
        return said if at is not None and at[2] else None
    return said if _slow(c, c.coordinator.try_get, f"{c.namespace}/{channel}/close/{peer}") is not None else None


def _slow(c: "Collective", op: Callable[..., Any], *args: Any) -> Any:
    """A key-value operation of a slow wait (counted apart); where it fails it did nothing (None)."""
    c.count("slow")
    try:
        return op(*args)
    except Exception as e:  # noqa: BLE001 - saying where one waits is advice: the wait goes on without it
        log.debug("%s%s failed: %s", getattr(op, "__name__", op), args[:1], e)
        return None
