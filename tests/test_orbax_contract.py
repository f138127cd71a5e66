"""SnapshotHandler keeps Orbax's StandardCheckpointHandler / PyTreeCheckpointHandler contract (issue 27).

Every test runs one case on Orbax's own handler and on ``SnapshotHandler`` in the same test (``tests/
orbax_pair.py``), through each route an Orbax user takes (a bare handler, ``ocp.AsyncCheckpointer``,
``ocp.CheckpointManager``) with each kind of Orbax args (``StandardSave``/``StandardRestore``,
``PyTreeSave``/``PyTreeRestore``), and compares jaxckpt's answer with Orbax's: containers, ``None`` and masked
leaves, leaf types, bits, shardings, metadata, and the errors (class and words). Orbax changing its behaviour
makes the comparison fail rather than drift silently.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from orbax.checkpoint._src.metadata import tree as tree_metadata

import jaxckpt
from jaxckpt.errors import EmptyItemError, JaxckptError, TargetMismatchError, UnsupportedTypeError
from orbax_pair import KINDS, ROUTES, Pair, assert_bits, assert_same_error, assert_same_metadata, assert_same_tree

optax = pytest.importorskip("optax", reason="the masked optimizer states come from optax (pip install -e '.[bench]')")

AUTO = jax.sharding.AxisType.Auto
CASES = [(k, r) for k in KINDS for r in ROUTES]


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))


def _abstract(tree):
    """What a user restores onto: each array's shape, dtype and sharding (Orbax's own helper)."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


@pytest.fixture
def ck():
    with jaxckpt.Checkpointer(jaxckpt.Config(keep=8, job_id="contract")) as c:
        yield c


@pytest.fixture(params=CASES, ids=[f"{k}-{r}" for k, r in CASES])
def pair(request, ck, tmp_path):
    p = Pair(*request.param, tmp_path, ck)
    yield p
    p.close()


# ------------------------------------------------------------------------------ (1) masked optimizer state
def _params():
    mesh = _mesh((4, 2), ("x", "y"))
    return {"w": jax.device_put(jnp.arange(32.0, dtype=jnp.float32).reshape(8, 4), NamedSharding(mesh, P("x", "y"))),
            "b": jnp.linspace(-1, 1, 4, dtype=jnp.float32),
            "scale": jnp.full((2,), 0.5, jnp.float32)}


def _stepped(tx, params):
    """The optimizer state after one update: moments that are not zeros."""
    grads = jax.tree.map(lambda p: jnp.cos(p) + 0.25, params)
    _, state = tx.update(grads, tx.init(params), params)
    return state


def test_masked_optimizer_state(pair, ck):
    params = _params()
    mask = {"w": True, "b": False, "scale": False}  # e.g. weight decay on kernels only
    state = _stepped(optax.masked(optax.adam(1e-2), mask), params)
    orbax_saved, ours_saved = pair.save(1, state)
    orbax_saved.get(), ours_saved.get()

    # The masked target: the masked structure comes back too.
    ref, got = pair.restore(1, _abstract(state))
    assert_same_tree(ref.get(), got.get())
    assert_same_tree(state, got.get())
    assert isinstance(got.value.inner_state[0].mu["b"], optax.MaskedNode)

    # The unmasked target (the same optimizer without the mask): None at the leaves the mask left out.
    unmasked = _abstract(optax.masked(optax.adam(1e-2), {"w": True, "b": True, "scale": True}).init(params))
    ref, got = pair.restore(1, unmasked)
    assert_same_tree(ref.get(), got.get())
    mu = got.value.inner_state[0].mu
    assert mu["b"] is None and mu["scale"] is None
    assert_bits(state.inner_state[0].mu["w"], mu["w"])

    # No target: the saved tree, masked leaves as None (Orbax's default container types).
    ref, got = pair.restore(1)
    assert_same_tree(ref.get(), got.get())
    ref, got = pair.metadata(1)
    assert_same_metadata(ref.get().tree, got.get().tree)


# ----------------------------------------------------------------------------------- (2) a None target leaf
def test_none_target_leaf_is_skipped(pair, ck):
    mesh = _mesh((8,), ("d",))
    a = jax.device_put(jnp.arange(64, dtype=jnp.int32), NamedSharding(mesh, P("d")))
    item = {"a": a, "b": jnp.ones((256, 256), jnp.float32), "c": {"x": np.arange(1000, dtype=np.float64)}}
    orbax_saved, ours_saved = pair.save(1, item)
    orbax_saved.get(), ours_saved.get()
    target = {"a": ocp.utils.to_shape_dtype_struct(a), "b": None, "c": {"x": None}}
    ref, got = pair.restore(1, target)
    assert_same_tree(ref.get(), got.get())
    assert got.value["b"] is None and got.value["c"]["x"] is None
    assert_bits(a, got.value["a"])
    assert ck.last_restore_report.nbytes == a.nbytes  # the skipped arrays were not read


