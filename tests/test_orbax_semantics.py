"""SnapshotHandler behaves as Orbax's pytree handlers do: issue 14's nine causes, one behaviour per test.

Each test saves through Orbax's own machinery (a CheckpointManager or an AsyncCheckpointer) with the args an
Orbax user passes, and checks what the user relies on: the bits, the types, the error and its message.
"""
import subprocess
import sys
import textwrap
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt
from jaxckpt.errors import StepNotFoundError, TargetMismatchError, UnsupportedLeafError, UnsupportedTypeError
from jaxckpt.orbax import SnapshotHandler

AUTO = jax.sharding.AxisType.Auto


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))


def _bits(a, b) -> None:
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.fixture
def ck():
    with jaxckpt.Checkpointer(jaxckpt.Config(keep=6, job_id="semantics")) as c:
        yield c


def _save(ck, path, item, **kw):
    with ocp.AsyncCheckpointer(SnapshotHandler(ck)) as c:
        c.save(path, args=ocp.args.PyTreeSave(item, **kw))
        c.wait_until_finished()


def _restore(ck, path, args=None, **handler_kw):
    with ocp.AsyncCheckpointer(SnapshotHandler(ck, **handler_kw)) as c:
        return c.restore(path) if args is None else c.restore(path, args=args)


class MuNu(NamedTuple):
    mu: object
    nu: object


# ------------------------------------------------------------------------------- (1) no silent narrowing
def test_numpy_stays_numpy_and_64_bit_is_never_narrowed(ck, tmp_path):
    big = np.array([2**40 + 5, -(2**50)], np.int64)
    huge = np.array([1e300, -2.5], np.float64)
    _save(ck, tmp_path / "a", {"i": big, "f": huge})
    # A target without a sharding: Orbax gives numpy back for leaves saved as numpy, every bit kept.
    target = {"i": jax.ShapeDtypeStruct((2,), np.int64), "f": jax.ShapeDtypeStruct((2,), np.float64)}
    out = _restore(ck, tmp_path / "a", ocp.args.StandardRestore(target))
    assert isinstance(out["i"], np.ndarray) and isinstance(out["f"], np.ndarray)
    _bits(out["i"], big)
    _bits(out["f"], huge)
    # Asking for a 64-bit jax.Array without x64 is refused, naming the (first) leaf, instead of narrowed.
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(TargetMismatchError, match=r"^f: a jax.Array target of dtype float64 needs jax_enable_x64"):
        ck.restore({"i": jax.ShapeDtypeStruct((2,), np.int64, sharding=one),
                    "f": jax.ShapeDtypeStruct((2,), np.float64, sharding=one)}, step=ck.latest_step())


