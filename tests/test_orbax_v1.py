"""jaxckpt.orbax.v1 through Orbax's v1 ``training.Checkpointer``, beside a standard pytree checkpointable."""
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp1
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt
import jaxckpt.orbax.v1 as jv1
from jaxckpt.orbax import MARKER_NAME

AUTO = jax.sharding.AxisType.Auto


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))


def _state(step: int, mesh) -> dict:
    w = jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) * 0.25 + step
    w = w.at[0, 0].set(jnp.nan)
    return {"w": jax.device_put(w, NamedSharding(mesh, P("data", None))),
            "b": jax.device_put(jnp.full((16,), step, jnp.bfloat16), NamedSharding(mesh, P("data"))),
            "count": np.array([2**40 + step], np.int64)}


def _target(mesh) -> dict:
    return {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P(None, "model"))),
            "b": jax.ShapeDtypeStruct((16,), jnp.bfloat16, sharding=NamedSharding(mesh, P("model"))),
            "count": np.zeros(1, np.int64)}


def _bitwise(out: dict, ref: dict, target: dict) -> None:
    for k in ("w", "b"):
        assert out[k].sharding == target[k].sharding
        np.testing.assert_array_equal(np.asarray(out[k]).view(np.uint8), np.asarray(ref[k]).view(np.uint8))
    assert isinstance(out["count"], np.ndarray) and out["count"].dtype == np.int64
    assert int(out["count"][0]) == int(ref["count"][0])  # 2**40 + step: no narrowing


def test_v1_checkpointer_save_latest_load_resharded(tmp_path):
    mesh, mesh2 = _mesh((8,), ("data",)), _mesh((2, 4), ("data", "model"))
    states = {s: _state(s, mesh) for s in (1, 2, 3)}
    with jaxckpt.Checkpointer(jaxckpt.Config(keep=3, job_id="v1-test")) as ck:
        jv1.configure(ck)
        with jv1.context():
            ckptr = ocp1.training.Checkpointer(tmp_path)
            for s, st in states.items():
                assert ckptr.save_checkpointables(s, {jv1.STATE: st, "extra": {"lr": np.array([0.5 * s], np.float32)}})
            ckptr.wait()
            assert ckptr.latest.step == 3 and [c.step for c in ckptr.checkpoints] == [1, 2, 3]
            # The pytree's bytes are in jaxckpt memory (a marker only); the standard checkpointable is Orbax's.
            assert {p.name for p in (tmp_path / "3" / jv1.STATE).iterdir()} - {"commit_success.txt"} == {
                MARKER_NAME, jv1.PYTREE_METADATA_FILE}
            assert (tmp_path / "3" / "extra" / "_METADATA").exists()
            assert ck.all_steps() == [1, 2, 3]

            target = _target(mesh2)
            out = ckptr.load_checkpointables(None, {jv1.STATE: target, "extra": {"lr": np.zeros(1, np.float32)}})
            _bitwise(out[jv1.STATE], states[3], target)
            np.testing.assert_array_equal(out["extra"]["lr"], np.array([1.5], np.float32))
            _bitwise(ckptr.load(1, target), states[1], target)  # the default name, an older step

            # No abstract state: the saved tree, jax leaves on their saved shardings, numpy as numpy.
            plain = ckptr.load(2)
            assert plain["w"].sharding == states[2]["w"].sharding
            _bitwise(plain, states[2], {k: states[2][k] for k in ("w", "b")})
            meta = ckptr.metadata(2).metadata
            assert meta["w"].shape == (64, 32) and meta["w"].dtype == jnp.float32
            assert meta["w"].sharding == states[2]["w"].sharding

            # overwrite=True of a step Orbax lists: saved again, the new bytes served.
            assert ckptr.save(2, states[3], overwrite=True, force=True)
            ckptr.wait()
            _bitwise(ckptr.load(2, target), states[3], target)
            ckptr.close()


def test_v1_step_memory_no_longer_holds_comes_from_the_persistent_tier(tmp_path):
    mesh = _mesh((8,), ("data",))
    states = {s: _state(s, mesh) for s in (1, 2)}
    config = jaxckpt.Config(keep=1, job_id="v1-persist", persistent_dir=str(tmp_path / "persistent"),
                            persistent_interval=1)
    with jaxckpt.Checkpointer(config) as ck:
        jv1.configure(ck)
        with jv1.context():
            ckptr = ocp1.training.Checkpointer(tmp_path / "orbax")
            for s, st in states.items():
                assert ckptr.save(s, st)
            ckptr.wait()
            ck.persister.wait(60)
            assert ck.store.steps() == [2]  # keep=1: memory holds only step 2
            assert 1 in ck.persister.steps()
            target = _target(_mesh((4, 2), ("data", "model")))
            _bitwise(ckptr.load(1, target), states[1], target)  # from the persistent tier
            _bitwise(ckptr.load(2, target), states[2], target)  # from memory
            ckptr.close()


def test_v1_bad_leaf_is_refused_with_orbax_words(tmp_path):
    with jaxckpt.Checkpointer(jaxckpt.Config(job_id="v1-bad")) as ck:
        jv1.configure(ck)
        handler = jv1.SnapshotPyTreeHandler()
        assert handler.is_handleable({"a": np.zeros(2)}) and not handler.is_handleable({"a": object()})
        with jv1.context():
            ckptr = ocp1.training.Checkpointer(tmp_path)
            with pytest.raises(Exception, match="Unsupported (leaf )?type"):
                ckptr.save(0, {"a": object()})
            ckptr.close()
