"""The collectives the DCP reader runs on its process group: bytes only, no pickle, one error for every rank.

``torch.distributed``'s ``*_object`` collectives pickle; what one rank sends another here is always a uint8 or
int64 tensor (msgpack inside where it has structure). Every function is called by every rank of the group at
the same point; errors are agreed on before (``jaxckpt.core.collective.agree``), so a rank that fails locally
never leaves the others waiting in the next collective. The group needs a CPU backend (gloo, or
``"cpu:gloo,cuda:nccl"``), as DCP's ``async_save`` does.
"""
from __future__ import annotations

import warnings
from typing import Sequence

import torch
import torch.distributed as dist

ALIGN = 64  # chunks start at multiples of this in slots and in exchanged buffers: any dtype can view them


def align(n: int) -> int:
    """``n`` rounded up to a multiple of ALIGN."""
    return -(-n // ALIGN) * ALIGN


def byte_tensor(buf: memoryview) -> torch.Tensor:
    """A uint8 tensor over ``buf``, no copy. A read-only buffer gets one too (torch warns): it is only read."""
    if len(buf) == 0:
        return torch.empty(0, dtype=torch.uint8)
    if not buf.readonly:
        return torch.frombuffer(buf, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(buf, dtype=torch.uint8)


def broadcast_bytes(group: dist.ProcessGroup, data: bytes | None, src: int = 0) -> bytes:
    """``data`` of group rank ``src``, on every rank (the others pass None)."""
    src_global = dist.get_global_rank(group, src)
    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(n, src_global, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(n), dtype=torch.uint8)
    if int(n):
        dist.broadcast(buf, src_global, group=group)
    return buf.numpy().tobytes()


def all_to_all_ints(group: dist.ProcessGroup, send: Sequence[Sequence[int]]) -> list[list[int]]:
    """``send[r]`` goes to rank r; returns what every rank sent this one, by sender."""
    counts = torch.tensor([len(s) for s in send], dtype=torch.int64)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    flat = torch.tensor([x for s in send for x in s], dtype=torch.int64)
    out = torch.empty(int(recv_counts.sum()), dtype=torch.int64)
    dist.all_to_all_single(out, flat, [int(c) for c in recv_counts], [int(c) for c in counts], group=group)
    values, pos = out.tolist(), 0
    result = []
    for c in recv_counts.tolist():
        result.append(values[pos:pos + c])
        pos += c
    return result


def all_to_all_bytes(group: dist.ProcessGroup, send: Sequence[Sequence[memoryview]],
                     recv: Sequence[Sequence[int]]) -> list[list[memoryview]]:
    """Send the buffers ``send[r]`` to rank r; receive buffers of the sizes ``recv[r]`` from each rank r (both
    sides know the sizes beforehand, from the checkpoint metadata). Each buffer travels ALIGN-padded, so every
    received one starts aligned."""
    send_sizes = [sum(align(len(b)) for b in bufs) for bufs in send]
    recv_sizes = [sum(align(n) for n in sizes) for sizes in recv]
    out_buf = torch.empty(sum(send_sizes), dtype=torch.uint8)
    pos = 0
    for bufs in send:
        for b in bufs:
            out_buf[pos:pos + len(b)] = byte_tensor(b)
            pos += align(len(b))
    received = torch.empty(sum(recv_sizes), dtype=torch.uint8)
    dist.all_to_all_single(received, out_buf, recv_sizes, send_sizes, group=group)
    whole, pos, out = memoryview(received.numpy()), 0, []
    for sizes in recv:
        mine = []
        for n in sizes:
            mine.append(whole[pos:pos + n])
            pos += align(n)
        out.append(mine)
    return out