def test_saved_sharding_is_used_when_the_target_has_none(ck, tmp_path):
    mesh = _mesh((2, 4), ("x", "y"))
    w = jax.device_put(jnp.arange(64.0, dtype=jnp.float32).reshape(8, 8), NamedSharding(mesh, P("x", "y")))
    _save(ck, tmp_path / "a", {"w": w})
    out = _restore(ck, tmp_path / "a", ocp.args.StandardRestore({"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}))
    assert out["w"].sharding == w.sharding  # not device 0
    _bits(out["w"], w)


# ---------------------------------------------------------------------------------------- (2) metadata
def test_metadata_tree_lets_a_restore_without_target_build_its_arrays(ck, tmp_path):
    mesh = _mesh((8,), ("d",))
    w = jax.device_put(jnp.arange(32, dtype=jnp.bfloat16), NamedSharding(mesh, P("d")))
    item = {"w": w, "n": np.arange(6, dtype=np.int16).reshape(2, 3), "s": np.float32(2.5)}
    with ocp.AsyncCheckpointer(SnapshotHandler(ck)) as c:  # PyTreeSave keeps a numpy scalar (StandardSave: 0-d)
        c.save(tmp_path / "a", args=ocp.args.PyTreeSave(item, custom_metadata={"run": "r1", "epoch": 3}))
        c.wait_until_finished()
        meta = c.metadata(tmp_path / "a").item_metadata
    tree = meta.tree
    assert meta.custom_metadata == {"run": "r1", "epoch": 3}
    assert isinstance(tree["w"], ocp.metadata.ArrayMetadata)
    assert tree["w"].shape == (32,) and tree["w"].dtype == jnp.bfloat16
    assert tree["w"].sharding.to_jax_sharding() == w.sharding
    assert tree["n"].shape == (2, 3) and tree["n"].dtype == np.int16 and tree["n"].sharding is None
    assert isinstance(tree["s"], ocp.metadata.ScalarMetadata) and tree["s"].dtype == np.float32
    # PyTreeRestore(restore_args) with no item: the arrays are built from the metadata.
    one = jax.sharding.SingleDeviceSharding(jax.devices()[5])
    out = _restore(ck, tmp_path / "a", ocp.args.PyTreeRestore(restore_args={
        "w": ocp.ArrayRestoreArgs(sharding=one), "n": ocp.RestoreArgs(), "s": ocp.RestoreArgs()}))
    assert out["w"].sharding == one
    _bits(out["w"], w)
    _bits(out["n"], item["n"])
    assert type(out["s"]) is np.float32 and out["s"] == np.float32(2.5)


# ------------------------------------------------------------------------- (3) restore without a target
def test_restore_without_target_keeps_containers_none_and_empty_nodes(ck, tmp_path):
    a = np.arange(4, dtype=np.uint8)
    item = {"nt": MuNu(mu=a, nu=None), "tup": (a + 1, [a + 2]), "empty": {}, "none": None,
            "empty_nt": (), "v": 7, "name": "run"}
    _save(ck, tmp_path / "a", item)
    out = _restore(ck, tmp_path / "a")
    assert type(out["nt"]).__name__ == "MuNu" and out["nt"]._fields == ("mu", "nu") and out["nt"].nu is None
    assert isinstance(out["tup"], tuple) and isinstance(out["tup"][1], list)
    assert out["empty"] == {} and out["none"] is None and out["empty_nt"] == ()
    assert out["v"] == 7 and out["name"] == "run"
    _bits(out["nt"].mu, a)
    _bits(out["tup"][1][0], a + 2)
    # Orbax's legacy answer (its default PyTreeMetadataOptions): namedtuples as dicts, tuples as lists.
    legacy = _restore(ck, tmp_path / "a", rich_types=False)
    assert legacy["nt"] == {"mu": legacy["nt"]["mu"], "nu": None} and isinstance(legacy["tup"], list)


# --------------------------------------------------------------------------------- (4) partial restore
def test_placeholder_and_partial_restore_skip_leaves(ck, tmp_path):
    item = {"a": np.arange(3.0), "b": {"c": np.arange(4), "d": np.ones(2, np.float32)}}
    _save(ck, tmp_path / "a", item)
    out = _restore(ck, tmp_path / "a", ocp.args.PyTreeRestore(
        item={"a": ocp.PLACEHOLDER, "b": {"c": np.zeros(4, np.int64), "d": ocp.PLACEHOLDER}}))
    assert out["a"] is ocp.PLACEHOLDER and out["b"]["d"] is ocp.PLACEHOLDER
    _bits(out["b"]["c"], item["b"]["c"])
    out = _restore(ck, tmp_path / "a", ocp.args.PyTreeRestore(item={"b": {"d": np.zeros(2, np.float32)}},
                                                              partial_restore=True))
    assert set(out) == {"b"} and set(out["b"]) == {"d"}
    _bits(out["b"]["d"], item["b"]["d"])
    # None in the item skips that leaf too, and comes back as None (as Orbax: tests/test_orbax_contract.py).
    out = _restore(ck, tmp_path / "a", ocp.args.PyTreeRestore(item={"b": {"d": None}}, partial_restore=True))
    assert out == {"b": {"d": None}}
    with pytest.raises(TargetMismatchError, match=r"User-provided restore item and on-disk value metadata tree "
                                                  r"structures do not match: saved leaves \['a'\] are missing"):
        _restore(ck, tmp_path / "a", ocp.args.PyTreeRestore(item={"b": {"c": None, "d": None}}))


# ------------------------------------------------------------------------------ (5) strict=False shapes
def test_strict_false_pads_and_truncates(ck, tmp_path):
    x = np.arange(1, 7, dtype=np.float32).reshape(2, 3)
    _save(ck, tmp_path / "a", {"x": x})
    one = jax.sharding.SingleDeviceSharding(jax.devices()[1])
    out = _restore(ck, tmp_path / "a", ocp.args.StandardRestore(
        {"x": jax.ShapeDtypeStruct((3, 2), jnp.float32, sharding=one)}, strict=False))
    assert out["x"].sharding == one
    np.testing.assert_array_equal(np.asarray(out["x"]), np.array([[1, 2], [4, 5], [0, 0]], np.float32))
    with pytest.raises(TargetMismatchError, match=r"x: saved shape \(2, 3\), target shape \(3, 2\) \(pass "
                                                  r"strict=False"):
        _restore(ck, tmp_path / "a", ocp.args.StandardRestore({"x": np.zeros((3, 2), np.float32)}))


# ----------------------------------------------------------------------------------------- (6) PRNG keys
def test_prng_key_target_given_as_key_data(ck, tmp_path):
    # Orbax 0.12 restores saved keys as keys even onto their key data (uint32[2], what to_shape_dtype_struct of a
    # key array gives), on the sharding given for the data; tests/test_orbax_contract.py compares with Orbax.
    key = jax.random.key(42)
    _save(ck, tmp_path / "a", {"rng": key})
    one = jax.sharding.SingleDeviceSharding(jax.devices()[2])
    out = _restore(ck, tmp_path / "a", ocp.args.StandardRestore(
        {"rng": jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=one)}))
    assert jax.dtypes.issubdtype(out["rng"].dtype, jax.dtypes.prng_key) and out["rng"].sharding == one
    _bits(jax.random.key_data(out["rng"]), jax.random.key_data(key))
    with pytest.raises(TargetMismatchError, match=r"rng: saved PRNG keys whose key data is \[2\], target shape \[3\]"):
        _restore(ck, tmp_path / "a", ocp.args.StandardRestore({"rng": jax.ShapeDtypeStruct((3,), jnp.uint32)}))
    keys = _restore(ck, tmp_path / "a")["rng"]  # without a target: the typed key itself
    assert jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)
    _bits(jax.random.key_data(keys), jax.random.key_data(key))


# ----------------------------------------------------------------------------------------------- (7) casts
def test_cast_at_save_and_at_restore(ck, tmp_path):
    w = jnp.linspace(-3, 3, 16, dtype=jnp.float32)
    _save(ck, tmp_path / "a", {"w": w, "m": np.arange(4, dtype=np.float64)},
          save_args={"w": ocp.SaveArgs(dtype=jnp.bfloat16), "m": ocp.SaveArgs()})
    meta = _restore(ck, tmp_path / "a")
    assert meta["w"].dtype == jnp.bfloat16  # stored as bfloat16
    _bits(meta["w"], w.astype(jnp.bfloat16))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    out = _restore(ck, tmp_path / "a", ocp.args.StandardRestore(
        {"w": jax.ShapeDtypeStruct((16,), jnp.float32, sharding=one), "m": np.zeros(4, np.float32)}))
    _bits(out["w"], w.astype(jnp.bfloat16).astype(jnp.float32))
    _bits(out["m"], np.arange(4, dtype=np.float32))


# ------------------------------------------------------------------------------ (8) a step saved again
def _manager(directory, handler, **options):
    registry = ocp.DefaultCheckpointHandlerRegistry()
    registry.add("state", ocp.args.StandardSave, handler)
    registry.add("state", ocp.args.StandardRestore, handler)
    return ocp.CheckpointManager(directory, handler_registry=registry,
                                 options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True, **options))