# ---------------------------------------------------------------------------------- (3) metadata as a tree
def test_metadata_is_the_saved_tree(pair, ck):
    mesh = _mesh((2, 4), ("x", "y"))
    item = {"w": jax.device_put(jnp.linspace(-3, 3, 64, dtype=jnp.float32).reshape(8, 8),
                                NamedSharding(mesh, P("x", "y"))),
            "n": np.arange(6, dtype=np.int16).reshape(2, 3), "step": 7, "lr": 0.5, "rng": jax.random.key(3),
            "masked": optax.MaskedNode(), "none": None}
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(), item)
    save_args["w"] = ocp.SaveArgs(dtype=np.dtype(jnp.bfloat16))
    orbax_saved, ours_saved = pair.save(1, item, save_args=save_args, custom_metadata={"run": "r1", "epoch": 3})
    orbax_saved.get(), ours_saved.get()
    ref, got = pair.metadata(1)
    ref, got = ref.get(), got.get()
    assert isinstance(got, tree_metadata.TreeMetadata)
    assert got.custom_metadata == ref.custom_metadata == {"run": "r1", "epoch": 3}
    assert_same_metadata(ref.tree, got.tree)
    # The metadata is the tree itself: tree-mapping it walks the saved leaves, indexing it gives them.
    dtypes = jax.tree.map(lambda m: m.dtype, got)
    assert dtypes.tree == jax.tree.map(lambda m: m.dtype, ref).tree
    assert dtypes["w"] == jnp.bfloat16 and dtypes.custom_metadata == {"run": "r1", "epoch": 3}
    assert got["w"].shape == (8, 8) and "step" in got and len(got) == len(ref)
    # Restored onto its own metadata: PyTreeRestore takes it, StandardRestore refuses its leaf types.
    ref, got = pair.restore(1, pair.orbax.metadata(1))
    if pair.kind.name == "pytree":
        assert_same_tree(ref.get(), got.get())
    else:
        assert_same_error(ref, got, "Unsupported type", UnsupportedTypeError)


# ------------------------------------------------------------------------------------------- (4) PRNG keys
def test_prng_keys_restore_as_keys(pair, ck):
    mesh = _mesh((4,), ("d",))
    keys = jax.device_put(jax.random.split(jax.random.key(1), 4), NamedSharding(mesh, P("d")))
    item = {"rng": jax.random.key(42), "keys": keys, "x": jnp.arange(3.0)}
    orbax_saved, ours_saved = pair.save(1, item)
    orbax_saved.get(), ours_saved.get()
    logical = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), item)
    for target in (_abstract(item), logical):  # key data (uint32[..., 2]) or key<fry> abstract leaves
        ref, got = pair.restore(1, target)
        assert_same_tree(ref.get(), got.get())
        assert_same_tree(item, got.value)
        assert str(got.value["rng"].dtype) == "key<fry>" and got.value["keys"].sharding == keys.sharding


# ------------------------------------------------------------------------------------------ (5) Orbax's errors
def test_empty_tree_is_refused(pair, ck):
    orbax_saved, ours_saved = pair.save(1, {"x": np.arange(3.0)})
    orbax_saved.get(), ours_saved.get()
    for step, item in ((2, {}), (3, None)):
        ref, got = pair.save(step, item)
        words = "Must provide item to save." if item is None and pair.kind.name == "standard" else "Found empty item."
        assert_same_error(ref, got, words, EmptyItemError)
    assert len(ck.all_steps()) == 1  # nothing committed for the refused saves, nothing lost
    assert_same_tree(pair.restore(1)[0].get(), pair.restore(1)[1].get())


def test_unsupported_leaf_type(pair, ck):
    ref, got = pair.save(1, {"a": "text", "b": jnp.ones(2)})
    if pair.kind.name == "standard":  # StandardSave takes arrays and numbers only
        assert_same_error(ref, got, "Unsupported type", UnsupportedTypeError)
        assert ck.all_steps() == []
    else:  # PyTreeSave also takes strings
        ref.get(), got.get()
        assert_same_tree(*(o.get() for o in pair.restore(1)))
    ref, got = pair.save(2, {"a": object(), "b": jnp.ones(2)})
    if pair.kind.name == "standard":
        assert_same_error(ref, got, "Unsupported type", UnsupportedTypeError)
    else:  # Orbax's PyTree handler says "TypeHandler lookup failed for: type=<class 'object'>"
        assert isinstance(ref.error, ValueError) and isinstance(got.error, UnsupportedTypeError), got.error
        assert got.where == ref.where and str(got.error).startswith("Unsupported type"), (got.where, got.error)

    # A target holding a leaf of such a type.
    orbax_saved, ours_saved = pair.save(3, {"a": jnp.arange(3), "b": jnp.ones(2)})
    orbax_saved.get(), ours_saved.get()
    target = {"a": "text", "b": ocp.utils.to_shape_dtype_struct(jnp.ones(2))}
    ref, got = pair.restore(3, target)
    if pair.kind.name == "standard":
        assert_same_error(ref, got, "Unsupported type", UnsupportedTypeError)
    else:  # PyTreeRestore reads such a leaf as saved
        assert_same_tree(ref.get(), got.get())


