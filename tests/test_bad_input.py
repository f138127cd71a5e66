"""Bad input from every direction: each gets a clear jaxckpt error, and nothing committed is lost.

Complements test_manifest.py / test_transport.py / test_config.py (which check the decoders in isolation):
here the damage goes through the real paths and, after each bad input, the newest committed step is restored
again and compared bit for bit.

- manifests damaged in a store (truncated, flipped, wrong version, schema-valid but lying, random), fuzzed
  with hypothesis through ``Checkpointer.restore``: a JaxckptError naming the step, never another exception;
- requests with bad lengths, types and fields to the peer transport server and to the node agent's Unix
  socket (hypothesis, bounded): refused with a code, and the server keeps serving correct clients;
- restore targets that do not match (structure, shape, dtype, kind) -> TargetMismatchError naming the path;
- config files and dicts with unknown or ill-typed keys -> ConfigError naming the key;
- steps that no process has -> StepNotFoundError naming the step (memory, shm, persistent fallback).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import typing
import uuid

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, event, given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt
from jaxckpt import Config
from jaxckpt.core import manifest as mf
from jaxckpt.backends.agent import protocol as proto
from jaxckpt.backends.memory import MemoryStore
from jaxckpt.backends.transport import MAX_REQUEST_BYTES, VERSION, ZmqTransport
from jaxckpt.core.checksum import crc32c
from jaxckpt.errors import (ConfigError, JaxckptError, ManifestError, NoCheckpointError, StepNotFoundError,
                            TargetMismatchError)

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
SMALL_FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
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


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.integers(-3, 70)
    | st.floats() | st.text(max_size=8) | st.binary(max_size=8)
    | st.sampled_from(["float32", "int16", "bfloat16", "O", "object", "finfo", "(2,)i4", "i4,f4", "U3", "V8",
                       "jax", "numpy", "prng_key", "numpy_scalar", "key", "idx", "attr", "params/w", "name",
                       "np", "count", "key<fry>", "threefry2x32"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)


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


# -------------------------------------------------------------------------------- peer transport
TOKEN = b"the-job-token-0123456789abcdef"
FRAME = 4096
PEER_DATA = np.random.default_rng(5).integers(0, 256, size=3 * FRAME + 100, dtype=np.uint8)
REFUSAL_CODES = {"bad-request", "too-large", "auth", "not-found"}  # never "internal": that is a server bug


@pytest.fixture(scope="module")
def peer_server():
    store = MemoryStore(Config())
    slot = store.reserve(3, PEER_DATA.size)
    np.frombuffer(slot.buffer, np.uint8)[:] = PEER_DATA
    store.commit(slot, b"manifest-of-step-3")
    transport = ZmqTransport(frame_bytes=FRAME, window=2)
    server = transport.serve(store, token=TOKEN)
    good = transport.connect(server.address, token=TOKEN, timeout_s=20.0)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.address)
    yield store, server, good, raw
    raw.close()
    good.close()
    server.close()
    store.close()


def _junk():
    return msgpack_values | st.integers(-(2**63), 2**64 - 1) | st.sampled_from([True, False, None, -1, 2**62])


def _field(name: str, good):
    return st.one_of(st.just(good), _junk()) if good is not None else _junk()


@st.composite
def peer_requests(draw):
    """Frames a peer might send: garbage, oversized, extra frames, or maps with fields of any type."""
    kind = draw(st.sampled_from(["map", "map", "map", "bytes", "frames", "big"]))
    if kind == "bytes":
        return [draw(st.binary(max_size=300))]
    if kind == "frames":
        return draw(st.lists(st.binary(max_size=40), min_size=2, max_size=4))
    if kind == "big":
        return [draw(st.binary(min_size=MAX_REQUEST_BYTES + 1, max_size=MAX_REQUEST_BYTES + 64))]
    from jaxckpt.backends import transport as tr
    req = {}
    for name, good in (("v", VERSION), ("id", 11), ("token", TOKEN), ("step", 3),
                       ("offset", draw(st.integers(0, PEER_DATA.size))), ("nbytes", draw(st.integers(0, FRAME))),
                       ("process", 0)):
        if draw(st.integers(0, 9)) < 8:  # mostly present, sometimes missing
            req[name] = draw(st.just(good) if draw(st.integers(0, 3)) else _junk())
    req["op"] = draw(st.sampled_from([*tr.OPS, "delete", "", "READ"]) | _junk())
    extra = draw(st.dictionaries(st.text(max_size=5), _junk(), max_size=2))
    body = msgpack.packb({**extra, **req}, use_bin_type=True)
    return [body]


def _recv_reply(sock, timeout_ms: int = 20_000):
    assert sock.poll(timeout_ms), "the server did not answer (hung or dropped the request)"
    frames = sock.recv_multipart()
    header = msgpack.unpackb(frames[0], raw=False)
    assert isinstance(header, dict) and header["v"] == VERSION and isinstance(header["ok"], bool), header
    return header, frames[1:]


@FUZZ
@given(peer_requests(), st.integers(0, PEER_DATA.size - 1), st.integers(0, 2 * FRAME))
def test_fuzzed_peer_requests_are_refused_with_a_code_and_the_server_serves_on(peer_server, frames, off, n):
    store, server, good, raw = peer_server
    raw.send_multipart(frames)
    header, payload = _recv_reply(raw)
    if header["ok"]:
        req = msgpack.unpackb(frames[0], raw=False)
        assert isinstance(req, dict) and req.get("token") == TOKEN  # nothing is served without the token
        if req.get("op") == "read":  # whatever was asked, what comes back is exactly the saved bytes
            o, k = req["offset"], req["nbytes"]
            np.testing.assert_array_equal(np.frombuffer(payload[0], np.uint8), PEER_DATA[o:o + k])
    else:
        assert header["code"] in REFUSAL_CODES, header
        assert payload in ([b""], []), "a refused request got data"
    n = min(n, PEER_DATA.size - off)
    np.testing.assert_array_equal(np.frombuffer(good.read(3, off, n), np.uint8), PEER_DATA[off:off + n])
    assert store.steps() == [3]


# A peer server that answers every request with a fuzzed reply: the client must refuse it with a PeerError
# (or StepNotFoundError), within its time-out, and never hand back data of the wrong size or type.
@st.composite
def peer_replies(draw):
    header = {"v": VERSION, "ok": draw(st.booleans() | _junk()), "code": draw(st.sampled_from(
        ["", "not-found", "auth", "internal"]) | _junk()), "error": draw(st.text(max_size=10) | _junk())}
    for name in ("steps", "size", "held"):
        if draw(st.booleans()):
            header[name] = draw(_junk() | st.lists(st.integers(-3, 2**64 - 1), max_size=3))
    header = {k: v for k, v in header.items() if draw(st.integers(0, 9)) < 9}
    frames = [msgpack.packb(header, use_bin_type=True) if draw(st.integers(0, 9)) else draw(st.binary(max_size=20))]
    frames += draw(st.lists(st.binary(max_size=2 * FRAME), max_size=2))
    return frames


@pytest.fixture(scope="module")
def liar():
    """A ROUTER socket whose replies the test writes; ``answer(frames)`` replies once to the next request."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    client = ZmqTransport(frame_bytes=FRAME, window=2).connect(f"tcp://127.0.0.1:{port}", token=TOKEN,
                                                                timeout_s=0.5)
    yield sock, client
    client.close()
    sock.close()


