"""Python's cyclic garbage collector, paused while jaxckpt makes many objects at once that live on together.

A save's views of a many-leaf state, a decoded manifest (a few objects per chunk), a restore's plans and arrays:
thousands of tracked objects made in one go. With the collector on they set off a young collection every 700
allocations, survive it, are promoted to the middle generation and then the oldest, where they count towards a
full collection, which examines every object of the process (JAX's included: 85-100 ms in a relaunched
4,096-leaf job's first restore, measured). :func:`paused` turns the collector off for the block and, at its
end, hands what it did not look at to the oldest generation unexamined: reference counts still free what dies,
and nothing made in the block counts towards a full collection.

Several threads may pause it at once (a restore beside a save): the collector comes back on when the last one
leaves, and only if it was on when the first one came in.
"""
from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

_lock = threading.Lock()
_inside = 0  # blocks in flight, all threads
_was_enabled = False  # the collector's state when the first of them came in


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector off for the block; what the block made goes to the oldest generation unexamined."""
    global _inside, _was_enabled
    with _lock:
        if _inside == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _inside += 1
    try:
        yield
    finally:
        with _lock:
            _inside -= 1
            if _inside == 0 and _was_enabled:
                skip_young()
                gc.enable()


def skip_young() -> None:
    """Move every tracked object to the oldest generation unexamined, when a young collection is due.

    ``freeze`` + ``unfreeze`` does it in constant time and counts none of them towards a full collection; the
    caller's young objects move with them (a cycle among them is freed by the next full collection instead of a
    young one). Not done when the caller froze objects itself (``unfreeze`` would release them)."""
    young = gc.get_threshold()[0]
    if young and gc.get_count()[0] > young and not gc.get_freeze_count():
        gc.freeze()
        gc.unfreeze()
