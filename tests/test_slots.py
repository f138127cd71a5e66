"""The one slot path (``jaxckpt.core.slots.SlotWriter``) on a real memory store: a slot reserved, written with a
crc32c per chunk, committed with its manifest (given with the write or after it) or freed on any failure,
retention of the ``keep`` newest counted steps with pins, a step replaced only where the caller allows it; and
both callers, the engine (through the torch ``Checkpointer``) and DCP's ``JaxckptWriter``, keeping those
properties alike, since both write through it."""
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from jaxckpt import Config
from jaxckpt.backends.memory import MemoryStore
from jaxckpt.core.checksum import crc32c
from jaxckpt.core.copier import CopyTask
from jaxckpt.core.slots import SlotWriter
from jaxckpt.errors import BudgetExceededError, StepError
from jaxckpt.torch import Checkpointer, JaxckptReader, JaxckptWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def chunks(*arrays):
    """Copy tasks laying ``arrays`` out back to back (the caller's layout), and the slot's size."""
    tasks, pos = [], 0
    for a in arrays:
        tasks.append(CopyTask(lambda a=a: a, pos, a.nbytes))
        pos += a.nbytes
    return tasks, pos


@pytest.fixture
def store():
    s = MemoryStore(Config(job_id="slots"))
    yield s
    s.close()


def write_step(slots: SlotWriter, step: int, *arrays, manifest=b"m") -> list[int]:
    tasks, n = chunks(*arrays)
    slot = slots.reserve(step, n)
    crcs = slots.write(slot, tasks, manifest=lambda r: manifest + bytes(str(r.crcs), "ascii")).result(30).crcs
    slots.count(step)
    return crcs


def test_a_slot_is_written_with_crc32cs_and_readable_only_once_committed(store):
    slots = SlotWriter(store, 2, workers=2, inflight_bytes=1 << 20)
    a, b = np.arange(1000, dtype=np.float32), np.arange(77, dtype=np.uint8)
    tasks, n = chunks(a, b)
    slot = slots.reserve(5, n)
    result = slots.write(slot, tasks).result(30)  # no manifest: written, not committed (DCP's coordinator)
    assert result.crcs == [crc32c(a.view(np.uint8)), crc32c(b)]
    assert store.steps() == [] and store.open(5) is None
    slots.commit(slot, b"given after the copy")
    with store.open(5) as view:
        assert view.manifest == b"given after the copy"
        assert bytes(view.buffer[:a.nbytes]) == a.tobytes() and bytes(view.buffer[a.nbytes:n]) == b.tobytes()
    slots.close()


def test_a_failure_in_the_copy_or_the_manifest_frees_the_slot_and_keeps_what_was_committed(store):
    slots = SlotWriter(store, 1, workers=1, inflight_bytes=1 << 20)
    kept = np.arange(64, dtype=np.int64)
    write_step(slots, 1, kept)

    def unreadable():
        raise RuntimeError("the shard cannot be read")

    slot = slots.reserve(2, 8)
    with pytest.raises(RuntimeError, match="the shard cannot be read"):
        slots.write(slot, [CopyTask(unreadable, 0, 8)], manifest=lambda r: b"never").result(30)
    slot = slots.reserve(2, kept.nbytes)  # the failed slot was freed: the step can be reserved again

    def bad_manifest(result):
        raise ValueError("the manifest cannot be encoded")

    with pytest.raises(ValueError, match="the manifest cannot be encoded"):
        slots.write(slot, chunks(kept)[0], manifest=bad_manifest).result(30)
    assert store.steps() == [1]
    with store.open(1) as view:
        assert bytes(view.buffer[:kept.nbytes]) == kept.tobytes()
    slots.close()


def test_a_held_step_is_replaced_only_where_the_caller_allows_it(store):
    engine_like = SlotWriter(store, 3, workers=1, inflight_bytes=1 << 20)
    write_step(engine_like, 4, np.zeros(8, np.uint8))
    with pytest.raises(StepError, match="step 4 is already held by the memory store"):
        engine_like.reserve(4, 8)
    dcp_like = SlotWriter(store, 3, workers=1, inflight_bytes=1 << 20, replace=True, counted=store.steps())
    write_step(dcp_like, 4, np.ones(8, np.uint8), manifest=b"again")
    with store.open(4) as view:
        assert bytes(view.buffer[:8]) == bytes([1] * 8) and view.manifest.startswith(b"again")
    assert dcp_like.counted() == [4]
    engine_like.close()
    dcp_like.close()


def test_retention_keeps_the_newest_counted_steps_the_one_just_counted_and_pinned_ones(store):
    slots = SlotWriter(store, 2, workers=1, inflight_bytes=1 << 20, replace=True)
    x = np.zeros(4, np.uint8)
    for s in (1, 2, 3):
        write_step(slots, s, x)
    assert store.steps() == [2, 3] == slots.counted()
    write_step(slots, 0, x)  # a lower step (a DCP id) saved after higher ones stays until a newer one counts
    assert store.steps() == [0, 2, 3]
    slots.pin(2)
    write_step(slots, 4, x)
    assert store.steps() == [2, 3, 4] and slots.counted() == [3, 4] and slots.pinned() == [2]
    slots.unpin(2)  # retention let it go while pinned: freed with its last pin
    assert store.steps() == [3, 4] and slots.pinned() == []
    slots.pin(3, let_go=True)  # an adopted step held only as a fallback
    slots.forget([4])
    assert slots.counted() == [3]
    slots.unpin(3)
    assert store.steps() == [4]  # forgetting leaves the bytes to the caller
    slots.close()


