"""A jax.Array's local per-device arrays, as save() views them: JAX's private fast path, guarded, or the public one.

save() must hold a zero-copy view of each shard it reads before it returns (see ``jax.snapshot``). The cheap way
in is private to jax: ``jax.Array._arrays`` (every local buffer as a single-device array, in the sharding's
``_addressable_device_assignment`` order) and ``jax.Array._fully_replicated_shard()`` (the one buffer of a fully
replicated array, without building the others). A jax release may rename or change them, so the first use checks,
on a real array, that they exist and give single-device arrays on the expected devices with the shard's shape;
if not, or if ``JAXCKPT_JAX_PUBLIC_BUFFERS=1`` says so, every save takes the public path (``addressable_shards``
and each shard's ``data``: the same buffers, the same views, a Shard object more per buffer) and one message is
logged (a warning when the check failed). The decision is kept for the process; ``recheck()`` drops it.

JAX builds a ``SingleDeviceSharding`` for every buffer it exposes through a Python function it looks up at each
call (``jax._src.sharding_impls.make_single_device_sharding``): about half of JAX's cost of exposing a buffer
(1.5 of 3.1 us a buffer here). ``shared_shardings()`` makes it answer from a per-(device, memory kind) cache
while save() takes its views: the same immutable sharding JAX would build, shared, as one NamedSharding is shared
by every array of a step. Outside that window, or when the function is not there with the expected parameters
(or the variable above is set), JAX builds its own.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
from typing import Any, Iterator

import jax

log = logging.getLogger("jaxckpt.jax.buffers")

ENV = "JAXCKPT_JAX_PUBLIC_BUFFERS"

_arrays_ok: bool | None = None  # ``_arrays`` checked (None: not yet)
_whole_ok: bool | None = None  # ``_fully_replicated_shard`` checked
_shardings_ok: bool | None = None  # ``make_single_device_sharding`` may be cached


def recheck() -> None:
    """Forget the decision (and read ``JAXCKPT_JAX_PUBLIC_BUFFERS`` again at the next use)."""
    global _arrays_ok, _whole_ok, _shardings_ok
    _arrays_ok = _whole_ok = _shardings_ok = None


def _forced() -> bool:
    return os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no")


def _single(a: Any, device: int, shape: tuple) -> bool:
    return isinstance(a, jax.Array) and [d.id for d in a.devices()] == [device] and tuple(a.shape) == shape


def _shard_shape(x: Any) -> tuple:
    return tuple(x.sharding.shard_shape(x.shape))


_VIEWS = ("save() views shards through jax's public addressable_shards, not jax.Array.%s",
          "jax.Array.%s is missing or does not give per-device arrays; save() views shards through the public "
          "addressable_shards instead (slower per shard)")


def _decide(name: str, check: Any, say: tuple[str, str] = _VIEWS) -> bool:
    if _forced():
        log.info("%s=1: " + say[0], ENV, name)
        return False
    try:
        ok = bool(check())
    except Exception as e:  # an attribute gone or changed: any failure means "not this way"
        log.debug("jax %s check failed: %r", name, e)
        ok = False
    if not ok:
        log.warning("jax %s: " + say[1], jax.__version__, name)
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


_lock = threading.Lock()
_entered = 0  # windows open (two Checkpointers may save from two threads at once)
_original: Any = None  # jax's own function (kept from the first check)
_made: dict[tuple[Any, Any], Any] = {}  # (device, memory kind) -> the sharding jax built for it


def _module() -> Any:
    from jax._src import sharding_impls
    return sharding_impls


def _cached(device: Any, *args: Any, **kw: Any) -> Any:
    """jax's ``make_single_device_sharding``, answered from ``_made`` for the calls of the form it was checked for."""
    original = _original
    if args or set(kw) - {"memory_kind"}:
        return original(device, *args, **kw)
    key = (device, kw.get("memory_kind"))
    made = _made.get(key)
    if made is None:
        made = _made[key] = original(device, **kw)
    return made


def _shardings_cacheable() -> bool:
    global _shardings_ok
    if _shardings_ok is None:
        def check() -> bool:
            global _original
            made = _module().make_single_device_sharding
            if made is _cached:  # a window of another thread is open: it already checked
                return True
            params = inspect.signature(made).parameters
            _original = made
            return list(params)[:1] == ["device"] and "memory_kind" in params \
                and params["memory_kind"].kind is inspect.Parameter.KEYWORD_ONLY
        _shardings_ok = _decide("sharding_impls.make_single_device_sharding", check, (
            "JAX builds its own sharding for every buffer save() views, not through a cached %s",
            "%s is missing or has other parameters; JAX builds its own sharding for every buffer save() views"))
    return _shardings_ok


@contextlib.contextmanager
def shared_shardings() -> Iterator[None]:
    """While open, JAX's per-buffer ``SingleDeviceSharding`` comes from a cache (see the module docstring)."""
    global _entered
    mod = _module() if _shardings_cacheable() else None
    with _lock:
        # jax's function replaced by someone else since the check: leave theirs be
        opened = mod is not None and mod.make_single_device_sharding in (_original, _cached)
        if opened:
            if _entered == 0:
                mod.make_single_device_sharding = _cached
            _entered += 1
    try:
        yield
    finally:
        if opened:
            with _lock:
                _entered -= 1
                if _entered == 0 and mod.make_single_device_sharding is _cached:
                    mod.make_single_device_sharding = _original
