"""Meshes, a Checkpointer factory and the arrays of the JAX front end's tests (``test_checkpointer.py`` and
``test_save_buffers.py``), in one process with 8 CPU devices."""
import jax
import numpy as np
import pytest

import jaxckpt
from jaxckpt import Config

AUTO = jax.sharding.AxisType.Auto


def mesh(shape, names, devices=None):
    if devices is not None:
        return jax.sharding.Mesh(np.array(devices).reshape(shape), names, axis_types=(AUTO,) * len(shape))
    return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))


@pytest.fixture(scope="module")
def m8():
    return mesh((8,), ("data",))


@pytest.fixture(scope="module")
def m24():
    return mesh((2, 4), ("data", "model"))


@pytest.fixture
def ckpt():
    made = []

    def make(**changes):
        ck = jaxckpt.Checkpointer(Config(**changes))
        made.append(ck)
        return ck

    yield make
    for ck in made:
        ck.close()


def bits(x) -> np.ndarray:
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


def abstract(tree):
    """The restore target of a state: ShapeDtypeStructs with the same shardings, plain leaves as they are."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, tree)


def filled(shape, dtype, sharding, seed=0):
    n = int(np.prod(shape))
    host = (np.arange(n, dtype=np.float64) * 0.37 + seed).reshape(shape)
    if np.dtype(dtype) == np.bool_:
        host = (np.arange(n).reshape(shape) + seed) % 3 == 0
    return jax.device_put(host.astype(dtype), sharding)