def test_spares_kept_past_keep_give_way_to_a_save_over_budget_and_counted_steps_never_do(caplog):
    """What a start-up adoption holds past ``keep`` (a fallback, the newest protected step) would otherwise fill a
    tight budget for good: no save fits, so no newer step is protected to release them. A save over budget
    deletes them, fallbacks first, then the guard, oldest first, saying so; a plain pin and the counted steps
    are never deleted for room: a save that still does not fit raises and leaves them readable."""
    x = np.arange(1024, dtype=np.uint8)  # 1 KiB a step
    store = MemoryStore(Config(job_id="slots-spares", memory_budget_bytes=4 * x.nbytes))
    slots = SlotWriter(store, 2, workers=1, inflight_bytes=1 << 20, counted=[])
    for s in (1, 2, 3, 4):
        write_step(slots, s, x + s)  # counting 3 and 4 lets go of 1 and 2: pinned first, they stay
        if s <= 2:
            slots.pin(s, let_go=False, spare="guard" if s == 1 else "fallback")
    assert store.steps() == [1, 2, 3, 4] and slots.counted() == [3, 4] and slots.pinned() == [1, 2]
    with caplog.at_level("WARNING", logger="jaxckpt.core.slots"):
        write_step(slots, 5, x + 5)
    assert store.steps() == [1, 4, 5] and slots.counted() == [4, 5] and slots.pinned() == [1]
    assert "step 2, kept past retention only as the start-up fallback, is deleted to make room" in caplog.text
    assert "step 5: snapshot of 1024 bytes does not fit the memory budget of 4096 bytes" in caplog.text
    caplog.clear()
    slots.pin(4)  # a pin of another kind (a restore, protection in flight): never given up
    write_step(slots, 6, x + 6)  # fits: 1, 4, 5, 6
    with caplog.at_level("WARNING", logger="jaxckpt.core.slots"):
        write_step(slots, 7, x + 7)
        assert "step 1, kept past retention only as the start-up guard, is deleted to make room" in caplog.text
        with pytest.raises(BudgetExceededError, match=r"step 8: snapshot of 2048 bytes does not fit the memory "
                                                      r"budget of 4096 bytes"):
            slots.reserve(8, 2 * x.nbytes)
    assert store.steps() == [4, 6, 7] and slots.counted() == [6, 7] and slots.pinned() == [4]
    for s in (4, 6, 7):
        with store.open(s) as view:
            assert bytes(view.buffer[:x.nbytes]) == (x + s).tobytes()
    with pytest.raises(ValueError, match="a spare is a 'fallback' or the 'guard', got 'maybe'"):
        slots.pin(6, spare="maybe")
    slots.close()
    store.close()


def test_the_engine_and_dcp_write_through_one_slot_path():
    """Both callers hold a SlotWriter on their store, and both keep its properties: a save over the store's
    budget raises the store's BudgetExceededError naming the step, frees its slot, and leaves the step saved
    before readable bit for bit; ``keep`` bounds the store alike."""
    small = {"w": torch.arange(256, dtype=torch.float32)}
    big = {"w": torch.arange(256, dtype=torch.float32), "big": torch.ones(64 << 10, dtype=torch.uint8)}
    budget = 32 << 10
    with Checkpointer(Config(job_id="slots-engine", keep=1, memory_budget_bytes=budget)) as ck:
        assert isinstance(ck.engine.slots, SlotWriter) and ck.engine.slots.store is ck.engine.store
        ck.save(1, small).result(30)
        with pytest.raises(BudgetExceededError, match=r"step 2: snapshot of \d+ bytes does not fit the memory "
                                                       r"budget of 32768 bytes"):
            ck.save(2, big).result(30)
        assert ck.engine.store.steps() == [1] and ck.latest_step() == 1
        got = ck.restore({"w": torch.zeros(256)})
        assert bytes(got["w"].numpy()) == bytes(small["w"].numpy())
        ck.save(3, small).result(30)
        assert ck.engine.store.steps() == [3]
    with JaxckptWriter(config=Config(job_id="slots-dcp", keep=1, memory_budget_bytes=budget)) as w:
        assert isinstance(w.slots, SlotWriter) and w.slots.store is w.store and w.slots.replace
        dcp.save(small, storage_writer=w, checkpoint_id=1)
        with pytest.raises(CheckpointException) as e:
            dcp.save(big, storage_writer=w, checkpoint_id=2)
        err = e.value.failures[0][0]
        assert isinstance(err, BudgetExceededError), err
        assert "step 2: snapshot of" in str(err) and "does not fit the memory budget of 32768 bytes" in str(err)
        assert w.store.steps() == [1]
        target = {"w": torch.zeros(256)}
        dcp.load(target, storage_reader=JaxckptReader(store=w.store), checkpoint_id=1)
        assert bytes(target["w"].numpy()) == bytes(small["w"].numpy())
        dcp.save(small, storage_writer=w, checkpoint_id=3)
        assert w.store.steps() == [3]
