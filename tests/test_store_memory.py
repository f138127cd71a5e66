"""MemoryStore against the shared Store conformance suite, plus what only the memory store promises."""
import numpy as np

from jaxckpt.backends.memory import MemoryStore
from jaxckpt.config import Config
from jaxckpt.registry import get_store_class
from jaxckpt.core.store import Store
from jaxckpt.testing.store import N, StoreTests


class TestMemoryStore(StoreTests):
    def make_store(self, config: Config) -> Store:
        return MemoryStore(config)

    def test_registered_as_memory(self) -> None:
        assert get_store_class("memory") is MemoryStore

    def test_double_buffered_with_two_allocations(self, store: Store) -> None:
        # keep=1 in the engine: a new step is written into the second buffer, never into the committed one.
        slots = [self.write(store, 1), self.write(store, 2)]
        store.delete(1)
        slot3 = self.write(store, 3, commit=False)
        assert store.allocations == 2
        a = np.frombuffer(slot3.buffer, dtype=np.uint8)
        with store.open(2) as view:
            b = np.frombuffer(view.buffer, dtype=np.uint8)
            assert not np.shares_memory(a, b)
        assert np.shares_memory(a, np.frombuffer(slots[0].buffer, dtype=np.uint8))
        store.abort(slot3)

    def test_idle_buffers_are_given_back_before_the_budget_refuses(self, open_store) -> None:
        store = open_store(memory_budget_bytes=5 * N // 2)
        self.write(store, 1, N)
        store.delete(1)  # pooled: N idle bytes
        self.write(store, 2, 2 * N)  # does not fit the pooled buffer; the pool is dropped to make room
        assert store.held_bytes() == 2 * N
        with store.open(2) as view:
            self.assert_snapshot(view, 2, 2 * N)
