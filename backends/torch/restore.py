"""Fill a torch state dict from an opened snapshot, onto the target's dtypes, devices and DTensor placements.

Works on any snapshot the core can open, whichever front end saved it: a JAX snapshot restores into torch
tensors and a torch one into ``jax.Array``s through the same manifests and the same planner.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from jaxckpt.core.box import Box
from jaxckpt.core.dtypes import dtype_from_name
from jaxckpt.errors import TargetMismatchError
from jaxckpt.core.fetch import ChunkReader, assemble
from jaxckpt.core.manifest import ArrayMeta, Manifest, check_target_paths, merge_chunks
from jaxckpt.core.plan import HOST, plan_restore

from jaxckpt.backends.torch import dtensor as dt
from jaxckpt.backends.torch.dtypes import dtype_name, from_numpy, torch_dtype
from jaxckpt.backends.torch.tree import Leaf, flatten, nested, rebuild

log = logging.getLogger("jaxckpt.backends.torch.restore")

ROW_KINDS = ("torch_rng", "per_rank")  # saved as (process_count, *shape): one row per process


class _Ctx:
    def __init__(self, arrays: dict[str, ArrayMeta], reader: ChunkReader, step: int, process: int,
                 in_place: bool) -> None:
        self.arrays, self.reader, self.step, self.process, self.in_place = arrays, reader, step, process, in_place

    def fill(self, meta: ArrayMeta, box: Box, dest: torch.Tensor) -> None:
        """Copy ``box`` of the saved array ``meta`` into ``dest`` (a tensor of the box's shape, any device)."""
        dtype = dtype_from_name(meta.dtype)
        (a,) = plan_restore(meta, {box: [HOST]}, step=self.step, prefer_process=self.process)
        with torch.no_grad():
            for r in a.reads:
                src = self.reader.array(meta.path, r.chunk, dtype)[r.chunk.box.relative(r.part) + (Ellipsis,)]
                dest[a.box.relative(r.part) + (Ellipsis,)].copy_(from_numpy(src, dest.dtype))

    def host(self, meta: ArrayMeta, box: Box, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(box.shape, dtype=dtype)
        self.fill(meta, box, out)
        return out

    def row(self, path: str, meta: ArrayMeta) -> Box:
        """The box of this process's row of a per-process array."""
        if self.process >= meta.shape[0]:
            raise TargetMismatchError(f"{path}: step {self.step} holds per-process values of {meta.shape[0]} "
                                      f"processes; this is process {self.process}")
        return Box((self.process,) + (0,) * (len(meta.shape) - 1), (self.process + 1,) + tuple(meta.shape[1:]))


def _describe(x: Any) -> str:
    if isinstance(x, DTensor):
        return f"DTensor {x.dtype}{list(x.shape)} {tuple(str(p) for p in x.placements)}"
    if isinstance(x, torch.Tensor):
        return f"tensor {x.dtype}{list(x.shape)} on {x.device}"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{type(x).__name__} {x.dtype}{list(x.shape)}"
    return f"a {type(x).__name__} value"


def _saved(meta: ArrayMeta) -> str:
    return f"{meta.kind} array {meta.dtype}{list(meta.shape)}"


def _check(path: str, meta: ArrayMeta, shape: tuple[int, ...], dtype: torch.dtype, target: Any) -> None:
    if meta.kind in ROW_KINDS:
        raise TargetMismatchError(f"{path}: saved a per-process {_saved(meta)}, target is {_describe(target)} "
                                  f"(use a PerRank or torch.Generator target)")
    if tuple(meta.shape) != shape:
        raise TargetMismatchError(f"{path}: saved shape {tuple(meta.shape)}, target shape {shape}")
    name = dtype_name(dtype, path)
    if name != meta.dtype:
        raise TargetMismatchError(f"{path}: saved dtype {meta.dtype}, target dtype {name}")


def _tensor(ctx: _Ctx, path: str, meta: ArrayMeta, t: torch.Tensor) -> torch.Tensor:
    _check(path, meta, tuple(t.shape), t.dtype, t)
    whole = Box.full(meta.shape)
    if ctx.in_place and t.device.type != "meta":
        ctx.fill(meta, whole, t)
        return t
    out = ctx.host(meta, whole, t.dtype)
    if t.device.type not in ("cpu", "meta"):
        out = out.to(t.device)
    if isinstance(t, torch.nn.Parameter):
        out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
    return out


def _dtensor(ctx: _Ctx, path: str, meta: ArrayMeta, t: DTensor) -> DTensor:
    _check(path, meta, tuple(t.shape), t.dtype, t)
    box, local = dt.local_tensor(path, t)
    if box is None:  # this rank is not in the target's mesh: nothing to hold
        return t
    if ctx.in_place:
        ctx.fill(meta, box, local)
        return t
    host = ctx.host(meta, box, t.dtype)
    return dt.make(host.to(local.device) if local.device.type != "cpu" else host, t)


def _rows(ctx: _Ctx, path: str, meta: ArrayMeta, like: torch.Tensor, dest: torch.Tensor | None) -> torch.Tensor:
    """This process's row of a per-process array (or a whole 1-d uint8 state) into a tensor shaped like ``like``."""
    if meta.kind in ROW_KINDS:
        box = ctx.row(path, meta)
        shape = tuple(meta.shape[1:])
    else:
        box, shape = Box.full(meta.shape), tuple(meta.shape)
    if shape != tuple(like.shape) or meta.dtype != dtype_name(like.dtype, path):
        raise TargetMismatchError(f"{path}: saved {_saved(meta)} (rows of {meta.dtype}{list(shape)}), target is "
                                  f"{_describe(like)}")
    host = ctx.host(meta, box, like.dtype).reshape(shape)
    if dest is not None:
        with torch.no_grad():
            dest.copy_(host)
        return dest
    return host.to(like.device) if like.device.type not in ("cpu", "meta") else host


def _restore_leaf(ctx: _Ctx, leaf: Leaf, values: dict) -> Any:
    path, t, kind = leaf.path, leaf.value, leaf.kind
    meta = ctx.arrays.get(path)
    if meta is None:
        value = values[path].value
        if kind == "value":
            return value
        if kind == "tensor" and t.dim() == 0 and isinstance(value, (bool, int, float)):
            if ctx.in_place and t.device.type != "meta":
                with torch.no_grad():
                    t.fill_(value)
                return t
            return torch.tensor(value, dtype=t.dtype, device="cpu" if t.device.type == "meta" else t.device)
        if kind in ("numpy", "numpy_scalar") and np.shape(t) == () and isinstance(value, (bool, int, float)):
            return np.asarray(value, dtype=t.dtype) if kind == "numpy" else t.dtype.type(value)
        raise TargetMismatchError(f"{path}: saved the value {value!r}, target is {_describe(t)}")
    if kind == "tensor":
        return _tensor(ctx, path, meta, t)
    if kind == "dtensor":
        return _dtensor(ctx, path, meta, t)
    if kind == "generator":
        state = t.get_state()
        t.set_state(_rows(ctx, path, meta, state, None))
        return t
    if kind == "per_rank":
        return _rows(ctx, path, meta, t.tensor, t.tensor if ctx.in_place and t.tensor.device.type != "meta" else None)
    if kind in ("numpy", "numpy_scalar"):
        shape, dtype = np.shape(t), np.asarray(t).dtype
        # Saved in native byte order (as from JAX): a big-endian target gets its values in its own order.
        if meta.kind in ROW_KINDS or tuple(meta.shape) != shape or \
                dtype_from_name(meta.dtype) != dtype.newbyteorder("="):
            raise TargetMismatchError(f"{path}: saved {_saved(meta)}, target is {_describe(t)}")
        (a,) = plan_restore(meta, {Box.full(meta.shape): [HOST]}, step=ctx.step, prefer_process=ctx.process)
        host = assemble(a, dtype_from_name(meta.dtype), ctx.reader).reshape(shape)  # numpy: str/bytes too
        if kind == "numpy_scalar":
            return host.astype(dtype)[()]
        if ctx.in_place:
            np.copyto(t, host)
            return t
        return host.astype(dtype, copy=True)
    if meta.kind == "numpy_scalar" and meta.shape == ():  # a numpy scalar saved from JAX, target a Python number
        return ctx.host(meta, Box.full(()), torch_dtype(meta.dtype, path)).item()
    raise TargetMismatchError(f"{path}: saved {_saved(meta)}, target is {_describe(t)}")


def _untargeted(ctx: _Ctx, meta: ArrayMeta) -> Any:
    box = ctx.row(meta.path, meta) if meta.kind in ROW_KINDS else Box.full(meta.shape)
    shape = tuple(meta.shape[1:]) if meta.kind in ROW_KINDS else tuple(meta.shape)
    try:
        dtype = torch_dtype(meta.dtype, meta.path)
    except Exception:  # a dtype torch lacks (int4, float8_e3m4, ...): numpy keeps it
        dtype = None
    if dtype is None or meta.kind in ("numpy", "numpy_scalar"):
        (a,) = plan_restore(meta, {box: [HOST]}, step=ctx.step, prefer_process=ctx.process)
        host = assemble(a, dtype_from_name(meta.dtype), ctx.reader).copy().reshape(shape)
        return host[()] if meta.kind == "numpy_scalar" else host
    return ctx.host(meta, box, dtype).reshape(shape)


def restore_state(target: Any, manifests: list[Manifest], reader: ChunkReader, *, step: int, process: int,
                  in_place: bool = False) -> Any:
    """The state saved at ``step``, shaped like ``target`` (see :meth:`Checkpointer.restore`)."""
    own = next((m for m in manifests if m.process == process), manifests[0])
    arrays = merge_chunks(manifests)
    values = {v.path: v for v in own.leaves}
    ctx = _Ctx(arrays, reader, step, process, in_place)
    with warnings.catch_warnings():
        # Saved chunks are read-only views of the store; torch warns about wrapping them, but we only read.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        if target is None:
            items = []
            for path in own.order:
                if path in arrays:
                    items.append((arrays[path].keypath, _untargeted(ctx, arrays[path])))
                else:
                    items.append((values[path].keypath, values[path].value))
            return nested(items)
        leaves = flatten(target)
        check_target_paths((leaf.path for leaf in leaves), own, step)
        out = iter([_restore_leaf(ctx, leaf, values) for leaf in leaves])
        return rebuild(target, lambda _: next(out))
