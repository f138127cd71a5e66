"""The node agent's part of protection: build a step's ``xor-group`` and ``replica`` blocks into a trainer's slot.

A trainer's protection worker (``jaxckpt.protect_runtime``) decides, coordinates and announces; the bytes move
here, in the agent, after the local commit: the trainer reserves its protection slot, writes the meta and the
parity stripes it computed from its own device copies, and sends ``pull`` on that slot with

  plan      the encoded protection plan of the step (``jaxckpt.protection.encode_plan``);
  tasks     ``[[kind, id, offset], ...]``: the ``xor-group`` stripes and ``replica`` copy blocks this process
            builds, and where each goes in the slot;
  sources   ``{process: [address, token] | None}``: where each saving process's chunks are (None: this node);
  rate      bytes per second the pulls may take (``Config.protection_bandwidth``; 0: unlimited);
  timeout   seconds a peer may take to answer one request.

The agent reads each needed chunk once (this node's from its own memory, zero-copy; other nodes' through the
peer transport), checks it against the crc32c of its process's manifest, XORs or copies it into place and
replies with the crc32c of each block, which the trainer writes into the slot header when it commits. So the
trainer process never holds the pulled bytes, and a node that is being filled sets its own pace (one request
per protecting trainer connection, one chunk at a time).
"""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from jaxckpt import manifest as mf
from jaxckpt import parity
from jaxckpt.checksum import crc32c
from jaxckpt.errors import ChecksumError, PeerError
from jaxckpt.protect_runtime import TokenBucket
from jaxckpt.protection import SavedChunk, copy_block, decode_plan, stripe_parity

log = logging.getLogger("jaxckpt.backends.protect_pull")

MAX_TASKS = 1 << 16


class _Sources:
    """Verified whole chunks of one step, from this node's memory or from the agents of other nodes."""

    def __init__(self, local, sources: dict[int, Any], step: int, timeout_s: float, rate: float) -> None:
        self.local, self.sources, self.step, self.timeout = local, sources, step, timeout_s
        self.bucket = TokenBucket(rate) if rate > 0 else None
        self.pulled = 0
        self._views: dict[int, Any] = {}
        self._clients: dict[int, Any] = {}
        self._crcs: dict[tuple[int, int], int] = {}
        self._chunks: dict[tuple[int, int], np.ndarray] = {}

    def _manifest(self, q: int) -> None:
        if q in self._views or q in self._clients:
            return
        if q not in self.sources:
            raise PeerError(f"step {self.step}: no source named for process {q}")
        where = self.sources[q]
        if where is None:
            view = self.local.open(q, self.step) if self.local is not None else None
            if view is None:
                raise PeerError(f"step {self.step} of process {q} is not held by this node's agent")
            self._views[q], raw = view, bytes(view.manifest)
        else:
            from jaxckpt.backends.transport import get_transport

            client = get_transport().connect(where[0], token=where[1], timeout_s=self.timeout)
            self._clients[q] = client
            raw = client.manifest(self.step, q)
        m = mf.decode(raw, source=f"step {self.step} manifest of process {q}")
        for a in m.arrays:
            for c in a.chunks:
                self._crcs[(c.process, c.offset)] = c.crc32c

    def read(self, c: SavedChunk, lo: int, hi: int) -> np.ndarray:
        if c.key not in self._chunks:
            self._manifest(c.process)
            if c.process in self._views:
                buf = self._views[c.process].buffer[c.offset:c.offset + c.nbytes]
                data = np.frombuffer(buf, np.uint8)
            else:
                if self.bucket is not None:  # the network's share: this node's own chunks are not pulled
                    self.bucket.take(c.nbytes)
                data = np.frombuffer(bytes(self._clients[c.process].read(self.step, c.offset, c.nbytes, c.process)),
                                     np.uint8)
                self.pulled += c.nbytes
            crc = self._crcs.get(c.key)
            if crc is None:
                raise ChecksumError(f"{c.path}: step {self.step} has no chunk at offset {c.offset} of process "
                                    f"{c.process}")
            parity.check(data, crc, f"{c.path}: step {self.step} chunk of process {c.process}")
            self._chunks[c.key] = data
        return self._chunks[c.key][lo:hi]

    def close(self) -> None:
        self._chunks.clear()
        for v in self._views.values():
            v.close()
        for c in self._clients.values():
            c.close()


def pull_into(buffer: memoryview, msg: dict, step: int, local) -> tuple[list[int], int, dict]:
    """Build the blocks ``msg`` asks for (see the module docstring) into ``buffer``, the writing slot of ``step``;
    returns the crc32c of each block in task order, the bytes pulled from other nodes, and the bandwidth
    account of a limited pull (rate, burst, bytes admitted, seconds slept, span since the first admission)."""
    tasks = msg["tasks"]
    if not isinstance(tasks, list) or len(tasks) > MAX_TASKS:
        raise ValueError(f"step {step}: tasks must be a list of at most {MAX_TASKS} [kind, id, offset]")
    raw = msg["sources"]
    if not isinstance(raw, dict):
        raise TypeError(f"step {step}: sources must be a map")
    sources: dict[int, Any] = {}
    for k, v in raw.items():
        q = int(k)
        if v is not None and not (isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)
                                  and v[0].startswith("tcp://") and isinstance(v[1], bytes) and v[1]):
            raise TypeError(f"step {step}: the source of process {q} must be [tcp address, token] or nil")
        sources[q] = v
    plan = decode_plan(msg["plan"], source=f"step {step} protection plan")
    timeout, rate = float(msg.get("timeout", 30.0)), float(msg.get("rate", 0) or 0)
    stripes = {s.id: s for s in plan.stripes}
    blocks = {b.id: b for b in plan.copy_blocks}
    out = np.frombuffer(buffer, np.uint8)
    src = _Sources(local, sources, step, timeout, rate)
    crcs = []
    try:
        for kind, bid, offset in tasks:
            if kind == "stripe" and bid in stripes:
                data = stripe_parity(plan, stripes[bid], src.read)
            elif kind == "copy" and bid in blocks:
                data = copy_block(plan, blocks[bid], src.read)
            else:
                raise ValueError(f"no {kind!r} block {bid!r} in the plan")
            b = parity.as_bytes(data)
            if not 0 <= int(offset) <= out.size - b.size:
                raise ValueError(f"{kind} block {bid} of {b.size} bytes does not fit the slot at {offset}")
            out[int(offset):int(offset) + b.size] = b
            crcs.append(crc32c(b))
    finally:
        src.close()
    b = src.bucket
    account = {} if b is None or b.started is None else {
        "rate": b.rate, "burst": b.burst, "admitted": b.admitted, "slept": b.slept,
        "span": time.monotonic() - b.started}
    return crcs, src.pulled, account
