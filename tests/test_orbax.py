"""SnapshotHandler inside a real orbax CheckpointManager: Composite with StandardSave, retention, resharding."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt
from jaxckpt.errors import StepError, StepNotFoundError
from jaxckpt.orbax import MARKER_NAME, SnapshotHandler, SnapshotRestore, SnapshotSave

AUTO = jax.sharding.AxisType.Auto


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))


def _state(step: int, sharding: NamedSharding) -> dict:
    w = jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) * 0.5 + step
    w = w.at[0, 0].set(jnp.nan)  # NaNs must come back bit for bit too
    return {"params": {"w": jax.device_put(w, sharding),
                       "b": jax.device_put(jnp.full((16,), step, jnp.bfloat16), NamedSharding(sharding.mesh, P("data")))},
            "count": np.int64(step), "name": f"run-{step}"}


def _target(sharding: NamedSharding, b_sharding: NamedSharding) -> dict:
    return {"params": {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=sharding),
                       "b": jax.ShapeDtypeStruct((16,), jnp.bfloat16, sharding=b_sharding)},
            "count": np.int64(0), "name": ""}


def _assert_bitwise(out: dict, ref: dict, target: dict) -> None:
    for k in ("w", "b"):
        assert out["params"][k].sharding == target["params"][k].sharding
        np.testing.assert_array_equal(np.asarray(out["params"][k]).view(np.uint8),
                                      np.asarray(ref["params"][k]).view(np.uint8))
    assert out["count"] == ref["count"] and out["name"] == ref["name"]


def _manager(directory, handler: SnapshotHandler, max_to_keep: int) -> ocp.CheckpointManager:
    registry = ocp.DefaultCheckpointHandlerRegistry()
    registry.add("state", SnapshotSave, handler)
    registry.add("state", SnapshotRestore, handler)
    registry.add("extra", ocp.args.StandardSave)
    registry.add("extra", ocp.args.StandardRestore)
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=True)
    return ocp.CheckpointManager(directory, options=options, handler_registry=registry)


def _save(mngr: ocp.CheckpointManager, step: int, state: dict) -> None:
    extra = {"step": np.array(step, np.int32), "lr": np.array([0.1 * step], np.float32)}
    assert mngr.save(step, args=ocp.args.Composite(state=SnapshotSave(state), extra=ocp.args.StandardSave(extra)))


def _restore_args(target: dict) -> ocp.args.Composite:
    extra = {"step": np.array(0, np.int32), "lr": np.zeros(1, np.float32)}
    return ocp.args.Composite(state=SnapshotRestore(target), extra=ocp.args.StandardRestore(extra))


def test_composite_with_standard_save_retention_and_resharding(tmp_path):
    mesh = _mesh((8,), ("data",))
    sh, b_sh = NamedSharding(mesh, P("data", None)), NamedSharding(mesh, P("data"))
    states = {s: _state(s, sh) for s in range(1, 6)}
    handler = SnapshotHandler(config=jaxckpt.Config(keep=3, job_id="orbax-test"))
    mngr = _manager(tmp_path, handler, max_to_keep=3)
    for s in range(1, 6):
        _save(mngr, s, states[s])
    mngr.wait_until_finished()

    assert mngr.all_steps() == [3, 4, 5]
    assert mngr.latest_step() == 5
    marker = json.loads((tmp_path / "5" / "state" / MARKER_NAME).read_text())
    assert marker["step"] == 5 and marker["job_id"] == "orbax-test" and marker["process_count"] == 1
    assert marker["nbytes"] >= 64 * 32 * 4 + 16 * 2
    # The bytes are in memory, not in the step directory.
    files = {p.name: p.stat().st_size for p in (tmp_path / "5" / "state").iterdir()}
    assert set(files) - {"commit_success.txt"} == {MARKER_NAME} and files[MARKER_NAME] < 1024

    target = _target(sh, b_sh)
    for step in (5, 3):  # latest and an older kept step
        out = mngr.restore(step, args=_restore_args(target))
        _assert_bitwise(out["state"], states[step], target)
        assert int(out["extra"]["step"]) == step

    # Onto a different mesh and sharding, and onto one device.
    mesh2 = _mesh((2, 4), ("data", "model"))
    t2 = _target(NamedSharding(mesh2, P(None, "model")), NamedSharding(mesh2, P(None)))
    _assert_bitwise(mngr.restore(4, args=_restore_args(t2))["state"], states[4], t2)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[3])
    t1 = _target(one, one)
    _assert_bitwise(mngr.restore(4, args=_restore_args(t1))["state"], states[4], t1)

    # max_to_keep deleted steps 1 and 2: Orbax refuses them, and jaxckpt memory no longer serves them.
    with pytest.raises(FileNotFoundError, match=r"/1 not found"):
        mngr.restore(1, args=_restore_args(target))
    handler.prune()
    assert handler.checkpointer.store.steps() == [3, 4, 5]
    with pytest.raises(StepNotFoundError, match="step 2"):
        handler.checkpointer.restore(target, step=2)
    with pytest.raises(StepNotFoundError, match="step 1: no jaxckpt snapshot marker"):
        handler.restore(tmp_path / "1" / "state", SnapshotRestore(target))
    mngr.close()


def test_orbax_deletion_frees_memory_kept_by_config(tmp_path):
    """Config.keep larger than max_to_keep: a step Orbax deleted is freed and never served from memory."""
    mesh = _mesh((8,), ("data",))
    sh = NamedSharding(mesh, P("data", None))
    handler = SnapshotHandler(config=jaxckpt.Config(keep=5))
    mngr = _manager(tmp_path, handler, max_to_keep=2)
    for s in range(1, 5):
        _save(mngr, s, _state(s, sh))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [3, 4]
    handler.prune()
    assert handler.checkpointer.store.steps() == [3, 4] and handler.checkpointer.all_steps() == [3, 4]
    with pytest.raises(StepNotFoundError, match="step 1"):
        handler.checkpointer.restore(step=1)
    mngr.close()


def test_step_with_nothing_in_memory_raises(tmp_path):
    mesh = _mesh((8,), ("data",))
    sh, b_sh = NamedSharding(mesh, P("data", None)), NamedSharding(mesh, P("data"))
    target = _target(sh, b_sh)
    handler = SnapshotHandler(config=jaxckpt.Config(keep=1))
    mngr = _manager(tmp_path, handler, max_to_keep=3)
    for s in (1, 2, 3):
        _save(mngr, s, _state(s, sh))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [1, 2, 3]  # Orbax keeps 3 step directories, memory (keep=1) only step 3
    with pytest.raises(StepNotFoundError, match=r"step 2: .* no longer holds its snapshot .*held steps: \[3\]"):
        mngr.restore(2, args=_restore_args(target))
    mngr.close()

    # A restarted job (a fresh in-process store) finds Orbax's steps but no snapshot in memory.
    fresh = SnapshotHandler(config=jaxckpt.Config(keep=1))
    mngr2 = _manager(tmp_path, fresh, max_to_keep=3)
    assert mngr2.latest_step() == 3
    with pytest.raises(StepNotFoundError, match=r"step 3: .*held steps: none.*SnapshotHandler\(directory="):
        mngr2.restore(3, args=_restore_args(target))
    mngr2.close()
    fresh.close()


def test_standalone_item_handlers(tmp_path):
    mesh = _mesh((4, 2), ("data", "model"))
    sh, b_sh = NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P("data"))
    with jaxckpt.Checkpointer(jaxckpt.Config(keep=2)) as ck:
        handler = SnapshotHandler(ck)
        options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
        mngr = ocp.CheckpointManager(tmp_path, item_handlers=handler, options=options)
        states = {s: _state(s, sh) for s in (10, 20, 30)}
        for s, st in states.items():
            assert mngr.save(s, args=SnapshotSave(st))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [20, 30] and mngr.latest_step() == 30
        target = _target(NamedSharding(mesh, P(None, "data")), b_sh)
        _assert_bitwise(mngr.restore(30, args=SnapshotRestore(target)), states[30], target)
        _assert_bitwise(mngr.restore(20, args=SnapshotRestore(target)), states[20], target)
        assert mngr.item_metadata(30).marker["step"] == 30
        mngr.close()
        assert ck.latest_step() == 30  # the handler did not close a Checkpointer it was given


def test_step_outside_a_manager_must_be_explicit(tmp_path):
    mesh = _mesh((8,), ("data",))
    sh, b_sh = NamedSharding(mesh, P("data", None)), NamedSharding(mesh, P("data"))
    state = _state(7, sh)
    handler = SnapshotHandler(config=jaxckpt.Config())
    with ocp.Checkpointer(handler) as ckptr:
        with pytest.raises(StepError, match="pass SnapshotSave"):
            ckptr.save(tmp_path / "run_3" / "ckpt", args=SnapshotSave(state))  # "run_3" is not a step dir
        ckptr.save(tmp_path / "plain" / "ckpt2", args=SnapshotSave(state, step=7))
        target = _target(sh, b_sh)
        _assert_bitwise(ckptr.restore(tmp_path / "plain" / "ckpt2", args=SnapshotRestore(target)), state, target)
    assert handler.checkpointer.latest_step() == 7
    handler.close()


def test_registry_default_handlers_share_one_checkpointer(tmp_path):
    """``registry.add(item, SnapshotSave)`` builds one handler per args type; both see the same snapshots."""
    registry = ocp.DefaultCheckpointHandlerRegistry()
    registry.add("state", SnapshotSave)
    registry.add("state", SnapshotRestore)
    assert registry.get("state", SnapshotSave) is not registry.get("state", SnapshotRestore)
    mngr = ocp.CheckpointManager(tmp_path, handler_registry=registry,
                                 options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True))
    x = np.arange(10, dtype=np.float64)
    base = (jaxckpt.orbax.default_checkpointer().latest_step() or 0) + 1
    mngr.save(base, args=ocp.args.Composite(state=SnapshotSave({"x": x})))
    mngr.wait_until_finished()
    out = mngr.restore(base, args=ocp.args.Composite(state=SnapshotRestore({"x": np.zeros(10)})))
    np.testing.assert_array_equal(out["state"]["x"].view(np.uint8), x.view(np.uint8))
    mngr.close()


def test_step_from_directory_layouts():
    from jaxckpt.orbax import step_from_directory
    tmp = ocp.path.step.TMP_DIR_SUFFIX
    assert step_from_directory(f"/r/12{tmp}/state{tmp}") == 12  # CheckpointManager while writing
    assert step_from_directory("/r/12/state") == 12  # finalized, or commit-file atomicity
    assert step_from_directory(f"/r/ckpt_40{tmp}/state{tmp}") == 40  # step_prefix="ckpt"
    assert step_from_directory(f"/r/run_3/ckpt{tmp}") is None  # bare ocp.Checkpointer: no step directory
    assert step_from_directory("/r/plain/state") is None
