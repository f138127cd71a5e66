"""PyTorch DCP on jaxckpt's stores: ``dcp.save(sd, storage_writer=JaxckptWriter(...))`` and ``dcp.load``.

``JaxckptWriter`` / ``JaxckptReader`` implement ``torch.distributed.checkpoint``'s ``StorageWriter`` /
``StorageReader``, so ``dcp.save``, ``dcp.async_save`` and ``dcp.load`` run unchanged and DCP's own planner
decides what each rank writes and reads (resharding included). Where the bytes go is jaxckpt's: one store slot
per rank and checkpoint (``Config.store``: ``"memory"`` in this process, ``"shm"`` in the node agent's shared
memory, where it outlives the process). The ``JAXCKPT_*`` environment applies over the given ``Config`` (default
``Config()``), as for a ``Checkpointer``: a site's ``JAXCKPT_SHM_ROOT`` or ``JAXCKPT_NODE_NAME`` reaches these
stores too.

Checkpoint ids. A checkpoint is a store step: ``checkpoint_id`` (given to the constructor or to ``dcp.save`` /
``dcp.load``, which pass it to ``reset``) is an int >= 0, or a string ``"12"``, ``"step_12"``, ``"step-12"`` or
``"jaxckpt://12"``; anything else raises :class:`jaxckpt.errors.StepError`. Saving needs an id; loading without
one reads the newest checkpoint the coordinator's store holds. Saving an id again replaces it (the slot writer's
``replace``: the old slot is freed when the new one is reserved). Each rank's store keeps the ``Config.keep``
highest steps and the one just saved (the slot writer's retention, as for ``Checkpointer``); give DCP checkpoints a ``job_id`` of their
own, a ``Checkpointer`` of the same job and store would see their slots as foreign snapshots. A DCP checkpoint
lives in the store only: ``Config.protection`` and ``Config.persistent_dir`` are refused (ConfigError).

Save, in DCP's call order (ranks are those of the process group DCP runs on):

0) (all ranks) ``reset(checkpoint_id)``; 1) ``set_up_storage_writer``; 2) ``prepare_local_plan``: unchanged.
3) (coordinator) ``prepare_global_plan``: stamps every rank's plan with one save id and the rank's index.
4) (all ranks) ``write_data``: writes the rank's items through the slot path every save of jaxckpt takes
   (``jaxckpt.core.slots.SlotWriter``, the engine's): one slot of the exact size at step = checkpoint id in the
   rank's own store, laid out by this rank (each ``WriteItem`` 64-byte aligned: tensors straight from the live
   tensor, ``BytesIO`` items as their value in msgpack, see below), copied with a crc32c each on the copy
   workers.
   Then every rank learns whether every rank wrote its slot (``jaxckpt.core.collective.agree``, one round over
   the process group's store): a failure on any rank (a slot over the store's budget, a tensor the planner
   cannot resolve) is raised on every rank (the same ``jaxckpt.errors`` class, naming the rank) and every rank
   frees its slot, so a failed save commits nothing and retention deletes nothing. Otherwise each rank but the
   coordinator commits its slot and applies retention; the coordinator keeps its slot uncommitted. Each
   WriteResult carries a :class:`Locator` (rank, offset, size, crc32c).
5) (coordinator) ``finish(metadata, results)``: encodes DCP's ``Metadata`` with every locator as msgpack
   (``dcp_metadata``: no pickle; what cannot be encoded is refused) and commits its slot with it as the
   manifest (given at commit, after the copy). A checkpoint exists once that commit is done: a save that fails
   anywhere leaves no metadata. (A ``finish`` that fails after the other ranks committed leaves their slots,
   without metadata, and their retention applied.)

Load: ``read_metadata`` (all ranks): group rank 0 reads the metadata from its own store; its error, if any, is
agreed on, then the metadata is broadcast as bytes. ``read_data`` (all ranks, DCP's planner having assigned each rank its ``ReadItem`` list):

- a chunk in the rank's own slot is read there, zero-copy;
- a chunk in the slot of another rank of the group is sent by that rank: two ``all_to_all`` rounds on the
  group (the chunk numbers each rank needs from each owner, then the bytes), so every rank reads only what its
  new sharding needs and the collective carries it, on one node or many (no cross-node shortcut);
- a chunk saved by a rank the group no longer has (saved on 4 ranks, loaded on 2) is read from the node agent's
  shared memory with ``store="shm"`` (that rank's slot outlives it); with ``store="memory"`` it is gone: a
  :class:`jaxckpt.errors.StepNotFoundError` names the chunk and the rank.

Why the collective: a rank's new sharding may need bytes any other rank wrote. Reading the other ranks' slots at
the node agent works only for ranks on the same node and not at all for ``store="memory"``; having the
coordinator gather everything moves the whole state through one rank. The all_to_all sends each needed byte once,
from the rank that holds it to the rank that needs it, on the job's own process group, which is how the
design's restore reaches other processes ("restore goes through collectives first"). The node agent is used only
where no rank of the group holds the slot any more.

Every chunk's crc32c is checked where it is read, by its owner before it is sent (``Config.verify_on_restore``);
a mismatch raises :class:`jaxckpt.errors.ChecksumError` naming the chunk, rank and step, on every rank, and no
rank waits in a collective for one that failed (``jaxckpt.core.collective.agree``: a round of the reader's
channel over the process group's store, the one wrapper every cross-process agreement goes through). DCP wraps errors raised inside its
steps in its ``CheckpointException``; the jaxckpt error is in ``.failures[rank][0]``, except for
``read_metadata`` (e.g. an id no store holds), whose error DCP turns into an ``AssertionError`` that carries our
message ("metadata is None; global metadata read failed: ...").

``dcp.async_save`` blocks for DCP's own staging copy (its default stager); this writer's copy into the store then
runs on DCP's background thread.

Non-tensor values: DCP's save planner turns each into ``BytesIO`` with ``torch.save``, and its default load
planner hands what it reads to torch's full unpickler (torch 2.13). So no pickle crosses the store: the writer
stores the value as msgpack (``dcp_values``: numbers, strings, bytes, lists, tuples, dicts, sets, dtypes, devices,
dense tensors), taking the object DCP's own planner looks up, or reading a custom planner's bytes back with
torch's restricted loader; the reader rebuilds the value, every type checked, and hands the planner ``torch.save``
bytes of it made in its own process. A value with no such encoding (a class of your own) raises
:class:`jaxckpt.errors.UnsupportedTypeError` at save, naming the item, the step and where in the value, on every
rank, and nothing is committed. Opting in on both ends stores it as DCP's pickled bytes:
``JaxckptWriter(pickle_values=True)`` writes them, and only ``JaxckptReader(trust_pickled_values=True)`` loads them
(for stores you trust); any other reader raises UnsupportedTypeError naming the item and the step before anything
is unpickled.

The process group must have a CPU backend (gloo, or ``"cpu:gloo,cuda:nccl"``) and be the one DCP runs on; pass
the same ``process_group`` to the writer/reader and to ``dcp.save``/``dcp.load``.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import msgpack
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from jaxckpt.torch import dcp_exchange as xc
from jaxckpt.torch import dcp_metadata, dcp_values
from jaxckpt.torch.dcp_exchange import align, byte_tensor
from jaxckpt.torch.dcp_metadata import Locator, StorageIndex, pack_slot_manifest, unpack_slot_manifest
from jaxckpt.torch.coordination import TorchStoreCoordinator, incarnation
from jaxckpt.torch.dcp_read import ChunkSet
from jaxckpt.torch.dtypes import numpy_view
from jaxckpt.config import Config
from jaxckpt.core.collective import Channel, Collective, agree
from jaxckpt.core.copier import CopyTask
from jaxckpt.core.slots import SlotWriter
from jaxckpt.registry import get_store_class
from jaxckpt.core.store import Slot, Store
from jaxckpt.errors import ConfigError, ManifestError, PlanError, StepError, StepNotFoundError

log = logging.getLogger("jaxckpt.torch.dcp")

_ID = re.compile(r"(?:jaxckpt://)?(?:step[_-]?)?(\d+)")

__all__ = ["JaxckptReader", "JaxckptWriter", "checkpoint_step"]


def checkpoint_step(checkpoint_id: Any) -> int:
    """The store step a DCP ``checkpoint_id`` names (see the module docstring); StepError if it names none."""
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        if checkpoint_id >= 0:
            return checkpoint_id
    elif isinstance(checkpoint_id, (str, os.PathLike)):
        m = _ID.fullmatch(os.fspath(checkpoint_id))
        if m:
            return int(m.group(1))
    raise StepError(f"checkpoint_id {checkpoint_id!r} is not a jaxckpt checkpoint id: use a step number, an int "
                    f">= 0 or a string '12', 'step_12', 'step-12' or 'jaxckpt://12'")


def _group_of(process_group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, int, int]:
    """(group or None when there is one rank, rank, world) of the process group DCP will run on."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, 0, 1
    group = process_group if process_group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return (group if world > 1 else None), rank, world


