"""TieredCheckpointManager end to end: memory every N, standard Orbax every M, extra state, restart from disk."""
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt
from jaxckpt.errors import ConfigError, NoCheckpointError, UnsupportedLeafError
from jaxckpt.orbax import TieredCheckpointManager

AUTO = jax.sharding.AxisType.Auto
CONFIG = {"lr": 1e-3, "mesh": [1, 8], "model": {"layers": 2, "name": "tiny"}, "warmup": None, "bf16": True}


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))


def _init(mesh) -> dict:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 16)).astype(np.float32)
    w.reshape(-1)[5] = np.array(0x7FC00123, np.uint32).view(np.float32)  # a NaN with a payload
    return {"params": {"w": jax.device_put(w, NamedSharding(mesh, P("data", None))),
                       "b": jax.device_put(np.zeros(16, jnp.bfloat16), NamedSharding(mesh, P("data")))},
            "opt": {"count": jax.device_put(np.int32(0), NamedSharding(mesh, P()))},
            "key": jax.random.key(0)}


@jax.jit
def _step(state, batch):
    w = state["params"]["w"] * 0.999 + batch.mean()
    b = (state["params"]["b"].astype(jnp.float32) + w.sum(0) * 1e-3).astype(jnp.bfloat16)
    return {"params": {"w": w, "b": b}, "opt": {"count": state["opt"]["count"] + 1},
            "key": jax.random.fold_in(state["key"], 1)}


def _snapshot(state) -> dict:
    return {"w": np.asarray(state["params"]["w"]).copy(), "b": np.asarray(state["params"]["b"]).copy(),
            "count": int(state["opt"]["count"]), "key": np.asarray(jax.random.key_data(state["key"])).copy()}


def _target(mesh2) -> dict:
    w_sharding = NamedSharding(mesh2, P(None, "model"))
    return {"params": {"w": jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=w_sharding),
                       "b": jax.ShapeDtypeStruct((16,), jnp.bfloat16, sharding=NamedSharding(mesh2, P("model")))},
            "opt": {"count": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh2, P()))},
            "key": jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh2, P()))}


def _assert_equal(state, ref: dict, target: dict) -> None:
    for k in ("w", "b"):
        assert state["params"][k].sharding == target["params"][k].sharding
        np.testing.assert_array_equal(np.asarray(state["params"][k]).view(np.uint8), ref[k].view(np.uint8))
    assert int(state["opt"]["count"]) == ref["count"]
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(state["key"])), ref["key"])


