"""Level 1 for torch: the host bytes of each tensor at ``save()``, and what ``wait_for_reads()`` waits for.

- CPU tensors: zero-copy numpy views; the snapshot's worker threads copy them into the store's slot. A view
  sees later in-place writes (``optimizer.step()``, BatchNorm statistics in a training forward), so nothing may
  write the state until those copies are done: :meth:`HostCopies.wait_for_reads` blocks until then.
- CUDA tensors: copied into preallocated pinned host buffers on a dedicated copy stream that first waits for
  the current stream (so it copies the values as of ``save()``), with an event per copy; the workers wait on
  the event, then read the pinned buffer. :meth:`wait_for_reads` makes the current stream wait for the copies,
  so kernels queued after it (the optimizer step) run after the copy, and the CPU does not block.
- Other devices: a synchronous ``.cpu()`` copy at ``save()``.
"""
from __future__ import annotations

import logging
from concurrent.futures import wait
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from jaxckpt.core.engine import SaveHandle
from jaxckpt.errors import CommitError

from jaxckpt.torch.dtypes import numpy_view

log = logging.getLogger("jaxckpt.torch.host")

Fetch = tuple[np.ndarray | Callable[[], np.ndarray], Callable[[], None] | None]


@dataclass
class Reads:
    """The reads one save still makes from live tensors."""

    handle: SaveHandle | None = None
    views: bool = False  # CPU views: wait for the workers' copies
    events: list = field(default_factory=list)  # CUDA: the copy stream's events, in order
    pinned: list = field(default_factory=list)  # pinned buffers to return to the pool once copied
    waited: bool = False


def _parity_read(handle: SaveHandle, timeout: float | None) -> bool:
    """Whether the save's parity stripes (Config.protection) have read its host shards, waiting up to ``timeout``.

    They are computed from the same views (or pinned buffers) as the snapshot's chunks, on their own thread and
    possibly after the local copy is done: an in-place update before then would put torn bytes into the parity.
    """
    fut = getattr(handle, "parity", None)
    if fut is None:
        return True
    try:
        wait([fut], timeout)
    except Exception:  # noqa: BLE001 - a failed parity is the protection's business (logged, step unprotected)
        pass
    return fut.done()


class HostCopies:
    """Hands the engine shard reads of tensors on the host and tracks the reads still running, one save at a time."""

    def __init__(self) -> None:
        self._pending: list[Reads] = []
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pool: dict[tuple, list[torch.Tensor]] = {}

    def begin(self) -> Reads:
        """Start collecting the reads of one save (and recycle pinned buffers of finished ones)."""
        self._reclaim()
        reads = Reads()
        self._pending.append(reads)
        return reads

    def shard_read(self, t: torch.Tensor, reads: Reads, lead: bool = False) -> Fetch:
        """(fetch, start) for the engine: ``t``'s bytes as of now, as a host array or a ``fetch()`` returning
        them (``lead``: with a new first axis of size 1, for per-process rows)."""
        t = t.detach()
        if t.device.type == "cpu":
            view = numpy_view(t)
            view = view.reshape((1,) + view.shape) if lead else view
            reads.views = True
            return view, None  # the array itself: nothing per tensor for the collector (core.copier.Chunks)
        if t.device.type == "cuda" and torch.cuda.is_available():
            return self._cuda_shard_read(t, reads, lead)
        host = numpy_view(t.cpu())  # unknown accelerators: a synchronous copy is always correct
        host = host.reshape((1,) + host.shape) if lead else host
        return host, None

    def _cuda_shard_read(self, t: torch.Tensor, reads: Reads, lead: bool) -> Fetch:
        stream = self._streams.get(t.device)
        if stream is None:
            stream = self._streams[t.device] = torch.cuda.Stream(device=t.device)
        key = (tuple(t.shape), t.dtype)
        free = self._pool.get(key)
        host = free.pop() if free else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        reads.pinned.append((key, host))
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        t.record_stream(stream)  # the caching allocator must not reuse t's memory before the copy ran
        reads.events.append((t.device, event))

        def fetch() -> np.ndarray:
            event.synchronize()
            view = numpy_view(host)
            return view.reshape((1,) + view.shape) if lead else view

        return fetch, None

    def wait_for_reads(self, timeout: float | None = None) -> None:
        """Return once no save reads live tensors any more (CPU), or once the current CUDA streams are ordered
        after every pending device-to-host copy (CUDA, no CPU wait)."""
        for reads in self._pending:
            if reads.waited:
                continue
            if reads.events:
                last: dict[torch.device, torch.cuda.Event] = {}
                for dev, ev in reads.events:
                    last[dev] = ev
                for dev, ev in last.items():
                    torch.cuda.current_stream(dev).wait_event(ev)
            if reads.views and reads.handle is not None:
                if not reads.handle.wait_local(timeout):
                    raise CommitError(f"step {reads.handle.step}: host copies not finished within {timeout}s")
                if not _parity_read(reads.handle, timeout):
                    raise CommitError(f"step {reads.handle.step}: parity of Config.protection not computed within "
                                      f"{timeout}s")
            reads.waited = True
        self._reclaim()

    def _reclaim(self) -> None:
        keep = []
        for reads in self._pending:
            finished = reads.handle is not None and reads.handle.local_done() and _parity_read(reads.handle, 0)
            if finished:
                for key, host in reads.pinned:
                    self._pool.setdefault(key, []).append(host)
                reads.pinned.clear()
            else:  # a finished save's copies are done, so nothing is left to wait for
                keep.append(reads)
        self._pending = keep

    def drop(self, reads: Reads) -> None:
        """Forget a save that failed before the engine took it."""
        if reads in self._pending:
            self._pending.remove(reads)

    def close(self) -> None:
        self._pool.clear()
        self._pending.clear()
