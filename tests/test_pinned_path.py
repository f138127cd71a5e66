"""The accelerator's save path: one ``device_put`` of the state's arrays to pinned host memory at ``save()``.

Here (CPU) ``shards.pinned_sharding`` answers None, as it must: a view of a CPU buffer is free. The path itself is
JAX's real ``device_put`` to the ``pinned_host`` memory kind, which CPU devices have too, so the tests turn it on
for CPU arrays by giving ``pinned_sharding`` the answer an accelerator's devices give, and check what a user
relies on: every restored bit, under a donating step right after each ``save()``. On a GPU, ``jaxckpt bench
device`` checks the same (its ``floors`` part) with the path on by itself. An array replicated over several
devices of the process is copied once, one piece per device (``shards.local_pieces``), by save() and by
``wrap_step`` alike; tests/test_pieces.py runs that across processes.
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
            # big enough to be copied in pieces, one per device (shards.local_pieces): replicated over data, and
            # over every device
            "e": put(jnp.arange(1024 * 128, dtype=jnp.float32).reshape(1024, 128), P(None, "model")),
            "f": put(jnp.arange(2048 * 64, dtype=jnp.int32).reshape(2048, 64), P()),
            "key": jax.random.key(3), "step": 7}


ARRAYS = ("w", "b", "m", "e", "f")


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
    step = jax.jit(lambda st: {"w": st["w"] * 3 + 1, "b": st["b"] * 2, "m": st["m"] - 5, "e": st["e"] * 0.5,
                               "f": st["f"] + 9}, donate_argnums=0)
    state, expected = _state(), {}
    with jaxckpt.Checkpointer(jaxckpt.Config(keep=4)) as ck:
        for k in range(4):
            expected[k] = {n: np.asarray(state[n]).copy() for n in ARRAYS}
            ck.save(k, state)
            # donates the buffers save() just read
            state = {**state, **step({n: state[n] for n in ARRAYS})}
        ck.wait()
        reads = ck.frontend.saver._layouts
        kinds = {r[0] for plan in reads.values() for r in plan.reads}
        assert "pinned" in kinds, kinds
        # The replicated arrays were copied to host once, in one piece per device, and saved as those pieces.
        with ck.engine.open(3) as (_, manifests, _reader):
            chunks = {a.path: sorted((c.box.start, c.box.stop) for c in a.chunks) for a in manifests[0].arrays}
        assert chunks["e"] == [((r, c), (r + 256, c + 64)) for r in range(0, 1024, 256) for c in (0, 64)], chunks["e"]
        assert chunks["f"] == [((r, 0), (r + 256, 64)) for r in range(0, 2048, 256)], chunks["f"]
        # said at a layout's first save, not at every save: inflight_bytes does not bound these transfers
        said = [r.getMessage() for r in caplog.records if r.name == "jaxckpt.jax.snapshot"]
        told = [m for m in said if "5 arrays move to pinned host memory" in m and "inflight_bytes" in m]
        assert 1 <= len(told) == len(reads) < 4, said
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                              if isinstance(x, jax.Array) and x.dtype != jax.random.key(0).dtype else x, _state())
        for k in range(4):
            out = ck.restore(step=k, target=target)
            for n in ARRAYS:
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


def test_local_pieces_cut_the_replicas_of_a_process_where_the_cut_pays():
    from jaxckpt.jax.shards import local_pieces

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    cut = lambda shape, spec, itemsize=4: local_pieces(shape, itemsize, NamedSharding(mesh, spec))  # noqa: E731
    assert cut((1024, 128), P(None, "model")).spec == P("data", "model")
    assert cut((2048, 64), P()).spec == P(("data", "model"), None)  # every device holds one piece
    assert cut((6, 65536), P()).spec == P("model", "data")  # each axis on the first dimension it divides
    assert cut((1024, 128), P(None, "model")).memory_kind == NamedSharding(mesh, P()).memory_kind
    assert cut((1024, 128), P("data", "model")) is None  # nothing replicated
    assert cut((8, 4), P()) is None  # pieces of 16 bytes: copied whole
    assert cut((7, 99991), P()) is None  # no dimension either axis divides
    assert cut((), P()) is None
    mixed = jax.make_mesh((4, 2), ("data", "model"),
                          axis_types=(jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto))
    assert local_pieces((1024, 128), 4, NamedSharding(mixed, P(None, "model"))) is None
    assert local_pieces((1024, 128), 4, jax.sharding.SingleDeviceSharding(jax.devices()[0])) is None


def test_a_copy_the_program_places_elsewhere_is_not_read_by_the_plan(pinned_on_cpu, monkeypatch, caplog):
    """Should a program put the pieces of a copy elsewhere than asked (on an Auto mesh a device_put inside a
    program keeps the input's spec unless the pieces are asked for first), reading them by the plan would save
    wrong bytes: that save fails with a PlanError naming the array, training goes on, and the next saves copy the
    arrays as they lie and restore bit for bit."""
    from jaxckpt.errors import PlanError
    from jaxckpt.jax import fused

    monkeypatch.setattr(fused, "_placed", lambda x, s: x)
    state = _fused_state(jax.sharding.AxisType.Auto)
    with jaxckpt.Checkpointer(jaxckpt.Config(keep=4)) as ck:
        step_fn = ck.wrap_step(_fused_step)
        state, _ = step_fn(state, 1.0, save_step=0)
        with pytest.raises(PlanError, match=r"step 0: e: the program placed its copy as .*spec=P\(None, 'model'\)"):
            ck.wait()
        assert "not taken" in caplog.text
        expected = {n: np.asarray(state[n]).copy() for n in ("w", "m", "e", "f")}
        state, _ = step_fn(state, 1.0, save_step=1)
        ck.wait()
        assert ck.all_steps() == [1]
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                              if isinstance(x, jax.Array) else x, _fused_state(jax.sharding.AxisType.Auto))
        target["step"] = jax.ShapeDtypeStruct((), jnp.int32)
        got = ck.restore(target, step=1)
        for n, want in expected.items():
            np.testing.assert_array_equal(np.asarray(got[n]), want, err_msg=n)


def _fused_state(axis_type=jax.sharding.AxisType.Explicit):
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type, axis_type))
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    return {"w": put(jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8), P("data", "model")),
            "m": put(jnp.arange(16.0).reshape(2, 8), P(None, "model")),
            "e": put(jnp.arange(1024 * 128, dtype=jnp.float32).reshape(1024, 128), P(None, "model")),
            "f": put(jnp.arange(2048 * 64, dtype=jnp.int32).reshape(2048, 64), P()),
            "step": 0, "key": jax.random.key(1)}


def _fused_step(state, lr):
    return {"w": state["w"] * 0.5 + lr, "m": state["m"] * 3, "e": state["e"] - lr, "f": state["f"] * 3,
            "step": state["step"] + 1, "key": jax.random.split(state["key"])[0]}, state["w"].sum()


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto])
def test_fused_pinned_copies_are_cut_into_pieces_and_restore_bit_for_bit(pinned_on_cpu, axis_type):
    """wrap_step on an accelerator: the program's pinned copies of the replicated arrays hold one piece per device
    (on an Auto mesh too, where a device_put inside a program keeps its input's spec unless asked first)."""
    state, expected = _fused_state(axis_type), {}
    with jaxckpt.Checkpointer(jaxckpt.Config(keep=3)) as ck:
        step_fn = ck.wrap_step(_fused_step)
        for k in range(3):
            expected[k] = {n: np.asarray(state[n]).copy() for n in ("w", "m", "e", "f")}
            state, _ = step_fn(state, 1.0, save_step=k)  # donates the incoming state
        ck.wait()
        with ck.engine.open(2) as (_, manifests, _reader):
            chunks = {a.path: sorted((c.box.start, c.box.stop) for c in a.chunks) for a in manifests[0].arrays}
        assert chunks["e"] == [((r, c), (r + 256, c + 64)) for r in range(0, 1024, 256) for c in (0, 64)], chunks["e"]
        assert chunks["f"] == [((r, 0), (r + 256, 64)) for r in range(0, 2048, 256)], chunks["f"]
        assert chunks["m"] == [((0, 0), (2, 4)), ((0, 4), (2, 8))]  # pieces of 16 bytes: copied whole
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                              if isinstance(x, jax.Array) else x, _fused_state(axis_type))
        target["step"] = jax.ShapeDtypeStruct((), jnp.int32)
        for k in range(3):
            got = ck.restore(target, step=k)
            for n, want in expected[k].items():
                assert got[n].sharding == target[n].sharding
                assert np.asarray(got[n]).view(np.uint8).tobytes() == want.view(np.uint8).tobytes(), (k, n)