@SMALL_FUZZ
@given(st.sampled_from(["steps", "manifest", "read", "read-multi"]), st.lists(peer_replies(), min_size=1,
                                                                               max_size=3))
def test_fuzzed_replies_from_a_lying_peer_raise_peer_errors(liar, call, replies):
    import threading

    from jaxckpt.errors import PeerError

    sock, client = liar
    stop = threading.Event()

    def serve():
        todo = list(replies)
        while not stop.is_set():
            if not sock.poll(20):
                continue
            ident, req = sock.recv_multipart()
            rid = msgpack.unpackb(req, raw=False)["id"]
            frames = todo.pop(0) if todo else [msgpack.packb({"v": VERSION, "id": rid, "ok": False, "code": "x",
                                                              "error": "no more"})]
            try:  # keep the request id when the fuzzed header is a map, so the client takes it as the answer
                h = msgpack.unpackb(frames[0], raw=False)
                if isinstance(h, dict):
                    frames = [msgpack.packb({**h, "id": rid}, use_bin_type=True), *frames[1:]]
            except Exception:  # noqa: BLE001 - garbage headers go out as they are
                pass
            sock.send_multipart([ident, *frames])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        try:
            if call == "steps":
                got = client.steps()
                assert isinstance(got, list) and all(isinstance(s, int) and s >= 0 for s in got), got
            elif call == "manifest":
                assert isinstance(client.manifest(3), bytes)
            else:
                n = 10 if call == "read" else 2 * FRAME + 3
                assert len(client.read(3, 0, n)) == n
        except (PeerError, StepNotFoundError):
            pass
    finally:
        stop.set()
        t.join()


