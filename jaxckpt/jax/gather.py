"""The JAX collective of a multi-process restore: staging arrays laid out as saved, one jitted program to the target.

For the arrays ``jaxckpt.core.routes`` routes to the collective, each process has filled its rows of a staging
array (one row per device of the target's sharding, the chunks it contributes flattened back to back). Here
those rows become one global ``jax.Array`` per array (``make_array_from_single_device_arrays``, each device
holding its own row: no process touches another's bytes), and one jitted program per device set forms every
array: it all-gathers the staging array over the devices (XLA's all-gather: gloo between CPU processes, the
device interconnect on accelerators), cuts each saved chunk out of its row and writes it into place, with
``out_shardings`` the targets' shardings, so each device keeps only its shard. The program is a pure copy
(slices and dynamic-update-slices, no arithmetic): the result is bit for bit the saved bytes.

On CPU devices, several per process, the program runs on one device per process instead (XLA:CPU runs one gloo
rank per device, so a gather over every device would carry each byte to a process once per local device), and
each process copies its devices' shards out of its whole copy in memory.

Programs are cached per (chunk table, shardings): a second restore of the same layout compiles nothing.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxckpt.core import hostbuf
from jaxckpt.core.box import Box
from jaxckpt.core.collective import Channel
from jaxckpt.core.dtypes import dtype_from_name
from jaxckpt.core.restore import Staged
from jaxckpt.core.routes import TargetLayout
from jaxckpt.jax import shards

log = logging.getLogger("jaxckpt.jax.gather")

__all__ = ["JaxGather", "gather_for", "target_layout"]


@functools.lru_cache(maxsize=4096)
def target_layout(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> TargetLayout | None:
    """Every device of ``sharding`` with its process and box (None when it is not a sharding over devices)."""
    try:
        index = sharding.devices_indices_map(shape)
    except Exception:  # noqa: BLE001 - a sharding kind that cannot list its devices: fetched as before
        return None
    # In the sharding's own device order: a jitted program's inputs must have the outputs' device assignment.
    order = getattr(sharding, "_device_assignment", None) or sorted(index, key=lambda d: d.id)
    return TargetLayout(tuple((d.id, d.process_index, Box.from_index(index[d], shape)) for d in order))


def gather_for(engine: Any, target: Any, config: Any = None) -> "JaxGather | None":
    """The collective of ``engine``'s restore onto ``target`` in a multi-process job (``Config.restore_collective``
    of ``config``, default the engine's), else None. Every process restoring the same target must get one (the
    restore's rounds are collective)."""
    if target is None or engine.process_count <= 1 or not (config or engine.config).restore_collective:
        return None
    return JaxGather(engine.collective.channel("restore"))


