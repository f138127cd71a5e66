"""The torch collective of a multi-rank restore: each rank's staging row, one ``all_gather_into_tensor``.

For the plain tensors ``jaxckpt.core.routes`` routes to the collective (every rank needs the whole tensor, each
rank saved 1/R of it), each rank has filled one staging row per array with the chunks it reads from its own
node's memory. The rows of every such array are laid back to back into one byte buffer per rank (the same
layout on every rank: routes are computed alike everywhere) and one ``all_gather_into_tensor`` on the process
group carries them all, on the device the group's backend serves (the CPU where it has a CPU backend, as gloo;
else the rank's GPU, as an NCCL-only group: the rows go up and the gathered bytes come back); each rank then
cuts every saved chunk out of the gathered rows into the whole tensor. A pure copy of bytes: the result is bit for bit the saved array.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from jaxckpt.core.box import Box
from jaxckpt.core.collective import Channel
from jaxckpt.core.dtypes import dtype_from_name
from jaxckpt.core.restore import Staged
from jaxckpt.core.routes import TargetLayout
from jaxckpt.torch.coordination import collective_device

log = logging.getLogger("jaxckpt.torch.gather")

__all__ = ["TorchGather", "replicated_layout"]


def replicated_layout(shape: tuple[int, ...], world: int) -> TargetLayout:
    """Every rank of ``world`` needs the whole array (a plain tensor target): one row per rank, by rank."""
    full = Box.full(shape)
    return TargetLayout(tuple((r, r, full) for r in range(world)))


class TorchGather:
    """The collective (:class:`jaxckpt.core.restore.Gather`) of a torch job on the default process group:
    rounds on ``channel``, bytes by ``all_gather_into_tensor``."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self.process_count = dist.get_world_size()
        self._rank = dist.get_rank()
        self._device = collective_device()  # a ConfigError now, before any byte is read, where there is none

    def all_gather(self, name: str, value: Any) -> list:
        return self._channel.all_gather(name, value)

    def local_devices(self, devices: Sequence[int]) -> list[int]:
        return [d for d in devices if d == self._rank]

    def run(self, staged: list[Staged]) -> list[Any]:
        """Every array of ``staged``, made by its request's ``target`` from the whole host array."""
        world = self.process_count
        sizes, offsets, total = [], [], 0
        for s in staged:
            if tuple(s.route.devices) != tuple(range(world)):
                raise ValueError(f"{s.request.meta.path}: a torch collective needs one row per rank, by rank")
            n = s.route.row_elements * dtype_from_name(s.request.meta.dtype).itemsize
            offsets.append(total)
            sizes.append(n)
            total += -(-n // 64) * 64  # rows aligned, so each array's rows view as its dtype
        mine = torch.empty(total, dtype=torch.uint8)
        view = mine.numpy()
        for s, off, n in zip(staged, offsets, sizes):
            view[off:off + n] = s.rows[self._rank].view(np.uint8)
        gathered = torch.empty(world * total, dtype=torch.uint8, device=self._device)
        dist.all_gather_into_tensor(gathered, mine.to(self._device))
        rows = gathered.cpu().numpy().reshape(world, total)
        out = []
        for s, off, n in zip(staged, offsets, sizes):
            meta = s.request.meta
            dtype = dtype_from_name(meta.dtype)
            mine_rows = rows[:, off:off + n].view(dtype)
            full = np.empty(meta.shape, dtype)
            for c in s.route.contributions:
                box = c.chunk.box
                full[box.slices()] = mine_rows[c.row, c.offset:c.offset + box.size].reshape(box.shape)
            out.append(s.request.target(full))
        return out
