"""save() and restore on JAX's per-buffer arrays, in one process with 8 CPU devices: what they leave to the
collector, the per-buffer shardings shared while save() takes its views, and the private and public ways to the
buffers, each checked bit for bit against the state at the call though the next step donates it."""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from jax_cases import abstract, bits, ckpt, filled, m24, mesh  # noqa: F401 - fixtures


def test_a_save_of_many_shards_leaves_few_young_python_objects_while_it_copies(ckpt, m24):
    """Tracked objects per shard that are young while the copy runs are promoted by the collector and count
    towards full collections on the training thread. A save of a state a donating step just made makes them
    (JAX's Python array and sharding of every local buffer, the views), so save() hands them to the oldest
    generation unexamined: with the collector running, as in training, what it leaves young while it copies is
    O(arrays), not O(shards), and no full collection runs; what it copied is the state at the call, bit for bit.
    Objects the caller froze stay frozen."""
    import gc
    import threading

    state = {f"p{i:03d}": filled((64, 32), jnp.float32, NamedSharding(m24, P("data", "model")), seed=i)
             for i in range(64)}
    shards = sum(len(x.addressable_shards) for x in state.values())  # 512
    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 2.0 + 1.0, s), donate_argnums=0)
    ck = ckpt(keep=2)
    ck.save(1, state).result(timeout=60)  # plans and caches made: the next save of this layout is the steady one
    state = jax.block_until_ready(step(state))  # fresh arrays: JAX has built no per-device arrays of them yet
    expected = {k: np.array(v) for k, v in state.items()}
    held = threading.Event()
    copier = ck.engine.slots.copier
    run_one = copier._run_one

    def hold(*args):
        held.wait(60)
        return run_one(*args)

    def young() -> int:
        return len(gc.get_objects(0)) + len(gc.get_objects(1))

    copier._run_one = hold
    gc.collect()
    full = gc.get_stats()[2]["collections"]
    try:
        before = young()
        handle = ck.save(2, state)
        deadline = time.monotonic() + 30
        while copier._queue.qsize() and time.monotonic() < deadline:  # the dispatcher took the save
            time.sleep(0.01)
        time.sleep(0.2)  # and built its table
        alive = young() - before
        full = gc.get_stats()[2]["collections"] - full
    finally:
        held.set()
    state = step(state)  # donates what was saved
    handle.result(timeout=60)
    copier._run_one = run_one
    assert full == 0, f"{full} full collections during a save"
    assert alive < shards // 2, f"{alive} young tracked objects alive for a save of {shards} shards"
    out = ck.restore(abstract(state), step=2)
    for k, want in expected.items():
        np.testing.assert_array_equal(bits(out[k]), bits(want), err_msg=k)
    state = jax.block_until_ready(step(state))
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        ck.save(3, state).result(timeout=60)
        assert gc.get_freeze_count() > frozen // 2  # released, it would be 0 (some frozen objects died since)
    finally:
        gc.unfreeze()


def test_a_restore_of_many_shards_leaves_few_young_python_objects(ckpt, m24):
    """A restore makes several tracked objects per chunk (plans, reads, host pieces) and the arrays it returns;
    it hands them to the oldest generation unexamined, so that with the collector running, as in training, what
    it leaves young is O(1), not O(shards), and counts towards no full collection (a relaunched 4,096-leaf job's
    first restore spent 85-100 ms in one). What it returns is the saved state, bit for bit."""
    import gc

    state = {f"p{i:03d}": filled((64, 32), jnp.float32, NamedSharding(m24, P("data", "model")), seed=i)
             for i in range(64)}
    shards = sum(len(x.addressable_shards) for x in state.values())  # 512
    ck = ckpt(keep=2)
    ck.save(1, state).result(timeout=60)
    ck.restore(abstract(state), step=1)  # plans and caches made: the next restore is the steady one

    def young() -> int:
        return len(gc.get_objects(0)) + len(gc.get_objects(1))

    gc.collect()
    before = young()
    out = ck.restore(abstract(state), step=1)
    alive = young() - before
    assert alive < shards // 2, f"{alive} young tracked objects left by a restore of {shards} shards"
    for k, want in state.items():
        np.testing.assert_array_equal(bits(out[k]), bits(want), err_msg=k)


def test_a_save_of_fresh_replicated_arrays_exposes_one_buffer_of_each(ckpt, m24):
    """JAX builds a Python array and a sharding for every local buffer of an array a step just made when any
    of them is asked for; a fully replicated array is read from one device, so its save asks for that one buffer
    only (not the 8 of the mesh): the tracked objects a save() call leaves are fewer than the local buffers of
    the state. What it saved is the state at the call, bit for bit, though the next step donates it."""
    import gc

    state = {f"r{i:03d}": filled((16, 8), jnp.float32, NamedSharding(m24, P()), seed=i) for i in range(64)}
    buffers = sum(len(x.sharding.addressable_devices) for x in state.values())  # 512
    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 2.0 + 1.0, s), donate_argnums=0)
    ck = ckpt(keep=2)
    ck.save(1, state).result(timeout=60)  # plans and caches made
    state = jax.block_until_ready(step(state))  # fresh arrays: no per-device arrays built yet
    expected, target = {k: np.array(v) for k, v in state.items()}, abstract(state)
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        handle = ck.save(2, state)
        left = len(gc.get_objects()) - before
    finally:
        gc.enable()
    state = step(state)
    handle.result(timeout=60)
    assert left < buffers, f"{left} tracked objects left by a save() of {buffers} replicated buffers"
    out = ck.restore(target, step=2)
    for k, want in expected.items():
        np.testing.assert_array_equal(bits(out[k]), bits(want), err_msg=k)