def _args(x):
    return ocp.args.Composite(state=ocp.args.StandardSave({"x": x}))


def _back(mngr, step):
    return mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore({"x": np.zeros(3)})))["state"]


def test_delete_then_save_the_same_step_and_overwrite(ck, tmp_path):
    handler = SnapshotHandler(ck)
    mngr = _manager(tmp_path, handler)
    for s in (0, 1):
        assert mngr.save(s, args=_args(np.full(3, float(s))))
    mngr.wait_until_finished()
    mngr.delete(1)
    assert mngr.save(1, args=_args(np.full(3, 11.0)))  # Orbax's step 1 again
    mngr.wait_until_finished()
    _bits(_back(mngr, 1)["x"], np.full(3, 11.0))
    _bits(_back(mngr, 0)["x"], np.zeros(3))
    mngr.close()
    # A bare Checkpointer with force=True overwrites its path.
    with ocp.AsyncCheckpointer(SnapshotHandler(ck)) as c:
        c.save(tmp_path / "p", args=ocp.args.StandardSave({"x": np.ones(3)}))
        c.save(tmp_path / "p", args=ocp.args.StandardSave({"x": np.full(3, 2.0)}), force=True)
        c.wait_until_finished()
        _bits(c.restore(tmp_path / "p")["x"], np.full(3, 2.0))


def test_two_managers_with_default_handlers(tmp_path):
    m1 = _manager(tmp_path / "one", SnapshotHandler())
    m2 = _manager(tmp_path / "two", SnapshotHandler())
    base = (jaxckpt.orbax.default_checkpointer().latest_step() or 0) + 10
    assert m1.save(base, args=_args(np.full(3, 1.0)))
    m1.wait_until_finished()
    assert m2.save(0, args=_args(np.full(3, 2.0)))  # older than m1's step in the shared Checkpointer
    m2.wait_until_finished()
    _bits(_back(m1, base)["x"], np.full(3, 1.0))
    _bits(_back(m2, 0)["x"], np.full(3, 2.0))
    m1.close()
    m2.close()


