"""Bad input on the wire: each gets a refusal with a code or a jaxckpt error, and the server serves on.

The peer transport and the node agent's Unix socket, fuzzed with hypothesis (bounded): requests with bad lengths,
types and fields to a real ZeroMQ peer server and to a real agent (the CLI, a process of its own) are refused
with a code and the server keeps serving correct clients; replies from a lying peer raise PeerError; after the
fuzzing the agent still holds every committed step bit for bit and logged no crash. The manifests, targets,
steps and config files of ``test_bad_input.py`` are the same promise through the other doors.
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
import uuid

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import event, given, strategies as st

from fuzzing import FUZZ, SMALL_FUZZ, msgpack_values
from jaxckpt import Config
from jaxckpt.backends.agent import protocol as proto
from jaxckpt.backends.memory import MemoryStore
from jaxckpt.backends.transport import MAX_REQUEST_BYTES, VERSION, ZmqTransport
from jaxckpt.errors import JaxckptError, StepNotFoundError

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
