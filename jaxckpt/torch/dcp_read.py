"""The bytes of the chunks one rank's DCP load plan needs, wherever they were saved (see ``dcp``'s docstring).

Own slot: zero-copy views. Another rank of the group: sent by that rank in two ``all_to_all`` rounds. A rank the
group no longer has: its slot at this node's agent (``store="shm"``). Every rank of the group runs
:meth:`ChunkSet.read` at the same point; a failure on any rank (a missing slot, a bad checksum) is agreed on
before the bytes move (``jaxckpt.core.collective.agree``, a round of the reader's channel), so it is raised on
every rank and nobody waits for a rank that gave up.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan

from jaxckpt.torch import dcp_exchange as xc
from jaxckpt.torch.dcp_metadata import Locator, StorageIndex, unpack_slot_manifest
from jaxckpt.core.checksum import crc32c
from jaxckpt.core.collective import Channel, agree
from jaxckpt.core.fetch import buffer_reader
from jaxckpt.core.store import Store
from jaxckpt.errors import ChecksumError, ManifestError, StepError, StepNotFoundError

log = logging.getLogger("jaxckpt.torch.dcp")

Read = Callable[[int, int], memoryview]


class ChunkSet:
    """The chunks of one load on this rank; :meth:`close` unpins the slots they were read from."""

    def __init__(self, store: Store, index: StorageIndex, group: dist.ProcessGroup | None, rank: int,
                 world: int, rounds: Channel | None = None) -> None:
        self.store, self.index, self.group, self.rank, self.world = store, index, group, rank, world
        self.rounds = rounds  # the group's error agreement (None: one rank)
        self.verify = store.config.verify_on_restore
        self._closers: list[Callable[[], None]] = []

    def read(self, plan: LoadPlan) -> dict[MetadataIndex, memoryview]:
        """Every chunk ``plan`` reads, by storage index, checksummed where it was read."""
        idx, me, world, group = self.index, self.rank, self.world, self.group
        error: BaseException | None = None
        wanted: dict[MetadataIndex, Locator] = {}
        try:
            for req in plan.items:
                loc = idx.locators.get(req.storage_index)
                if loc is None:
                    raise ManifestError(f"{req.storage_index.fqn}: checkpoint step {idx.step} has no saved chunk at "
                                        f"offset {list(req.storage_index.offset or [])}")
                wanted[req.storage_index] = loc
        except Exception as e:  # noqa: BLE001 - agreed on below, raised on every rank
            error, wanted = e, {}
        in_group = group is not None
        from_peer: list[list[MetadataIndex]] = [[] for _ in range(world)]
        for mi, loc in wanted.items():
            if in_group and loc.rank != me and loc.rank < world:
                from_peer[loc.rank].append(mi)
        asked: list[list[MetadataIndex]] = [[] for _ in range(world)]
        if in_group:
            # Chunks are numbered alike on every rank (the metadata is the same): requests are int64 tensors.
            order = sorted(idx.locators, key=lambda m: (idx.locators[m].rank, idx.locators[m].offset))
            number = {m: i for i, m in enumerate(order)}
            asked_ids = xc.all_to_all_ints(group, [[number[m] for m in ms] for ms in from_peer])
            asked = [[order[i] for i in ids] for ids in asked_ids]
        got: dict[MetadataIndex, memoryview] = {}
        send: list[list[memoryview]] = [[] for _ in range(world)]
        try:
            if error is None:
                own = [mi for mi, loc in wanted.items() if loc.rank == me]
                if own or any(asked):
                    read = self._open(me)
                    for mi in own:
                        got[mi] = self._read(read, mi)
                    send = [[self._read(read, mi) for mi in ms] for ms in asked]
                outside = [mi for mi, loc in wanted.items() if loc.rank != me and (not in_group or loc.rank >= world)]
                for owner in sorted({wanted[mi].rank for mi in outside}):
                    read = self._open(owner)
                    for mi in outside:
                        if wanted[mi].rank == owner:
                            got[mi] = self._read(read, mi)
        except Exception as e:  # noqa: BLE001 - agreed on below, raised on every rank
            error = e
        if self.rounds is not None:
            agree(self.rounds, f"reading DCP checkpoint step {idx.step}", error)
        elif error is not None:
            raise error
        if in_group:
            recv = [[idx.locators[mi].nbytes for mi in ms] for ms in from_peer]
            for ms, bufs in zip(from_peer, xc.all_to_all_bytes(group, send, recv)):
                got.update(zip(ms, bufs))
        return got

    def _open(self, owner: int) -> Read:
        """Pin ``owner``'s slot of this step and check it belongs to this save."""
        step = self.index.step
        if owner == self.rank:
            view = self.store.open(step)
            if view is None:
                raise StepNotFoundError(f"checkpoint step {step}: rank {owner}'s slot is not held by its "
                                        f"{self.store.name} store (job {self.store.config.job_id!r}; it holds steps "
                                        f"{self.store.steps() or 'none'})")
            self._closers.append(view.close)
            manifest, read = view.manifest, buffer_reader(view.buffer)
        else:
            manifest, read = self._open_at_agent(owner, step)
        body = unpack_slot_manifest(manifest, f"step {step} of rank {owner}")
        if body.get("save_id") != self.index.save_id or body.get("rank") != owner:
            raise StepError(f"checkpoint step {step}: rank {owner}'s slot holds another save (checkpoint "
                            f"{body.get('checkpoint_id')!r} of rank {body.get('rank')}, save {body.get('save_id')}) "
                            f"than the metadata names (save {self.index.save_id}): it was saved again since")
        return read

    def _open_at_agent(self, owner: int, step: int) -> tuple[Any, Read]:
        from jaxckpt.core.capabilities import AgentHolders
        if not self.store.supports(AgentHolders):
            raise StepNotFoundError(
                f"checkpoint step {step} has chunks saved by rank {owner}, which this process group of "
                f"{self.world} rank(s) does not have; a {self.store.name} store holds only its own process's "
                f"snapshots (with store='shm' they stay in the node agent and are read from there)")
        holder = self.store.capability(AgentHolders).node_holder("local")
        self._closers.append(holder.close)
        opened = holder.open(owner, step)  # StepNotFoundError names the agent and what it holds
        self._closers.insert(0, opened.close)
        return opened.manifest, opened.read

    def _read(self, read: Read, mi: MetadataIndex) -> memoryview:
        loc = self.index.locators[mi]
        buf = read(loc.offset, loc.nbytes)
        if self.verify:
            got = crc32c(buf)
            if got != loc.crc:
                raise ChecksumError(f"{mi.fqn}: chunk at byte {loc.offset} of rank {loc.rank}'s slot of checkpoint "
                                    f"step {self.index.step} fails its crc32c (saved {loc.crc:#010x}, read "
                                    f"{got:#010x}): the snapshot is corrupted")
        return buf

    def close(self) -> None:
        """Unpin every slot opened (the chunks' views must no longer be used)."""
        closers, self._closers = self._closers, []
        for close in closers:
            try:
                close()
            except Exception as e:  # noqa: BLE001 - one failed unpin must not hide the others or the load's result
                log.warning("unpinning a DCP checkpoint slot failed: %s", e)