TOPOLOGY_RESTORE = textwrap.dedent("""
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    sys.path.insert(0, sys.argv[1])
    import jax.numpy as jnp, numpy as np, orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxckpt
    from jaxckpt.errors import TargetMismatchError
    from orbax_pair import KINDS, ROUTES, Pair, assert_same_error, assert_same_tree, assert_bits
    root, disk = sys.argv[2], sys.argv[3]
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    on4 = {"w": jax.ShapeDtypeStruct((16,), jnp.float32, sharding=NamedSharding(mesh, P("d"))),
           "one": jax.ShapeDtypeStruct((2,), jnp.float32, sharding=NamedSharding(mesh, P())),
           "n": np.zeros(3, np.int64)}
    config = jaxckpt.Config(job_id="contract-topology", persistent_dir=disk, persistent_interval=1,
                            persistent_keep=6)
    with jaxckpt.Checkpointer(config) as ck:
        for kind in KINDS:
            for route in ROUTES:
                pair = Pair(kind, route, f"{root}/{kind}/{route}", ck)
                ref, got = pair.restore(1)
                if kind == "standard":
                    assert_same_error(ref, got, "Topology mismatch detected", TargetMismatchError)
                else:  # Orbax's PyTree handler fails deeper, with words of its own
                    assert isinstance(ref.error, ValueError) and isinstance(got.error, TargetMismatchError)
                    assert str(got.error).startswith("Topology mismatch detected"), got.error
                assert "w: saved on devices [0, 1, 2, 3, 4, 5, 6, 7]" in str(got.error), got.error
                # A target with this job's topology (PyTreeRestore takes its shardings from restore_args).
                extra = {"restore_args": ocp.checkpoint_utils.construct_restore_args(on4)} if kind == "pytree" else {}
                ref, got = pair.restore(1, on4, **extra)
                assert_same_tree(ref.get(), got.get())
                assert_bits(got.value["w"], np.arange(16, dtype=np.float32))
                # None leaves skip the others (jaxckpt's persistent tier reads them to host memory, then drops them).
                part = {"w": on4["w"], "one": None, "n": None}
                extra = {"restore_args": ocp.checkpoint_utils.construct_restore_args(part)} if kind == "pytree" else {}
                ref, got = pair.restore(1, part, **extra)
                assert_same_tree(ref.get(), got.get())
                pair.close()
                print("PASS", kind, route, flush=True)
""")


def test_topology_mismatch_without_target(tmp_path):
    """Saved on 8 devices; a job with 4 restores without a target: Orbax's "Topology mismatch detected"."""
    mesh = _mesh((8,), ("d",))
    state = {"w": jax.device_put(jnp.arange(16, dtype=jnp.float32), NamedSharding(mesh, P("d"))),
             "one": jax.device_put(jnp.ones(2, jnp.float32), jax.sharding.SingleDeviceSharding(jax.devices()[6])),
             "n": np.arange(3, dtype=np.int64)}
    config = jaxckpt.Config(job_id="contract-topology", persistent_dir=str(tmp_path / "disk"), persistent_interval=1,
                            persistent_keep=len(CASES))
    with jaxckpt.Checkpointer(config) as ck:
        for kind in KINDS:
            for route in ROUTES:
                pair = Pair(kind, route, tmp_path / kind / route, ck)
                orbax_saved, ours_saved = pair.save(1, state)
                orbax_saved.get(), ours_saved.get()
                pair.close()
                ck.persister.wait(120)  # each step persisted (the tier never queues more than one)
    # The job's memory went with it: the restarted job with 4 devices reads the persistent tier.
    tests = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", TOPOLOGY_RESTORE, tests, str(tmp_path), str(tmp_path / "disk")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("PASS") == len(KINDS) * len(ROUTES), proc.stdout


# ------------------------------------------------- Orbax v1: a None leaf skips, so its metadata gives values
def test_v1_load_onto_its_metadata(tmp_path):
    """v1's ``load(step, metadata(step).metadata)``: Python values, strings and None leaves come back as from
    Orbax's own v1 pytree handler (the metadata gives a value of the saved type, never a skipping None). (Masked
    leaves are left out: without an abstract tree jaxckpt's v1 handler keeps the saved container types, Orbax's
    v1 defaults to its legacy ones.)"""
    import orbax.checkpoint.experimental.v1 as ocp1

    import jaxckpt.orbax.v1 as jv1
    state = {"w": jnp.arange(4.0), "step": 3, "lr": 0.5, "name": "run", "n": np.arange(2), "none": None}
    orbax = ocp1.training.Checkpointer(tmp_path / "orbax")
    orbax.save(1, state)
    orbax.wait()
    ref = orbax.load(1, orbax.metadata(1).metadata)
    orbax.close()
    with jaxckpt.Checkpointer(jaxckpt.Config(job_id="contract-v1")) as ck:
        jv1.configure(ck)
        with jv1.context():
            ours = ocp1.training.Checkpointer(tmp_path / "jaxckpt")
            ours.save(1, state)
            ours.wait()
            got = ours.load(1, ours.metadata(1).metadata)
            ours.close()
    assert_same_tree(ref, got)
    assert got["step"] == 3 and got["name"] == "run"
