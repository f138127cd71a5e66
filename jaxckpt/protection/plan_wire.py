"""A protection plan's bytes: what the trainers hand their node agent with every step's pull, and what the agents
keep with the step, since a restarted job cannot recompute the plan of a layout it no longer has.

The envelope is msgpack ``[FORMAT, VERSION, crc32c(body), body]``; chunk ids and block positions are implied by
order. Decoding checks everything (:func:`jaxckpt.protection.plan.validate_protection` included) and is the
dear part: a 4,096-leaf state on 4 nodes has about 49,000 chunks, a second of Python to decode. The plan of a
layout is the same bytes at every step, and both its readers meet it again and again (an agent at each step's
pull, a restore's scan once per step held), so the last few decoded plans are kept by their bytes.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import msgpack

from jaxckpt.core import collector
from jaxckpt.core.box import Box
from jaxckpt.core.checksum import crc32c
from jaxckpt.errors import ManifestError
from jaxckpt.protection.plan import (ALIGN, KINDS, ChunkRange, CopyBlock, ProtectionPlan, SavedChunk, Stripe, Unit,
                                     validate_protection)

WIRE_FORMAT = "jaxckpt-protection"
WIRE_VERSION = 1
# Distinct plans kept decoded: the job's layout and the one before a change of it (two plans of a 49,000-chunk
# layout are tens of MB of Python objects, in an agent that lives as long as the node).
KEEP_DECODED = 2

_decoded: "OrderedDict[bytes, ProtectionPlan]" = OrderedDict()
_lock = threading.Lock()


def encode_plan(plan: ProtectionPlan) -> bytes:
    """The envelope of a plan (see the module docstring); kept as the decoding of its bytes, so the process that
    made the plan (a trainer, whose restores scan its steps' protection) never decodes it."""
    # Paths and replica sets go in tables: a box replicated over thousands of processes is listed once.
    paths = {p: i for i, p in enumerate(dict.fromkeys(c.path for c in plan.chunks))}
    reps = {r: i for i, r in enumerate(dict.fromkeys(c.replicas for c in plan.chunks))}
    body = msgpack.packb({
        "policy": plan.policy, "copies": plan.copies, "group_size": plan.group_size, "unit_bytes": plan.unit_bytes,
        "nodes": list(plan.nodes), "groups": [list(g) for g in plan.groups], "layout": plan.layout,
        "paths": list(paths), "replica_sets": [list(r) for r in reps],
        "chunks": [[c.process, c.offset, c.nbytes, paths[c.path], c.box.to_wire(), c.source.to_wire(),
                    reps[c.replicas], c.policy] for c in plan.chunks],
        "stripes": [[s.kind, s.node, s.process, [[u.node, [[g.chunk, g.lo, g.hi] for g in u.ranges]]
                                                 for u in s.units]] for s in plan.stripes],
        "copy_blocks": [[b.node, b.source_node, b.process, list(b.chunks)] for b in plan.copy_blocks],
        **({"agents": list(plan.agents)} if plan.agents else {}),
    }, use_bin_type=True)
    raw = msgpack.packb([WIRE_FORMAT, WIRE_VERSION, crc32c(body), body], use_bin_type=True)
    _keep(raw, plan)
    return raw


def decode_plan(data: bytes | memoryview, *, source: str = "protection plan") -> ProtectionPlan:
    """Decode and validate an encoded plan; any defect raises ManifestError naming ``source``. Equal bytes give
    the same (immutable) plan object while it is among the last :data:`KEEP_DECODED` decoded."""
    raw = bytes(data)
    with _lock:
        plan = _decoded.get(raw)
        if plan is not None:
            _decoded.move_to_end(raw)
            return plan
    # Outside the lock: another thread's plan need not wait for this one. The collector paused, as for a manifest:
    # a plan is a few objects per chunk made at once and kept (a 6,144-chunk plan decoded in 23 ms instead of 45-52)
    with collector.paused():
        plan = _decode(raw, source)
    _keep(raw, plan)
    return plan


def _keep(raw: bytes, plan: ProtectionPlan) -> None:
    with _lock:
        _decoded[raw] = plan
        _decoded.move_to_end(raw)
        while len(_decoded) > KEEP_DECODED:
            _decoded.popitem(last=False)


def _decode(raw: bytes, source: str) -> ProtectionPlan:
    try:
        env = msgpack.unpackb(raw, raw=False)
        if not (isinstance(env, list) and len(env) == 4 and env[0] == WIRE_FORMAT):
            raise ManifestError(f"{source}: not a jaxckpt protection plan")
        if env[1] != WIRE_VERSION:
            raise ManifestError(f"{source}: protection plan version {env[1]!r} is not supported ({WIRE_VERSION})")
        if not isinstance(env[3], bytes) or crc32c(env[3]) != env[2]:
            raise ManifestError(f"{source}: protection plan checksum mismatch (corrupt)")
        d = msgpack.unpackb(env[3], raw=False, strict_map_key=False)
        nodes = tuple(_i(n) for n in d["nodes"])
        paths = [str(p) for p in d["paths"]]
        rsets = [tuple(_i(r) for r in rs) for rs in d["replica_sets"]]
        boxes: dict[tuple, Box] = {}  # equal boxes recur across leaves of one shape: one (checked) Box each

        def box(w: Any) -> Box:
            start, stop = w
            key = (*start, None, *stop)
            b = boxes.get(key)
            if b is None:
                b = boxes[key] = Box(tuple(_i(v) for v in start), tuple(_i(v) for v in stop))
            return b

        def chunk(p: Any, off: Any, nb: Any, path: Any, b: Any, src: Any, reps: Any, kind: Any) -> SavedChunk:
            # the five integers checked at once (exactly int, not negative: an index of -1 would read the last
            # node or path); each is named only when one is not
            if not (type(p) is int and type(off) is int and type(nb) is int and type(path) is int
                    and type(reps) is int and p >= 0 and off >= 0 and nb >= 0 and path >= 0 and reps >= 0):
                for v in (p, off, nb, path, reps):
                    _i(v)
            if kind not in KINDS:
                _kind(kind)
            return SavedChunk(p, nodes[p], off, nb, paths[path], box(b), box(src), rsets[reps], kind)

        chunks = tuple([chunk(*row) for row in d["chunks"]])
        stripes = tuple(Stripe(i, _kind(kind), _i(node), int(proc),
                               tuple(Unit(_i(un), tuple(ChunkRange(_i(c), _i(lo), _i(hi)) for c, lo, hi in segs))
                                     for un, segs in units))
                        for i, (kind, node, proc, units) in enumerate(d["stripes"]))
        blocks = []
        for i, (node, src, proc, idx) in enumerate(d["copy_blocks"]):
            positions, pos = [], 0
            for c in idx:
                positions.append(pos)
                pos += -(-chunks[_i(c)].nbytes // ALIGN) * ALIGN
            blocks.append(CopyBlock(i, _i(node), _i(src), _i(proc), tuple(_i(c) for c in idx), tuple(positions), pos))
        plan = ProtectionPlan(str(d["policy"]), _i(d["copies"]), _i(d["group_size"]), _i(d["unit_bytes"]), nodes,
                              tuple(tuple(_i(n) for n in g) for g in d["groups"]), chunks, stripes, tuple(blocks),
                              str(d["layout"]), tuple(_i(a) for a in d.get("agents", ())))
        if plan.agents and len(plan.agents) != len(nodes):
            raise ValueError(f"{len(plan.agents)} agents for {len(nodes)} processes")
        validate_protection(plan)
        return plan
    except ManifestError:
        raise
    except Exception as e:  # msgpack, unpacking, index and plan errors alike mean a malformed plan
        raise ManifestError(f"{source}: malformed protection plan ({type(e).__name__}: {e})") from None


def _i(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"expected a non-negative int, got {v!r}")
    return v


def _kind(v: Any) -> str:
    if v not in KINDS:
        raise ValueError(f"unknown protection kind {v!r}")
    return v
