"""Peer transport: every transport passes TransportTests (zarr's shared-conformance-suite pattern)."""
import logging
import socket

import msgpack
import numpy as np
import pytest
import zmq

from jaxckpt import Config
from jaxckpt.backends.memory import MemoryStore
from jaxckpt.backends.transport import MAX_REQUEST_BYTES, VERSION, Span, ZmqTransport
from jaxckpt.core.checksum import crc32c, span_crc
from jaxckpt.errors import PeerError, PeerUnreachableError, StepNotFoundError
from jaxckpt.testing import free_port

TOKEN = b"s3cret-token-of-the-job"
FRAME = 4096  # small frames so that multi-frame reads are exercised on small data


def _commit(store: MemoryStore, step: int, data: np.ndarray, manifest: bytes) -> None:
    slot = store.reserve(step, data.nbytes)
    np.frombuffer(slot.buffer, dtype=np.uint8)[:] = data.view(np.uint8).reshape(-1)
    store.commit(slot, manifest)


class TransportTests:
    """What every transport must do; a subclass provides ``make_transport``."""

    def make_transport(self):
        raise NotImplementedError

    @pytest.fixture
    def served(self):
        store = MemoryStore(Config())
        data = np.random.default_rng(0).integers(0, 256, size=50_000, dtype=np.uint8)
        _commit(store, 3, data, b"manifest-of-step-3")
        t = self.make_transport()
        server = t.serve(store, token=TOKEN)
        clients = []

        def connect(token=TOKEN, timeout_s=20.0):
            c = t.connect(server.address, token=token, timeout_s=timeout_s)
            clients.append(c)
            return c

        yield store, server, data, connect
        for c in clients:
            c.close()
        server.close()
        store.close()

    def test_manifest_steps_and_ranges(self, served):
        store, server, data, connect = served
        c = connect()
        assert c.steps() == [3]
        assert c.manifest(3) == b"manifest-of-step-3"
        for off, n in [(0, 10), (100, FRAME), (7, FRAME * 3 + 5), (0, data.size), (data.size, 0)]:
            got = np.frombuffer(c.read(3, off, n), dtype=np.uint8)
            np.testing.assert_array_equal(got, data[off:off + n])
        big = np.random.default_rng(1).integers(0, 256, FRAME * 3 + 17, dtype=np.uint8).tobytes()
        _commit(store, 4, data[:10], big)  # a manifest larger than a frame comes back in pages
        assert c.manifest(4) == big and c.steps() == [3, 4]

    def test_spans_come_back_with_the_crc32c_of_the_rest_of_their_chunk(self, served):
        store, server, data, connect = served
        c = connect()
        chunk = (1000, 30_000)  # a chunk of the snapshot buffer: its crc32c is what a manifest would record
        whole = crc32c(data[chunk[0]:chunk[0] + chunk[1]])
        spans = [Span(1000, 10, chunk), Span(5000, FRAME * 4 + 3, chunk), Span(30_990, 10, chunk),
                 Span(1000, 30_000, chunk), Span(40_000, 77), Span(2000, 0, chunk)]
        got = {i: (bytes(buf), rest) for i, buf, rest in c.read_spans(3, spans, manifest=True)}
        assert sorted(got) == [-1, *range(len(spans))]
        assert got.pop(-1) == (b"manifest-of-step-3", None)  # asked for in the same flight as the spans
        for i, sp in enumerate(spans):
            buf, rest = got[i]
            assert buf == data[sp.offset:sp.offset + sp.nbytes].tobytes(), sp
            if sp.chunk is None:
                assert rest is None
                continue
            after = chunk[0] + chunk[1] - sp.offset - sp.nbytes
            assert span_crc(rest[0], buf, rest[1], after) == whole, sp
            flipped = bytearray(buf or b"\0")
            flipped[len(flipped) // 2] ^= 1
            assert span_crc(rest[0], bytes(flipped), rest[1], after) != whole or not buf
        # the holder's bytes outside the span count too: a flipped byte there fails the span's check
        data[chunk[0] + 3] ^= 0xFF
        _commit(store, 5, data, b"m5")
        (_, buf, rest), = c.read_spans(5, [Span(20_000, 100, chunk)])
        assert span_crc(rest[0], buf, rest[1], chunk[0] + chunk[1] - 20_100) != whole
        big = np.random.default_rng(1).integers(0, 256, FRAME * 2 + 9, dtype=np.uint8).tobytes()
        _commit(store, 6, data, big)  # a manifest over a frame: its other pages follow the spans
        assert {i: bytes(b) for i, b, _ in c.read_spans(6, [Span(0, 10)], manifest=True)} == {
            0: data[:10].tobytes(), -1: big}
        with pytest.raises(PeerError, match=r"range 999\+10 is not inside chunk 1000\+30000"):
            list(c.read_spans(3, [Span(999, 10, chunk)]))
        with pytest.raises(PeerError, match=r"runs past the end of step 3"):
            list(c.read_spans(3, [Span(data.size - 5, 10)]))

    def test_missing_step_and_bad_range(self, served):
        store, server, data, connect = served
        c = connect()
        with pytest.raises(StepNotFoundError, match=r"step 9 is not held by process 0 \(held: \[3\]\)"):
            c.manifest(9)
        with pytest.raises(PeerError, match="runs past the end of step 3"):
            c.read(3, data.size - 5, 10)
        store.delete(3)
        with pytest.raises(StepNotFoundError, match="step 3 is not held"):
            c.read(3, 0, 10)

    def test_wrong_token_is_refused_and_logged(self, served, caplog):
        store, server, data, connect = served
        bad = connect(token=b"not-the-token")
        with caplog.at_level(logging.WARNING, logger="jaxckpt.backends.transport"):
            for call in (bad.steps, lambda: bad.manifest(3), lambda: bad.read(3, 0, 10)):
                with pytest.raises(PeerError, match="refused .*wrong or missing token"):
                    call()
        assert server.refused == 3
        assert any("wrong or missing token" in r.getMessage() and "127.0.0.1" in r.getMessage()
                   for r in caplog.records)
        assert connect().manifest(3) == b"manifest-of-step-3"  # the server keeps serving good peers

    # what a request to a server closed under the client says: refused once the port is closed (a loaded
    # machine may reach the request's time-out first)
    CLOSED_SERVER_ERROR = "no reply|the connection was refused for 0.25s: nothing listens"

    def test_a_refused_connection_ends_the_request_without_waiting_out_the_time_out(self):
        """Nothing listens at the address (an agent gone, its stale address still published): a request says so
        once the connection was refused for a moment, not after the peer time-out (20 s here), and raises
        PeerUnreachableError, which a restore or a discovery takes as that peer being gone."""
        t = self.make_transport()
        nobody = t.connect(f"tcp://127.0.0.1:{free_port()}", token=TOKEN, timeout_s=20.0)
        try:
            for call, what in ((lambda: nobody.manifest(3), "the manifest of step 3"),
                               (lambda: nobody.read(3, 0, 20_000), r"step 3 range 0\+20000")):
                with pytest.raises(PeerUnreachableError, match=rf"{what}: the connection was refused for 0.25s: "
                                                               rf"nothing listens at that address"):
                    call()
        finally:
            nobody.close()

    def test_timeouts_are_bounded(self, served):
        store, server, data, connect = served
        t = self.make_transport()
        silent = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # takes connections, never answers one
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        nobody = t.connect(f"tcp://127.0.0.1:{silent.getsockname()[1]}", token=TOKEN, timeout_s=0.3)
        try:
            with pytest.raises(PeerError, match=r"no reply to the manifest of step 3 within 0.3s: nothing accepted"):
                nobody.manifest(3)
            with pytest.raises(PeerError, match=r"no reply to step 3 range 0\+20000 within 0.3s"):
                nobody.read(3, 0, 20_000)
        finally:
            nobody.close()
            silent.close()
        c = connect(timeout_s=0.5)
        server.close()
        with pytest.raises(PeerError, match=self.CLOSED_SERVER_ERROR):
            c.steps()


class TestZmqTransport(TransportTests):
    def make_transport(self):
        return ZmqTransport(frame_bytes=FRAME, window=3)

    def _raw(self, server):
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(server.address)
        return s

    def _reply(self, s, timeout_ms=20_000):
        assert s.poll(timeout_ms), "no reply"
        frames = s.recv_multipart()
        return msgpack.unpackb(frames[0], raw=False), frames[1:]

    def test_garbage_and_oversized_requests_get_clear_errors(self, served):
        store, server, data, connect = served
        s = self._raw(server)
        try:
            s.send(b"\xc1 this is not msgpack")
            header, payload = self._reply(s)
            assert (header["ok"], header["code"]) == (False, "bad-request") and "not msgpack" in header["error"]
            assert payload == [b""]
            s.send_multipart([b"a", b"b"])
            header, _ = self._reply(s)
            assert header["code"] == "bad-request" and "expected one request frame, got 2" in header["error"]
            s.send(msgpack.packb([1, 2, 3]))
            header, _ = self._reply(s)
            assert header["code"] == "bad-request" and "not a msgpack map" in header["error"]
            s.send(b"x" * (MAX_REQUEST_BYTES + 1))
            header, _ = self._reply(s)
            assert header["code"] == "too-large" and f"{MAX_REQUEST_BYTES}-byte limit" in header["error"]
            good = {"v": VERSION, "id": 7, "token": TOKEN}
            cases = [({"op": "read", "step": 3, "offset": 0, "nbytes": FRAME + 1}, "exceeds the 4096-byte"),
                     ({"op": "read", "step": 3, "offset": -1, "nbytes": 1}, "'offset' must be a non-negative"),
                     ({"op": "manifest", "step": 3, "offset": 10**6}, "manifest offset 1000000 outside"),
                     ({"op": "delete", "step": 3}, "unknown op 'delete'"),
                     ({"op": "spans", "step": 3, "spans": [0, 10]}, "a span must be [offset, nbytes]"),
                     ({"op": "spans", "step": 3, "spans": []}, "spans must be a list of 1..1024 ranges"),
                     ({"op": "spans", "step": 3, "spans": [[0, 1]] * 1025}, "spans must be a list of 1..1024"),
                     ({"op": "spans", "step": 3, "spans": [[0, 10, 5]]}, "a span must be [offset, nbytes]"),
                     ({"op": "spans", "step": 3, "spans": [[0, FRAME], [0, 1]]}, "exceed the 4096-byte frame"),
                     ({"op": "spans", "step": 3, "spans": [[0, 10, 5, 20]]}, "range 0+10 is not inside chunk"),
                     ({"op": "steps", "v": 99}, "protocol version 99")]
            for fields, msg in cases:
                s.send(msgpack.packb({**good, **fields}))
                header, _ = self._reply(s)
                assert header["ok"] is False and header["id"] == 7 and msg in header["error"], header
            s.send(msgpack.packb({**good, "token": "a str, not bytes", "op": "steps"}))
            header, _ = self._reply(s)
            assert header["code"] == "auth"
        finally:
            s.close()
        # A request beyond ZeroMQ's message limit costs the sender its connection; the server goes on.
        big = self._raw(server)
        try:
            big.send(b"y" * (2 << 20))
            assert not big.poll(300)
        finally:
            big.close()
        c = connect()
        np.testing.assert_array_equal(np.frombuffer(c.read(3, 5, 100), dtype=np.uint8), data[5:105])
        assert server.refused == 1

    def test_a_rebuild_asked_of_a_server_holding_no_parity_is_refused_clearly(self, served):
        """A rebuild runs on the server's workers; a source holding no parity (a process's store) says so, a
        malformed request is refused naming the field, and the server serves on."""
        store, server, data, connect = served
        c = connect()
        src = {1: ("tcp://127.0.0.1:1", b"token", "")}
        with pytest.raises(PeerError, match=r"rebuilds nothing \(not-supported\)"):
            c.rebuild(3, 5, 0, 1, 0, 100, src)
        s = self._raw(server)
        try:
            good = {"v": VERSION, "id": 9, "token": TOKEN, "op": "rebuild", "step": 3, "offset": 0, "nbytes": 8,
                    "stripe": 0, "unit": 0, "timeout_ms": 1000, "agents": [["tcp://127.0.0.1:1", b"t", ""]],
                    "sources": [[1, 0]], "process": 5}
            for fields, msg in [({"process": None}, "names the protection slot"),
                                ({"sources": [[1, 3]]}, "rebuild sources must be"),
                                ({"agents": [["a", "not bytes", ""]]}, "rebuild sources must be"),
                                ({"nbytes": FRAME + 1}, "exceeds the 4096-byte frame"),
                                ({"stripe": -1}, "'stripe' must be a non-negative")]:
                s.send(msgpack.packb({**good, **fields}))
                header, _ = self._reply(s)
                assert header["ok"] is False and header["id"] == 9 and msg in header["error"], header
        finally:
            s.close()
        np.testing.assert_array_equal(np.frombuffer(c.read(3, 5, 100), dtype=np.uint8), data[5:105])

    def _counting(self, c):
        """Count ``c``'s requests by op, and the most in flight at each send."""
        sent, outstanding, ops = [0, 0], [], []
        send, recv = c._send, c._recv

        def counting_send(op, *a, **kw):
            sent[0] += 1
            outstanding.append(sent[0] - sent[1])
            ops.append(op)
            return send(op, *a, **kw)

        def counting_recv(*a, **kw):
            got = recv(*a, **kw)
            sent[1] += 1
            return got
        c._send, c._recv = counting_send, counting_recv
        return outstanding, ops

    def test_small_ranges_go_a_frame_of_them_to_a_request_big_ones_a_window_of_frames(self, served):
        """Ranges under a frame go together, a frame's worth (or MAX_SPANS of them) to one ``spans`` request: a
        many-array read asks for thousands of ranges of a few KiB, and a request each cost more than their bytes.
        Such requests of few bytes go up to MAX_IN_FLIGHT at once, ranges of a frame each at most the window (3
        here); every byte comes back where it belongs, with the crc32c of the rest of its chunk."""
        from jaxckpt.backends.transport import MAX_SPANS
        from jaxckpt.backends.zmq_client import MAX_IN_FLIGHT

        store, server, data, connect = served
        c = connect()
        outstanding, ops = self._counting(c)
        small = [Span(97 * i, 8) for i in range(500)]  # 4,000 bytes: one request
        got = dict((i, bytes(b)) for i, b, _ in c.read_spans(3, small))
        assert all(got[i] == data[sp.offset:sp.offset + 8].tobytes() for i, sp in enumerate(small))
        assert ops == ["spans"]
        ops.clear()
        # 5,000 ranges of a byte: as many to a request as its 4 KiB hold (the server refuses a larger one), all
        # those requests in flight at once
        tiny = [Span(9 * i, 1, (9 * i, 5)) for i in range(5000)]
        got = {i: (bytes(b), rest) for i, b, rest in c.read_spans(3, tiny)}
        for i, sp in enumerate(tiny):
            buf, (before, after) = got[i]
            assert buf == data[sp.offset:sp.offset + 1].tobytes()
            assert span_crc(before, buf, after, 4) == crc32c(data[sp.offset:sp.offset + 5])
        assert set(ops) == {"spans"} and -(-len(tiny) // MAX_SPANS) <= len(ops) <= len(tiny) // 300, len(ops)
        assert 3 < max(outstanding) <= MAX_IN_FLIGHT, max(outstanding)
        outstanding.clear()
        big = [Span(FRAME * i, FRAME) for i in range(data.size // FRAME)]
        got = dict((i, bytes(b)) for i, b, _ in c.read_spans(3, big))
        assert all(got[i] == data[sp.offset:sp.offset + FRAME].tobytes() for i, sp in enumerate(big))
        assert max(outstanding) == 3, outstanding
        # one bad range fails its request, naming the range
        with pytest.raises(PeerError, match=rf"range {data.size - 5}\+10 runs past the end of step 3"):
            list(c.read_spans(3, [Span(0, 10), Span(data.size - 5, 10)]))

    def test_a_peer_without_spans_requests_is_asked_a_range_a_request(self, served, monkeypatch):
        """An agent of an older jaxckpt refuses ``spans`` as an unknown op: the client asks it for each range on
        its own from then on, and gets every byte."""
        import jaxckpt.backends.transport as transport

        store, server, data, connect = served
        monkeypatch.setattr(transport, "OPS", tuple(op for op in transport.OPS if op != "spans"))
        n, size = 1100, 1  # 1,100 ranges: several spans requests in flight when the first refusal comes
        c = connect()
        outstanding, ops = self._counting(c)
        small = [Span(37 * i, size) for i in range(n)] + [Span(45_000, FRAME + 1)]
        for call in range(2):
            ops.clear()
            got = dict((i, bytes(b)) for i, b, _ in c.read_spans(3, small))
            assert all(got[i] == data[sp.offset:sp.offset + sp.nbytes].tobytes() for i, sp in enumerate(small))
            assert ops.count("read") == n + 2 and (ops.count("spans") > 0) == (call == 0), ops[:3]

    def test_late_replies_to_timed_out_requests_are_dropped(self, served):
        store, server, data, connect = served
        c = connect()
        # A stale reply (id 1) queued ahead of the real one must not be taken for it.
        c._send("manifest", "the manifest of step 3", step=3)
        assert c.steps() == [3]
        np.testing.assert_array_equal(np.frombuffer(c.read(3, 0, 9000), dtype=np.uint8), data[:9000])


# ------------------------------------------------------------------------------------ from the registry
class RecordingTransport(ZmqTransport):
    """The zmq transport, recording what it was asked to make (a transport registered by a user)."""

    made: list[str] = []

    def serve(self, store, **kw):
        RecordingTransport.made.append("serve")
        return super().serve(store, **kw)

    def connect(self, address, **kw):
        RecordingTransport.made.append("connect")
        return super().connect(address, **kw)


def test_the_transport_is_the_one_config_names_in_the_registry(monkeypatch):
    """``Config.transport`` names the peer transport in the registry (group "transport"): the job's peer server
    is made by it, "module:Class" names one directly, and an unknown name is a ConfigError at construction."""
    from jaxckpt import registry
    from jaxckpt.backends.peers import Peers
    from jaxckpt.core.coordination import LocalCoordinator
    from jaxckpt.core.transport import get_transport
    from jaxckpt.errors import BackendNotFoundError, ConfigError

    assert type(get_transport()) is ZmqTransport and type(get_transport(Config().transport)) is ZmqTransport
    assert type(get_transport(f"{__name__}:RecordingTransport")) is RecordingTransport
    with pytest.raises(ConfigError, match=r"Config.transport='pigeon': unknown peer transport \(known: zmq"):
        Config(transport="pigeon")
    monkeypatch.setenv("JAXCKPT_TRANSPORT", "pigeon")
    with pytest.raises(ConfigError, match="environment: Config.transport='pigeon'"):
        Config().with_env()
    with pytest.raises(BackendNotFoundError, match="no transport named 'pigeon'"):
        get_transport("pigeon")

    registry.register_part("transport", "recording", RecordingTransport)
    RecordingTransport.made.clear()
    store = MemoryStore(Config(job_id="rec"))
    peers = Peers(Config(job_id="rec", transport="recording"), LocalCoordinator(), store)
    try:
        assert RecordingTransport.made == ["serve"]
        data = np.arange(64, dtype=np.uint8)
        _commit(store, 5, data, b"manifest-of-step-5")
        client = get_transport("recording").connect(peers.server.address, token=peers._token, timeout_s=20.0)
        try:
            assert client.steps() == [5] and bytes(client.read(5, 8, 16)) == data[8:24].tobytes()
        finally:
            client.close()
        assert RecordingTransport.made == ["serve", "connect"]
    finally:
        peers.close()
        store.close()
        registry.unregister_part("transport", "recording")
        assert "recording" not in registry.registered_parts("transport")


def test_a_node_agent_refuses_a_transport_it_cannot_make(tmp_path):
    """The node agent makes its peer server with ``--transport`` (``Config.transport``, passed by the trainer that
    spawns it): an unknown name stops it at start with the ConfigError naming the field, in one line, before it
    makes its directory or log."""
    import subprocess
    import sys

    d, log = tmp_path / "agent", tmp_path / "agent.log"
    r = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", "tr", "--dir", str(d), "--log",
                        str(log), "--transport", "pigeon"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "jaxckpt agent: ConfigError: Config.transport='pigeon': unknown peer transport (known: zmq" in r.stderr
    assert "Traceback" not in r.stderr and not d.exists() and not log.exists()
