"""Fill a torch state dict from an opened snapshot, onto the target's dtypes, devices and DTensor placements.

Works on any snapshot the core can open, whichever front end saved it: a JAX snapshot restores into torch
tensors and a torch one into ``jax.Array``s through the same manifests and the same restore driver
(``jaxckpt.core.restore``): each target leaf becomes an ``ArrayRequest`` (the box this rank needs, and how to make
its tensor from the host box) or a ready value.
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
from torch.autograd.graph import increment_version

from jaxckpt.core.box import Box
from jaxckpt.core.dtypes import dtype_from_name
from jaxckpt.core.fetch import ChunkReader
from jaxckpt.core.manifest import ArrayMeta, Manifest, check_target_paths, merge_chunks
from jaxckpt.core.restore import ArrayRequest, restore_leaves
from jaxckpt.errors import TargetMismatchError

from jaxckpt.torch.gather import replicated_layout
from jaxckpt.torch.dtypes import dtype_name, from_numpy, numpy_view, torch_dtype
from jaxckpt.torch.tree import Leaf, flatten, is_dtensor, rebuild
from jaxckpt.core.keypath import nested

if TYPE_CHECKING:  # DTensor's module is imported only by a state holding one (jaxckpt.torch.tree.is_dtensor)
    from torch.distributed.tensor import DTensor

log = logging.getLogger("jaxckpt.torch.restore")

ROW_KINDS = ("torch_rng", "per_rank")  # saved as (process_count, *shape): one row per process


def _describe(x: Any) -> str:
    if is_dtensor(x):
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


def _row(path: str, meta: ArrayMeta, step: int, process: int) -> Box:
    """The box of this process's row of a per-process array."""
    if process >= meta.shape[0]:
        raise TargetMismatchError(f"{path}: step {step} holds per-process values of {meta.shape[0]} "
                                  f"processes; this is process {process}")
    return Box((process,) + (0,) * (len(meta.shape) - 1), (process + 1,) + tuple(meta.shape[1:]))


def _into(meta: ArrayMeta, dest: torch.Tensor, then: Any, box: Box | None = None,
          done: Callable[[torch.Tensor], Any] | None = None) -> ArrayRequest:
    """Copy ``box`` (default: the whole array) into ``dest`` (any device) and return ``then`` (or ``done(dest)``).
    A contiguous CPU tensor is assembled into directly (one copy, however many saved chunks make the box);
    others get the host box copied in."""
    finish = (lambda: done(dest)) if done is not None else (lambda: then)
    if dest.device.type == "cpu" and dest.is_contiguous() and not dest.is_conj() and not dest.is_neg():
        def written(_: np.ndarray) -> Any:
            # Written through a numpy view: tell autograd, as the in-place copy_ it replaces would have.
            increment_version(dest)
            return finish()
        return ArrayRequest.whole(meta, written, box=box, out=numpy_view(dest))

    def copy(host: np.ndarray) -> Any:
        with torch.no_grad():
            dest.copy_(from_numpy(host, dest.dtype))
        return finish()
    return ArrayRequest.whole(meta, copy, box=box)


def _host(meta: ArrayMeta, dtype: torch.dtype, device: torch.device, then: Callable[[torch.Tensor], Any],
          box: Box | None = None, shape: tuple[int, ...] | None = None) -> ArrayRequest:
    """A new tensor of ``box`` (default: the whole array) on ``device`` (meta: CPU), reshaped to ``shape``.

    On CPU the box is assembled straight into a new tensor; for another device the host box may be a view of
    the saved bytes, copied once by the transfer."""
    if device.type in ("cpu", "meta"):
        new = torch.empty((box or Box.full(meta.shape)).shape, dtype=dtype)
        return _into(meta, new, None, box, lambda t: then(t.reshape(shape) if shape is not None else t))

    def make(host: np.ndarray) -> Any:
        t = from_numpy(host, dtype)
        return then((t.reshape(shape) if shape is not None else t).to(device))
    return ArrayRequest.whole(meta, make, box=box)