def _make_store(config: Config | None, store: Store | None, rank: int, world: int) -> tuple[Config, Store, bool]:
    if store is not None:
        if config is not None and config is not store.config:
            raise PlanError("pass either a config or a store to the DCP writer/reader, not both")
        if store.process_index != rank:
            raise PlanError(f"the given {store.name} store belongs to process {store.process_index}, but this "
                            f"process is rank {rank} of the DCP process group")
        _refuse_tiers(store.config)
        return store.config, store, False
    # The JAXCKPT_* environment applied as every front end applies it: a site's JAXCKPT_SHM_ROOT or
    # JAXCKPT_NODE_NAME must reach a DCP checkpoint's store and agent too (they were ignored here).
    config = (config or Config()).with_env()
    _refuse_tiers(config)
    return config, get_store_class(config.store)(config, process_index=rank, process_count=world), True


def _refuse_tiers(config: Config) -> None:
    """DCP checkpoints are slots of the store only (docs/design.md, known limits): an option asking for more is
    refused, never ignored."""
    if config.protection != "none":
        raise ConfigError(f"Config.protection={config.protection!r}: DCP checkpoints (JaxckptWriter/JaxckptReader) "
                          f"are not protected; use protection='none' for them, or jaxckpt's own torch Checkpointer")
    if config.persistent_dir:
        raise ConfigError(f"Config.persistent_dir={config.persistent_dir!r}: DCP checkpoints (JaxckptWriter/"
                          f"JaxckptReader) are not persisted; leave it empty, or save to disk with DCP's own "
                          f"FileSystemWriter")


