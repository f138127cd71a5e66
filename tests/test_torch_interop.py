"""One store, one manifest format, two front ends: arrays saved from JAX restore into torch tensors and torch
tensors restore into sharded jax.Arrays, bit for bit, through the same CheckpointEngine."""
import jax
import ml_dtypes
import numpy as np
import torch
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt
from jaxckpt import Config
from jaxckpt.torch import Checkpointer as TorchCheckpointer
from jaxckpt.torch.dtypes import numpy_view

AUTO = jax.sharding.AxisType.Auto

# name -> (shape, numpy dtype, torch dtype, JAX partition spec on the (data=8) mesh)
ARRAYS = {
    "layer.weight": ((16, 8), np.float32, torch.float32, P("data", None)),
    "layer.bias": ((8,), ml_dtypes.bfloat16, torch.bfloat16, P("data")),
    "emb": ((8, 6), np.float16, torch.float16, P(None, None)),
    "ids": ((24,), np.int8, torch.int8, P("data")),
    "count": ((4, 2), np.uint32, torch.uint32, P()),
    "mask": ((8, 3), np.bool_, torch.bool, P("data", None)),
    "f8": ((8, 4), ml_dtypes.float8_e4m3fn, torch.float8_e4m3fn, P("data", None)),
    "z": ((2, 3), np.complex64, torch.complex64, P()),
}


def random_host(shape, dtype, rng) -> np.ndarray:
    """Arbitrary bit patterns (NaN payloads included) of ``dtype``."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    raw = rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def spec24(shape) -> P:
    """A partition spec on the (data=2, model=4) mesh that divides ``shape``."""
    if len(shape) == 2 and shape[1] % 4 == 0:
        return P("data", "model") if shape[0] % 2 == 0 else P(None, "model")
    return P("data") if shape[0] % 2 == 0 else P()


def raw(x) -> np.ndarray:
    a = numpy_view(x) if isinstance(x, torch.Tensor) else np.asarray(x)
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def test_jax_to_torch_and_back_through_one_engine():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
    mesh24 = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AUTO,) * 2)
    rng = np.random.default_rng(0)
    host = {k: random_host(shape, dt, rng) for k, (shape, dt, _, _) in ARRAYS.items()}
    jstate = {"model": {k: jax.device_put(host[k], NamedSharding(mesh, spec))
                        for k, (_, _, _, spec) in ARRAYS.items()}, "step": 5, "name": "run-1"}

    with jaxckpt.Checkpointer(Config(keep=2)) as jck:
        tck = TorchCheckpointer(engine=jck.engine)  # the torch front end on the JAX checkpointer's store

        # JAX -> torch: a JAX snapshot restored into torch tensors (new, then in place)
        jck.save(1, jstate)
        jck.wait()
        target = {"model": {k: torch.zeros(shape, dtype=tdt) for k, (shape, _, tdt, _) in ARRAYS.items()},
                  "step": 0, "name": ""}
        out = tck.restore(target)
        assert out["step"] == 5 and out["name"] == "run-1"
        for k, (shape, _, tdt, _) in ARRAYS.items():
            assert out["model"][k].dtype == tdt and tuple(out["model"][k].shape) == shape
            np.testing.assert_array_equal(raw(out["model"][k]), raw(host[k]), err_msg=k)
        tck.restore(target, in_place=True)
        for k in ARRAYS:
            np.testing.assert_array_equal(raw(target["model"][k]), raw(host[k]), err_msg=k)

        # torch -> JAX: a torch snapshot (the tensors above, each bit pattern bumped) restored onto a 2x4 mesh
        tstate = {"model": {k: v.clone() for k, v in out["model"].items()}, "step": 6, "name": "run-1"}
        for k, t in tstate["model"].items():
            t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).add_(1)
        tck.save(2, tstate)
        tck.wait()
        assert jck.latest_step() == 2 and jck.all_steps() == [1, 2]
        jtarget = {"model": {k: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh24, spec24(shape)))
                             for k, (shape, dt, _, _) in ARRAYS.items()}, "step": 0, "name": ""}
        back = jck.restore(jtarget)
        assert back["step"] == 6 and back["name"] == "run-1"
        for k in ARRAYS:
            assert back["model"][k].sharding == jtarget["model"][k].sharding
            np.testing.assert_array_equal(raw(back["model"][k]), raw(tstate["model"][k]), err_msg=k)
        plain = jck.restore(step=2)  # no target: numpy, still bit for bit
        for k in ARRAYS:
            np.testing.assert_array_equal(raw(plain["model"][k]), raw(tstate["model"][k]), err_msg=k)

        # both snapshots carry the same paths, read by the same core
        for step in (1, 2):
            with jck.engine.open(step) as (_, manifests, _reader):
                assert sorted(a.path for a in manifests[0].arrays) == sorted(f"model/{k}" for k in ARRAYS)
        tck.close()  # leaves the shared engine open
        assert jck.latest_step() == 2
