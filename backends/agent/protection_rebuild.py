"""The node agent's part of recovery: a lost range rebuilt where its parity lives, so the lost bytes move once.

After a node loss, a restoring process (``jaxckpt.protection.holder``) needs bytes [lo, hi) of unit ``unit`` of a
parity stripe whose other units survive. Read where it restores, that takes the parity's bytes and every other
unit's (about G-1 times the bytes rebuilt for an XOR group of G nodes). Instead it asks the agent holding the
stripe's parity (the peer transport's ``rebuild``, ``jaxckpt.core.transport.ServedHolder.rebuild``), which

  1) finds the stripe in the protection slot (``jaxckpt.protection.slot``) it holds: the plan kept in the slot's
     meta, decoded once per slot and step, and the parity block's place in the slot;
  2) reads the other units' bytes in [lo, hi) from the agents the request names, each span checked against its
     chunk's crc32c as a protection pull checks them (``protection_pull.ChunkSpans``: the span and the holder's
     crc32c of the rest of the chunk), each source's manifest asked for once per step;
  3) XORs them into its own parity's bytes and returns the result, ``hi - lo`` bytes: all the requester receives.

The requester checks the rebuilt chunk against its manifest's crc32c as before, and reads the parity and the
units itself when this fails (an agent without the request, an unreachable unit, a corrupt source).
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxckpt.backends.agent.protection_pull import ChunkSpans
from jaxckpt.core import manifest as mf
from jaxckpt.core.checksum import crc32c
from jaxckpt.errors import ChecksumError, PeerError, StepNotFoundError
from jaxckpt.protection import PROTECT_BASE, parity
from jaxckpt.protection.plan import ProtectionPlan
from jaxckpt.protection.plan_wire import decode_plan
from jaxckpt.protection.slot import BlockRef, decode_header, decode_meta

log = logging.getLogger("jaxckpt.backends.agent.protection_rebuild")

MAX_SLOTS = 8  # protection slots whose decoded plan and crc32c an agent keeps (the steps a recovery reads)


@dataclass
class _Slot:
    """A protection slot's decoded plan, its parity blocks, and the crc32c of the chunks its rebuilds read."""

    plan: ProtectionPlan
    stripes: dict[int, BlockRef]
    crcs: dict[tuple[int, int], int] = field(default_factory=dict)
    known: set[int] = field(default_factory=set)


_slots: "OrderedDict[tuple, _Slot]" = OrderedDict()
_lock = threading.Lock()


def _slot(view: Any, process: int, step: int) -> _Slot:
    key = (process, step, crc32c(view.manifest))
    with _lock:
        got = _slots.get(key)
        if got is not None:
            _slots.move_to_end(key)
            return got
    where = f"protection slot {process - PROTECT_BASE} of step {step}"
    hdr = decode_header(view.manifest, source=where)
    off, n, crc = hdr.meta
    raw = bytes(view.buffer[off:off + n])
    if crc32c(raw) != crc:
        raise ChecksumError(f"the meta of {where} is corrupt")
    plan_bytes, manifests = decode_meta(raw, source=f"the meta of {where}")
    got = _Slot(decode_plan(plan_bytes, source=f"the plan of {where}"),
                {b.id: b for b in hdr.blocks if b.kind == "stripe"})
    for q, m in manifests.items():  # the manifests kept with protection: those processes' crc32c need no request
        got.crcs.update(mf.chunk_crcs(m, source=f"manifest of process {q} kept in {where}"))
        got.known.add(q)
    with _lock:
        _slots[key] = got
        while len(_slots) > MAX_SLOTS:
            _slots.popitem(last=False)
    return got


def rebuild_range(snapshots: Any, process: int, step: int, stripe: int, unit: int, lo: int, hi: int,
                  sources: dict[int, tuple], timeout_s: float, transport: str = "zmq") -> np.ndarray:
    """Bytes [lo, hi) of unit ``unit`` of ``stripe``, whose parity this agent holds in protection slot ``process``
    of ``step`` (``snapshots``: its ``serve.AgentSnapshots``): the parity XOR the stripe's other units, read from
    ``sources`` (saving process -> (address, token, CURVE key)) within ``timeout_s`` each."""
    if process < PROTECT_BASE:
        raise StepNotFoundError(f"slot {process} of step {step} is a snapshot, not a protection slot")
    view = snapshots.open(process, step)
    if view is None:
        raise StepNotFoundError(f"protection slot {process - PROTECT_BASE} of step {step} is not held here")
    try:
        slot = _slot(view, process, step)
        plan = slot.plan
        ref = slot.stripes.get(stripe)
        if ref is None or not 0 <= stripe < len(plan.stripes) or not 0 <= unit < len(plan.stripes[stripe].units):
            raise StepNotFoundError(f"step {step}: stripe {stripe} unit {unit} has no parity in protection slot "
                                    f"{process - PROTECT_BASE}")
        s = plan.stripes[stripe]
        if not 0 <= lo <= hi <= s.units[unit].nbytes or ref.offset + hi > len(view.buffer):
            raise StepNotFoundError(f"step {step}: bytes {lo}..{hi} are outside unit {unit} of stripe {stripe}")
        terms: list[list[tuple]] = []  # per other unit: its chunks' spans in [lo, hi), in order
        for k, u in enumerate(s.units):
            if k == unit:
                continue
            spans, pos = [], 0
            for g in u.ranges:
                x, y = max(lo, pos), min(hi, pos + g.nbytes)
                if y > x:
                    spans.append((plan.chunks[g.chunk], g.lo + x - pos, g.lo + y - pos))
                pos += g.nbytes
            terms.append(spans)
        needs = [t for spans in terms for t in spans]
        missing = sorted({c.process for c, _, _ in needs} - set(sources))
        if missing:
            raise PeerError(f"step {step}: the request names no agent for processes {missing[:16]}")
        src = ChunkSpans(snapshots, {q: list(a) for q, a in sources.items()}, step, timeout_s, None, transport,
                         crcs=slot.crcs, known=slot.known)
        try:
            src.start(needs)
            blocks = [view.buffer[ref.offset + lo:ref.offset + hi]]
            blocks += [[src.read(c, a, b) for c, a, b in spans] for spans in terms]
            out = parity.encode(blocks, np.empty(hi - lo, np.uint8), length=hi - lo)
            src.finish()
        finally:
            src.close()
        log.debug("step %d: rebuilt bytes %d..%d of unit %d of stripe %d here (%d bytes of other units read)",
                  step, lo, hi, unit, stripe, src.pulled)
        return out
    finally:
        view.close()
