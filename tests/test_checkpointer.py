"""The JAX front end end to end, in one process with 8 CPU devices: every leaf type, resharding, donation
consistency, retention, and every error named by issue 2. Restored arrays are compared bit for bit."""
import functools
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

import jaxckpt
from jaxckpt.core import manifest as mf
from jaxckpt.backends.memory import MemoryStore
from jaxckpt.errors import (BudgetExceededError, ChecksumError, ClosedError, NoCheckpointError, StepError,
                            StepNotFoundError, TargetMismatchError, UnsupportedLeafError)

from jax_cases import abstract, bits, ckpt, filled, m8, m24, mesh  # noqa: F401 - fixtures


def assert_same(got, want) -> None:
    """Same type family, dtype, shape and bytes (NaN payloads and -0.0 included)."""
    if isinstance(want, jax.Array):
        assert isinstance(got, jax.Array), type(got)
        assert got.dtype == want.dtype and got.shape == want.shape
        if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
            assert jax.random.key_impl(got) == jax.random.key_impl(want)
    elif isinstance(want, (np.ndarray, np.generic)):
        assert type(got) is type(want), (type(got), type(want))
        assert got.dtype == want.dtype and got.shape == want.shape
    else:
        assert type(got) is type(want) and got == want, (got, want)
        return
    np.testing.assert_array_equal(bits(got), bits(want))


def assert_tree_same(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_same(g, w)


def nan_payloads() -> np.ndarray:
    raw = np.array([0x7FC00001, 0xFFC00123, 0x7F800000, 0x80000000, 0x3F800000, 0x7FBFFFFF], dtype=np.uint32)
    return raw.view(np.float32)


# ------------------------------------------------------------------------------------------ leaf types
def every_leaf(m8, m24):
    dev = jax.devices()
    return {
        "single": filled((5, 3), jnp.float32, SingleDeviceSharding(dev[2])),
        "replicated": filled((6, 4), jnp.float32, NamedSharding(m8, P())),
        "partial": filled((8, 6), jnp.float32, NamedSharding(m24, P("data", None))),
        "sharded2": filled((8, 8), jnp.float32, NamedSharding(m24, P("data", "model"))),
        "sharded2t": filled((4, 16), jnp.int32, NamedSharding(m24, P("model", "data"))),
        "uneven_rows": filled((8, 3), jnp.float32, NamedSharding(m24, P("model"))),
        "nans": jax.device_put(nan_payloads(), NamedSharding(m24, P("data"))),
        "bf16": filled((16, 4), jnp.bfloat16, NamedSharding(m8, P("data"))),
        "int8": filled((8, 5), jnp.int8, NamedSharding(m24, P("data", None))),
        "bool": filled((4, 8), jnp.bool_, NamedSharding(m24, P(None, "model"))),
        "zero_d": jnp.float32(3.25),
        "empty": jnp.zeros((0, 4), jnp.float32),
        "np": {"f64": np.linspace(-1, 1, 7), "bf16": np.arange(6, dtype=ml_dtypes.bfloat16),
               "i8": np.arange(-4, 4, dtype=np.int8), "bool": np.array([True, False, True]),
               "zero_d": np.array(2.5), "nans": nan_payloads(), "empty": np.zeros((3, 0), np.int16)},
        "npscalar": [np.float32(1.5), np.int64(-7), np.bool_(True), ml_dtypes.bfloat16(2.5), np.uint8(255)],
        "py": {"int": 2**62, "neg": -3, "float": 0.1, "bool": False, "str": "héllo", "bytes": b"\x00\xff",
               "none": None},
        "key": jax.random.key(42),
        "keys": jax.device_put(jax.random.split(jax.random.key(1), 8), NamedSharding(m8, P("data"))),
        "rbg": jax.random.key(3, impl="rbg"),
        "raw_key": jax.random.PRNGKey(7),
        "tuple": (jnp.ones(3, jnp.float32), 4),
    }


def test_every_leaf_type_roundtrips_onto_its_own_shardings(ckpt, m8, m24):
    state = every_leaf(m8, m24)
    ck = ckpt()
    h = ck.save(1, state)
    h.result()
    assert h.nbytes > 0 and h.save_call_seconds >= 0 and h.snapshot_seconds is not None
    assert ck.latest_step() == 1 and ck.all_steps() == [1]
    out = ck.restore(abstract(state))
    assert_tree_same(out, state)
    for path in ("single", "replicated", "partial", "sharded2", "sharded2t", "bf16", "int8", "bool", "keys"):
        assert out[path].sharding == state[path].sharding, path
    # A target of live arrays works like one of ShapeDtypeStructs.
    assert_tree_same(ck.restore(state), state)


def test_restore_without_target_returns_nested_numpy(ckpt, m8, m24):
    state = every_leaf(m8, m24)
    ck = ckpt()
    ck.save(1, state).result()
    out = ck.restore()
    assert set(out) == set(state)
    for name in ("single", "replicated", "partial", "sharded2", "bf16", "int8", "bool", "nans", "empty"):
        assert isinstance(out[name], np.ndarray), name
        assert out[name].dtype == state[name].dtype
        np.testing.assert_array_equal(bits(out[name]), bits(state[name]))
    assert isinstance(out["zero_d"], np.ndarray) and out["zero_d"].shape == ()
    for k, v in state["np"].items():
        assert_same(out["np"][k], v)
    assert isinstance(out["npscalar"], list)
    for got, want in zip(out["npscalar"], state["npscalar"]):
        assert_same(got, want)
    # None is an empty pytree node in JAX, not a leaf: without a target it has nothing to come back as.
    assert out["py"] == {k: v for k, v in state["py"].items() if v is not None}
    np.testing.assert_array_equal(out["keys"], np.asarray(jax.random.key_data(state["keys"])))
    np.testing.assert_array_equal(out["raw_key"], np.asarray(state["raw_key"]))
    assert isinstance(out["tuple"], list) and out["tuple"][1] == 4


# ------------------------------------------------------------------------------------------ resharding
def test_restore_onto_different_shardings(ckpt, m8, m24):
    x = filled((64, 32), jnp.float32, NamedSharding(m8, P("data", None)), seed=5)
    keys = jax.device_put(jax.random.split(jax.random.key(9), 16), NamedSharding(m8, P("data")))
    host = np.asarray(x)
    ck = ckpt()
    ck.save(1, {"x": x, "keys": keys}).result()
    dev = jax.devices()
    one = mesh((1,), ("x",), devices=[dev[6]])
    targets = [NamedSharding(m24, P(None, "model")), NamedSharding(m24, P("model", "data")),
               NamedSharding(m24, P()), SingleDeviceSharding(dev[5]), NamedSharding(one, P("x", None))]
    for sh in targets:
        out = ck.restore({"x": jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=sh),
                          "keys": jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=_1d(sh))})
        assert out["x"].sharding == sh
        np.testing.assert_array_equal(bits(out["x"]), bits(host))
        for shard in out["x"].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), host[shard.index])
        # JAX itself normalises a key array's spec (P() comes back as P(None,)): equivalent is what it can be.
        assert out["keys"].sharding.is_equivalent_to(_1d(sh), 1)
        assert_same(out["keys"], keys)


