"""On CPU a restore from the in-process memory store lends the committed snapshot's memory to the restored
arrays instead of copying it. What users rely on: the restored state and the snapshot never change each other,
through donation, later saves, retention, or more restores."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt
from jaxckpt import Config
from jaxckpt.errors import ChecksumError

AUTO = jax.sharding.AxisType.Auto


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AUTO, AUTO))


def _state(mesh, k: int) -> dict:
    base = jnp.arange(64 * 96, dtype=jnp.float32).reshape(64, 96) * (k + 1)
    return {"w": jax.device_put(base, NamedSharding(mesh, P("data", "model"))),
            "b": jax.device_put(jnp.arange(32, dtype=jnp.bfloat16) + k, NamedSharding(mesh, P("model"))),
            "r": jax.device_put(jnp.full((8, 8), k, jnp.int32), NamedSharding(mesh, P()))}


def _host(tree) -> dict:
    return {k: np.asarray(v).copy() for k, v in tree.items()}


def _equal(tree, want: dict) -> None:
    for k, v in tree.items():
        got = np.asarray(v)
        np.testing.assert_array_equal(got.view(np.uint8), want[k].view(np.uint8), err_msg=k)


def _target(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def _inside(ptr: int, store) -> bool:
    return any(b.ctypes.data <= ptr < b.ctypes.data + b.nbytes for b in map(store.slot_bytes, store.steps()))


def test_restored_shards_use_the_snapshot_memory_and_a_donating_step_leaves_it_intact(mesh):
    state = _state(mesh, 0)
    want = _host(state)
    with jaxckpt.Checkpointer(Config(keep=1)) as ck:
        ck.save(1, state).result()
        out = ck.restore(_target(state))
        _equal(out, want)
        w = out["w"].addressable_shards[0].data
        assert _inside(w.unsafe_buffer_pointer(), ck.store)  # lent, not copied
        step = jax.jit(lambda t: jax.tree.map(lambda x: x * 3 + 1, t), donate_argnums=0)
        stepped = step(out)
        np.testing.assert_array_equal(np.asarray(stepped["w"]), want["w"] * 3 + 1)
        _equal(ck.restore(_target(state)), want)  # the snapshot did not take the step's writes


def test_later_saves_and_retention_never_reuse_lent_memory(mesh):
    with jaxckpt.Checkpointer(Config(keep=1)) as ck:
        ck.save(1, _state(mesh, 1)).result()
        first = ck.restore(_target(_state(mesh, 1)))
        want = _host(first)
        before = ck.store.allocations
        for k in range(2, 6):  # step 1 is retired at once; its lent buffer must not take these bytes
            ck.save(k, _state(mesh, k)).result()
        _equal(first, want)
        # The lent buffer is never reused: double-buffering needs two others, allocated once, then reused.
        assert ck.store.allocations == before + 2
        _equal(ck.restore(_target(_state(mesh, 5))), _host(_state(mesh, 5)))
        again = ck.restore(_target(_state(mesh, 5)))  # two restores of one step share its memory, both intact
        _equal(again, _host(_state(mesh, 5)))
        _equal(first, want)


def test_a_corrupt_snapshot_is_still_refused_and_stays_listed(mesh):
    state = _state(mesh, 2)
    with jaxckpt.Checkpointer(Config(keep=1)) as ck:
        ck.save(1, state).result()
        (step,) = ck.store.steps()
        ck.store.slot_bytes(step)[0] ^= 0xFF  # a bit flip in host memory after the commit
        with pytest.raises(ChecksumError, match=r"step 1 .*crc32c"):
            ck.restore(_target(state))
        assert ck.latest_step() == 1


# ------------------------------------------------------------------------------------ the node agent's memory
def test_shm_restore_lends_the_agent_segment_which_is_never_reused_and_survives_an_agent_restart(mesh, tmp_path):
    import os
    import shutil
    import uuid

    from jaxckpt.backends.agent import protocol as proto
    from jaxckpt.testing import remove_agents

    base = f"/dev/shm/jaxckpt-lend-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    os.makedirs(base, mode=0o700)
    d = f"{base}/node0"
    cfg = Config(store="shm", shm_dir=d, job_id="lend", keep=1)
    try:
        with jaxckpt.Checkpointer(cfg) as ck:
            ck.save(1, _state(mesh, 1)).result()
        want = _host(_state(mesh, 1))
        with jaxckpt.Checkpointer(cfg) as ck:  # a restarted trainer
            first = ck.restore(_target(_state(mesh, 1)))
            _equal(first, want)
            seg = next(n for n in os.listdir(d) if n.startswith("seg-p0-"))
            assert ck.last_restore_report.to_dict()["bytes_by_kind"].get("local", 0) > 0
            proto.kill_agent(d)  # an agent restart must honour the lend (it is in the step's record)
            stepped = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)(
                ck.restore(_target(_state(mesh, 1))))
            for k in range(2, 6):  # step 1 retired: its segment must not be handed out for these
                ck.save(k, _state(mesh, k)).result()
            _equal(first, want)
            np.testing.assert_array_equal(np.asarray(stepped["r"]), want["r"] + 1)
            assert seg not in os.listdir(d)  # unlinked once freed, not pooled
            _equal(ck.restore(_target(_state(mesh, 5))), _host(_state(mesh, 5)))
        _equal(first, want)  # the store is closed; the arrays keep their mapping
    finally:
        remove_agents(base)
        shutil.rmtree(base, ignore_errors=True)
