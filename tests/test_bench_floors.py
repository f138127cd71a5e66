"""The floors ``bench stall`` measures a snapshot against (``jaxckpt.tools.bench.breakdown``): ``view-floor``'s
views are the buffers a save reads, zero-copy, and they keep a donating step off those buffers until the floor's
pass drops them, as a save's views do; the pass copies every piece and drops what it held on its own thread."""
import gc
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt
from jaxckpt.tools.bench.breakdown import FloorCopy, saved_views, take_views
from jaxckpt.tools.bench.memcpy import memcpy_seconds


def _state():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    return {"w": put(jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8), P("data", "model")),
            "m": put(jnp.arange(16.0).reshape(2, 8), P(None, "model")),
            "r": put(jnp.arange(32, dtype=jnp.int32), P()),
            "b": put(jnp.ones((8, 4), jnp.bfloat16), P("data", None))}


def test_view_floor_views_exactly_the_buffers_a_save_reads_and_holds_them_through_a_donating_step():
    state = _state()
    with jaxckpt.Checkpointer(jaxckpt.Config(keep=1, replicas="split")) as ck:
        ck.save(0, state).result()
        plan = saved_views(ck)
        with ck.engine.open(0) as (_, manifests, _reader):
            saved = {a.path: len(a.chunks) for a in manifests[0].arrays}
    leaves = jax.tree_util.tree_leaves(state)
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    # one process, so every distinct shard once: 8 of "w", 2 of "m" (of its 8 buffers), 1 of "r" (of 8), 4 of "b"
    counts = {paths[i]: len(devs) for i, _how, _pos, devs, _protocol in plan}
    assert counts == {"['b']": 4, "['m']": 2, "['r']": 1, "['w']": 8}, counts
    assert sum(saved.values()) >= sum(counts.values()), saved

    views = take_views(leaves, plan)
    for (i, _how, _pos, devices, _protocol), vs in zip(plan, views):
        by_device = {s.device.id: s for s in leaves[i].addressable_shards}
        for d, v in zip(devices, vs):
            data = by_device[d].data
            assert v.dtype == data.dtype and v.shape == data.shape
            np.testing.assert_array_equal(v, np.asarray(data))
            # zero-copy: the view is the device buffer itself
            assert v.__array_interface__["data"][0] == data.unsafe_buffer_pointer(), (paths[i], d)
    expected = [[v.copy() for v in vs] for vs in views]

    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 3 + 1, s), donate_argnums=0)
    state = jax.block_until_ready(step(state))  # donates the buffers the views hold
    state = jax.block_until_ready(step(state))
    for vs, want in zip(views, expected):
        for v, w in zip(vs, want):
            np.testing.assert_array_equal(v, w)  # the step left the viewed buffers alone


class _Held:
    """Stands for a pass's views: weak-referenceable, so the test sees where the floor drops it."""


class _Gate:
    """The floor's pieces, handed out once ``open`` is set: the pass starts only after the test let go."""

    def __init__(self, pieces: list, open_: threading.Event) -> None:
        self.pieces, self.open = pieces, open_

    def __iter__(self):
        assert self.open.wait(10)
        return iter(self.pieces)


def test_floor_copy_copies_every_piece_and_drops_what_it_held_on_its_own_thread():
    sizes = [1, 1024, 40 << 10, 3 << 20, 7]
    floor, go = FloorCopy(sizes), threading.Event()
    try:
        pieces = floor._pieces
        floor._pieces = _Gate(pieces, go)
        dropped_on: list[int] = []

        def held() -> _Held:
            h = _Held()
            weakref.finalize(h, lambda: dropped_on.append(threading.get_ident()))
            return h

        floor.start(held())  # the test keeps no reference: the pass's thread holds the last one
        gc.collect()
        assert dropped_on == []  # held while the pass has not run
        go.set()
        floor.wait()
        assert len(dropped_on) == 1 and dropped_on[0] != threading.get_ident(), dropped_on
        floor._pieces = pieces
        floor.start()  # no views: copy-floor's pass
        floor.wait()
        assert floor.passes == 2 and floor.bytes == sum(sizes)
        for src, dst in pieces:
            np.testing.assert_array_equal(src, dst)
    finally:
        go.set()  # never leave the pass waiting at the gate
        floor.close()


def test_memcpy_runs_its_hook_ahead_of_each_timed_copy_and_checks_its_sizes():
    """``bench cluster``'s copies at once: the hook (a barrier there) runs before each timed copy, in order."""
    called: list[int] = []
    times = memcpy_seconds(1 << 20, 3, before=called.append)
    assert called == [0, 1, 2] and len(times) == 3 and all(t > 0 for t in times)
    with pytest.raises(ValueError, match="nbytes=0"):
        memcpy_seconds(0, 3)


def test_the_breakdown_counts_the_training_thread_s_waits_for_the_gil_among_its_blocked_time():
    """A span in which another thread holds the GIL in a pure-Python loop while the training thread runs Python
    too: the training thread waits for the GIL at every switch interval, off a core, and the breakdown's blocked
    time and voluntary switches say so; the same span alone shows neither. A sleep is blocked time too."""
    import time as _time

    from jaxckpt.tools.bench.breakdown import Breakdown, blocked_added, describe

    def work(seconds_cpu: float) -> None:  # Python bytecode until this thread has had that much CPU
        end = _time.thread_time() + seconds_cpu
        while _time.thread_time() < end:
            sum(range(200))

    def span(contended: bool) -> dict:
        stop = threading.Event()

        def spin():
            while not stop.is_set():
                sum(range(200))
        other = threading.Thread(target=spin, daemon=True) if contended else None
        probe = Breakdown()
        probe.start()
        if other is not None:
            other.start()
        work(0.2)
        stop.set()
        if other is not None:
            other.join()
        return probe.stop(1)

    alone, contended = span(False), span(True)
    assert alone["training"]["blocked_ms"] < 100, alone  # it ran: 200 ms of CPU, nothing to wait for
    assert contended["training"]["blocked_ms"] > 50, contended  # about a switch interval per turn of the other
    assert contended["training"]["switches"] > alone["training"]["switches"] + 5, (alone, contended)
    assert contended["cpu_ms"]["training thread"] >= 200 * 0.95, contended
    assert blocked_added(contended, alone).startswith("training thread blocked +"), blocked_added(contended, alone)
    assert "training thread blocked ms per save (waiting for the GIL" in describe(contended)
    probe = Breakdown()
    probe.start()
    _time.sleep(0.1)
    slept = probe.stop(1)["training"]
    assert slept["blocked_ms"] >= 90 and slept["switches"] >= 1, slept