def test_jax_builds_the_same_per_buffer_shardings_inside_a_save_window_and_gets_its_function_back():
    """``buffers.shared_shardings()``: while save() takes its views, JAX's per-buffer SingleDeviceSharding comes
    from a per-device cache; the arrays it exposes there have the shardings JAX builds outside it (equal, same
    device, same memory kind), windows of two threads overlap without losing jax's function, and a function
    someone else put in jax's place after the check is left alone."""
    import threading

    from jax._src import sharding_impls

    from jaxckpt.jax import buffers

    buffers.recheck()
    own = sharding_impls.make_single_device_sharding
    m42 = mesh((4, 2), ("data", "model"))
    make = jax.jit(lambda x: x + 1.0, out_shardings=NamedSharding(m42, P("data", None)))
    outside = make(jnp.zeros((8, 4), jnp.float32))._arrays
    inside_arrays = []
    entered, leave = threading.Barrier(2), threading.Event()

    def other() -> None:
        with buffers.shared_shardings():
            entered.wait(timeout=30)
            leave.wait(timeout=30)

    t = threading.Thread(target=other)
    t.start()
    with buffers.shared_shardings():
        entered.wait(timeout=30)
        assert sharding_impls.make_single_device_sharding is buffers._cached
        for _ in range(2):
            inside_arrays.append(make(jnp.zeros((8, 4), jnp.float32))._arrays)
    assert sharding_impls.make_single_device_sharding is buffers._cached  # the other thread's window still open
    leave.set()
    t.join(timeout=30)
    assert sharding_impls.make_single_device_sharding is own
    for arrays in inside_arrays:
        assert [a.sharding for a in arrays] == [a.sharding for a in outside]
        assert all(isinstance(a.sharding, SingleDeviceSharding) for a in arrays)
        assert [a.sharding.memory_kind for a in arrays] == [a.sharding.memory_kind for a in outside]
    # one sharding per device, shared by both arrays made in the window
    assert [a.sharding for a in inside_arrays[0]] == [a.sharding for a in inside_arrays[1]]
    assert all(x.sharding is y.sharding for x, y in zip(*inside_arrays))
    theirs = lambda device, *, memory_kind=None: own(device, memory_kind=memory_kind)  # noqa: E731
    sharding_impls.make_single_device_sharding = theirs
    try:
        with buffers.shared_shardings():
            assert sharding_impls.make_single_device_sharding is theirs
        assert sharding_impls.make_single_device_sharding is theirs
    finally:
        sharding_impls.make_single_device_sharding = own
        buffers.recheck()


@pytest.mark.parametrize("public", [False, True], ids=["private-views", "public-views"])
def test_a_save_of_a_mixed_layout_is_bit_for_bit_through_either_way_to_the_buffers(ckpt, public, monkeypatch,
                                                                                  caplog):
    """save() views shards through jax's private per-device arrays where they are there and behave, else through
    the public ``addressable_shards`` (``jaxckpt.jax.buffers``; ``JAXCKPT_JAX_PUBLIC_BUFFERS=1`` forces the public
    way, as a jax without them would): either way the snapshot of a mixed layout (fully sharded, split over one
    axis, replicated) is the state at the call bit for bit, though the next step donates it, and so is
    wrap_step's fused snapshot."""
    import logging

    from jaxckpt.jax import buffers

    m42 = mesh((4, 2), ("data", "model"))
    specs = (P("data", "model"), P(None, "model"), P("data", None), P())
    if public:
        monkeypatch.setenv(buffers.ENV, "1")
    buffers.recheck()
    try:
        with caplog.at_level(logging.INFO, logger="jaxckpt.jax.buffers"):
            state = {f"a{i:02d}": filled((16, 8), jnp.float32, NamedSharding(m42, specs[i % 4]), seed=i)
                     for i in range(16)}
            step = jax.jit(lambda s: jax.tree.map(lambda x: x * 2.0 + 1.0, s), donate_argnums=0)
            ck = ckpt(keep=2)
            ck.save(1, state).result(timeout=60)
            state = jax.block_until_ready(step(state))  # fresh arrays, donated by the next step
            expected, target = {k: np.array(v) for k, v in state.items()}, abstract(state)
            handle = ck.save(2, state)
            state = step(state)
            handle.result(timeout=60)
            # wrap_step's fused save takes its views of the program's host copies the same way
            fused = ck.wrap_step(lambda s: jax.tree.map(lambda x: x * 2.0 + 1.0, s), copy="in_program")
            fused_expected = {k: np.array(v) for k, v in state.items()}
            state = fused(state, save_step=3)
            fused.last_save.result(timeout=60)
        assert (buffers._arrays_ok, buffers._whole_ok, buffers._shardings_ok) == (not public,) * 3
        said = [r.getMessage() for r in caplog.records if r.name == "jaxckpt.jax.buffers"]
        assert len(said) == (3 if public else 0) and all(buffers.ENV in m for m in said), said
        from jax._src import sharding_impls
        assert sharding_impls.make_single_device_sharding is not buffers._cached  # the saves' windows closed
        for at, want_state in ((2, expected), (3, fused_expected)):
            out = ck.restore(target, step=at)
            for k, want in want_state.items():
                np.testing.assert_array_equal(bits(out[k]), bits(want), err_msg=f"step {at} {k}")
                assert out[k].sharding == target[k].sharding
    finally:
        monkeypatch.delenv(buffers.ENV, raising=False)
        buffers.recheck()
