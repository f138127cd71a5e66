"""A conformance suite every Store backend inherits (zarr's ``zarr.testing.store.StoreTests`` is the model).

A backend's test module subclasses :class:`StoreTests` and supplies the one hook it needs::

    class TestMyStore(StoreTests):
        def make_store(self, config: Config) -> Store:
            return MyStore(config)

and, when the backend is registered under another name or needs fields of its own, ``config(**changes)``.
The class name does not start with ``Test`` so pytest collects only the subclasses. Needs pytest (the
``test`` extra); no part of the library imports this module.

What every store must do (jaxckpt/core/store.py states the state machine): a WRITING slot is never visible to
``steps()``/``open()``; a committed snapshot's bytes never change while a view of it is open, whatever later
saves reserve, write, abort or delete; aborted slots vanish; a step is reserved at most once while held;
a store over its memory budget refuses the new slot and keeps every committed snapshot; after ``close()``
nothing new starts, open views stay readable until closed, and nothing is held once they are.

Capabilities (jaxckpt/core/capabilities.py): every one a store's class declares is given and works (its node agent
finds itself, its agent holders read committed snapshots, its protection slots are separate and the agent's pull
builds a copy block into one), and every one it does not declare is refused with CapabilityError.
"""
from __future__ import annotations

import os
import threading
from typing import Callable, Iterator

import numpy as np
import pytest

from jaxckpt.config import Config
from jaxckpt.errors import BudgetExceededError, CapabilityError, ClosedError, StepError, StepNotFoundError
from jaxckpt.core import capabilities as cap
from jaxckpt.core import manifest as mf
from jaxckpt.core.box import Box
from jaxckpt.core.checksum import crc32c
from jaxckpt.core.store import Slot, SnapshotView, Store

# Page-sized snapshots, so that backends which round to pages (shared memory) meet the same budgets.
N = 64 << 10


def pattern(step: int, nbytes: int = N) -> np.ndarray:
    """Bytes that differ from step to step and from offset to offset."""
    return ((np.arange(nbytes, dtype=np.uint64) * 2654435761 + step * 40503) >> 7).astype(np.uint8)


def manifest_of(step: int) -> bytes:
    return f"manifest of step {step}".encode() + bytes(range(256))