def _tensor(path: str, meta: ArrayMeta, t: torch.Tensor, in_place: bool) -> ArrayRequest:
    _check(path, meta, tuple(t.shape), t.dtype, t)
    if in_place and t.device.type != "meta":
        return _into(meta, t, t)

    def wrap(out: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.nn.Parameter):
            return torch.nn.Parameter(out, requires_grad=t.requires_grad)
        return out
    return _host(meta, t.dtype, t.device, wrap)


def _dtensor(path: str, meta: ArrayMeta, t: DTensor, in_place: bool) -> Any:
    from jaxckpt.torch import dtensor as dt

    _check(path, meta, tuple(t.shape), t.dtype, t)
    box, local = dt.local_tensor(path, t)
    if box is None:  # this rank is not in the target's mesh: nothing to hold
        return t
    if in_place:
        return _into(meta, local, t, box)
    return _host(meta, t.dtype, local.device, lambda host: dt.make(host, t), box=box)


def _rows(path: str, meta: ArrayMeta, like: torch.Tensor, dest: torch.Tensor | None, step: int, process: int,
          then: Callable[[torch.Tensor], Any] = lambda x: x) -> ArrayRequest:
    """This process's row of a per-process array (or a whole 1-d uint8 state) into a tensor shaped like ``like``."""
    if meta.kind in ROW_KINDS:
        box = _row(path, meta, step, process)
        shape = tuple(meta.shape[1:])
    else:
        box, shape = Box.full(meta.shape), tuple(meta.shape)
    if shape != tuple(like.shape) or meta.dtype != dtype_name(like.dtype, path):
        raise TargetMismatchError(f"{path}: saved {_saved(meta)} (rows of {meta.dtype}{list(shape)}), target is "
                                  f"{_describe(like)}")
    if dest is None:
        return _host(meta, like.dtype, like.device, then, box=box, shape=shape)

    def copy(host: np.ndarray) -> Any:
        with torch.no_grad():
            dest.copy_(from_numpy(host, like.dtype).reshape(shape))
        return then(dest)
    return ArrayRequest.whole(meta, copy, box=box)


def _generator(path: str, meta: ArrayMeta, g: torch.Generator, step: int, process: int) -> ArrayRequest:
    def set_state(state: torch.Tensor) -> torch.Generator:
        g.set_state(state)
        return g
    return _rows(path, meta, g.get_state(), None, step, process, set_state)


def _numpy(path: str, meta: ArrayMeta, t: Any, kind: str, in_place: bool) -> ArrayRequest:
    shape, dtype = np.shape(t), np.asarray(t).dtype
    # Saved in native byte order (as from JAX): a big-endian target gets its values in its own order.
    if meta.kind in ROW_KINDS or tuple(meta.shape) != shape or dtype_from_name(meta.dtype) != dtype.newbyteorder("="):
        raise TargetMismatchError(f"{path}: saved {_saved(meta)}, target is {_describe(t)}")

    def make(host: np.ndarray) -> Any:  # numpy: str/bytes too
        host = host.reshape(shape)
        if kind == "numpy_scalar":
            return host.astype(dtype)[()]
        if in_place:
            np.copyto(t, host)
            return t
        return host.astype(dtype, copy=True)
    return ArrayRequest.whole(meta, make)


def _value(path: str, value: Any, t: Any, kind: str, in_place: bool) -> Any:
    """A leaf saved by value (no bytes), as target leaf ``t`` asks for it."""
    if kind == "value":
        return value
    if kind == "tensor" and t.dim() == 0 and isinstance(value, (bool, int, float)):
        if in_place and t.device.type != "meta":
            with torch.no_grad():
                t.fill_(value)
            return t
        return torch.tensor(value, dtype=t.dtype, device="cpu" if t.device.type == "meta" else t.device)
    if kind in ("numpy", "numpy_scalar") and np.shape(t) == () and isinstance(value, (bool, int, float)):
        return np.asarray(value, dtype=t.dtype) if kind == "numpy" else t.dtype.type(value)
    raise TargetMismatchError(f"{path}: saved the value {value!r}, target is {_describe(t)}")


