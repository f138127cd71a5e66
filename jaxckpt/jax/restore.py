"""Rebuild a pytree from saved chunks onto the target's shardings (which may differ from the saved ones).

The JAX side of the one restore driver (``jaxckpt.core.restore``): each target leaf becomes an
``ArrayRequest`` (the boxes its sharding puts on this process's devices, and how to make the ``jax.Array`` from
them) or a ready value; the driver plans, fetches, assembles and reports.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import jax
import numpy as np

from jaxckpt.core import hostbuf
from jaxckpt.core.box import Box
from jaxckpt.core.dtypes import dtype_from_name, dtype_name
from jaxckpt.core.fetch import ChunkReader
from jaxckpt.core.manifest import ArrayMeta, LeafMeta, Manifest, check_target_paths, merge_chunks
from jaxckpt.core.restore import ArrayRequest, Gather, restore_leaves
from jaxckpt.errors import ManifestError, TargetMismatchError
from jaxckpt.jax import shards
from jaxckpt.jax.gather import target_layout
from jaxckpt.core.keypath import nested
from jaxckpt.jax.tree import flatten

log = logging.getLogger("jaxckpt.jax.restore")

# A target leaf meaning "do not read this saved leaf" (partial restores, jaxckpt.orbax.layout); it comes back as is.
SKIP = type("Skip", (), {"__repr__": lambda self: "SKIP"})()


def _target_spec(path: str, t: Any) -> tuple[str, tuple[int, ...] | None, Any, Any]:
    """(kind, shape, dtype, sharding) the target asks for; kind is "jax", "numpy" or "value"."""
    if isinstance(t, (jax.ShapeDtypeStruct, jax.Array)):
        return "jax", tuple(t.shape), t.dtype, getattr(t, "sharding", None)
    if isinstance(t, np.ndarray):
        return "numpy", tuple(t.shape), t.dtype, None
    return "value", None, None, None


def _on(meta: ArrayMeta, sharding: Any, then: Callable[[Any], Any] = lambda x: x, *,
        collective: bool = False) -> ArrayRequest:
    """A request for the saved bytes of ``meta`` laid out on ``sharding`` (None: one host array, possibly a
    view of the saved bytes), handed to ``then``. ``collective``: the array itself is the leaf, so the restore
    may form it with the collective (``jaxckpt.jax.gather``) instead."""
    if sharding is None:
        return ArrayRequest.whole(meta, then)
    dtype, private = dtype_from_name(meta.dtype), shards.needs_private_hosts(sharding)

    def make(hosts: dict[Box, np.ndarray]) -> Any:
        return then(shards.make_array(meta.shape, dtype, sharding, hosts, private=private))
    layout = target_layout(meta.shape, sharding) if collective else None
    return ArrayRequest(meta, shards.needed_boxes(meta.shape, sharding), make, private=private, layout=layout,
                        target=sharding)


def _keys(path: str, meta: ArrayMeta, t: Any, step: int) -> ArrayRequest:
    """A typed PRNG key array: its raw key data laid out like the target, wrapped with the saved impl."""
    kind, shape, dtype, sharding = _target_spec(path, t)
    key_shape, key_dtype = tuple(meta.attrs["key_shape"]), meta.attrs["key_dtype"]
    if kind != "jax" or shape != key_shape or str(dtype) != key_dtype:
        raise TargetMismatchError(f"{path}: saved a PRNG key array {key_dtype}{list(key_shape)}, target is "
                                  f"{_describe(t)}")
    data_sharding = shards.key_data_sharding(sharding, len(meta.shape) - len(key_shape)) if sharding else None

    def wrap(data: Any) -> Any:
        if isinstance(data, np.ndarray):
            data = hostbuf.copy(data)  # a view of the store's buffer, which JAX on CPU would alias
        try:
            keys = jax.random.wrap_key_data(data, impl=meta.attrs["impl"])
        except (TypeError, ValueError) as e:  # an impl name or key shape this JAX cannot take
            raise ManifestError(f"{path}: step {step} saved PRNG keys this JAX cannot rebuild: {e}") from None
        return keys if sharding is None or data_sharding is not None else jax.device_put(keys, sharding)
    return _on(meta, data_sharding, wrap)


def _request(path: str, meta: ArrayMeta, t: Any, step: int) -> ArrayRequest:
    """What target leaf ``t`` needs of the saved array ``meta``; TargetMismatchError when it cannot hold it."""
    if meta.kind == "prng_key":
        return _keys(path, meta, t, step)
    kind, shape, dtype, sharding = _target_spec(path, t)
    if kind == "value":
        if meta.kind == "numpy_scalar":
            return ArrayRequest.whole(meta, lambda host: host[()])
        raise TargetMismatchError(f"{path}: saved an array {meta.dtype}{list(meta.shape)}, target is {_describe(t)}")
    if shape != meta.shape:
        raise TargetMismatchError(f"{path}: saved shape {meta.shape}, target shape {shape}")
    if dtype_name(dtype) != meta.dtype:
        raise TargetMismatchError(f"{path}: saved dtype {meta.dtype}, target dtype {dtype_name(dtype)}")
    if kind == "numpy":
        return ArrayRequest.whole(meta, lambda host: host.copy())
    if np.dtype(dtype).itemsize == 8 and np.dtype(dtype).kind in "iuf" and not jax.config.jax_enable_x64:
        # JAX would silently narrow it (int64 2**40+5 -> int32 5, float64 1e300 -> inf)
        raise TargetMismatchError(f"{path}: a jax.Array target of dtype {dtype_name(dtype)} needs jax_enable_x64 "
                                  f"(JAX would narrow it to 32 bits); restore it onto a numpy target or enable x64")
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return _on(meta, sharding, collective=True)


def _value(path: str, saved: LeafMeta, t: Any) -> Any:
    """A leaf saved by value (no bytes), as target leaf ``t`` asks for it."""
    value = saved.value
    kind, shape, dtype, sharding = _target_spec(path, t)
    if kind == "value":
        return value
    if shape == () and isinstance(value, (bool, int, float)):
        host = np.asarray(value, dtype=dtype)
        return host if kind == "numpy" else jax.device_put(host, sharding)
    raise TargetMismatchError(f"{path}: saved the value {value!r}, target is {_describe(t)}")


def _untargeted(meta: ArrayMeta) -> ArrayRequest:
    """The saved array as a numpy array of its own (a numpy scalar for a saved numpy scalar)."""
    scalar = meta.kind == "numpy_scalar"
    return ArrayRequest.whole(meta, lambda host: host.copy()[()] if scalar else host.copy())


def _describe(t: Any) -> str:
    if hasattr(t, "shape") and hasattr(t, "dtype"):
        return f"{type(t).__name__} {t.dtype}{list(t.shape)}"
    return f"a {type(t).__name__} value"


def restore_tree(target: Any, manifests: list[Manifest], reader: ChunkReader, *, step: int, process: int,
                 gather: Gather | None = None) -> Any:
    """The pytree of ``target``'s structure filled from the snapshot described by ``manifests``; with
    ``gather`` (a job of several processes), replicated arrays are formed by the collective
    (``jaxckpt.core.routes``), and every process must restore the same target."""
    own = next((m for m in manifests if m.process == process), manifests[0])
    # On CPU every restored buffer needs memory of its own (see shards.make_array): copy while verifying.
    reader.private_copies = jax.devices()[0].platform == "cpu"
    arrays = merge_chunks(manifests)
    values = {v.path: v for v in own.leaves}
    if target is None:
        out = restore_leaves((_untargeted(arrays[p]) if p in arrays else values[p].value for p in own.order),
                             reader, step=step, process=process)
        keypaths = [arrays[p].keypath if p in arrays else values[p].keypath for p in own.order]
        return nested(list(zip(keypaths, out)))
    leaves, treedef = flatten(target, classify_leaves=False)
    check_target_paths((leaf.path for leaf in leaves), own, step)
    out = restore_leaves((SKIP if leaf.value is SKIP else _request(leaf.path, arrays[leaf.path], leaf.value, step)
                          if leaf.path in arrays else _value(leaf.path, values[leaf.path], leaf.value)
                          for leaf in leaves),
                         reader, step=step, process=process, gather=gather)
    result = jax.tree_util.tree_unflatten(treedef, out)
    t0 = time.perf_counter()
    jax.block_until_ready([x for x in out if isinstance(x, jax.Array)])
    reader.report.timeline.record("device_put", t0, time.perf_counter(), 0, 0)  # the transfers' tail
    return result
