"""Rebuild a pytree from saved chunks onto the target's shardings (which may differ from the saved ones)."""
from __future__ import annotations

import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from jaxckpt.core import hostbuf
from jaxckpt.core.box import Box
from jaxckpt.core.dtypes import dtype_from_name, dtype_name
from jaxckpt.errors import ManifestError, PlanError, TargetMismatchError
from jaxckpt.jax import shards
from jaxckpt.jax.tree import flatten, nested
from jaxckpt.core.fetch import ChunkReader, assemble
from jaxckpt.core.manifest import ArrayMeta, Manifest, check_target_paths, merge_chunks
from jaxckpt.core.plan import plan_restore

log = logging.getLogger("jaxckpt.jax.restore")


def _target_spec(path: str, t: Any) -> tuple[str, tuple[int, ...] | None, Any, Any]:
    """(kind, shape, dtype, sharding) the target asks for; kind is "jax", "numpy" or "value"."""
    if isinstance(t, (jax.ShapeDtypeStruct, jax.Array)):
        return "jax", tuple(t.shape), t.dtype, getattr(t, "sharding", None)
    if isinstance(t, np.ndarray):
        return "numpy", tuple(t.shape), t.dtype, None
    return "value", None, None, None


def _restore_array(path: str, meta: ArrayMeta, t: Any, reader: ChunkReader, step: int, process: int) -> Any:
    kind, shape, dtype, sharding = _target_spec(path, t)
    saved_dtype = dtype_from_name(meta.dtype)
    if meta.kind == "prng_key":
        key_shape, key_dtype = tuple(meta.attrs["key_shape"]), meta.attrs["key_dtype"]
        if kind != "jax" or shape != key_shape or str(dtype) != key_dtype:
            raise TargetMismatchError(f"{path}: saved a PRNG key array {key_dtype}{list(key_shape)}, target is "
                                      f"{_describe(t)}")
        data_sharding = shards.key_data_sharding(sharding, len(meta.shape) - len(key_shape)) if sharding else None
        data = _build(path, meta, saved_dtype, data_sharding, reader, step, process)
        if isinstance(data, np.ndarray):
            data = hostbuf.copy(data)  # a view of the store's buffer, which JAX on CPU would alias
        try:
            keys = jax.random.wrap_key_data(data, impl=meta.attrs["impl"])
        except (TypeError, ValueError) as e:  # an impl name or key shape this JAX cannot take
            raise ManifestError(f"{path}: step {step} saved PRNG keys this JAX cannot rebuild: {e}") from None
        return keys if sharding is None or data_sharding is not None else jax.device_put(keys, sharding)
    if kind == "value":
        if meta.kind == "numpy_scalar":
            return _build(path, meta, saved_dtype, None, reader, step, process)[()]
        raise TargetMismatchError(f"{path}: saved an array {meta.dtype}{list(meta.shape)}, target is {_describe(t)}")
    if shape != meta.shape:
        raise TargetMismatchError(f"{path}: saved shape {meta.shape}, target shape {shape}")
    if dtype_name(dtype) != meta.dtype:
        raise TargetMismatchError(f"{path}: saved dtype {meta.dtype}, target dtype {dtype_name(dtype)}")
    if kind == "numpy":
        return _build(path, meta, saved_dtype, None, reader, step, process).copy()
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return _build(path, meta, saved_dtype, sharding, reader, step, process)


def _build(path: str, meta: ArrayMeta, dtype: np.dtype, sharding: Any, reader: ChunkReader, step: int,
           process: int) -> Any:
    if sharding is None:
        whole = Box.full(meta.shape)
        (a,) = plan_restore(meta, {whole: [-1]}, step=step, prefer_process=process)
        return assemble(a, dtype, reader)
    needed = shards.needed_boxes(meta.shape, sharding)
    private = shards.needs_private_hosts(sharding)
    plans = plan_restore(meta, needed, step=step, prefer_process=process)
    # Copies and checksums release the GIL: the boxes of a sharded array are assembled in parallel.
    hosts = list(_pool().map(lambda a: assemble(a, dtype, reader, private), plans)) if len(plans) > 1 else \
        [assemble(a, dtype, reader, private) for a in plans]
    return shards.make_array(meta.shape, dtype, sharding, {a.box: h for a, h in zip(plans, hosts)}, private=private)


