"""The protection slot: where a trainer keeps one protected step's protection data in its node's agent.

Every trainer ``p`` keeps, in its own node's agent, one extra slot per protected step under the pseudo process
index ``PROTECT_BASE + p`` (ordinary agent slots: the agent needs no new state, serves them to peers like any
snapshot, and frees them with the trainer's retention; a store offers them through the ``ProtectionSlots``
capability, ``jaxckpt.core.capabilities``). A slot is

  manifest field  msgpack ``[FORMAT, VERSION, {step, process, meta: [off, n, crc], blocks: [[kind, id, off, n,
                  crc], ...]}]``: a small header (the agent lists it but never counts it as a snapshot: its
                  process index is not below its process count)
  buffer          the *meta* (msgpack: the encoded :class:`~jaxckpt.protection.plan.ProtectionPlan` and the manifests
                  of the processes of the preceding nodes of the ring, so a lost node's chunks can be verified
                  after rebuilding), then the blocks this node holds: parity stripes and copy blocks, 64-aligned.

Pure numpy and msgpack: the trainer writes slots (``jaxckpt.protection.runtime``), restores read them
(``jaxckpt.protection.holder``), and the agent tells them apart by ``PROTECT_BASE``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import msgpack
import numpy as np

from jaxckpt.protection import PROTECT_BASE, parity  # noqa: F401 - PROTECT_BASE: re-exported, slots' indices
from jaxckpt.core.checksum import crc32c
from jaxckpt.errors import ManifestError
from jaxckpt.protection.plan import ALIGN

FORMAT, VERSION = "jaxckpt-protect", 1
MAX_HEADER_BYTES = 16 << 20


@dataclass(frozen=True)
class BlockRef:
    """Block ``id`` of ``kind`` ("stripe" or "copy") at bytes [offset, offset + nbytes) of a slot's buffer."""

    kind: str
    id: int
    offset: int
    nbytes: int
    crc: int


@dataclass(frozen=True)
class SlotHeader:
    step: int
    process: int
    meta: tuple[int, int, int]  # offset, nbytes, crc32c
    blocks: tuple[BlockRef, ...]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def build_slot(step: int, process: int, meta: bytes, blocks: Iterable[tuple[str, int, np.ndarray]]
               ) -> tuple[bytes, int, list[tuple[int, Any]]]:
    """(header, buffer size, [(offset, bytes)]) of a protection slot holding ``meta`` and ``blocks``."""
    datas = [(kind, bid, parity.as_bytes(data)) for kind, bid, data in blocks]
    offsets, size = slot_layout(len(meta), [b.size for _, _, b in datas])
    writes: list[tuple[int, Any]] = [(0, meta)] + [(o, b) for o, (_, _, b) in zip(offsets, datas)]
    refs = [[kind, int(bid), o, int(b.size), crc32c(b)] for o, (kind, bid, b) in zip(offsets, datas)]
    return slot_header(step, process, meta, refs), size, writes


def slot_layout(meta_bytes: int, sizes: Iterable[int]) -> tuple[list[int], int]:
    """The offset of each block after a meta of ``meta_bytes`` bytes, and the slot's size."""
    offsets, pos = [], _aligned(meta_bytes)
    for n in sizes:
        offsets.append(pos)
        pos = _aligned(pos + int(n))
    return offsets, pos


def slot_header(step: int, process: int, meta: bytes, refs: list[list]) -> bytes:
    """The header of a slot holding ``meta`` at 0 and blocks ``refs`` ([kind, id, offset, nbytes, crc32c])."""
    return msgpack.packb([FORMAT, VERSION, {"step": step, "process": process,
                                            "meta": [0, len(meta), crc32c(meta)], "blocks": refs}],
                         use_bin_type=True)


def decode_header(data: bytes, *, source: str) -> SlotHeader:
    """A slot header; ManifestError naming ``source`` if it is not one."""
    try:
        if len(data) > MAX_HEADER_BYTES:
            raise ValueError(f"{len(data)} bytes")
        env = msgpack.unpackb(bytes(data), raw=False)
        if not (isinstance(env, list) and len(env) == 3 and env[0] == FORMAT and env[1] == VERSION):
            raise ValueError("not a protection slot")
        d = env[2]
        blocks = tuple(BlockRef(str(k), int(i), int(o), int(n), int(c)) for k, i, o, n, c in d["blocks"])
        if any(b.kind not in ("stripe", "copy") or min(b.id, b.offset, b.nbytes) < 0 for b in blocks):
            raise ValueError("bad block")
        meta = tuple(int(x) for x in d["meta"])
        return SlotHeader(int(d["step"]), int(d["process"]), meta, blocks)  # type: ignore[arg-type]
    except Exception as e:  # noqa: BLE001 - any defect means: not a usable protection slot
        raise ManifestError(f"{source}: malformed protection slot header ({type(e).__name__}: {e})") from None


def encode_meta(plan: bytes, manifests: dict[int, bytes]) -> bytes:
    """The meta of a slot: the encoded protection plan and some processes' encoded manifests."""
    return msgpack.packb({"plan": plan, "manifests": {int(q): bytes(m) for q, m in manifests.items()}},
                         use_bin_type=True)


def decode_meta(data: bytes, *, source: str) -> tuple[bytes, dict[int, bytes]]:
    try:
        d = msgpack.unpackb(bytes(data), raw=False, strict_map_key=False)
        man = {int(q): bytes(m) for q, m in d["manifests"].items()}
        return bytes(d["plan"]), man
    except Exception as e:  # noqa: BLE001
        raise ManifestError(f"{source}: malformed protection meta ({type(e).__name__}: {e})") from None
