"""A jax.Array's local per-device arrays, as save() views them: JAX's private fast path, guarded, or the public one.

save() must hold a zero-copy view of each shard it reads before it returns (see ``jax.snapshot``). The cheap way
in is private to jax: ``jax.Array._arrays`` (every local buffer as a single-device array, in the sharding's
``_addressable_device_assignment`` order) and ``jax.Array._fully_replicated_shard()`` (the one buffer of a fully
replicated array, without building the others). A jax release may rename or change them, so the first use checks,
on a real array, that they exist and give single-device arrays on the expected devices with the shard's shape;
if not, or if ``JAXCKPT_JAX_PUBLIC_BUFFERS=1`` says so, every save takes the public path (``addressable_shards``
and each shard's ``data``: the same buffers, the same views, a Shard object more per buffer) and one message is
logged (a warning when the check failed). The decision is kept for the process; ``recheck()`` drops it.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import jax

log = logging.getLogger("jaxckpt.jax.buffers")

ENV = "JAXCKPT_JAX_PUBLIC_BUFFERS"

_arrays_ok: bool | None = None  # ``_arrays`` checked (None: not yet)
_whole_ok: bool | None = None  # ``_fully_replicated_shard`` checked


def recheck() -> None:
    """Forget the decision (and read ``JAXCKPT_JAX_PUBLIC_BUFFERS`` again at the next use)."""
    global _arrays_ok, _whole_ok
    _arrays_ok = _whole_ok = None


def _forced() -> bool:
    return os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no")


def _single(a: Any, device: int, shape: tuple) -> bool:
    return isinstance(a, jax.Array) and [d.id for d in a.devices()] == [device] and tuple(a.shape) == shape


def _shard_shape(x: Any) -> tuple:
    return tuple(x.sharding.shard_shape(x.shape))


def _decide(name: str, check: Any) -> bool:
    if _forced():
        log.info("%s=1: save() views shards through jax's public addressable_shards, not %s", ENV, name)
        return False
    try:
        ok = bool(check())
    except Exception as e:  # an attribute gone or changed: any failure means "not this way"
        log.debug("jax.Array.%s check failed: %r", name, e)
        ok = False
    if not ok:
        log.warning("jax %s: jax.Array.%s is missing or does not give per-device arrays; save() views shards "
                    "through the public addressable_shards instead (slower per shard)", jax.__version__, name)
    return ok


def private_arrays(x: Any, order: tuple[int, ...]) -> bool:
    """Whether ``x._arrays`` may be used (checked once, on ``x``, whose local devices are ``order``)."""
    global _arrays_ok
    if _arrays_ok is None:
        shape = _shard_shape(x)
        _arrays_ok = _decide("_arrays", lambda: len(x._arrays) == len(order) and all(
            _single(a, d, shape) for a, d in zip(x._arrays, order)))
    return _arrays_ok


def private_whole(x: Any) -> bool:
    """Whether ``x._fully_replicated_shard()`` may be used (checked once, on a fully replicated ``x``)."""
    global _whole_ok
    if _whole_ok is None:
        def check() -> bool:
            one = x._fully_replicated_shard()
            return len(one.devices()) == 1 and next(iter(one.devices())) in x.sharding.device_set \
                and tuple(one.shape) == tuple(x.shape)
        _whole_ok = _decide("_fully_replicated_shard", check)
    return _whole_ok


def public(x: Any, devices: tuple[int, ...]) -> list[Any]:
    """The single-device arrays of ``x`` on ``devices`` (ids, in that order), through public jax API only."""
    by_id = {s.device.id: s.data for s in x.addressable_shards}
    return [by_id[d] for d in devices]