class _GroupRounds:
    """A writer's or reader's rounds over its process group's store (``jaxckpt.core.collective``), made on first
    use; none for a group of one rank."""

    def __init__(self, group: dist.ProcessGroup | None, config: Config) -> None:
        self.group, self._config = group, config
        self._collective: Collective | None = None
        if group is not None:
            # The group's run token (a broadcast the first time) here, where the user makes the writer or reader
            # on every rank, rather than at its first round: dcp.async_save runs the writer on a thread of its own.
            incarnation(group)

    def channel(self) -> Channel | None:
        """The channel every agreement of this writer or reader is a round of (None: one rank, nothing to agree)."""
        if self.group is None:
            return None
        if self._collective is None:
            coordinator = TorchStoreCoordinator.from_process_group(self.group)
            self._collective = Collective.for_job(coordinator, self._config.job_id, self._config.commit_timeout_s)
        return self._collective.channel("dcp")

    def agree(self, name: str, error: BaseException | None) -> None:
        """Raise on every rank when any failed (``jaxckpt.core.collective.agree``; one rank: its own error)."""
        rounds = self.channel()
        if rounds is not None:
            agree(rounds, name, error)
        elif error is not None:
            raise error

    def close(self) -> None:
        """End the rounds (bounded by ``Config.peer_timeout_s`` for ranks that do not close)."""
        if self._collective is not None:
            self._collective.close(timeout_s=self._config.peer_timeout_s)
            self._collective = None


@dataclass(frozen=True)
class _SaveTag:
    """``SavePlan.storage_data`` set by the coordinator: one id per save, and the plan's rank."""

    save_id: str
    rank: int
    world: int