def _train(mngr, state, rng, steps, refs, extras):
    for step in steps:
        batch = jnp.asarray(rng.standard_normal(64).astype(np.float32))
        state = _step(state, batch)
        extra = {"data": {"epoch": step // 5, "index": step * 64}, "rng": rng.bit_generator.state,
                 "step": step, "config": CONFIG}
        saved = mngr.save(step, state, extra=extra)
        assert saved == (step % mngr.memory_interval == 0 or step % mngr.persistent_interval == 0)
        if saved:
            refs[step], extras[step] = _snapshot(state), extra
            mngr.wait_until_finished()  # deterministic: no persist is skipped for being slower than a step
    return state


def test_tiered_end_to_end_and_restart_from_disk(tmp_path):
    mesh, mesh2 = _mesh((8,), ("data",)), _mesh((2, 4), ("data", "model"))
    target = _target(mesh2)
    refs, extras = {}, {}
    rng = np.random.default_rng(42)
    cfg = jaxckpt.Config(job_id="tiered-e2e")
    with TieredCheckpointManager(tmp_path, config=cfg, memory_interval=2, persistent_interval=5, max_to_keep=2,
                                 persistent_max_to_keep=2) as mngr:
        state = _train(mngr, _init(mesh), rng, range(1, 13), refs, extras)
        assert mngr.memory_steps() == [10, 12]  # max_to_keep=2 in memory
        assert mngr.persisted_steps() == [5, 10]  # every 5th, 2 kept on disk
        assert mngr.all_steps() == [5, 10, 12] and mngr.latest_step() == 12

        r = mngr.restore(target=target)  # latest: from memory, onto another mesh
        assert (r.step, r.source) == (12, "memory")
        _assert_equal(r.state, refs[12], target)
        assert r.extra == extras[12]
        resumed = np.random.default_rng()
        resumed.bit_generator.state = r.extra["rng"]  # the numpy RNG continues exactly where it was
        ref_rng = np.random.default_rng()
        ref_rng.bit_generator.state = extras[12]["rng"]
        np.testing.assert_array_equal(resumed.standard_normal(8), ref_rng.standard_normal(8))

        r = mngr.restore(5, target=ocp.args.StandardRestore(target))  # older, only on disk
        assert (r.step, r.source) == (5, "persistent")
        _assert_equal(r.state, refs[5], target)
        assert r.extra == extras[5]

    # The disk tier is plain Orbax: state in the "default" item, extra as Orbax's JSON item.
    mngr_o = ocp.CheckpointManager(tmp_path, item_names=("default", "extra"))
    got = mngr_o.restore(10, args=ocp.args.Composite(default=ocp.args.StandardRestore(target),
                                                      extra=ocp.args.JsonRestore()))
    _assert_equal(got["default"], refs[10], target)
    assert got["extra"] == extras[10]
    mngr_o.close()
    single = ocp.CheckpointManager(tmp_path)  # the single-item API sees the state alone
    assert single.all_steps() == [5, 10]
    _assert_equal(single.restore(5, args=ocp.args.StandardRestore(target)), refs[5], target)
    single.close()

    # Restart: a new process's manager over the same directory, nothing in memory.
    with TieredCheckpointManager(tmp_path, config=cfg.replace(job_id="tiered-restart"), memory_interval=2,
                                 persistent_interval=5, max_to_keep=2, persistent_max_to_keep=2) as mngr:
        assert mngr.memory_steps() == [] and mngr.latest_step() == 10
        r = mngr.restore(target=target)
        assert (r.step, r.source) == (10, "persistent")
        _assert_equal(r.state, refs[10], target)
        assert r.extra == extras[10]
        rng = np.random.default_rng()
        rng.bit_generator.state = r.extra["rng"]
        state = _train(mngr, r.state, rng, range(11, 16), {}, {})
        assert mngr.persisted_steps() == [10, 15] and mngr.memory_steps() == [14, 15]
    # A third run reads what the resumed run persisted, extra state included.
    with TieredCheckpointManager(tmp_path, config=cfg.replace(job_id="tiered-check"), memory_interval=2,
                                 persistent_interval=5) as mngr:
        r = mngr.restore(15, target=target)
        assert r.source == "persistent" and r.extra["step"] == 15 and r.extra["config"] == CONFIG


def test_tiered_uninterrupted_matches_resumed(tmp_path):
    """Steps 5..8 trained after restoring step 4 from disk equal those of the uninterrupted run, bit for bit."""
    mesh, mesh2 = _mesh((8,), ("data",)), _mesh((2, 4), ("data", "model"))
    target = _target(mesh2)
    refs, extras = {}, {}
    with TieredCheckpointManager(tmp_path / "a", memory_interval=1, persistent_interval=4,
                                 config=jaxckpt.Config(job_id="tiered-a")) as mngr:
        _train(mngr, _init(mesh), np.random.default_rng(7), range(1, 9), refs, extras)
    with TieredCheckpointManager(tmp_path / "a", memory_interval=1, persistent_interval=4,
                                 config=jaxckpt.Config(job_id="tiered-b")) as mngr:
        r = mngr.restore(4, target=target)
        assert r.source == "persistent"
        rng = np.random.default_rng()
        rng.bit_generator.state = r.extra["rng"]
        state = r.state
        for step in range(5, 9):
            state = _step(state, jnp.asarray(rng.standard_normal(64).astype(np.float32)))
        snap = _snapshot(state)
    for k in ("w", "b"):
        np.testing.assert_array_equal(snap[k].view(np.uint8), refs[8][k].view(np.uint8))
    assert snap["count"] == refs[8]["count"]


def test_tiered_save_rules_and_errors(tmp_path):
    mesh = _mesh((8,), ("data",))
    with pytest.raises(ConfigError, match="persistent_interval=0"):
        TieredCheckpointManager(tmp_path, persistent_interval=0)
    with TieredCheckpointManager(tmp_path, memory_interval=3, persistent_interval=4, max_to_keep=2,
                                 config=jaxckpt.Config(job_id="tiered-rules")) as mngr:
        with pytest.raises(NoCheckpointError):
            mngr.restore()
        assert [s for s in range(1, 13) if mngr.should_save(s)] == [3, 4, 6, 8, 9, 12]
        state = _init(mesh)
        assert mngr.save(1, state) is False
        assert mngr.save(2, state, force=True) is True
        with pytest.raises(UnsupportedLeafError, match="extra/config/n: numpy.int64 is not a JSON type"):
            mngr.save(3, state, extra={"config": {"n": np.int64(3)}})
        with pytest.raises(UnsupportedLeafError, match="extra/ids: key 1 is not a str"):
            mngr.save(3, state, extra={"ids": {1: "a"}})
        assert mngr.save(4, state, extra={"t": (1, 2)})
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2, 4] and mngr.persisted_steps() == [4]
        r = mngr.restore(2, target=None)
        assert r.extra is None and r.source == "memory"
        assert mngr.restore(4).extra == {"t": [1, 2]}  # JSON: tuples come back as lists