class StoreTests:
    """Conformance tests for a :class:`~jaxckpt.core.store.Store`; subclass and implement :meth:`make_store`."""

    # ------------------------------------------------------------------------------------------------ hooks
    def make_store(self, config: Config) -> Store:
        """A new, empty store of the backend under test."""
        raise NotImplementedError

    def config(self, **changes) -> Config:
        """The config stores are made with; override to pick the backend's registry name or its own fields."""
        return Config(**changes)

    def allocation_count(self, store: Store) -> int | None:
        """Buffers the store has allocated so far, or None when the backend does not expose it."""
        return getattr(store, "allocations", None)

    # ------------------------------------------------------------------------------------------- fixtures
    @pytest.fixture
    def open_store(self) -> Iterator[Callable[..., Store]]:
        """``open_store(**config_changes)``: a new store, closed at teardown."""
        made: list[Store] = []

        def make(**changes) -> Store:
            s = self.make_store(self.config(**changes))
            made.append(s)
            return s

        yield make
        for s in made:
            s.close()

    @pytest.fixture
    def store(self, open_store) -> Store:
        return open_store()

    # ------------------------------------------------------------------------------------------- helpers
    @staticmethod
    def write(store: Store, step: int, nbytes: int = N, *, commit: bool = True) -> Slot:
        slot = store.reserve(step, nbytes)
        np.frombuffer(slot.buffer, dtype=np.uint8)[:] = pattern(step, nbytes)
        if commit:
            store.commit(slot, manifest_of(step))
        return slot

    @staticmethod
    def assert_snapshot(view: SnapshotView, step: int, nbytes: int = N) -> None:
        assert view.step == step
        assert bytes(view.manifest) == manifest_of(step)
        assert len(view.buffer) == nbytes
        np.testing.assert_array_equal(np.frombuffer(view.buffer, dtype=np.uint8), pattern(step, nbytes))

    # ------------------------------------------------------------------------------------ reserve/commit
    def test_empty_store(self, store: Store) -> None:
        assert store.steps() == []
        assert store.latest() is None
        assert store.open(0) is None

    def test_reserve_gives_a_writable_slot_of_exactly_nbytes(self, store: Store) -> None:
        slot = store.reserve(3, N)
        assert (slot.step, slot.nbytes, len(slot.buffer)) == (3, N, N)
        assert not slot.buffer.readonly
        store.abort(slot)

    def test_commit_then_open_roundtrips_bytes_and_manifest(self, store: Store) -> None:
        self.write(store, 1)
        assert store.steps() == [1]
        assert store.latest() == 1
        with store.open(1) as view:
            self.assert_snapshot(view, 1)

    def test_manifest_alone_pins_nothing(self, store: Store) -> None:
        self.write(store, 1)
        slot = store.reserve(2, N)  # being written: not committed, no manifest yet
        assert store.manifest(1) == manifest_of(1) and store.manifest(2) is None and store.manifest(7) is None
        store.abort(slot)
        store.delete(1)  # as any step (test_agent.py checks the agent holds no pin of it)
        assert store.steps() == [] and store.manifest(1) is None

    def test_view_is_read_only(self, store: Store) -> None:
        self.write(store, 1)
        view = store.open(1)
        try:
            assert view.buffer.readonly
            with pytest.raises(TypeError):
                view.buffer[0] = 1
        finally:
            view.close()

    def test_writing_slot_is_invisible(self, store: Store) -> None:
        self.write(store, 1)
        slot = self.write(store, 2, commit=False)
        assert store.steps() == [1]
        assert store.latest() == 1
        assert store.open(2) is None
        store.commit(slot, manifest_of(2))
        assert store.steps() == [1, 2]
        with store.open(2) as view:
            self.assert_snapshot(view, 2)

    def test_steps_are_sorted_whatever_the_commit_order(self, store: Store) -> None:
        slots = {s: self.write(store, s, commit=False) for s in (5, 2, 9)}
        for s in (9, 2, 5):
            store.commit(slots[s], manifest_of(s))
        assert store.steps() == [2, 5, 9]
        assert store.latest() == 9

    def test_duplicate_reserve_raises_step_error(self, store: Store) -> None:
        slot = store.reserve(4, N)
        with pytest.raises(StepError, match="4"):
            store.reserve(4, N)  # while writing
        store.commit(slot, manifest_of(4))
        with pytest.raises(StepError, match="4"):
            store.reserve(4, N)  # while committed
        assert store.steps() == [4]

    def test_commit_twice_raises_step_error(self, store: Store) -> None:
        slot = self.write(store, 1)
        with pytest.raises(StepError, match="1"):
            store.commit(slot, b"other")
        with store.open(1) as view:
            self.assert_snapshot(view, 1)

    def test_commit_of_aborted_slot_raises_step_error(self, store: Store) -> None:
        slot = self.write(store, 1, commit=False)
        store.abort(slot)
        with pytest.raises(StepError, match="1"):
            store.commit(slot, manifest_of(1))
        assert store.steps() == []

    def test_zero_byte_snapshot(self, store: Store) -> None:
        slot = store.reserve(1, 0)
        assert len(slot.buffer) == 0
        store.commit(slot, b"")
        with store.open(1) as view:
            assert len(view.buffer) == 0 and bytes(view.manifest) == b""

    def test_large_manifest_roundtrips(self, store: Store) -> None:
        manifest = pattern(7, 1 << 20).tobytes()
        slot = store.reserve(1, 64)
        store.commit(slot, manifest)
        with store.open(1) as view:
            assert bytes(view.manifest) == manifest

    def test_knows_its_process(self, store: Store) -> None:
        assert 0 <= store.process_index < store.process_count

    # --------------------------------------------------------------------------------------------- abort
    def test_aborted_slot_disappears_and_step_can_be_reserved_again(self, store: Store) -> None:
        self.write(store, 1)
        slot = self.write(store, 2, commit=False)
        store.abort(slot)
        assert store.steps() == [1]
        assert store.open(2) is None
        self.write(store, 2)
        with store.open(2) as view:
            self.assert_snapshot(view, 2)

    def test_abort_is_idempotent_and_never_touches_a_committed_slot(self, store: Store) -> None:
        slot = self.write(store, 1)
        store.abort(slot)  # committed: abort is a no-op
        assert store.steps() == [1]
        with store.open(1) as view:
            self.assert_snapshot(view, 1)
        other = self.write(store, 2, commit=False)
        store.abort(other)
        store.abort(other)
        assert store.steps() == [1]

    # -------------------------------------------------------------------------------------------- delete
    def test_delete(self, store: Store) -> None:
        for s in (1, 2, 3):
            self.write(store, s)
        store.delete(2)
        assert store.steps() == [1, 3]
        assert store.open(2) is None
        store.delete(2)  # already gone
        store.delete(99)  # never held
        assert store.steps() == [1, 3]

    def test_delete_of_a_writing_slot_is_ignored(self, store: Store) -> None:
        slot = self.write(store, 1, commit=False)
        store.delete(1)
        store.commit(slot, manifest_of(1))
        with store.open(1) as view:
            self.assert_snapshot(view, 1)

    def test_retain_keeps_only_the_given_steps(self, store: Store) -> None:
        for s in (1, 2, 3, 4):
            self.write(store, s)
        store.retain({2, 4})
        assert store.steps() == [2, 4]

    def test_pinned_view_survives_delete_and_new_saves(self, store: Store) -> None:
        self.write(store, 1)
        view = store.open(1)
        try:
            store.delete(1)
            assert store.steps() == []
            assert store.open(1) is None
            # Later saves of the same size must not be handed the pinned buffer.
            for s in range(2, 6):
                slot = store.reserve(s, N)
                np.frombuffer(slot.buffer, dtype=np.uint8)[:] = 0xFF
                store.commit(slot, manifest_of(s))
                store.delete(s)
            aborted = store.reserve(6, N)
            np.frombuffer(aborted.buffer, dtype=np.uint8)[:] = 0xEE
            store.abort(aborted)
            self.assert_snapshot(view, 1)
        finally:
            view.close()
        view.close()  # closing twice is harmless

    def test_every_pin_must_close_before_the_bytes_go(self, store: Store) -> None:
        self.write(store, 1)
        a, b = store.open(1), store.open(1)
        store.delete(1)
        a.close()
        for s in (2, 3):
            slot = store.reserve(s, N)
            np.frombuffer(slot.buffer, dtype=np.uint8)[:] = 0xFF
            store.commit(slot, manifest_of(s))
            store.delete(s)
        self.assert_snapshot(b, 1)
        b.close()

    def test_writer_never_touches_the_newest_committed_snapshot(self, store: Store) -> None:
        # keep=1 in an engine: one committed, one writing, the older freed as soon as the new one commits.
        self.write(store, 1)
        for s in range(2, 8):
            with store.open(s - 1) as newest:
                slot = store.reserve(s, N)
                np.frombuffer(slot.buffer, dtype=np.uint8)[:] = 0xFF
                self.assert_snapshot(newest, s - 1)
                np.frombuffer(slot.buffer, dtype=np.uint8)[:] = pattern(s)
                store.commit(slot, manifest_of(s))
            store.delete(s - 1)
            assert store.steps() == [s]
        with store.open(7) as view:
            self.assert_snapshot(view, 7)

    def test_snapshots_of_different_sizes(self, store: Store) -> None:
        sizes = {1: N, 2: 3 * N, 3: 100, 4: N // 2}
        for s, n in sizes.items():
            self.write(store, s, n)
        store.delete(2)
        self.write(store, 5, 2 * N)
        for s in (1, 3, 4, 5):
            with store.open(s) as view:
                self.assert_snapshot(view, s, sizes.get(s, 2 * N))

    def test_concurrent_writers(self, store: Store) -> None:
        errors: list[BaseException] = []

        def run(first: int) -> None:
            try:
                for s in range(first, first + 40, 4):
                    slot = self.write(store, s, 4096, commit=False)
                    if s % 3 == 0:
                        store.abort(slot)
                    else:
                        store.commit(slot, manifest_of(s))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        want = [s for s in range(40) if s % 3]
        assert store.steps() == want
        for s in want:
            with store.open(s) as view:
                self.assert_snapshot(view, s, 4096)

    # -------------------------------------------------------------------------------------- held bytes
    def test_held_bytes_counts_committed_and_writing(self, store: Store) -> None:
        base = store.held_bytes()
        assert base >= 0
        self.write(store, 1)
        assert store.held_bytes() >= base + N
        slot = self.write(store, 2, commit=False)
        assert store.held_bytes() >= base + 2 * N
        store.abort(slot)

    # -------------------------------------------------------------------------------------------- budget
    def test_budget_refuses_a_new_slot_and_keeps_committed_snapshots(self, open_store) -> None:
        store = open_store(memory_budget_bytes=N * 5 // 2)
        self.write(store, 1)
        self.write(store, 2)
        with pytest.raises(BudgetExceededError, match="step 3"):
            store.reserve(3, N)
        assert store.held_bytes() <= N * 5 // 2
        assert store.steps() == [1, 2]
        for s in (1, 2):
            with store.open(s) as view:
                self.assert_snapshot(view, s)
        # Once a snapshot is freed its room serves the next one.
        store.delete(1)
        self.write(store, 3)
        assert store.steps() == [2, 3]
        with store.open(2) as view:
            self.assert_snapshot(view, 2)

    def test_budget_counts_writing_slots(self, open_store) -> None:
        store = open_store(memory_budget_bytes=N * 3 // 2)
        slot = self.write(store, 1, commit=False)
        with pytest.raises(BudgetExceededError, match="step 2"):
            store.reserve(2, N)
        store.commit(slot, manifest_of(1))
        with store.open(1) as view:
            self.assert_snapshot(view, 1)

    def test_budget_refusal_leaves_no_trace(self, open_store) -> None:
        store = open_store(memory_budget_bytes=N * 3 // 2)
        self.write(store, 1)
        with pytest.raises(BudgetExceededError):
            store.reserve(2, N)
        assert store.steps() == [1]
        assert store.open(2) is None
        store.delete(1)
        self.write(store, 2)  # the refused step was never held
        assert store.steps() == [2]

    def test_pinned_deleted_snapshot_still_counts_against_the_budget(self, open_store) -> None:
        store = open_store(memory_budget_bytes=N * 3 // 2)
        self.write(store, 1)
        view = store.open(1)
        store.delete(1)
        with pytest.raises(BudgetExceededError):
            store.reserve(2, N)
        self.assert_snapshot(view, 1)
        view.close()
        self.write(store, 2)

    # -------------------------------------------------------------------------------------- buffer reuse
    def test_no_new_allocation_after_warm_up(self, store: Store) -> None:
        if self.allocation_count(store) is None:
            pytest.skip(f"{type(store).__name__} does not expose its allocation count")
        # An engine with keep=1: commit s, then free s-1; two buffers cover every later step.
        self.write(store, 1)
        self.write(store, 2)
        store.delete(1)
        warm = self.allocation_count(store)
        for s in range(3, 12):
            self.write(store, s)
            store.delete(s - 1)
            with store.open(s) as view:
                self.assert_snapshot(view, s)
        assert self.allocation_count(store) == warm
        held = store.held_bytes()
        self.write(store, 12)
        store.delete(11)
        assert store.held_bytes() == held

    def test_aborted_buffer_is_reused(self, store: Store) -> None:
        if self.allocation_count(store) is None:
            pytest.skip(f"{type(store).__name__} does not expose its allocation count")
        store.abort(self.write(store, 1, commit=False))
        warm = self.allocation_count(store)
        for s in range(2, 6):
            store.abort(self.write(store, s, commit=False))
        assert self.allocation_count(store) == warm

    # --------------------------------------------------------------------------------------------- close
    def test_close_refuses_new_work(self, open_store) -> None:
        store = open_store()
        self.write(store, 1)
        writing = self.write(store, 2, commit=False)
        store.close()
        with pytest.raises(ClosedError):
            store.reserve(3, N)
        with pytest.raises(ClosedError):
            store.commit(writing, manifest_of(2))
        with pytest.raises(ClosedError):
            store.open(1)
        # A commit decision may still arrive after close: its abort and retention must not raise.
        store.abort(writing)
        store.delete(1)
        store.close()  # idempotent

    def test_close_keeps_open_views_readable_then_frees_everything(self, open_store) -> None:
        store = open_store()
        self.write(store, 1)
        self.write(store, 2)
        view = store.open(1)
        store.close()
        self.assert_snapshot(view, 1)
        view.close()
        assert store.held_bytes() == 0
        try:
            assert store.steps() == []
        except ClosedError:
            pass

    def test_close_frees_everything(self, open_store) -> None:
        store = open_store()
        for s in (1, 2):
            self.write(store, s)
        store.delete(1)
        store.close()
        assert store.held_bytes() == 0

    # -------------------------------------------------------------------------------------- capabilities
    @staticmethod
    def declared(store: Store, kind: type):
        """``store``'s implementation of ``kind``, or skip the test when its class does not declare it."""
        if not store.supports(kind):
            pytest.skip(f"{type(store).__name__} does not offer {kind.__name__}")
        return store.capability(kind)

    def test_declared_capabilities_are_given(self, store: Store) -> None:
        for kind in type(store).capabilities:
            assert kind in cap.KNOWN, f"{type(store).__name__} declares an unknown capability {kind!r}"
            assert store.supports(kind)
            assert isinstance(store.capability(kind), kind)

    def test_undeclared_capabilities_are_refused_with_a_clear_error(self, store: Store) -> None:
        class Unheard:
            """A capability no store declares."""

        for kind in [k for k in cap.KNOWN if k not in type(store).capabilities] + [Unheard]:
            assert not store.supports(kind)
            with pytest.raises(CapabilityError, match=rf"{type(store).__name__}.* does not offer {kind.__name__}"):
                store.capability(kind)

    def test_node_agent_finds_itself(self, store: Store) -> None:
        agent = self.declared(store, cap.NodeAgent)
        assert os.path.isdir(agent.directory)
        gen = agent.generation()
        assert gen and isinstance(agent.node(), str)
        dirs = agent.directories()
        assert dirs[0] == agent.directory and len(set(dirs)) == len(dirs)
        stamp = agent.stamp(agent.directory)
        assert stamp is not None and agent.stamp(agent.directory) == stamp
        (info,) = agent.find([agent.directory])
        assert (info.generation, info.job) == (gen, store.config.job_id) and info.token
        assert cap.AgentInfo.from_wire(info.to_wire()) == info
        other = os.path.join(agent.directory, "no-agent-here")
        assert agent.stamp(other) is None and agent.find([other]) == []

    def test_agent_holders_read_committed_snapshots(self, store: Store) -> None:
        holders = self.declared(store, cap.AgentHolders)
        agent = self.declared(store, cap.NodeAgent)
        self.write(store, 3)
        self.write(store, 4, commit=False)  # being written: no holder lists or opens it
        me = store.process_index
        (info,) = agent.find([agent.directory])
        for h in (holders.node_holder("here"), holders.remote_holder(info, "there")):
            try:
                assert (h.kind, h.node) == (("node", "here") if h.kind == "node" else ("remote", "there"))
                assert [(e.step, e.crc) for e in h.held() if e.process == me] == [(3, crc32c(manifest_of(3)))]
                o = h.open(me, 3)
                try:
                    assert bytes(o.manifest) == manifest_of(3)
                    np.testing.assert_array_equal(np.frombuffer(o.read(1000, 5000), np.uint8),
                                                  pattern(3)[1000:6000])
                finally:
                    o.close()
                with pytest.raises(StepNotFoundError, match="4"):
                    h.open(me, 4)
            finally:
                h.close()

    def test_protection_slots_are_apart_and_the_agent_pull_fills_one(self, store: Store) -> None:
        from jaxckpt.protection.plan import CopyBlock, ProtectionPlan, SavedChunk
        from jaxckpt.protection.plan_wire import encode_plan
        from jaxckpt.protection.slot import PROTECT_BASE

        slots = self.declared(store, cap.ProtectionSlots)
        me = store.process_index
        # A real snapshot (its manifest names the chunk's checksum, which the agent checks) ...
        data = pattern(7)
        box = Box((0,), (N,))
        chunk = mf.ChunkMeta(box, 0, N, crc32c(data), me)
        m = mf.Manifest(7, me, store.process_count, "numpy", (mf.ArrayMeta("x", (("key", "x"),), (N,), "uint8",
                                                                            "numpy", chunks=(chunk,)),),
                        order=("x",), nbytes=N)
        slot = store.reserve(7, N)
        np.frombuffer(slot.buffer, np.uint8)[:] = data
        store.commit(slot, mf.encode(m))
        # ... and a plan that keeps a copy of its one chunk on another node.
        nodes = tuple(range(store.process_count)) + (store.process_count,)
        plan = ProtectionPlan("replica", 1, 0, 0, nodes, (), (SavedChunk(me, nodes[me], 0, N, "x", box, box, (),
                                                                             "replica"),),
                              (), (CopyBlock(0, nodes[-1], nodes[me], me, (0,), (0,), N),))
        held = store.steps()
        assert 7 in held
        ps = slots.slot_store(me)
        try:
            assert type(ps) is type(store) and ps.process_index == PROTECT_BASE + me
            assert ps.steps() == []
            pslot = ps.reserve(7, N)
            reply = ps.capability(cap.ProtectionSlots).pull(pslot, plan=encode_plan(plan), tasks=[["copy", 0, 0]],
                                                            sources={str(me): None}, rate=0, timeout=30.0)
            assert reply["crcs"] == [crc32c(data)]
            np.testing.assert_array_equal(np.frombuffer(pslot.buffer, np.uint8), data)
            ps.commit(pslot, manifest_of(7))
            assert ps.steps() == [7] and store.steps() == held
            ps.delete(7)
            assert ps.steps() == [] and store.steps() == held
            with store.open(7) as view:
                np.testing.assert_array_equal(np.frombuffer(view.buffer, np.uint8), data)
        finally:
            ps.close()
