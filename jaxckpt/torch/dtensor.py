"""DTensor placements <-> planner boxes: where each rank's local shard sits in the global tensor.

torch shards a tensor dimension like ``torch.chunk`` (chunks of ``ceil(n / k)``, the last ones shorter or
empty) and applies a mesh's placements left to right, so a dimension sharded over two mesh dimensions is cut
by the first, then each piece by the second. :func:`shard_box` computes that for any mesh coordinate, so every
process can list the boxes of all ranks (the planner's global view) without a collective.
"""
from __future__ import annotations

import itertools
from typing import Callable, Sequence

import torch
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement as TorchPlacement

from jaxckpt.core.box import Box
from jaxckpt.errors import UnsupportedLeafError
from jaxckpt.core.plan import Placement


def check_placements(path: str, placements: Sequence[TorchPlacement], spec: object | None = None) -> None:
    """Refuse placements a box cannot describe: partial sums, strided shards, a non-default shard order."""
    for p in placements:
        if type(p) not in (Shard, Replicate):
            raise UnsupportedLeafError(f"{path}: DTensor placement {p} is not supported (only Shard and "
                                       f"Replicate; redistribute Partial/_StridedShard tensors before saving)")
    order = getattr(spec, "shard_order", None)
    if spec is not None and order is not None and hasattr(type(spec), "compute_default_shard_order"):
        if tuple(order) != tuple(type(spec).compute_default_shard_order(tuple(placements))):
            raise UnsupportedLeafError(f"{path}: DTensor with a non-default shard order {order} is not supported")


def shard_box(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
              placements: Sequence[TorchPlacement]) -> Box:
    """The box of the global tensor held at mesh coordinate ``coord`` (pure; Shard and Replicate only)."""
    start, stop = [0] * len(shape), [int(s) for s in shape]
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, Shard):
            continue
        d, k, r = p.dim % len(shape), int(mesh_shape[mesh_dim]), int(coord[mesh_dim])
        n = stop[d] - start[d]
        full = -(-n // k) if n % k else n // k
        lo = min(n, full * r)
        hi = min(n, lo + full)
        start[d], stop[d] = start[d] + lo, start[d] + max(lo, hi)
    return Box(tuple(start), tuple(stop))


def mesh_ranks(mesh: DeviceMesh) -> list[tuple[tuple[int, ...], int]]:
    """(coordinate, global rank) of every position of ``mesh``."""
    grid = mesh.mesh
    return [(c, int(grid[c])) for c in itertools.product(*(range(s) for s in grid.shape))]


def placements(path: str, shape: tuple[int, ...], mesh: DeviceMesh, dplacements: Sequence[TorchPlacement],
               process_of: Callable[[int], int]) -> tuple[Placement, ...]:
    """The planner's placements of a DTensor: one per mesh position, on the process ``process_of(rank)`` (which is
    also its device id: one local shard per process).

    Positions with the same box on several processes are replicas, which the planner splits between them.
    """
    check_placements(path, dplacements)
    out = []
    for coord, rank in mesh_ranks(mesh):
        proc = process_of(rank)
        out.append(Placement(shard_box(shape, mesh.mesh.shape, coord, dplacements), proc, proc))
    return tuple(sorted(out, key=lambda p: (p.process, p.box)))


def local_box(path: str, shape: tuple[int, ...], mesh: DeviceMesh,
              dplacements: Sequence[TorchPlacement]) -> Box | None:
    """The box this rank holds, or None when this rank is not in ``mesh``."""
    check_placements(path, dplacements)
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    return shard_box(shape, mesh.mesh.shape, coord, dplacements)


def local_tensor(path: str, x: DTensor) -> tuple[Box | None, torch.Tensor]:
    """(box, local shard) of a DTensor on this rank; the shard's shape is checked against the box."""
    check_placements(path, x.placements, getattr(x, "_spec", None))
    box = local_box(path, tuple(x.shape), x.device_mesh, x.placements)
    local = x.to_local()
    if box is not None and tuple(local.shape) != box.shape:
        raise UnsupportedLeafError(f"{path}: local shard of shape {tuple(local.shape)} does not match the box "
                                   f"{box.start}..{box.stop} its placements {x.placements} give (padded shard?)")
    return box, local


def describe(x: DTensor) -> str:
    """A short description for manifests and ``jaxckpt inspect``."""
    mesh = x.device_mesh
    names = mesh.mesh_dim_names or tuple(f"d{i}" for i in range(mesh.ndim))
    dims = ",".join(f"{n}={s}" for n, s in zip(names, mesh.mesh.shape))
    return f"DTensor(mesh({dims}), {tuple(str(p) for p in x.placements)})"


def make(local: torch.Tensor, like: DTensor) -> DTensor:
    """A DTensor with ``like``'s mesh, placements, global shape and stride around this rank's ``local``."""
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())
