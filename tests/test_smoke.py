import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt


def test_save_restore_reshard_roundtrip():
    mesh = jax.make_mesh((8,), ("data",))
    mesh2 = jax.make_mesh((2, 4), ("data", "model"))
    x = jax.device_put(jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32), NamedSharding(mesh, P("data", None)))
    with jaxckpt.Checkpointer(jaxckpt.Config()) as ck:
        ck.save(1, {"x": x})
        ck.wait()
        assert ck.latest_step() == 1
        tgt = {"x": jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh2, P(None, "model")))}
        out = ck.restore(tgt)
    assert out["x"].sharding == tgt["x"].sharding
    np.testing.assert_array_equal(np.asarray(out["x"]), np.asarray(x))
