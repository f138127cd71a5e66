"""The collectives the DCP reader runs on its process group: bytes only, no pickle, one error for every rank.

``torch.distributed``'s ``*_object`` collectives pickle; what one rank sends another here is always a uint8 or
int64 tensor (msgpack inside where it has structure). Every function is called by every rank of the group at
the same point, and :func:`agree` turns one rank's failure into an error raised on all of them, so a rank that
fails locally never leaves the others waiting in the next collective. The group needs a CPU backend (gloo, or
``"cpu:gloo,cuda:nccl"``), as DCP's ``async_save`` does.
"""
from __future__ import annotations

import warnings
from typing import Sequence

import msgpack
import torch
import torch.distributed as dist

from jaxckpt import errors
from jaxckpt.errors import JaxckptError

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


def remote_error(name: str, message: str) -> JaxckptError:
    """The jaxckpt error class ``name`` (JaxckptError if it names none) with ``message``."""
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, JaxckptError)):
        cls = JaxckptError
    return cls(message)


def broadcast_bytes(group: dist.ProcessGroup, data: bytes | None, src: int = 0) -> bytes:
    """``data`` of group rank ``src``, on every rank (the others pass None)."""
    src_global = dist.get_global_rank(group, src)
    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(n, src_global, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(n), dtype=torch.uint8)
    if int(n):
        dist.broadcast(buf, src_global, group=group)
    return buf.numpy().tobytes()


def allgather_bytes(group: dist.ProcessGroup, data: bytes) -> list[bytes]:
    """Every rank's ``data``, in group rank order."""
    world = dist.get_world_size(group)
    n = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.empty(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    lengths = [int(s) for s in sizes]
    top = max(lengths)
    if top == 0:
        return [b""] * world
    mine = torch.zeros(top, dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty(top, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [t[:k].numpy().tobytes() for t, k in zip(out, lengths)]


def agree(group: dist.ProcessGroup | None, error: BaseException | None, what: str) -> None:
    """Raise on every rank if ``error`` is set on any: the rank's own error, else the first failing rank's,
    re-created as the same jaxckpt error class with the rank in its message."""
    if group is None:
        if error is not None:
            raise error
        return
    mine = b"" if error is None else msgpack.packb([type(error).__name__, str(error)])
    failures = [(r, p) for r, p in enumerate(allgather_bytes(group, mine)) if p]
    if error is not None:
        raise error
    if failures:
        rank, payload = failures[0]
        name, message = msgpack.unpackb(payload)
        more = f" ({len(failures) - 1} more ranks failed)" if len(failures) > 1 else ""
        raise remote_error(name, f"{what} failed on rank {rank}{more}: {message}")


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
