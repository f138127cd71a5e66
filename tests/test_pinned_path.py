"""The accelerator's save path: one ``device_put`` of the state's arrays to pinned host memory at ``save()``.

Here (CPU) ``shards.pinned_sharding`` answers None, as it must: a view of a CPU buffer is free. The path itself is
JAX's real ``device_put`` to the ``pinned_host`` memory kind, which CPU devices have too, so the tests turn it on
for CPU arrays by giving ``pinned_sharding`` the answer an accelerator's devices give, and check what a user
relies on: every restored bit, under a donating step right after each ``save()``. On a GPU, ``jaxckpt bench
device`` checks the same (its ``floors`` part) with the path on by itself.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt
from jaxckpt.jax import shards


def _state():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    return {"w": put(jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8), P("data", "model")),
            "b": put(jnp.ones((8,), jnp.bfloat16), P()),
            "m": put(jnp.arange(16.0).reshape(2, 8), P(None, "model")),
            "key": jax.random.key(3), "step": 7}


@pytest.fixture
def pinned_on_cpu(monkeypatch):
    """``pinned_sharding`` as on an accelerator: every jax array's sharding in the pinned_host memory kind."""
    real = shards.pinned_sharding
    assert real(_state()["w"].sharding) is None  # the real answer here
    monkeypatch.setattr(shards, "pinned_sharding", lambda s: s.with_memory_kind(shards.PINNED))
    return real


def test_cpu_arrays_take_views_not_pinned_copies():
    s = _state()
    assert shards.pinned_sharding(s["w"].sharding) is None
    assert shards.pinned_sharding(s["b"].sharding) is None


def test_pinned_saves_restore_bit_for_bit_under_donation(pinned_on_cpu, caplog):
    step = jax.jit(lambda st: {"w": st["w"] * 3 + 1, "b": st["b"] * 2, "m": st["m"] - 5}, donate_argnums=0)
    state, expected = _state(), {}
    with jaxckpt.Checkpointer(jaxckpt.Config(keep=4)) as ck:
        for k in range(4):
            expected[k] = {n: np.asarray(state[n]).copy() for n in ("w", "b", "m")}
            ck.save(k, state)
            # donates the buffers save() just read
            state = {**state, **step({n: state[n] for n in ("w", "b", "m")})}
        ck.wait()
        reads = ck.frontend.saver._layouts
        kinds = {r[0] for plan in reads.values() for r in plan.reads}
        assert "pinned" in kinds, kinds
        # said at a layout's first save, not at every save: inflight_bytes does not bound these transfers
        said = [r.getMessage() for r in caplog.records if r.name == "jaxckpt.jax.snapshot"]
        told = [m for m in said if "3 arrays move to pinned host memory" in m and "inflight_bytes" in m]
        assert 1 <= len(told) == len(reads) < 4, said
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                              if isinstance(x, jax.Array) and x.dtype != jax.random.key(0).dtype else x, _state())
        for k in range(4):
            out = ck.restore(step=k, target=target)
            for n in ("w", "b", "m"):
                assert out[n].sharding == target[n].sharding
                assert np.asarray(out[n]).view(np.uint8).tobytes() == expected[k][n].view(np.uint8).tobytes(), (k, n)
            assert out["step"] == 7
            assert np.array_equal(jax.random.key_data(out["key"]), jax.random.key_data(jax.random.key(3)))



@pytest.mark.parametrize("path", ["pinned", "cpu views"])
def test_a_leaf_already_in_pinned_host_memory_saves_and_restores(path, request):
    # An optimizer state offloaded to host memory, saved and restored onto its own sharding (memory kind included).
    # On the pinned path the save's device_put to that same memory kind is told not to alias (jax.device_put
    # hands such an array back as it is otherwise), so the snapshot is a copy of its own.
    if path == "pinned":
        request.getfixturevalue("pinned_on_cpu")
    state = _state()
    state["m"] = jax.device_put(state["m"], state["m"].sharding.with_memory_kind(shards.PINNED))
    want = {n: np.asarray(state[n]).copy() for n in ("w", "b", "m")}
    with jaxckpt.Checkpointer(jaxckpt.Config(keep=2)) as ck:
        ck.save(0, state)
        ck.wait()
        target = {n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) if n in want else v
                  for n, v in state.items()}
        out = ck.restore(target=target)
    for n in want:
        assert out[n].sharding == state[n].sharding, n
        assert np.asarray(out[n]).view(np.uint8).tobytes() == want[n].view(np.uint8).tobytes(), n