# ---------------------------------------------------------------------------- the agent's Unix socket
AGENT_JOB = "badinput"
AGENT_BUDGET = 8 << 20
FUZZ_PROCESS = 7  # the fuzzer speaks as this process; the real trainer is process 0


def _shm_engine(directory: str):
    from shm_trainer import records, state  # noqa: F401 - the numpy trainer of tests/test_agent.py

    from jaxckpt.core.coordination import LocalCoordinator
    from jaxckpt.core.engine import CheckpointEngine

    cfg = Config(store="shm", job_id=AGENT_JOB, shm_dir=directory, keep=2, workers=1, chunk_bytes=8192,
                 commit_timeout_s=30.0)
    return CheckpointEngine(cfg, LocalCoordinator(), framework="numpy")


def _start_agent(directory: str, log_path: str) -> subprocess.Popen:
    err = open(log_path + ".stderr", "wb")
    p = subprocess.Popen([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", AGENT_JOB, "--dir", directory,
                          "--budget-bytes", str(AGENT_BUDGET), "--log", log_path],
                         stdin=subprocess.DEVNULL, stdout=err, stderr=err)
    err.close()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(directory, proto.SOCKET_NAME)):
        assert p.poll() is None and time.monotonic() < deadline, "the agent did not start"
        time.sleep(0.01)
    return p


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    """A real agent (CLI) holding process 0's committed steps 1 and 2 of a numpy trainer."""
    from shm_trainer import records, state

    directory = f"/dev/shm/jaxckpt-badinput-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    log_path = str(tmp_path_factory.mktemp("agent") / "agent.log")
    p = _start_agent(directory, log_path)
    try:
        eng = _shm_engine(directory)
        for step in (1, 2):
            eng.save(step, records(state(11, step)), [], ()).result()
        eng.close()
        yield directory, p, log_path
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=60)
        shutil.rmtree(directory, ignore_errors=True)


def assert_agent_lost_nothing(directory: str) -> None:
    from shm_trainer import restore, same_bits, state

    eng = _shm_engine(directory)
    try:
        assert eng.latest_step() == 2 and eng.all_steps() == [1, 2]
        for step in (1, 2):
            got_step, got = restore(eng, step)
            assert got_step == step and same_bits(got, state(11, step))
    finally:
        eng.close()


def _frame(msg) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def _mostly(draw, good, p_good: int = 8):
    """``good`` with probability p_good/10, else junk of any type."""
    return good if draw(st.integers(0, 9)) < p_good else draw(_junk())


@st.composite
def agent_messages(draw):
    """One connection's worth of framed requests: mostly a valid hello, then requests whose fields are mostly
    well-typed, sometimes junk, sometimes missing."""
    msgs = []
    if draw(st.integers(0, 9)) < 8:
        hello = {"v": 1, "op": "hello", "job": AGENT_JOB, "role": "trainer", "process": FUZZ_PROCESS, "keep": 1,
                 "pending": 1, "budget": 1 << 20}
        if draw(st.integers(0, 3)) == 0:
            hello["role"] = draw(st.sampled_from(["client", "reader", "x"]))
            hello["job"] = draw(st.sampled_from([AGENT_JOB, AGENT_JOB, None]))
        for k in list(hello):
            if draw(st.integers(0, 15)) == 0:
                hello[k] = draw(_junk().filter(lambda v: v != 0))
        msgs.append(hello)
    for _ in range(draw(st.integers(1, 5))):
        op = _mostly(draw, draw(st.sampled_from(["reserve", "commit", "abort", "steps", "open", "unpin", "delete",
                                                 "held", "status", "manifest", "index", "hello", "bogus"])), 9)
        msg = {"v": _mostly(draw, 1, 9), "op": op}
        for name, good in (("step", draw(st.integers(0, 5))), ("nbytes", draw(st.integers(0, 1 << 16))),
                           ("manifest", b"m" * 10), ("process", draw(st.sampled_from([0, FUZZ_PROCESS]))),
                           ("job", AGENT_JOB), ("role", "trainer"), ("keep", 1), ("pending", 1), ("budget", 1)):
            if draw(st.integers(0, 19)) < 17:
                msg[name] = _mostly(draw, good, 9)
        if op == "shutdown" or (op == "hello" and msg.get("process") == 0):
            msg["op"] = "bogus"  # a shutdown or a claim of process 0 is allowed to this uid by design
        msgs.append(msg if draw(st.integers(0, 19)) else draw(_junk()))
    return msgs