def _request(leaf: Leaf, arrays: dict[str, ArrayMeta], values: dict, step: int, process: int,
             in_place: bool) -> Any:
    path, t, kind = leaf.path, leaf.value, leaf.kind
    meta = arrays.get(path)
    if meta is None:
        return _value(path, values[path].value, t, kind, in_place)
    if kind == "tensor":
        return _tensor(path, meta, t, in_place)
    if kind == "dtensor":
        return _dtensor(path, meta, t, in_place)
    if kind == "generator":
        return _generator(path, meta, t, step, process)
    if kind == "per_rank":
        dest = t.tensor if in_place and t.tensor.device.type != "meta" else None
        return _rows(path, meta, t.tensor, dest, step, process)
    if kind in ("numpy", "numpy_scalar"):
        return _numpy(path, meta, t, kind, in_place)
    if meta.kind == "numpy_scalar" and meta.shape == ():  # a numpy scalar saved from JAX, target a Python number
        return _host(meta, torch_dtype(meta.dtype, path), torch.device("cpu"), lambda x: x.item())
    raise TargetMismatchError(f"{path}: saved {_saved(meta)}, target is {_describe(t)}")


def _untargeted(meta: ArrayMeta, step: int, process: int) -> ArrayRequest:
    box = _row(meta.path, meta, step, process) if meta.kind in ROW_KINDS else None
    shape = tuple(meta.shape[1:]) if meta.kind in ROW_KINDS else tuple(meta.shape)
    try:
        dtype = torch_dtype(meta.dtype, meta.path)
    except Exception:  # a dtype torch lacks (int4, float8_e3m4, ...): numpy keeps it
        dtype = None
    if dtype is None or meta.kind in ("numpy", "numpy_scalar"):
        scalar = meta.kind == "numpy_scalar"

        def make(host: np.ndarray) -> Any:
            host = host.copy().reshape(shape)
            return host[()] if scalar else host
        return ArrayRequest.whole(meta, make, box=box)
    return _host(meta, dtype, torch.device("cpu"), lambda x: x, box=box, shape=shape)


def _by_collective(req: Any, leaf: Leaf, in_place: bool, world: int) -> Any:
    """A plain tensor's request that may also be formed by the collective (``jaxckpt.torch.gather``): every
    rank needs the whole tensor; ``target`` makes the leaf from the whole host array."""
    if not isinstance(req, ArrayRequest) or leaf.kind != "tensor" or req.meta.kind in ROW_KINDS:
        return req
    t = leaf.value

    def finish(full: np.ndarray) -> Any:
        if in_place and t.device.type != "meta":
            with torch.no_grad():
                t.copy_(from_numpy(full, t.dtype))
            return t
        out = from_numpy(full, t.dtype)  # ``full`` is memory of its own
        if t.device.type not in ("cpu", "meta"):
            out = out.to(t.device)
        return torch.nn.Parameter(out, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else out
    return dataclasses.replace(req, layout=replicated_layout(tuple(req.meta.shape), world), target=finish)


def restore_state(target: Any, manifests: list[Manifest], reader: ChunkReader, *, step: int, process: int,
                  in_place: bool = False, gather: Any = None) -> Any:
    """The state saved at ``step``, shaped like ``target`` (see :meth:`Checkpointer.restore`); with ``gather``
    (a ``TorchGather``, every rank restoring the same target), plain tensors are formed by the collective."""
    own = next((m for m in manifests if m.process == process), manifests[0])
    arrays = merge_chunks(manifests)
    values = {v.path: v for v in own.leaves}
    with warnings.catch_warnings():
        # Saved chunks are read-only views of the store; torch warns about wrapping them, but we only read.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        if target is None:
            out = restore_leaves((_untargeted(arrays[p], step, process) if p in arrays else values[p].value
                                  for p in own.order), reader, step=step, process=process)
            keypaths = [arrays[p].keypath if p in arrays else values[p].keypath for p in own.order]
            return nested(list(zip(keypaths, out)))
        leaves = flatten(target)
        check_target_paths((leaf.path for leaf in leaves), own, step)
        world = gather.process_count if gather is not None else 1
        requests = (_request(leaf, arrays, values, step, process, in_place) for leaf in leaves)
        if gather is not None:
            requests = (_by_collective(r, leaf, in_place, world) for r, leaf in zip(requests, leaves))
        out = iter(restore_leaves(requests, reader, step=step, process=process, gather=gather))
        return rebuild(target, lambda _: next(out))
