"""The fused snapshot path: the compiled step returns a pinned-host copy of its incoming state."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt


def _state(axis_type=jax.sharding.AxisType.Explicit):
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type, axis_type))
    w = jax.device_put(jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8), NamedSharding(mesh, P("data", "model")))
    b = jax.device_put(jnp.ones((8,), jnp.bfloat16), NamedSharding(mesh, P()))
    m = jax.device_put(jnp.arange(16.0).reshape(2, 8), NamedSharding(mesh, P(None, "model")))  # partly replicated
    return {"w": w, "b": b, "m": m, "step": 0, "key": jax.random.key(1)}


def _train_step(state, lr):
    w = state["w"] * 0.5 + lr
    return {"w": w, "b": state["b"] + 1, "m": state["m"] * 3, "step": state["step"] + 1,
            "key": jax.random.split(state["key"])[0]}, w.sum()


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto])
def test_fused_snapshots_equal_the_incoming_state_under_donation(axis_type):
    state = _state(axis_type)
    expected = {}
    with jaxckpt.Checkpointer(jaxckpt.Config(keep=4)) as ck:
        step_fn = ck.wrap_step(_train_step)
        for k in range(4):
            expected[k] = {"w": np.asarray(state["w"]).copy(), "b": np.asarray(state["b"]).copy(),
                           "m": np.asarray(state["m"]).copy(),
                           "key": np.asarray(jax.random.key_data(state["key"])).copy()}
            state, _ = step_fn(state, 1.0, save_step=k)  # donates the incoming state
        state, _ = step_fn(state, 1.0)  # plain step, no snapshot
        ck.wait()
        assert ck.all_steps() == [0, 1, 2, 3]
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                              if isinstance(x, jax.Array) else x, _state(axis_type))
        # jit turns the python step counter into an int32 array after the first step; steps saved later hold that.
        target["step"] = jax.ShapeDtypeStruct((), jnp.int32)
        for k in range(4):
            got = ck.restore(target, step=k)
            np.testing.assert_array_equal(np.asarray(got["w"]), expected[k]["w"])
            np.testing.assert_array_equal(np.asarray(got["m"]), expected[k]["m"])
            np.testing.assert_array_equal(np.asarray(got["b"]).view(np.uint16), expected[k]["b"].view(np.uint16))
            assert got["w"].sharding == target["w"].sharding
            assert int(got["step"]) == k
            np.testing.assert_array_equal(jax.random.key_data(got["key"]), expected[k]["key"])