def _1d(sh):
    """The 1-d counterpart of a 2-d target sharding (for the key array)."""
    if isinstance(sh, NamedSharding):
        return NamedSharding(sh.mesh, P(*tuple(sh.spec)[:1]))
    return sh


def test_restore_numpy_saved_leaves_onto_devices_and_jax_leaves_into_numpy(ckpt, m24):
    a = np.arange(64, dtype=np.float32).reshape(8, 8)
    x = filled((8, 4), jnp.bfloat16, NamedSharding(m24, P("data", "model")))
    ck = ckpt()
    ck.save(1, {"a": a, "x": x}).result()
    sh = NamedSharding(m24, P("data", "model"))
    out = ck.restore({"a": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=sh),
                      "x": np.zeros((8, 4), ml_dtypes.bfloat16)})
    assert out["a"].sharding == sh
    np.testing.assert_array_equal(np.asarray(out["a"]), a)
    assert isinstance(out["x"], np.ndarray) and out["x"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(bits(out["x"]), bits(x))


# ------------------------------------------------------------------------------- frameworks' states
def test_optax_adamw_state(ckpt, m24):
    params = {"w": filled((16, 8), jnp.float32, NamedSharding(m24, P("data", "model"))),
              "b": filled((8,), jnp.float32, NamedSharding(m24, P()))}
    opt = optax.adamw(1e-2)
    opt_state = jax.jit(opt.init)(params)  # as a training script does: every leaf placed on the mesh
    grads = jax.tree.map(lambda p: jnp.cos(p), params)
    updates, opt_state = jax.jit(opt.update)(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    state = {"params": params, "opt_state": opt_state}
    ck = ckpt()
    ck.save(1, state).result()
    out = ck.restore(abstract(state))
    assert_tree_same(out, state)
    assert type(out["opt_state"][0]) is type(opt_state[0])
    # Training continues identically from the restored optimizer state.
    u1, _ = jax.jit(opt.update)(grads, opt_state, params)
    u2, _ = jax.jit(opt.update)(grads, out["opt_state"], out["params"])
    assert_tree_same(u2, u1)


class _Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))