@functools.lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="jaxckpt-restore")


def _assembly_sharding(meta: ArrayMeta, t: Any) -> tuple[bool, Any]:
    """(wanted, sharding) the saved bytes of ``meta`` will be assembled onto for target ``t`` (None: one host
    array), as ``_restore_array`` does; not wanted when the target does not match (the build says why)."""
    kind, shape, _, sharding = _target_spec(meta.path, t)
    if meta.kind == "prng_key":
        if kind != "jax":
            return False, None
        return True, shards.key_data_sharding(sharding, len(meta.shape) - len(shape)) if sharding else None
    if kind == "value":
        return meta.kind == "numpy_scalar", None
    if shape != meta.shape:
        return False, None
    if kind == "numpy":
        return True, None
    return True, sharding if sharding is not None else jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _prefetch(pairs: list[tuple[ArrayMeta, Any]], reader: ChunkReader, step: int, process: int) -> None:
    """Fetch every saved chunk the arrays of ``pairs`` (meta, target) will be built from, once each and in
    parallel (``ChunkReader.prefetch``), before any array is assembled."""
    chunks = []
    for meta, t in pairs:
        try:
            wanted, sharding = _assembly_sharding(meta, t)
            if not wanted:
                continue
            needed = {Box.full(meta.shape): [-1]} if sharding is None else shards.needed_boxes(meta.shape, sharding)
            chunks += [(meta.path, r.chunk) for a in plan_restore(meta, needed, step=step, prefer_process=process)
                       for r in a.reads]
        except (PlanError, TargetMismatchError, ValueError, TypeError, KeyError):
            continue  # the build of this array raises the error, with its message
    reader.prefetch(chunks)


def _describe(t: Any) -> str:
    if hasattr(t, "shape") and hasattr(t, "dtype"):
        return f"{type(t).__name__} {t.dtype}{list(t.shape)}"
    return f"a {type(t).__name__} value"


def restore_tree(target: Any, manifests: list[Manifest], reader: ChunkReader, *, step: int, process: int) -> Any:
    """The pytree of ``target``'s structure filled from the snapshot described by ``manifests``."""
    own = next((m for m in manifests if m.process == process), manifests[0])
    # On CPU every restored buffer needs memory of its own (see shards.make_array): copy while verifying.
    reader.private_copies = jax.devices()[0].platform == "cpu"
    arrays = merge_chunks(manifests)
    values = {v.path: v for v in own.leaves}
    if target is None:
        _prefetch([(arrays[p], None) for p in own.order if p in arrays], reader, step, process)
        items = []
        for path in own.order:
            if path in arrays:
                meta = arrays[path]
                host = _build(path, meta, dtype_from_name(meta.dtype), None, reader, step, process).copy()
                items.append((meta.keypath, host[()] if meta.kind == "numpy_scalar" else host))
            else:
                items.append((values[path].keypath, values[path].value))
        return nested(items)
    leaves, treedef = flatten(target, classify_leaves=False)
    check_target_paths((leaf.path for leaf in leaves), own, step)
    _prefetch([(arrays[leaf.path], leaf.value) for leaf in leaves if leaf.path in arrays], reader, step, process)
    out = []
    for leaf in leaves:
        if leaf.path in arrays:
            out.append(_restore_array(leaf.path, arrays[leaf.path], leaf.value, reader, step, process))
            continue
        value = values[leaf.path].value
        kind, shape, dtype, sharding = _target_spec(leaf.path, leaf.value)
        if kind == "value":
            out.append(value)
        elif shape == () and isinstance(value, (bool, int, float)):
            host = np.asarray(value, dtype=dtype)
            out.append(host if kind == "numpy" else jax.device_put(host, sharding))
        else:
            raise TargetMismatchError(f"{leaf.path}: saved the value {value!r}, target is {_describe(leaf.value)}")
    result = jax.tree_util.tree_unflatten(treedef, out)
    jax.block_until_ready([x for x in out if isinstance(x, jax.Array)])
    return result