def test_exception_inside_async_save_lets_the_process_exit(tmp_path):
    script = textwrap.dedent(f"""
        import numpy as np, orbax.checkpoint as ocp, jaxckpt
        from jaxckpt.orbax import SnapshotHandler
        h = SnapshotHandler(config=jaxckpt.Config(job_id="exit-test", memory_budget_bytes=1 << 20))
        reg = ocp.DefaultCheckpointHandlerRegistry()
        reg.add("state", ocp.args.StandardSave, h)
        m = ocp.CheckpointManager({str(tmp_path)!r}, handler_registry=reg,
                                  options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True))
        m.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave({{"x": np.zeros(3)}})))
        m.wait_until_finished()
        try:  # refused at save(), as Orbax's own handler refuses it
            m.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave({{"x": object()}})))
        except Exception as e:
            print("ERROR", type(e).__name__, e)
        m.wait_until_finished()
        # Refused by the engine once Orbax started the save (over the memory budget): an asynchronous failure.
        m.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave({{"x": np.zeros(1 << 18)}})))
        try:
            m.wait_until_finished()
        except Exception as e:
            print("ASYNC", type(e).__name__)
        print("LATEST", m.latest_step())
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERROR UnsupportedTypeError Unsupported type: <class 'object'> for key: ('x',). x: StandardSave takes " \
           "arrays and numbers" in proc.stdout
    assert "ASYNC BudgetExceededError" in proc.stdout
    assert "LATEST 0" in proc.stdout  # the refused steps are not listed


# ------------------------------------------------------------------------ (9) Orbax's words, restarts
def test_unsupported_type_has_orbax_words(ck, tmp_path):
    with ocp.AsyncCheckpointer(SnapshotHandler(ck)) as c:
        with pytest.raises(ValueError, match=r"^Unsupported type: <class 'object'> for key: \('bad',\)\. bad: "
                                             r"StandardSave takes arrays and numbers") as info:
            c.save(tmp_path / "a", args=ocp.args.StandardSave({"ok": np.zeros(1), "bad": object()}))
        c.wait_until_finished()
    assert isinstance(info.value, UnsupportedTypeError) and isinstance(info.value, UnsupportedLeafError)


def test_restart_with_memory_store_starts_fresh_or_falls_back(tmp_path):
    with jaxckpt.Checkpointer(jaxckpt.Config(job_id="restart")) as ck:
        mngr = _manager(tmp_path / "run", SnapshotHandler(ck))
        for s in (1, 2):
            assert mngr.save(s, args=_args(np.full(3, float(s))))
        mngr.wait_until_finished()
        mngr.close()
    # The job restarts: store="memory" lost every snapshot. A MaxText-style resume starts fresh.
    with jaxckpt.Checkpointer(jaxckpt.Config(job_id="restart")) as ck:
        handler = SnapshotHandler(ck, directory=tmp_path / "run")
        mngr = _manager(tmp_path / "run", handler)
        assert mngr.latest_step() is None and mngr.all_steps() == []
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["1.jaxckpt-lost", "2.jaxckpt-lost"]
        mngr.close()

    # Built without directory= (after the manager listed the steps): the first restore of a gone step raises
    # StepNotFoundError naming it and renames the gone steps away, so the manager's reload() starts fresh.
    (tmp_path / "run" / "1.jaxckpt-lost").rename(tmp_path / "run" / "1")
    (tmp_path / "run" / "2.jaxckpt-lost").rename(tmp_path / "run" / "2")
    with jaxckpt.Checkpointer(jaxckpt.Config(job_id="restart")) as ck:
        mngr = _manager(tmp_path / "run", SnapshotHandler(ck))
        assert mngr.latest_step() == 2
        with pytest.raises(StepNotFoundError, match=r"step 2: Orbax lists .* no longer holds its snapshot .*"
                                                    r"renamed to <step>\.jaxckpt-lost, so CheckpointManager"
                                                    r"\.reload\(\) lists only steps that can be restored"):
            _back(mngr, 2)
        mngr.reload()
        assert mngr.latest_step() is None and mngr.all_steps() == []
        mngr.close()

    # With a persistent tier the step it holds is kept and restored from there.
    config = jaxckpt.Config(job_id="restart-p", persistent_dir=str(tmp_path / "disk"), persistent_interval=2)
    with jaxckpt.Checkpointer(config) as ck:
        mngr = _manager(tmp_path / "run2", SnapshotHandler(ck))
        for s in (1, 2, 3):
            assert mngr.save(s, args=_args(np.full(3, float(s))))
        mngr.wait_until_finished()
        ck.persister.wait()  # unbounded, as elsewhere: pytest's time-out bounds a hang, load cannot fail it
        mngr.close()
    with jaxckpt.Checkpointer(config) as ck:
        mngr = _manager(tmp_path / "run2", SnapshotHandler(ck, directory=tmp_path / "run2"))
        assert mngr.all_steps() == [2]
        _bits(_back(mngr, mngr.latest_step())["x"], np.full(3, 2.0))  # from the persistent tier
        assert ck.store.steps() == []
        mngr.close()