def _recv_exact(s: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        try:
            chunk = s.recv(n - len(data))  # a time-out here is a hang: socket.timeout fails the test
        except ConnectionResetError:  # closed by the agent with our bytes unread
            return None
        if not chunk:
            return None
        data += chunk
    return data


def _connect_agent(directory: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(os.path.join(directory, proto.SOCKET_NAME))
    return s


def _call_raw(s: socket.socket, payload: bytes):
    """Send ``payload``; the framed reply, or None when the agent closes the connection instead."""
    try:
        s.sendall(payload)
    except (BrokenPipeError, ConnectionResetError):
        return None
    head = _recv_exact(s, 4)
    if head is None:
        return None
    body = _recv_exact(s, struct.unpack(">I", head)[0])
    assert body is not None, "the agent cut a reply short"
    return msgpack.unpackb(body, raw=False)


@FUZZ
@given(agent_messages())
def test_fuzzed_requests_to_the_agent_each_get_a_refusal_or_an_answer(agent, msgs):
    directory, p, _ = agent
    with _connect_agent(directory) as s:
        for m in msgs:
            r = _call_raw(s, _frame(m))
            if not isinstance(m, dict):  # not a request map: the agent ends this connection, by design
                assert r is None, r
                break
            # Every request map is answered (a handler that raised would drop the connection unanswered).
            assert isinstance(r, dict) and isinstance(r.get("ok"), bool), (m, r)
            event(f"{m.get('op')!s:.10}: {r.get('code', 'ok')}")
            if not r["ok"]:
                assert isinstance(r.get("code"), str) and r["code"] and isinstance(r.get("error"), str), r
    assert p.poll() is None, "the agent died"


@FUZZ
@given(st.one_of(st.binary(max_size=64),
                 st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=64)).map(
                     lambda t: struct.pack(">I", t[0]) + t[1]),
                 st.binary(min_size=1, max_size=32).map(lambda b: struct.pack(">I", len(b)) + b)))
def test_badly_framed_bytes_to_the_agent_close_only_that_connection(agent, payload):
    directory, p, _ = agent
    with _connect_agent(directory) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        while True:  # the agent answers what parses as a request, then closes on the rest
            head = _recv_exact(s, 4)
            if head is None:
                break
            body = _recv_exact(s, struct.unpack(">I", head)[0])
            assert body is not None, "the agent cut a reply short"
            r = msgpack.unpackb(body, raw=False)
            assert isinstance(r, dict) and isinstance(r.get("ok"), bool)
    assert p.poll() is None, "the agent died"


def test_a_step_the_agent_does_not_hold_is_named(agent):
    directory, _, _ = agent
    eng = _shm_engine(directory)
    try:
        for step in (0, 3, 99, 2**40):
            with pytest.raises(StepNotFoundError, match=rf"step {step} is not held"):
                with eng.open(step):
                    pass
        with pytest.raises(JaxckptError, match="step must be a non-negative int"):
            with eng.open("../2"):
                pass
    finally:
        eng.close()


def test_after_the_fuzzing_the_agent_lost_nothing_and_logged_no_crash(agent):
    directory, p, log_path = agent
    assert p.poll() is None
    assert_agent_lost_nothing(directory)
    with open(log_path + ".stderr", "rb") as f:
        err = f.read().decode(errors="replace")
    with open(log_path, "rb") as f:
        text = f.read().decode(errors="replace")
    assert "Traceback" not in err and "Traceback" not in text, (err[-3000:], text[-3000:])


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
