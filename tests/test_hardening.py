"""Hardening found by review and chaos: bounded agent messages, an unambiguous chunk cache, out-of-range steps,
fixed-width string and raw-bytes numpy arrays.

- the agent's socket: a length header above the limit is a ProtocolError and drops that connection only; a
  client that sends part of a message and stalls loses its connection after the agent's message time-out,
  while the agent serves other clients meanwhile (real agent process, raw sockets);
- ChunkReader caches a chunk under its whole identity (step, process, offset, size, checksum): readers of two
  steps interleaved get each step's bytes, and a chunk at the same place as a cached one is never served from it;
- ``restore(step=2**63)`` (and any step past MAX_STEP) raises StepError naming the step and the steps held,
  with the shm store too (it used to surface as the agent's AgentError);
- numpy ``str_``/``bytes_``/``void`` arrays restore bit for bit (names ``str[N]``, ``bytes[N]``, ``void[N]``),
  non-native byte order restores as the same values, structured dtypes are refused at save naming the path.
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
import threading
import uuid

import msgpack
import numpy as np
import pytest

import jaxckpt
from jaxckpt.backends.agent import protocol as proto
from jaxckpt.core.box import Box
from jaxckpt.core.checksum import crc32c
from jaxckpt.core.dtypes import dtype_from_name, dtype_name
from jaxckpt.core.engine import MAX_STEP
from jaxckpt.errors import ChecksumError, ManifestError, StepError, UnsupportedLeafError
from jaxckpt.core.fetch import ChunkReader, buffer_reader
from jaxckpt.core.manifest import ChunkMeta

BASE = f"/dev/shm/jaxckpt-hard-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@pytest.fixture(autouse=True, scope="module")
def _base_dir():
    yield
    shutil.rmtree(BASE, ignore_errors=True)  # the agents removed their own directories; this is their parent


@pytest.fixture
def agent(tmp_path):
    """A real agent (message time-out 1 s, no peer server): (directory, job, log path)."""
    job, d, log = f"hard-{uuid.uuid4().hex[:6]}", os.path.join(BASE, uuid.uuid4().hex[:6]), str(tmp_path / "agent.log")
    p = subprocess.Popen([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", job, "--dir", d, "--log", log,
                          "--peer-bind", "none", "--message-timeout-s", "1"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while (proto.read_pid_file(d) or (None,))[0] != p.pid or not os.path.exists(os.path.join(d, proto.SOCKET_NAME)):
            assert p.poll() is None and time.monotonic() < deadline, "the agent did not start"
            time.sleep(0.01)
        yield d, job, log
    finally:
        proto.stop_agent(d, job, timeout_s=20)
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait()
        shutil.rmtree(BASE, ignore_errors=True)


def _raw(d: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(os.path.join(d, proto.SOCKET_NAME))
    s.settimeout(60)  # a guard only: the agent answers (or drops us) long before
    return s


def _stop(d: str, job: str) -> None:
    proto.stop_agent(d, job, timeout_s=20)
    try:
        os.unlink(proto.default_log_path(d))
    except FileNotFoundError:
        pass


def _status(d: str, job: str) -> dict:
    return proto.agent_status(d, job, timeout_s=60)


def _log_has(log: str, text: str) -> bool:
    deadline = time.monotonic() + 30  # the agent logs right after dropping the connection
    while time.monotonic() < deadline:
        with open(log) as f:
            if text in f.read():
                return True
        time.sleep(0.02)
    return False


# ------------------------------------------------------------------------------------ agent messages
def test_recv_msg_refuses_oversized_lengths_before_allocating_and_stalled_messages():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", 0xFFFFFFFF))
        with pytest.raises(proto.ProtocolError, match=r"message of 4294967295 bytes exceeds the \d+-byte limit"):
            proto.recv_msg(b, message_timeout_s=5)
    a, b = socket.socketpair()
    with a, b:
        body = msgpack.packb({"v": 1, "op": "status"})
        a.sendall(struct.pack(">I", len(body)) + body[:3])  # half a message, then nothing
        with pytest.raises(proto.ProtocolError, match=rf"message stalled: 3 of {len(body)} bytes arrived"):
            proto.recv_msg(b, message_timeout_s=0.2)
        assert b.gettimeout() is None  # the idle wait is the socket's own again
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"\x00\x00")  # half a length header
        # the rest of the header after its first byte
        with pytest.raises(proto.ProtocolError, match="message stalled: 1 of 3 bytes"):
            proto.recv_msg(b, message_timeout_s=0.2)
    a, b = socket.socketpair()
    with a, b:  # a whole message still arrives in pieces of any size
        body = msgpack.packb({"v": 1, "op": "status", "pad": b"x" * 3_000_000}, use_bin_type=True)
        t = threading.Thread(target=a.sendall, args=(struct.pack(">I", len(body)) + body,))
        t.start()
        assert proto.recv_msg(b, message_timeout_s=30)["pad"] == b"x" * 3_000_000
        t.join()


def test_agent_drops_an_oversized_message_and_serves_on(agent):
    d, job, log = agent
    with _raw(d) as s:
        s.sendall(struct.pack(">I", proto.MAX_MESSAGE_BYTES + 1))
        assert s.recv(16) == b""  # dropped, with nothing allocated for it
    assert _log_has(log, f"message of {proto.MAX_MESSAGE_BYTES + 1} bytes exceeds the")
    assert _status(d, job)["job"] == job


def test_a_stalled_client_loses_its_connection_while_others_are_served(agent):
    d, job, log = agent
    body = msgpack.packb({"v": 1, "op": "hello", "job": job, "role": "client"})
    with _raw(d) as stalled, _raw(d) as idle:
        stalled.sendall(struct.pack(">I", len(body)) + body[: len(body) // 2])
        # Meanwhile the agent serves others, on a connection opened before and on a new one.
        assert _status(d, job)["job"] == job
        proto.send_msg(idle, {"v": 1, "op": "hello", "job": job, "role": "client"})
        assert proto.recv_msg(idle)["ok"] is True
        assert stalled.recv(16) == b""  # the agent gave up on the half message and dropped the connection
        assert _log_has(log, f"message stalled: {len(body) // 2} of {len(body)} bytes arrived")
        # An idle connection (between requests) is not a stalled one: it is still served.
        proto.send_msg(idle, {"v": 1, "op": "status"})
        assert proto.recv_msg(idle)["job"] == job


# ------------------------------------------------------------------------------------------ chunk cache
def _chunk(data: bytes, offset: int, process: int = 0) -> ChunkMeta:
    return ChunkMeta(Box((0,), (len(data),)), offset, len(data), crc32c(data), process)


def test_chunk_readers_of_two_steps_interleaved_get_each_steps_bytes():
    one, two = bytes(range(64)), bytes(range(64, 128))  # same layout: every chunk at the same (process, offset)
    readers = {1: ChunkReader({0: buffer_reader(memoryview(one))}, 1),
               2: ChunkReader({0: buffer_reader(memoryview(two))}, 2)}
    want = {1: one, 2: two}
    for off in (0, 16, 32, 48, 0, 16):
        for step in (2, 1):
            c = _chunk(want[step][off:off + 16], off)
            assert bytes(readers[step].raw("w", c)) == want[step][off:off + 16]
    for step, r in readers.items():
        assert r.report.chunks == 4 and r.report.bytes_by_process == {0: 64}


def test_a_chunk_at_a_cached_place_is_never_served_from_the_cache():
    """Two chunks at the same (process, offset) but of other bytes (another step's manifest, another layout):
    the second is read and verified on its own, never handed the first one's bytes."""
    held = bytes(range(32))
    r = ChunkReader({0: buffer_reader(memoryview(held))}, 5)
    assert bytes(r.raw("a", _chunk(held[:16], 0))) == held[:16]
    other = _chunk(bytes(16), 0)  # what another snapshot holds there
    with pytest.raises(ChecksumError, match=r"b: step 5 chunk \(0,\)\.\.\(16,\) of process 0 failed its crc32c"):
        r.raw("b", other)
    shorter = _chunk(held[:8], 0)
    assert bytes(r.raw("c", shorter)) == held[:8]


# ---------------------------------------------------------------------------------------------- steps
@pytest.mark.parametrize("store", ["memory", "shm"])
def test_out_of_range_steps_raise_step_error_naming_the_steps_held(store):
    d = os.path.join(BASE, uuid.uuid4().hex[:6])
    cfg = jaxckpt.Config(store=store, job_id=f"hs-{uuid.uuid4().hex[:6]}",
                         **({"shm_dir": d} if store == "shm" else {}))
    try:
        with jaxckpt.Checkpointer(cfg) as ck:
            ck.save(3, {"w": np.arange(4, dtype=np.float32)}).result()
            for step in (2**63, 2**64 + 5, MAX_STEP + 1):
                with pytest.raises(StepError, match=rf"step {step} is not held by store '{store}' \(held: \[3\]\): "
                                                    rf"it is out of range \(steps are at most {MAX_STEP}\)"):
                    ck.restore(step=step)
            with pytest.raises(StepError, match=rf"step {2**63} is out of range: steps are at most {MAX_STEP}"):
                ck.save(2**63, {"w": np.arange(4, dtype=np.float32)})
            np.testing.assert_array_equal(ck.restore(step=3)["w"], np.arange(4, dtype=np.float32))
    finally:
        if store == "shm":
            _stop(d, cfg.job_id)


# --------------------------------------------------------------------------------------------- dtypes
def test_fixed_width_dtype_names_round_trip_and_stay_strict():
    import ml_dtypes

    for dt in ("<U5", "S7", "V3", "U1", "S1"):
        assert dtype_from_name(dtype_name(np.dtype(dt))) == np.dtype(dt)
    assert (dtype_name(np.dtype("<U5")), dtype_name(np.dtype("S7")), dtype_name(np.dtype("V3"))) == \
        ("str[5]", "bytes[7]", "void[3]")
    assert dtype_name(np.dtype(">U2")) == "str[2]"  # saved in native order
    assert dtype_name(ml_dtypes.bfloat16) == "bfloat16"  # kind "V" too, but not a raw void
    for bad in ("str[x]", "str[123456789]", "void32", "str160", "str[5],i4", "object"):
        with pytest.raises(ManifestError, match="unknown dtype"):
            dtype_from_name(bad)


def _strings() -> dict:
    return {"u": np.array([["ab", "\u00fc\u20ac\U0001f600"], ["", "xyz"]], dtype="<U3"),
            "s": np.array([b"a\x00b", b"\xff", b""], dtype="S3"),
            "v": np.frombuffer(bytes(range(24)), dtype="V4").reshape(2, 3),
            "scalar": np.str_("tag"), "b1": np.array([b"\x00\x01"], dtype="V2")[0],
            "be": np.array(["hi", "yo"], dtype=">U2"), "bef": np.arange(3, dtype=">f4") / 3}


@pytest.mark.parametrize("store", ["memory", "shm"])
def test_string_and_void_numpy_leaves_restore_bit_for_bit(store):
    d = os.path.join(BASE, uuid.uuid4().hex[:6])
    cfg = jaxckpt.Config(store=store, job_id=f"hd-{uuid.uuid4().hex[:6]}",
                         **({"shm_dir": d} if store == "shm" else {}))
    want = _strings()
    try:
        with jaxckpt.Checkpointer(cfg) as ck:
            ck.save(1, want).result()
            for got in (ck.restore(), ck.restore(_strings())):
                for k, w in want.items():
                    g = got[k]
                    native = np.asarray(w).astype(np.asarray(w).dtype.newbyteorder("="))
                    assert np.asarray(g).dtype == native.dtype, k
                    np.testing.assert_array_equal(np.frombuffer(np.ascontiguousarray(g).tobytes(), np.uint8),
                                                  np.frombuffer(np.ascontiguousarray(native).tobytes(), np.uint8))
                    np.testing.assert_array_equal(g, w)
    finally:
        if store == "shm":
            _stop(d, cfg.job_id)


def test_structured_dtypes_are_refused_at_save_naming_the_path():
    rec = np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")])
    with jaxckpt.Checkpointer(jaxckpt.Config()) as ck:
        with pytest.raises(UnsupportedLeafError, match=r"opt/rec: numpy structured or sub-array dtype"):
            ck.save(1, {"opt": {"rec": rec}})
        with pytest.raises(UnsupportedLeafError, match=r"opt/one: numpy structured"):
            ck.save(1, {"opt": {"one": rec[0]}})
        assert ck.all_steps() == []


# ----------------------------------------------------------------------------- chaos peer proxy
def test_peer_proxy_delays_and_drops_real_transport_traffic_without_wrong_bytes():
    """jaxckpt chaos's peer faults: the real ZeroMQ transport through the proxy. Delayed pieces arrive late but
    whole; a dropped piece (reset or stall) costs the requests in flight a PeerError naming the peer, never
    wrong bytes, and the client is served again once ZeroMQ has reconnected."""
    from jaxckpt import Config
    from jaxckpt.backends.memory import MemoryStore
    from jaxckpt.backends.transport import ZmqTransport
    from jaxckpt.tools.chaos.proxy import PeerProxy
    from jaxckpt.errors import PeerError

    token = b"proxy-test-token"
    store = MemoryStore(Config())
    data = np.random.default_rng(7).integers(0, 256, size=200_000, dtype=np.uint8)
    slot = store.reserve(1, data.nbytes)
    np.frombuffer(slot.buffer, dtype=np.uint8)[:] = data
    store.commit(slot, b"manifest-of-step-1")
    t = ZmqTransport(frame_bytes=16 << 10)
    server = t.serve(store, token=token)
    try:
        with PeerProxy(server.address, seed=1, delay_p=0.5, delay_max_s=0.02) as slow:
            c = t.connect(slow.address, token=token, timeout_s=30)
            try:
                for off, n in ((0, data.size), (5, 70_001), (199_990, 10)):
                    np.testing.assert_array_equal(np.frombuffer(c.read(1, off, n), np.uint8), data[off:off + n])
                assert c.manifest(1) == b"manifest-of-step-1"
            finally:
                c.close()
            assert slow.stats.delayed > 0 and slow.stats.resets == slow.stats.stalls == 0
        with PeerProxy(server.address, seed=2, drop_p=0.2, max_drops=3, stall_max_s=0.5) as lossy:
            c = t.connect(lossy.address, token=token, timeout_s=2)
            ok = failed = 0
            try:
                for i in range(40):
                    off = (i * 4999) % (data.size - 20_000)
                    try:
                        got = np.frombuffer(c.read(1, off, 20_000), np.uint8)
                    except PeerError as e:
                        assert f"peer {lossy.address}" in str(e) and "within 2s" in str(e), e
                        failed += 1
                        continue
                    np.testing.assert_array_equal(got, data[off:off + 20_000])
                    ok += 1
                    if lossy.stats.resets + lossy.stats.stalls == 3 and ok >= 3:
                        break
            finally:
                c.close()
            assert lossy.stats.resets + lossy.stats.stalls == 3, lossy.stats.summary()
            assert ok >= 3, (ok, failed, lossy.stats.summary())  # served again after every drop
    finally:
        server.close()
        store.close()
    assert not [th for th in threading.enumerate() if th.name.startswith("jaxckpt-chaos-proxy")]
