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
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import msgpack

if TYPE_CHECKING:
    from jaxckpt.core.collective import Collective

log = logging.getLogger("jaxckpt.core.slow_wait")

__all__ = ["Ahead", "Closing", "SLOW_WAIT_S", "closing_key", "wait_for"]

SLOW_WAIT_S = 1.0  # a wait past this (or a quarter of its time-out) says where it waits


class Ahead(Exception):
    """The awaited peer waits in a later round (``number``, ``name``): it is past the one being waited in."""

    def __init__(self, number: int, name: str) -> None:
        super().__init__(number, name)
        self.number, self.name = number, name
        self.why = f"skipped it: it waits in round {name!r} #{number} already"  # said of the peer in the error


class Closing(Exception):
    """The awaited peer is closing (or closed the channel): it runs no more rounds of the channel but the close."""

    why = "is closing: it will not run this round"


def closing_key(namespace: str, process: int) -> str:
    """The key ``process`` sets under ``namespace`` once it runs no more rounds but its close's."""
    return f"{namespace}/pub/closing/{process}"


def wait_for(c: "Collective", channel: str, key: str, timeout: float, n: int, name: str, peer: int) -> bytes:
    """``key``'s value, set within ``timeout`` (else TimeoutError), for round ``n`` (named ``name``) of
    ``channel``; :class:`Ahead` once ``peer`` waits in a later round and ``key`` is still unset, :class:`Closing`
    once it is closing (see the module docstring)."""
    grace = min(SLOW_WAIT_S, timeout / 4)
    deadline = time.monotonic() + timeout
    c.count("gets")  # the round's own wait: only what follows is a slow wait's
    try:
        return c.coordinator.get(key, grace)
    except TimeoutError:
        pass
    here = f"{c.namespace}/{channel}/at/{c.process_index}"
    _slow(c, c.coordinator.delete, here)  # one left by a wait whose last step failed
    _slow(c, c.coordinator.set, here, msgpack.packb([n, name]))
    try:
        while True:
            at = _waiting_in(c, f"{c.namespace}/{channel}/at/{peer}")
            ahead = at is not None and at[0] > n
            if ahead or (not c.is_closing and _gone(c, channel, peer)):
                c.count("slow")
                mine = c.coordinator.try_get(key)  # set just before it moved on? (an error: raised as is)
                if mine is not None:
                    return mine
                raise Ahead(*at) if ahead else Closing(peer)
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


def _waiting_in(c: "Collective", key: str) -> tuple[int, str] | None:
    """(number, name) of the round the process of ``key`` says it waits in now, or None (not waiting, not said)."""
    raw = _slow(c, c.coordinator.try_get, key)
    try:
        number, name = msgpack.unpackb(raw, raw=False)
    except Exception:  # noqa: BLE001 - nothing said (None), or not what a wait says: no conclusion
        return None
    return (number, str(name)) if isinstance(number, int) and not isinstance(number, bool) else None


def _gone(c: "Collective", channel: str, peer: int) -> bool:
    """True once ``peer`` said it is closing, or (a follower) closed ``channel``: its close round's key is set."""
    if _slow(c, c.coordinator.try_get, closing_key(c.namespace, peer)) is not None:
        return True
    return peer != 0 and _slow(c, c.coordinator.try_get, f"{c.namespace}/{channel}/close/{peer}") is not None


def _slow(c: "Collective", op: Callable[..., Any], *args: Any) -> Any:
    """A key-value operation of a slow wait (counted apart); where it fails it did nothing (None)."""
    c.count("slow")
    try:
        return op(*args)
    except Exception as e:  # noqa: BLE001 - saying where one waits is advice: the wait goes on without it
        log.debug("%s%s failed: %s", getattr(op, "__name__", op), args[:1], e)
        return None