class JaxckptWriter(StorageWriter):
    """A DCP ``StorageWriter`` into jaxckpt's store ``config.store`` (see the module docstring).

    ``store``: an existing store to write into (for ``store="memory"``, share it with the reader:
    ``JaxckptReader(store=writer.store)``); otherwise one is made from ``config`` for this rank and closed by
    :meth:`close`. ``pickle_values``: store a non-tensor value that has no encoding without pickle (a class of
    your own) as DCP's ``torch.save`` bytes instead of refusing it; only a reader made with
    ``trust_pickled_values=True`` loads it (see the module docstring).
    """

    def __init__(self, checkpoint_id: Any = None, *, config: Config | None = None, store: Store | None = None,
                 process_group: dist.ProcessGroup | None = None, pickle_values: bool = False) -> None:
        self.pickle_values = pickle_values
        group, self.rank, self.world = _group_of(process_group)
        self.config, self.store, self._owns_store = _make_store(config, store, self.rank, self.world)
        # The one slot path (jaxckpt.core.slots): an id saved again replaces its slot; retention counts what the
        # store already holds (a node agent's store keeps an earlier writer's checkpoints).
        self.slots = SlotWriter(self.store, self.config.keep, workers=self.config.workers,
                                inflight_bytes=self.config.inflight_bytes, replace=True, counted=self.store.steps())
        self._rounds = _GroupRounds(group, self.config)
        self.checkpoint_id: str | None = None
        self._step: int | None = None
        self._pending: tuple[Slot, dict] | None = None  # the coordinator's slot, committed by finish()
        self._is_coordinator = False
        if checkpoint_id is not None:
            self.reset(checkpoint_id)

    # ---------------------------------------------------------------------------------------- DCP's calls
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Start a new save; ``checkpoint_id`` names its step (kept from the last call if None)."""
        self._abort_pending()
        if checkpoint_id is not None:
            self._step = checkpoint_step(checkpoint_id)
            self.checkpoint_id = os.fspath(checkpoint_id) if not isinstance(checkpoint_id, int) else str(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Whether ``checkpoint_id`` names a step (see the module docstring)."""
        try:
            checkpoint_step(checkpoint_id)
            return True
        except StepError:
            return False

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Refuses a save without a checkpoint id: a step must be named."""
        self._abort_pending()  # a save whose finish() never came (another rank failed): its slot is freed
        self._is_coordinator = is_coordinator
        if kwargs.get("use_collectives") is False and self.world > 1:
            raise PlanError("dcp.save(..., use_collectives=False) plans each rank alone with rank-local metadata; "
                            "JaxckptWriter needs DCP's global plan (one save id, the coordinator's metadata)")
        if self._step is None:
            raise StepError("dcp.save with a JaxckptWriter needs a checkpoint_id (the step to save), given to "
                            "JaxckptWriter(checkpoint_id) or dcp.save(..., checkpoint_id=...)")

    def storage_meta(self) -> StorageMeta | None:
        """The checkpoint id, recorded in DCP's metadata."""
        return StorageMeta(checkpoint_id=self.checkpoint_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Unchanged: DCP's planner decides what this rank writes."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """(coordinator) Stamp each rank's plan with this save's id and the rank's index."""
        save_id = uuid.uuid4().hex
        return [dataclasses.replace(p, storage_data=_SaveTag(save_id, i, len(plans))) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write every item of ``plan`` into one slot of this rank's store, with a crc32c each; commit it once
        every rank wrote its own (see the module docstring)."""
        tag, step = plan.storage_data, self._step
        slot: Slot | None = None
        error: Exception | None = None
        layout: list = []
        crcs: list[int] = []
        try:
            if not isinstance(tag, _SaveTag):
                raise PlanError(f"step {step}: the save plan of rank {self.rank} has storage_data {tag!r}, not the "
                                f"coordinator's JaxckptWriter stamp: every rank must save with a JaxckptWriter")
            if tag.rank != self.store.process_index:
                raise PlanError(f"step {step}: DCP planned rank {tag.rank}, but this writer's store is that of "
                                f"process {self.store.process_index}: give JaxckptWriter the process_group of "
                                f"dcp.save")
            layout, nbytes = self._layout(plan, planner, step)
            slot = self._reserve(step, nbytes)
            crcs = self.slots.write(slot, self._tasks(layout, planner, step)).result().crcs
        except Exception as e:  # noqa: BLE001 - agreed on below: raised on every rank
            error = e
        try:
            self._rounds.agree(f"writing DCP checkpoint step {step}", error)
        except BaseException:
            if slot is not None:
                self.slots.abort(slot)  # a failed write freed its slot already; aborting again is harmless
            raise
        chunks = [[it.index.fqn, off, n, crc, enc] for (it, off, n, _, enc), crc in zip(layout, crcs)]
        body = {"save_id": tag.save_id, "rank": tag.rank, "world": tag.world, "step": step,
                "checkpoint_id": self.checkpoint_id, "chunks": chunks}
        if self._is_coordinator:
            self._pending = (slot, body)
        else:
            self._commit(slot, body)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([WriteResult(index=it.index, size_in_bytes=n,
                                    storage_data=Locator(tag.rank, off, n, crc, enc))
                        for (it, off, n, _, enc), crc in zip(layout, crcs)])
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """(coordinator) Commit this rank's slot with DCP's metadata and every rank's locators as its manifest."""
        if self._pending is None:
            raise PlanError(f"step {self._step}: finish() without a write_data() of this coordinator before it")
        slot, body = self._pending
        self._pending = None
        try:
            locators: dict[MetadataIndex, Locator] = {}
            for rank_results in results:
                for wr in rank_results:
                    if not isinstance(wr.storage_data, Locator):
                        raise PlanError(f"step {slot.step}: the write result of {wr.index.fqn} was not made by a "
                                        f"JaxckptWriter (storage_data {wr.storage_data!r})")
                    locators[wr.index] = wr.storage_data
            body["metadata"] = dcp_metadata.encode(metadata, StorageIndex(body["save_id"], slot.step, body["world"],
                                                                          locators))
        except BaseException:
            self.slots.abort(slot)
            raise
        self._commit(slot, body)
        log.info("DCP checkpoint %s committed at step %d: %d chunks from %d ranks", self.checkpoint_id, slot.step,
                 len(locators), body["world"])

    # ------------------------------------------------------------------------------------------- helpers
    def _layout(self, plan: SavePlan, planner: SavePlanner, step: int) -> tuple[list, int]:
        """This rank's slot layout: (item, offset, nbytes, the bytes of a non-tensor value or None, encoding) per
        item, each 64-byte aligned, and the slot's size."""
        layout, pos = [], 0
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raw, encoding = self._value(item, planner, f"DCP checkpoint step {step}, item {item.index.fqn!r}")
                layout.append((item, pos, len(raw), raw, encoding))
                pos = align(pos + len(raw))
            else:
                td = item.tensor_data
                n = math.prod(td.chunk.sizes) * td.properties.dtype.itemsize
                layout.append((item, pos, n, None, "raw"))
                pos = align(pos + n)
        return layout, pos

    def _value(self, item: WriteItem, planner: SavePlanner, where: str) -> tuple[bytes | memoryview, str]:
        """A non-tensor item's stored bytes and their encoding (``dcp_values``)."""
        kind = type(planner)
        if kind.resolve_data is DefaultSavePlanner.resolve_data and \
                kind.transform_object is DefaultSavePlanner.transform_object:
            # DCP's own planner would torch.save the looked-up object: encode that object, rather than bytes made
            # of it and read back (a torch.save and a restricted torch.load: ~80 us a value, BENCHMARKS.md).
            return dcp_values.stored_value(planner.lookup_object(item.index), where, self.pickle_values,
                                           lambda: planner.resolve_data(item).getbuffer())
        return dcp_values.stored(planner.resolve_data(item), where, self.pickle_values)

    def _reserve(self, step: int, nbytes: int) -> Slot:
        try:
            return self.slots.reserve(step, nbytes)  # an id saved again: its slot is freed first (replace)
        except StepError as e:
            raise StepError(f"checkpoint {self.checkpoint_id!r} (step {step}) cannot be written on rank "
                            f"{self.rank}: {e} (a load still reading it, or a save of it still running?)") from None

    def _tasks(self, layout: list, planner: SavePlanner, step: int) -> list[CopyTask]:
        """The copy of each item at its offset (the slot writer's copy workers: ``Config.workers`` threads,
        ``Config.inflight_bytes`` in flight; torch copies and crc32c release the GIL); tensors straight from
        their source, on any device."""
        tasks = []
        for item, off, n, raw, _ in layout:
            if raw is not None:
                tasks.append(CopyTask(lambda raw=raw: np.frombuffer(raw, np.uint8), off, n))
            else:
                tasks.append(CopyTask(self._tensor_fetch(item, planner.resolve_data(item), step), off, n))
        return tasks

    @staticmethod
    def _tensor_fetch(item: WriteItem, t: Any, step: int) -> Callable[[], np.ndarray]:
        sizes = tuple(item.tensor_data.chunk.sizes)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != sizes or t.dtype != item.tensor_data.properties.dtype:
            raise PlanError(f"{item.index.fqn}: step {step}: the planner resolved {type(t).__name__} "
                            f"{getattr(t, 'dtype', '')}{list(getattr(t, 'shape', []))} for a chunk of "
                            f"{item.tensor_data.properties.dtype}{list(sizes)}")
        return lambda: numpy_view(t.detach().cpu())

    def _commit(self, slot: Slot, body: dict) -> None:
        """Commit ``slot`` with ``body`` as its manifest and count it (retention)."""
        try:
            manifest = pack_slot_manifest(body)
        except BaseException:
            self.slots.abort(slot)
            raise
        self.slots.commit(slot, manifest)
        self.slots.count(slot.step)

    def _abort_pending(self) -> None:
        if self._pending is not None:
            slot, _ = self._pending
            self._pending = None
            self.slots.abort(slot)

    def close(self) -> None:
        """Abort an unfinished save, end the rounds and close the store if this writer made it (a memory store's
        data goes)."""
        self._abort_pending()
        self.slots.close()
        self._rounds.close()
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> "JaxckptWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class JaxckptReader(StorageReader):
    """A DCP ``StorageReader`` from jaxckpt's store ``config.store`` (see the module docstring).

    ``store``: an existing store to read (e.g. ``writer.store`` for ``store="memory"``); otherwise one is made
    from ``config`` for this rank and closed by :meth:`close`. ``trust_pickled_values``: load the non-tensor values
    a writer stored pickled (``pickle_values=True``), which DCP's planner unpickles in full; only for a store you
    trust (see the module docstring).
    """

    def __init__(self, checkpoint_id: Any = None, *, config: Config | None = None, store: Store | None = None,
                 process_group: dist.ProcessGroup | None = None, trust_pickled_values: bool = False) -> None:
        self._group, self.rank, self.world = _group_of(process_group)
        self.config, self.store, self._owns_store = _make_store(config, store, self.rank, self.world)
        self.trust_pickled_values = trust_pickled_values
        self.checkpoint_id: str | None = None
        self._step: int | None = None
        self._index: StorageIndex | None = None
        self._rounds = _GroupRounds(self._group, self.config)  # the group's error agreement
        self._chunks: dict[MetadataIndex, tuple[torch.dtype, tuple[int, ...]]] = {}
        if checkpoint_id is not None:
            self.reset(checkpoint_id)

    # ---------------------------------------------------------------------------------------- DCP's calls
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Start a new load; ``checkpoint_id`` names its step (None: kept from before, or the newest)."""
        if checkpoint_id is not None:
            self._step = checkpoint_step(checkpoint_id)
            self.checkpoint_id = os.fspath(checkpoint_id) if not isinstance(checkpoint_id, int) else str(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Whether ``checkpoint_id`` names a step (see the module docstring)."""
        return JaxckptWriter.validate_checkpoint_id(checkpoint_id)

    def read_metadata(self) -> Metadata:
        """(all ranks) The checkpoint's metadata: read by group rank 0 from its store, broadcast as bytes."""
        payload, error = None, None
        if self.rank == 0:
            try:
                payload = msgpack.packb(self._local_metadata())
            except Exception as e:  # noqa: BLE001 - agreed on: the other ranks would wait for it otherwise
                error = e
        self._rounds.agree("reading DCP checkpoint metadata", error)
        if self._group is not None:
            payload = xc.broadcast_bytes(self._group, payload)
        return dcp_metadata.decode(msgpack.unpackb(payload), f"metadata of checkpoint {self.checkpoint_id or 'newest'}")

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Index the saved chunks' dtypes and shapes."""
        index = metadata.storage_data
        if not isinstance(index, StorageIndex):
            raise ManifestError(f"the DCP metadata given to JaxckptReader was not read by one (storage_data "
                                f"{type(index).__name__})")
        self._index = index
        self._chunks = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for c in md.chunks:
                    self._chunks[MetadataIndex(fqn, c.offsets)] = (md.properties.dtype, tuple(c.sizes))

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Unchanged: DCP's planner decides what this rank reads."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Unchanged."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """(all ranks) Read every item of ``plan`` (own slot, other ranks through the group, see docstring)."""
        index = self._index
        if index is None:
            raise PlanError("read_data() before set_up_storage_reader()")
        chunks = ChunkSet(self.store, index, self._group, self.rank, self.world, self._rounds.channel())
        try:
            got = chunks.read(plan)
            for req in plan.items:
                self._deliver(req, got[req.storage_index], planner, index)
        finally:
            chunks.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # ------------------------------------------------------------------------------------------- helpers
    def _local_metadata(self) -> dict:
        steps = self.store.steps()
        if self._step is None:
            if not steps:
                raise StepNotFoundError(f"no DCP checkpoint to load: the {self.store.name} store of rank 0 "
                                        f"(job {self.config.job_id!r}) holds no step")
            candidates = list(reversed(steps))
        else:
            candidates = [self._step]
        for step in candidates:
            view = self.store.open(step)
            if view is None:
                raise StepNotFoundError(f"checkpoint {self.checkpoint_id!r} (step {step}) is not held by the "
                                        f"{self.store.name} store of rank 0 (job {self.config.job_id!r}; it holds "
                                        f"steps {steps or 'none'})")
            with view:
                body = unpack_slot_manifest(view.manifest, f"step {step} of rank 0")
            if "metadata" in body:
                self.checkpoint_id = self.checkpoint_id or str(step)
                return body["metadata"]
            if self._step is not None:
                raise StepNotFoundError(f"checkpoint {self.checkpoint_id!r} (step {step}) has no metadata on rank "
                                        f"0: its save did not finish (DCP's finish() never ran)")
        raise StepNotFoundError(f"no finished DCP checkpoint in the {self.store.name} store of rank 0 (steps "
                                f"{steps})")

    def _deliver(self, req: Any, buf: memoryview, planner: LoadPlanner, index: StorageIndex) -> None:
        step = index.step
        if req.type == LoadItemType.BYTE_IO:
            where = f"DCP checkpoint step {step}, item {req.storage_index.fqn!r}"
            encoding = index.locators[req.storage_index].encoding
            planner.load_bytes(req, dcp_values.loadable(bytes(buf), encoding, where, self.trust_pickled_values))
            return
        dtype, sizes = self._chunks[MetadataIndex(req.storage_index.fqn, req.storage_index.offset)]
        src = byte_tensor(buf).view(dtype).view(sizes)
        for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
            src = src.narrow(dim, start, length)  # the region of the saved chunk this item reads
        target = planner.resolve_tensor(req).detach()
        if target.size() != src.size():
            raise PlanError(f"{req.dest_index.fqn}: step {step}: the planner's target is {list(target.size())}, "
                            f"the saved region {list(src.size())}")
        target.copy_(src)
        planner.commit_tensor(req, target)

    def close(self) -> None:
        """End this reader's rounds (bounded by ``Config.peer_timeout_s`` for ranks that do not close), and close
        the store if this reader made it."""
        self._rounds.close()
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> "JaxckptReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