def test_flax_linen_train_state(ckpt):
    model = _Dense()
    x = jnp.linspace(-1, 1, 8, dtype=jnp.float32).reshape(2, 4)
    params = model.init(jax.random.key(0), x)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))
    grads = jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2))(state.params)
    state = state.apply_gradients(grads=grads)
    ck = ckpt()
    ck.save(1, state).result()
    out = ck.restore(abstract(state))
    assert isinstance(out, train_state.TrainState) and out.step == 1
    assert_tree_same(out, state)
    assert_tree_same(out.apply_gradients(grads=grads), state.apply_gradients(grads=grads))


class _NNX(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(4, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.lin(x))


def test_flax_nnx_state_with_rngs(ckpt):
    model = _NNX(nnx.Rngs(0, dropout=1))
    x = jnp.ones((3, 4), jnp.float32)
    model(x)  # advance the dropout stream so its count is not the initial one
    graphdef, state = nnx.split(model)
    ck = ckpt()
    ck.save(1, state).result()
    out = ck.restore(abstract(state))
    assert_tree_same(out, state)
    restored = nnx.merge(graphdef, out)
    np.testing.assert_array_equal(bits(restored(x)), bits(model(x)))  # same dropout mask: same rng state
    np.testing.assert_array_equal(bits(restored(x)), bits(model(x)))


# ------------------------------------------------------------------------------------------ donation
def test_snapshots_equal_the_state_at_save_despite_donation(ckpt, m24):
    """Save every step and immediately run a donating jitted step that rewrites every buffer; with several
    saves in flight, each snapshot must equal the state as it was at its save() call, bit for bit."""
    state = {"w": filled((256, 128), jnp.float32, NamedSharding(m24, P("data", "model"))),
             "b": filled((128,), jnp.float32, NamedSharding(m24, P())),
             "v": filled((64, 16), jnp.bfloat16, NamedSharding(m24, P("data", None))),
             "n": jax.device_put(jnp.int32(0), NamedSharding(m24, P())),
             "key": jax.device_put(jax.random.key(0), NamedSharding(m24, P()))}

    @functools.partial(jax.jit, donate_argnums=0)
    def step(s):
        key, sub = jax.random.split(s["key"])
        return {"w": s["w"] * 1.5 + s["b"] + jax.random.normal(sub, s["w"].shape), "b": s["b"] - 1.0,
                "v": (s["v"] * 3).astype(jnp.bfloat16), "n": s["n"] + 1, "key": key}

    steps = 10
    ck = ckpt(keep=steps, max_pending_saves=4)
    target = abstract(state)
    expected, handles = {}, []
    for i in range(1, steps + 1):
        expected[i] = {k: np.array(jax.random.key_data(v) if k == "key" else v) for k, v in state.items()}
        handles.append(ck.save(i, state))
        state = step(state)
    ck.wait()
    assert all(h.done() for h in handles)
    assert ck.all_steps() == list(range(1, steps + 1))
    for i in range(1, steps + 1):
        out = ck.restore(target, step=i)
        for k, want in expected[i].items():
            np.testing.assert_array_equal(bits(out[k]), want.reshape(-1).view(np.uint8), err_msg=f"step {i} {k}")
    assert int(state["n"]) == steps  # the training state itself moved on untouched


def test_numpy_leaf_written_in_place_after_save_is_saved_as_at_the_call(ckpt, m8):
    """The workers copy after save() returns, so save() must hold a numpy leaf as it was at the call: writing it in
    place at once (64 MiB, while the copies run) must not reach the snapshot, checksums valid or not."""
    big = (np.arange(16 << 20, dtype=np.uint32) * 2654435761).view(np.float32)
    small = np.arange(12, dtype=">i4").reshape(3, 4)  # non-native byte order: saved in native order
    want_big, want_small = big.copy(), small.astype("<i4")
    ck = ckpt()
    state = {"big": big, "small": small, "x": filled((64, 8), jnp.float32, NamedSharding(m8, P("data")))}
    h = ck.save(1, state)
    big[:] = -1.0
    small[:] = -1
    h.result()
    out = ck.restore()
    np.testing.assert_array_equal(out["big"].view(np.uint32), want_big.view(np.uint32))
    np.testing.assert_array_equal(out["small"], want_small)
    np.testing.assert_array_equal(bits(out["x"]), bits(state["x"]))


# ----------------------------------------------------------------------------------------- retention
def test_keep_two_restores_an_older_kept_step(ckpt, m24):
    sh = NamedSharding(m24, P("data", "model"))
    states = {i: {"x": filled((8, 8), jnp.float32, sh, seed=i), "i": i} for i in range(1, 5)}
    ck = ckpt(keep=2)
    for i, s in states.items():
        ck.save(i, s)
    ck.wait()
    assert ck.all_steps() == [3, 4] and ck.store.steps() == [3, 4]
    assert ck.latest_step() == 4
    assert_tree_same(ck.restore(abstract(states[3]), step=3), states[3])
    assert_tree_same(ck.restore(abstract(states[4])), states[4])
    with pytest.raises(StepNotFoundError, match="step 2 is not held"):
        ck.restore(abstract(states[2]), step=2)


def test_keep_one_is_double_buffered(ckpt, m8):
    x = filled((64, 16), jnp.float32, NamedSharding(m8, P("data")))
    ck = ckpt(keep=1)
    for i in range(1, 9):
        ck.save(i, {"x": x + i}).result()
    ck.wait()
    assert ck.store.steps() == [8]
    assert ck.store.allocations <= 2  # after warm-up a save reuses the freed buffer
    np.testing.assert_array_equal(bits(ck.restore({"x": x})["x"]), bits(x + 8))


class SlowDeleteStore(MemoryStore):
    """A memory store whose delete() is slow, as a remote or shared-memory store's may be."""

    def delete(self, step: int) -> None:
        time.sleep(0.1)
        super().delete(step)


def test_wait_returns_after_retention(ckpt):
    ck = ckpt(store=f"{__name__}:SlowDeleteStore", keep=1)
    assert type(ck.store) is SlowDeleteStore
    for i in range(1, 4):
        ck.save(i, {"x": jnp.full(4, i, jnp.float32)})
    ck.wait()
    assert ck.all_steps() == [3] and ck.store.steps() == [3]


# ---------------------------------------------------------------------------------------------- errors
def test_target_mismatch_names_the_first_differing_path(ckpt):
    state = {"a": jnp.ones(4, jnp.float32), "b": jnp.ones((2, 3), jnp.float32), "c": jnp.ones(5, jnp.int32)}
    ck = ckpt()
    ck.save(1, state).result()
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    good = {"a": sds((4,), jnp.float32), "b": sds((2, 3), jnp.float32), "c": sds((5,), jnp.int32)}
    cases = [
        ({**good, "b": sds((3, 2), jnp.float32), "c": sds((5,), jnp.float32)},  # b differs first
         r"^b: saved shape \(2, 3\), target shape \(3, 2\)"),
        ({**good, "c": sds((5,), jnp.float32)}, "^c: saved dtype int32, target dtype float32"),
        ({**good, "b": sds((2, 3), jnp.bfloat16)}, "^b: saved dtype float32, target dtype bfloat16"),
        ({**good, "d": sds((1,), jnp.float32)}, "^d: in the target but not in step 1"),
        ({"a": good["a"], "b": good["b"]}, "^c: saved in step 1 but missing from the target"),
        ({**good, "a": 3}, r"^a: saved an array float32\[4\], target is a int value"),
        ([good["a"], good["b"], good["c"]], "^0: in the target but not in step 1"),
    ]
    for target, match in cases:
        with pytest.raises(TargetMismatchError, match=match):
            ck.restore(target)
    assert_tree_same(ck.restore(good), state)


def test_target_mismatch_for_keys_and_values(ckpt):
    ck = ckpt()
    ck.save(1, {"k": jax.random.key(0), "s": "text"}).result()
    with pytest.raises(TargetMismatchError, match=r"^k: saved a PRNG key array key<fry>"):
        ck.restore({"k": jax.ShapeDtypeStruct((2,), jnp.uint32), "s": "x"})
    with pytest.raises(TargetMismatchError, match="^s: saved the value 'text'"):
        ck.restore({"k": jax.random.key(5), "s": jax.ShapeDtypeStruct((), jnp.float32)})


def test_unsupported_leaf_names_its_path(ckpt):
    ck = ckpt()
    with pytest.raises(UnsupportedLeafError, match="^cfg/opts/1: leaf of type builtins.object"):
        ck.save(1, {"w": jnp.ones(2), "cfg": {"opts": [1, object()]}})
    with pytest.raises(UnsupportedLeafError, match="^obj: numpy arrays of dtype object"):
        ck.save(1, {"obj": np.array([1, "a"], dtype=object)})
    with pytest.raises(UnsupportedLeafError, match="^big: integer"):
        ck.save(1, {"big": 2**70})
    ck.save(1, {"w": jnp.ones(2)}).result()  # the refused saves used up nothing
    assert ck.latest_step() == 1


def test_step_must_grow(ckpt):
    ck = ckpt()
    ck.save(5, {"x": jnp.ones(2)})
    with pytest.raises(StepError, match="step 5 is not newer than the newest saved step 5"):
        ck.save(5, {"x": jnp.ones(2)})
    with pytest.raises(StepError, match="step 3 is not newer than the newest saved step 5"):
        ck.save(3, {"x": jnp.ones(2)})
    for bad in (-1, 1.5, True, "6"):
        with pytest.raises(StepError, match="non-negative int"):
            ck.save(bad, {"x": jnp.ones(2)})
    ck.save(np.int64(6), {"x": jnp.ones(2)}).result()
    assert ck.latest_step() == 6
    # restore(step, target) for restore(target, step): the message names the type and stays short, every leaf unsaid
    big = {f"layer{i}": jnp.zeros((64, 64)) for i in range(500)}
    with pytest.raises(StepError, match=r"step must be a non-negative int, got dict \{'layer0': ") as e:
        ck.restore(6, big)
    assert len(str(e.value)) < 400, len(str(e.value))


def test_budget_exceeded_keeps_the_newest_committed_step(ckpt, m8):
    x = filled((128, 64), jnp.float32, NamedSharding(m8, P("data")))
    probe = ckpt()
    nbytes = probe.save(1, {"x": x}).nbytes
    budget = nbytes * 3 // 2
    ck = ckpt(memory_budget_bytes=budget, keep=1)
    ck.save(1, {"x": x}).result()
    with pytest.raises(BudgetExceededError, match=f"step 2: snapshot of {nbytes} bytes does not fit the memory "
                                                  f"budget of {budget} bytes"):
        ck.save(2, {"x": x * 2})
    assert ck.store.held_bytes() <= budget
    assert ck.latest_step() == 1 and ck.all_steps() == [1]
    np.testing.assert_array_equal(bits(ck.restore({"x": x})["x"]), bits(x))
    ck.wait()  # the refused step left nothing pending


def test_restore_with_nothing_saved(ckpt):
    ck = ckpt()
    assert ck.latest_step() is None and ck.all_steps() == []
    with pytest.raises(NoCheckpointError, match="nothing has been committed"):
        ck.restore()
    with pytest.raises(StepNotFoundError, match="step 0 is not held"):
        ck.restore(step=0)


def test_unknown_step(ckpt):
    ck = ckpt()
    ck.save(1, {"x": jnp.ones(2)}).result()
    with pytest.raises(StepNotFoundError, match=r"step 7 is not held by store 'memory' \(held: \[1\]\)"):
        ck.restore(step=7)


def test_corrupted_chunk_raises_checksum_error(ckpt, m8):
    state = {"params": {"w": filled((64, 8), jnp.float32, NamedSharding(m8, P("data"))),
                        "b": filled((8,), jnp.float32, NamedSharding(m8, P()))}}
    ck = ckpt()
    ck.save(1, state).result()
    with ck.store.open(1) as view:
        meta = mf.decode(view.manifest).array("params/w")
    chunk = meta.chunks[3]
    ck.store.slot_bytes(1)[chunk.offset + 5] ^= 0x10
    with pytest.raises(ChecksumError, match=r"params/w: step 1 chunk \(24, 0\)\.\.\(32, 8\) of process 0 "
                                            r"failed its crc32c check"):
        ck.restore(abstract(state))
    # Without verification the damaged bytes come through (the check is what caught it).
    unchecked = ckpt(verify_on_restore=False)
    unchecked.save(1, state).result()
    unchecked.store.slot_bytes(1)[chunk.offset + 5] ^= 0x10
    got = np.asarray(unchecked.restore(abstract(state))["params"]["w"])
    assert not np.array_equal(bits(got), bits(state["params"]["w"]))


def test_closed_checkpointer_refuses_work(ckpt):
    ck = ckpt()
    ck.save(1, {"x": jnp.ones(2)})
    ck.close()
    with pytest.raises(ClosedError):
        ck.save(2, {"x": jnp.ones(2)})
    with pytest.raises(ClosedError):
        ck.restore()
    ck.close()
    assert ck.store.held_bytes() == 0


def test_context_manager_closes(m8):
    with jaxckpt.Checkpointer() as ck:
        ck.save(1, {"x": jnp.ones(2)})
    with pytest.raises(ClosedError):
        ck.save(2, {"x": jnp.ones(2)})
