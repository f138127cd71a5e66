"""Rebuild a pytree from saved chunks onto the target's shardings (which may differ from the saved ones)."""
from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np

from jaxckpt.box import Box
from jaxckpt.dtypes import dtype_from_name, dtype_name
from jaxckpt.errors import TargetMismatchError
from jaxckpt.jax import shards
from jaxckpt.jax.tree import flatten, nested
from jaxckpt.fetch import ChunkReader, assemble
from jaxckpt.manifest import ArrayMeta, Manifest, merge_chunks
from jaxckpt.plan import plan_restore

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
            data = data.copy()  # a view of the store's buffer; JAX on CPU would alias it (see shards.make_array)
        keys = jax.random.wrap_key_data(data, impl=meta.attrs["impl"])
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
    boxes = {a.box: assemble(a, dtype, reader) for a in plan_restore(meta, needed, step=step, prefer_process=process)}
    return shards.make_array(meta.shape, dtype, sharding, boxes)


def _describe(t: Any) -> str:
    if hasattr(t, "shape") and hasattr(t, "dtype"):
        return f"{type(t).__name__} {t.dtype}{list(t.shape)}"
    return f"a {type(t).__name__} value"


def restore_tree(target: Any, manifests: list[Manifest], reader: ChunkReader, *, step: int, process: int) -> Any:
    """The pytree of ``target``'s structure filled from the snapshot described by ``manifests``."""
    own = next((m for m in manifests if m.process == process), manifests[0])
    arrays = merge_chunks(manifests)
    values = {v.path: v for v in own.leaves}
    if target is None:
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
    saved = set(own.order)
    for leaf in leaves:
        if leaf.path not in saved:
            raise TargetMismatchError(f"{leaf.path}: in the target but not in step {step} (structure differs)")
    wanted = {leaf.path for leaf in leaves}
    for path in own.order:
        if path not in wanted:
            raise TargetMismatchError(f"{path}: saved in step {step} but missing from the target (structure differs)")
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
