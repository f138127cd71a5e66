"""Bad input from every direction: each gets a clear jaxckpt error, and nothing committed is lost.

Complements test_manifest.py / test_transport.py / test_config.py (which check the decoders in isolation):
here the damage goes through the real paths and, after each bad input, the newest committed step is restored
again and compared bit for bit.

- manifests damaged in a store (truncated, flipped, wrong version, schema-valid but lying, random), fuzzed
  with hypothesis through ``Checkpointer.restore``: a JaxckptError naming the step, never another exception;
- restore targets that do not match (structure, shape, dtype, kind) -> TargetMismatchError naming the path;
- config files and dicts with unknown or ill-typed keys -> ConfigError naming the key;
- steps that no process has -> StepNotFoundError naming the step (memory, shm, persistent fallback).

Bad requests and replies on the wire (the peer transport, the node agent's socket): ``test_bad_input_wire.py``.
"""
from __future__ import annotations

import typing

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from hypothesis import given, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt
from fuzzing import FUZZ, msgpack_values
from jaxckpt import Config
from jaxckpt.core import manifest as mf
from jaxckpt.core.checksum import crc32c
from jaxckpt.errors import (ConfigError, JaxckptError, ManifestError, NoCheckpointError, StepNotFoundError,
                            TargetMismatchError)

AUTO = jax.sharding.AxisType.Auto


def bits(x) -> np.ndarray:
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