class JaxGather:
    """The collective (:class:`jaxckpt.core.restore.Gather`) of a JAX job: rounds on ``channel``, programs on
    the devices."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self.process_count = jax.process_count()
        self._me = jax.process_index()
        self._devices = {d.id: d for d in jax.devices()}

    def all_gather(self, name: str, value: Any) -> list:
        return self._channel.all_gather(name, value)

    def local_devices(self, devices: Sequence[int]) -> list[int]:
        return [d for d in devices if self._devices[d].process_index == self._me]

    def run(self, staged: list[Staged]) -> list[Any]:
        """The target arrays of ``staged``: one program per device set, in an order every process agrees on."""
        out: list[Any] = [None] * len(staged)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, s in enumerate(staged):
            groups.setdefault(s.route.devices, []).append(i)
        for devices, idx in sorted(groups.items()):
            mine = self.local_devices(devices)
            if not mine:  # a program over other processes' devices only: ours hold no shard of these arrays
                for i in idx:
                    s = staged[i]
                    out[i] = jax.make_array_from_single_device_arrays(s.request.meta.shape, s.request.target, [],
                                                                      dtype=dtype_from_name(s.request.meta.dtype))
                continue
            per_process = [self._devices[d].process_index for d in devices]
            if all(self._devices[d].platform == "cpu" for d in devices) and len(set(per_process)) < len(devices):
                self._by_leaders(devices, idx, staged, out)
                continue
            mesh = Mesh(np.array([self._devices[d] for d in devices]), ("rows",))
            rows_sharding = NamedSharding(mesh, PartitionSpec("rows"))
            inputs = []
            for i in idx:
                s = staged[i]
                shards = jax.device_put([s.rows[d].reshape(1, -1) for d in mine], [self._devices[d] for d in mine])
                inputs.append(jax.make_array_from_single_device_arrays(
                    (len(devices), s.route.row_elements), rows_sharding, shards))
            program = _program(tuple(_signature(staged[i]) for i in idx), mesh,
                               tuple(staged[i].request.target for i in idx))
            for i, x in zip(idx, program(*inputs)):
                out[i] = x
        return out


    def _by_leaders(self, devices: tuple[int, ...], idx: list[int], staged: list[Staged], out: list[Any]) -> None:
        """CPU devices, several per process: XLA:CPU runs a collective rank per device, so an all-gather over
        every device would carry each byte to each process once per local device. Here every array's rows of a
        process are laid side by side in one byte row on one device of that process, one all-gather program
        (the same for every layout of that many bytes: compiled once) carries them all, and each process cuts
        the saved chunks out of its copy into the whole arrays in memory and hands its devices their shards."""
        procs: list[int] = []
        leader: dict[int, int] = {}
        slot: dict[int, tuple[int, int]] = {}  # device id -> (its process's row, its place in that row)
        for d in devices:
            p = self._devices[d].process_index
            if p not in leader:
                leader[p] = d
                procs.append(p)
            slot[d] = (procs.index(p), sum(1 for r, _ in slot.values() if r == procs.index(p)))
        k = 1 + max(j for _, j in slot.values())
        layout, total = [], 0  # per array: (byte offset of its part of the row, elements per device row, dtype)
        for i in idx:
            n, dtype = staged[i].route.row_elements, dtype_from_name(staged[i].request.meta.dtype)
            layout.append((total, n, dtype))
            total += -(-k * n * dtype.itemsize // 64) * 64
        row = hostbuf.empty(total, np.uint8)
        for i, (off, n, dtype) in zip(idx, layout):
            for d in self.local_devices(devices):
                at = off + slot[d][1] * n * dtype.itemsize
                row[at:at + n * dtype.itemsize] = staged[i].rows[d].view(np.uint8)
        mesh = Mesh(np.array([self._devices[leader[p]] for p in procs]), ("rows",))
        staging = jax.make_array_from_single_device_arrays(
            (len(procs), total), NamedSharding(mesh, PartitionSpec("rows")),
            [jax.device_put(row.reshape(1, -1), self._devices[leader[self._me]])])
        gathered = _all_gather(mesh, total)(staging)
        rows = np.asarray(gathered.addressable_data(0))  # every process's row, in this process's memory
        for i, (off, n, dtype) in zip(idx, layout):
            meta, target = staged[i].request.meta, staged[i].request.target
            mine = rows[:, off:off + k * n * dtype.itemsize].view(dtype)
            full = hostbuf.empty(meta.shape, dtype)
            for c in staged[i].route.contributions:
                r, j = slot[devices[c.row]]
                box = c.chunk.box
                full[box.slices()] = mine[r, j * n + c.offset:j * n + c.offset + box.size].reshape(box.shape)
            boxes = shards.needed_boxes(meta.shape, target)
            # ``full`` is memory of its own: each distinct box may be given to a device as it is
            out[i] = shards.make_array(meta.shape, dtype, target, {b: full[b.slices()] for b in boxes}, private=True)


@functools.lru_cache(maxsize=64)
def _all_gather(mesh: Mesh, nbytes: int) -> Any:
    """A program that gathers one byte row per device of ``mesh`` onto every one of them."""
    return jax.jit(lambda rows: rows, out_shardings=NamedSharding(mesh, PartitionSpec()))


def _signature(s: Staged) -> tuple:
    """What the program of one array depends on: shape, dtype, row length and where each chunk goes."""
    meta, r = s.request.meta, s.route
    return (tuple(meta.shape), dtype_from_name(meta.dtype), r.row_elements,
            tuple((c.row, c.offset, c.chunk.box.start, c.chunk.box.stop) for c in r.contributions))


@functools.lru_cache(maxsize=64)
def _program(signatures: tuple, mesh: Mesh, shardings: tuple) -> Any:
    replicated = NamedSharding(mesh, PartitionSpec())

    def form(*staging):
        outs = []
        for (shape, dtype, _, pieces), rows in zip(signatures, staging):
            rows = jax.lax.with_sharding_constraint(rows, replicated)  # the all-gather
            full = jnp.zeros(shape, dtype)
            for row, offset, start, stop in pieces:
                box_shape = tuple(b - a for a, b in zip(start, stop))
                n = int(np.prod(box_shape, dtype=np.int64))
                piece = jax.lax.slice(rows, (row, offset), (row + 1, offset + n)).reshape(box_shape)
                full = jax.lax.dynamic_update_slice(full, piece, start)
            outs.append(full)
        return tuple(outs)
    return jax.jit(form, out_shardings=shardings)