def assert_tree_bitwise(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if isinstance(w, (jax.Array, np.ndarray, np.generic)):
            assert g.dtype == w.dtype and g.shape == w.shape, (g, w)
            np.testing.assert_array_equal(bits(g), bits(w))
        else:
            assert type(g) is type(w) and g == w


def nan_payloads() -> np.ndarray:
    return np.array([0x7FC00001, 0xFFC00123, 0x7F800000, 0x80000000, 0x3F800000], np.uint32).view(np.float32)


def make_state(step: int) -> dict:
    """A small state of every kind of leaf, a pure function of ``step``."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"), axis_types=(AUTO, AUTO))
    rng = np.random.default_rng(step)
    w = rng.standard_normal((8, 6)).astype(np.float32)
    w.reshape(-1)[:5] = nan_payloads()
    return {
        "params": {"w": jax.device_put(w, NamedSharding(mesh, P("a", "b"))),
                   "b": jax.device_put(rng.standard_normal(6).astype(jnp.bfloat16), NamedSharding(mesh, P()))},
        "np": rng.integers(-100, 100, (5, 3)).astype(np.int16),
        "key": jax.random.fold_in(jax.random.key(7), step),
        "count": np.int64(step),
        "lr": 0.5 * step,
        "name": f"run-{step}",
    }


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, tree)


@pytest.fixture(scope="module")
def committed():
    """A checkpointer holding committed steps 1 and 2 (the state nothing may ever lose)."""
    ck = jaxckpt.Checkpointer(Config(keep=2))
    for step in (1, 2):
        ck.save(step, make_state(step)).result()
    yield ck
    ck.close()


def assert_nothing_lost(ck) -> None:
    """The newest committed step (and the older kept one) still restore bit for bit."""
    assert ck.latest_step() == 2 and ck.all_steps() == [1, 2]
    for step in (1, 2):
        want = make_state(step)
        assert_tree_bitwise(ck.restore(abstract(want), step=step), want)


# --------------------------------------------------------------------------------------- manifests
_injected = iter(range(1000, 10**9))


def inject(ck, manifest: bytes, source_step: int = 2) -> int:
    """Put a step whose buffer is ``source_step``'s genuine bytes and whose manifest is ``manifest``."""
    step = next(_injected)
    with ck.store.open(source_step) as view:
        slot = ck.store.reserve(step, len(view.buffer))
        np.frombuffer(slot.buffer, np.uint8)[:] = np.frombuffer(view.buffer, np.uint8)
    ck.store.commit(slot, manifest)
    return step


def genuine_manifest(ck, step: int = 2) -> bytes:
    with ck.store.open(step) as view:
        return bytes(view.manifest)


_GOOD_CRC = object()


def envelope(body: bytes, *, version=mf.VERSION, fmt=mf.FORMAT, crc=_GOOD_CRC) -> bytes:
    return msgpack.packb([fmt, version, crc32c(body) if crc is _GOOD_CRC else crc, body], use_bin_type=True)


def nodes(obj, path=()):
    """Every (path, value) inside a wire manifest, containers included."""
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from nodes(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from nodes(v, path + (i,))


def replaced(obj, path, value):
    if not path:
        return value
    if isinstance(obj, dict):
        return {k: (replaced(v, path[1:], value) if k == path[0] else v) for k, v in obj.items()}
    return [replaced(v, path[1:], value) if i == path[0] else v for i, v in enumerate(obj)]




def _restore_all_ways(ck, step: int) -> None:
    """Restore ``step`` with and without a target; any failure must be a JaxckptError."""
    want = make_state(2)
    for target in (None, abstract(want)):
        try:
            ck.restore(target, step=step)
        except JaxckptError:
            pass


@FUZZ
@given(st.data())
def test_damaged_manifests_in_the_store_raise_jaxckpt_errors_and_lose_nothing(committed, data):
    ck = committed
    good = genuine_manifest(ck)
    env = msgpack.unpackb(good, raw=False)
    body = env[3]
    kind = data.draw(st.sampled_from(["truncate", "flip", "version", "format", "crc", "random", "schema"]))
    if kind == "truncate":
        bad = good[:data.draw(st.integers(0, len(good) - 1))]
    elif kind == "flip":
        bit = data.draw(st.integers(0, len(good) * 8 - 1))
        bad = bytearray(good)
        bad[bit // 8] ^= 1 << (bit % 8)
        bad = bytes(bad)
    elif kind == "version":
        bad = envelope(body, version=data.draw(msgpack_values.filter(lambda v: v != mf.VERSION)))
    elif kind == "format":
        bad = envelope(body, fmt=data.draw(msgpack_values.filter(lambda v: v != mf.FORMAT)))
    elif kind == "crc":
        bad = envelope(body, crc=data.draw(msgpack_values.filter(lambda v: v != crc32c(body))))
    elif kind == "random":
        bad = data.draw(st.binary(max_size=512))
    else:  # a checksum-valid body that lies somewhere: only the schema and restore checks stand in the way
        wire = msgpack.unpackb(body, raw=False, strict_map_key=False)
        places = list(nodes(wire))
        path, _ = places[data.draw(st.integers(0, len(places) - 1))]
        bad = envelope(msgpack.packb(replaced(wire, path, data.draw(msgpack_values)), use_bin_type=True))
    step = inject(ck, bad)
    try:
        if kind == "schema":
            _restore_all_ways(ck, step)
        else:
            for target in (None, abstract(make_state(2))):
                with pytest.raises(ManifestError, match=f"step {step} manifest of process 0"):
                    ck.restore(target, step=step)
    finally:
        ck.store.delete(step)
    assert_nothing_lost(ck)


def test_a_manifest_that_lies_about_its_chunks_is_refused_before_restore(committed):
    """Checksum-valid manifests whose chunks overlap, or whose sizes or dtypes disagree, never reach the reader."""
    ck = committed
    wire = msgpack.unpackb(msgpack.unpackb(genuine_manifest(ck), raw=False)[3], raw=False)
    w = next(i for i, a in enumerate(wire["arrays"]) if a["path"] == "params/w")
    first = wire["arrays"][w]["chunks"][0]
    cases = {
        "overlap": (("arrays", w, "chunks", 1, 1), first[1], "overlaps a chunk"),
        "size": (("arrays", w, "chunks", 0, 2), first[2] + 4, "bytes, expected"),
        "object dtype": (("arrays", w, "dtype"), "object", "unknown dtype 'object'"),
        "subarray dtype": (("arrays", w, "dtype"), "(2,)f4", "unknown dtype"),
        "order": (("order", 0), "nope", "leaf order names unknown"),
        "key inside a leaf": (("leaves", 0, "keypath"), [["key", "params"]], "both a leaf and a container"),
        "duplicate path": (("leaves", 0, "path"), "params/w", "listed twice"),
        "leaf value": (("leaves", 0, "value"), [1, 2], "has type list"),
        "prng attrs": (("arrays", next(i for i, a in enumerate(wire["arrays"]) if a["kind"] == "prng_key"),
                        "attrs"), {"impl": "threefry2x32"}, "PRNG key array without"),
        "process": (("process",), 5, "manifest of process 5 in a job of 1"),
    }
    for name, (path, value, match) in cases.items():
        step = inject(ck, envelope(msgpack.packb(replaced(wire, path, value), use_bin_type=True)))
        try:
            with pytest.raises(ManifestError, match=match):
                ck.restore(step=step)
        finally:
            ck.store.delete(step)
    assert_nothing_lost(ck)


# ------------------------------------------------------------------------------------------- targets
def test_mismatched_targets_name_the_path_and_lose_nothing(committed):
    ck = committed
    want = make_state(2)
    good = abstract(want)
    sds = jax.ShapeDtypeStruct
    key_sharding = good["params"]["w"].sharding
    cases = [
        ({**good, "params": {"w": good["params"]["w"]}}, r"^params/b: saved in step {step} but missing"),
        ({**good, "params": {**good["params"], "extra": sds((1,), jnp.float32)}}, r"^params/extra: in the target"),
        ({**good, "params": [good["params"]["b"], good["params"]["w"]]}, r"^params/0: in the target but not"),
        ({**good, "np": np.zeros((3, 5), np.int16)}, r"^np: saved shape \(5, 3\), target shape \(3, 5\)"),
        ({**good, "np": np.zeros((5, 3), np.int32)}, "^np: saved dtype int16, target dtype int32"),
        ({**good, "params": {**good["params"], "w": sds((8, 6), jnp.float16, sharding=key_sharding)}},
         "^params/w: saved dtype float32, target dtype float16"),
        ({**good, "params": {**good["params"], "w": sds((6, 8), jnp.float32, sharding=key_sharding)}},
         r"^params/w: saved shape \(8, 6\), target shape \(6, 8\)"),
        ({**good, "key": jax.random.key(0, impl="rbg")}, "^key: saved a PRNG key array key<fry>"),
        ({**good, "key": sds((2,), jnp.uint32)}, "^key: saved a PRNG key array"),
        ({**good, "np": 3}, r"^np: saved an array int16\[5, 3\], target is a int value"),
        ({**good, "name": sds((), jnp.float32)}, "^name: saved the value 'run-{step}'"),
        ({**good, "lr": np.zeros((2,), np.float64)}, r"^lr: saved the value [01]\.[05]"),
        ((good,), "^0/count: in the target but not in step {step}"),
    ]
    for target, match in cases:
        for step in (None, 1, 2):
            with pytest.raises(TargetMismatchError, match=match.replace("{step}", str(step or 2))):
                ck.restore(target, step=step)
    assert_nothing_lost(ck)


# ------------------------------------------------------------------------------------ missing steps
@pytest.mark.parametrize("bad", [-1, 2.0, 2.5, True, "2", "../x", "/etc", "\x00", "9" * 5000, None])
def test_malformed_step_numbers_are_refused_cleanly(committed, bad):
    ck = committed
    if bad is None:
        assert_tree_bitwise(ck.restore(abstract(make_state(2)), step=bad), make_state(2))  # None: the latest
        return
    with pytest.raises(JaxckptError, match="step must be a non-negative int"):
        ck.restore(step=bad)
    assert_nothing_lost(ck)


def test_a_step_that_no_process_has_is_named(committed, tmp_path):
    ck = committed
    for step in (0, 3, 99, 2**63):
        with pytest.raises(StepNotFoundError, match=rf"step {step} is not held by store 'memory' \(held: \[1, 2\]\)"):
            ck.restore(step=step)
    assert_nothing_lost(ck)
    # With a persistent tier too: neither memory nor the directory has it, and the message says both.
    with jaxckpt.Checkpointer(Config(persistent_dir=str(tmp_path / "persist"), persistent_interval=0)) as pk:
        with pytest.raises(NoCheckpointError, match="nothing has been committed yet .* nor in "):
            pk.restore()
        pk.save(1, {"x": np.arange(3)}).result()
        with pytest.raises(StepNotFoundError, match=r"step 5 is not held by store 'memory' \(held: \[1\]\) nor by any "
                                                    r"holder this process can reach \(asked: persistent directory "):
            pk.restore(step=5)
        np.testing.assert_array_equal(pk.restore()["x"], np.arange(3))


# ---------------------------------------------------------------------------------------------- config
FIELDS = typing.get_type_hints(Config)
toml_values = st.recursive(
    st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats() | st.text(max_size=10)
    | st.sampled_from(["shm", "memory", "replica", "../x", "", "/abs", "a" * 300]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6)


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(FIELDS)) | st.text(max_size=12), toml_values, max_size=4))
def test_fuzzed_config_dicts_build_a_config_or_name_the_bad_key(values):
    try:
        cfg = Config.from_dict(values, source="fuzz.toml")
    except ConfigError as e:
        msg = str(e)
        assert msg.startswith("fuzz.toml: "), msg
        assert any(k in msg for k in values), (values, msg)  # names the key at fault
        unknown = sorted(set(values) - set(FIELDS))
        if unknown:
            assert "unknown Config key" in msg and all(k in msg for k in unknown), msg
        return
    for k, v in values.items():  # accepted: every value is the field's type, as given
        assert getattr(cfg, k) == v or (v != v and getattr(cfg, k) != getattr(cfg, k))
        assert type(v) is FIELDS[k] or (FIELDS[k] is float and type(v) is int), (k, v)


@pytest.mark.parametrize("text, key", [
    ("keep = 2\n[jaxckpt]\nstore = 'shm'\n", "jaxckpt"),  # keys beside the table: the table is a key too
    ("[jaxckpt]\nkeep = 2\n[jaxckpt.nested]\nx = 1\n", "nested"),
    ("[jaxckpt]\nkeep = '2'\n", "Config.keep='2': expected int, got str"),
    ("[jaxckpt]\nkeep = 2.0\n", "Config.keep=2.0: expected int, got float"),
    ("[jaxckpt]\nkeep = true\n", "Config.keep=True: expected int, got bool"),
    ("[jaxckpt]\nverify_on_restore = 1\n", "Config.verify_on_restore=1: expected bool"),
    ("[jaxckpt]\ncommit_timeout_s = nan\n", "Config.commit_timeout_s=nan: must be positive"),
    ("[jaxckpt]\ncommit_timeout_s = inf\n", "Config.commit_timeout_s=inf: must be positive"),
    ("[jaxckpt]\npeer_timeout_s = 1e300\n", "Config.peer_timeout_s=1e+300: must be positive and at most"),
    ("[jaxckpt]\njob_id = '../../etc'\n", "Config.job_id='../../etc': use letters"),
    ("[jaxckpt]\njob_id = '" + "j" * 300 + "'\n", "300 characters, at most 128"),
    ("[jaxckpt]\nshm_dir = 'relative/dir'\n", "Config.shm_dir='relative/dir': must be an absolute path"),
    ("[jaxckpt]\nstore = ['shm']\n", "Config.store=['shm']: expected str, got list"),
    ("[jaxckpt]\nmemory_budget_bytes = -1\n", "Config.memory_budget_bytes=-1: must not be negative"),
    ("[jaxckpt]\nkeep = 1\nkeep = 2\n", "not valid TOML"),
    ("\x00\xff\xfe", "not valid TOML"),
])
def test_config_files_with_unknown_or_ill_typed_keys_name_the_key(tmp_path, text, key):
    path = tmp_path / "jaxckpt.toml"
    path.write_bytes(text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text)
    with pytest.raises(ConfigError) as e:
        Config.from_file(path, env=False)
    assert str(e.value).startswith(str(path)) and key in str(e.value), str(e.value)


@pytest.mark.parametrize("var, raw, key", [
    ("JAXCKPT_COMMIT_TIMEOUT_S", "nan", "commit_timeout_s"),
    ("JAXCKPT_PEER_TIMEOUT_S", "inf", "peer_timeout_s"),
    ("JAXCKPT_JOB_ID", "x/../y", "job_id"),
    ("JAXCKPT_KEEP", "\x00", "JAXCKPT_KEEP"),
])
def test_environment_overrides_with_bad_values_name_the_key(var, raw, key):
    with pytest.raises(ConfigError, match=key):
        Config().with_env({var: raw})
