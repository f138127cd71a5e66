"""Bulk reads of a restore over the network (real peer servers and clients on loopback): small chunks from another
node's agent come in a flight of ``spans`` requests, through every wrapper of a holder, falling back chunk by
chunk to the next holder with each failure reported (jaxckpt.core.fetch.ChunkReader)."""
import numpy as np
import pytest

from jaxckpt.backends.transport import ZmqTransport
from jaxckpt.core.box import Box
from jaxckpt.core.checksum import crc32c
from jaxckpt.core.fetch import ChunkReader
from jaxckpt.core.manifest import ChunkMeta
from jaxckpt.core.sources import Source
from jaxckpt.errors import ChecksumError, PeerError


@pytest.mark.parametrize("workers", [1, 4])
def test_small_chunks_from_other_nodes_come_in_one_flight_and_fall_back_chunk_by_chunk(workers):
    """Chunks under BULK_BYTES whose first source reads ranges in bulk (another node's agent; the real peer
    transport here) are asked for in one flight: 400 chunks of 1 KiB cost the holder a reply, not 400. A chunk
    whose bytes fail their crc32c there comes from the next source, reported; a holder that stops answering is
    asked once, and what it did not give comes from the next holder, in bulk too."""
    from jaxckpt import Config
    from jaxckpt.backends.memory import MemoryStore
    from jaxckpt.core.transport import Span

    token, size = b"bulk-test-token", 1024
    data = np.random.default_rng(3).integers(0, 256, 400 * size, dtype=np.uint8)
    bad = data.copy()
    bad[7 * size + 3] ^= 1
    chunks = [ChunkMeta(Box((i * size,), ((i + 1) * size,)), i * size, size, crc32c(data[i * size:(i + 1) * size]), 2)
              for i in range(400)]
    t, stores, servers, clients = ZmqTransport(), [], [], []

    def holder(name: str, buf: np.ndarray) -> Source:
        store = MemoryStore(Config())
        slot = store.reserve(1, buf.nbytes)
        np.frombuffer(slot.buffer, np.uint8)[:] = buf
        store.commit(slot, b"m")
        server = t.serve(store, token=token)
        c = t.connect(server.address, token=token, timeout_s=10)
        stores.append(store), servers.append(server), clients.append(c)
        return Source("remote", name, name, lambda o, n: c.read(1, o, n),
                      read_spans=lambda ranges: [(i, b) for i, b, _ in c.read_spans(1, [Span(o, n) for o, n in ranges])])
    try:
        a, b = holder("agent A", bad), holder("agent B", data)
        reader = ChunkReader({2: [a, b]}, 1, workers=workers)
        reader.prefetch([("w", c) for c in chunks])
        for c in chunks:
            assert bytes(reader.raw("w", c)) == data[c.offset:c.offset + size].tobytes()
        r = reader.finish()
        assert (servers[0].served, servers[1].served) == (1, 1)  # one flight at A, the corrupt chunk alone at B
        assert r.bytes_by_source == {"agent A": 399 * size, "agent B": size}
        assert len(r.fallbacks) == 1 and "remote source agent A failed (ChecksumError: w: step 1 chunk (7168,)" \
            in r.fallbacks[0] and r.fallbacks[0].endswith("read from remote source agent B")
        servers[0].close()  # A stops answering: asked once, every chunk from B in bulk
        c_, d_ = holder("agent C", data), holder("agent D", data)
        servers[2].close()
        reader = ChunkReader({2: [c_, d_]}, 1, workers=workers)
        reader.prefetch([("w", c) for c in chunks])
        assert all(bytes(reader.raw("w", c)) == data[c.offset:c.offset + size].tobytes() for c in chunks)
        r = reader.finish()
        assert servers[3].served == 1 and r.bytes_by_source == {"agent D": 400 * size}
        assert len(r.fallbacks) == 400 and "remote source agent C failed (PeerUnreachableError: w: step 1 chunk " \
            "(0,)..(1024,) of process 2 from agent C: peer tcp://" in r.fallbacks[0]
    finally:
        for x in clients + servers + stores:
            x.close()


def test_a_fallback_holder_is_read_in_bulk_too():
    """The first holder of a process's bytes does not answer: the chunks come from the next holder, opened on
    its first read (core/holders.lazy_source), in one flight as well: its manifest and one spans request."""
    from jaxckpt import Config
    from jaxckpt.backends.agent.readers import RemoteAgentHolder
    from jaxckpt.backends.memory import MemoryStore
    from jaxckpt.core.capabilities import AgentInfo
    from jaxckpt.core.holders import lazy_source
    from jaxckpt.core.transport import Span

    token, size = b"lazy-test-token", 1024
    data = np.random.default_rng(4).integers(0, 256, 200 * size, dtype=np.uint8)
    chunks = [ChunkMeta(Box((i * size,), ((i + 1) * size,)), i * size, size, crc32c(data[i * size:(i + 1) * size]), 0)
              for i in range(200)]
    store = MemoryStore(Config())
    slot = store.reserve(1, data.nbytes)
    np.frombuffer(slot.buffer, np.uint8)[:] = data
    store.commit(slot, b"manifest-1")
    t = ZmqTransport()
    dead, good = t.serve(store, token=token), t.serve(store, token=token)
    gone = t.connect(dead.address, token=token, timeout_s=5)
    dead.close()
    holder = RemoteAgentHolder(AgentInfo(good.address, "n2", "job", "g", "/nowhere", token), "n2", timeout_s=10)
    opened = []
    try:
        first = Source("remote", "agent A", "n1", lambda o, n: gone.read(1, o, n),
                       read_spans=lambda ranges: [(i, b) for i, b, _ in gone.read_spans(
                           1, [Span(o, n) for o, n in ranges])])
        reader = ChunkReader({0: [first, lazy_source(holder, 0, 1, crc32c(b"manifest-1"), opened)]}, 1, workers=4)
        reader.prefetch([("w", c) for c in chunks])
        assert all(bytes(reader.raw("w", c)) == data[c.offset:c.offset + size].tobytes() for c in chunks)
        assert reader.finish().bytes_by_source == {holder.name: 200 * size}
        assert good.served == 2  # the manifest, then one spans request for the 200 chunks
    finally:
        for o in opened:
            o.close()
        for x in (holder, gone, good, dead, store):
            x.close()


def test_a_guarded_remote_agent_keeps_its_bulk_reads():
    """The catalog wraps each remote agent (Guarded: not asked again in an operation once it timed out); its
    opened snapshot keeps the holder's bulk read (read_spans), which a many-array restore and a rebuild's
    twins read through, and a time-out there marks the agent as one not to ask again."""
    from jaxckpt import Config
    from jaxckpt.backends.agent.readers import RemoteAgentHolder
    from jaxckpt.backends.memory import MemoryStore
    from jaxckpt.core.capabilities import AgentInfo
    from jaxckpt.core.holders import Guarded, NotAsked

    token = b"guarded-test-token"
    data = np.random.default_rng(5).integers(0, 256, 50_000, dtype=np.uint8)
    store = MemoryStore(Config())
    slot = store.reserve(2, data.nbytes)
    np.frombuffer(slot.buffer, np.uint8)[:] = data
    store.commit(slot, b"manifest-2")
    server = ZmqTransport().serve(store, token=token)
    timed_out = []

    def unresponsive(g: Guarded, e: Exception) -> None:  # as the catalog marks it, for the operation
        timed_out.append(e)
        g.dead = "restore"
    info = AgentInfo(server.address, "n9", "job", "g1", "/nowhere", token)
    h = Guarded(RemoteAgentHolder(info, "n9", timeout_s=1.0), unresponsive, info)
    try:
        o = h.open(0, 2)
        assert o.read_spans is not None and o.manifest == b"manifest-2"
        ranges = [(97 * i, 40) for i in range(300)]
        before = server.served
        got = dict(o.read_spans(ranges))
        assert all(bytes(got[i]) == data[a:a + n].tobytes() for i, (a, n) in enumerate(ranges))
        assert server.served - before == 1  # one spans request for the 300 ranges
        server.close()  # the agent stops answering: the bulk read times out, the agent is not asked again
        with pytest.raises(PeerError):
            o.read_spans([(0, 10)])
        assert len(timed_out) == 1
        with pytest.raises(NotAsked, match="not asked, it did not answer earlier in this restore"):
            o.read_spans([(0, 10)])
    finally:
        h.close()
        server.close()
        store.close()


@pytest.mark.parametrize("workers", [1, 4])
def test_small_chunks_in_this_nodes_memory_are_read_in_one_run_and_fall_back_chunk_by_chunk(workers):
    """Small chunks whose first source is this node's memory are read and checked in one run on the restoring
    thread (ChunkReader._near); a chunk whose bytes fail their crc32c there, or whose range runs past the end of
    the buffer, comes from the next source with the failure reported, and the report counts every byte once."""
    from jaxckpt.core.fetch import buffer_reader

    size, n = 4096, 300
    data = np.random.default_rng(5).integers(0, 256, n * size, dtype=np.uint8)
    bad = data.copy()
    bad[11 * size + 9] ^= 0x10
    chunks = [ChunkMeta(Box((i * size,), ((i + 1) * size,)), i * size, size, crc32c(data[i * size:(i + 1) * size]), 0)
              for i in range(n)]
    # the local buffer is one chunk short: the last chunk's range runs past its end
    local = Source("local", "own memory of process 0", "n0", buffer_reader(memoryview(bad[:(n - 1) * size])))
    node = Source("node", "node agent", "n0", buffer_reader(memoryview(data)))
    reader = ChunkReader({0: [local, node]}, 3, workers=workers)
    reader.prefetch([("opt/mu", c) for c in chunks])
    for c in chunks:
        assert bytes(reader.raw("opt/mu", c)) == data[c.offset:c.offset + size].tobytes()
    r = reader.finish()
    assert r.chunks == n and r.bytes_by_process == {0: n * size}
    assert r.bytes_by_source == {"own memory of process 0": (n - 2) * size, "node agent": 2 * size}
    assert r.bytes_by_kind == {"local": (n - 2) * size, "node": 2 * size} and r.bytes_by_node == {"n0": n * size}
    assert len(r.fallbacks) == 2, r.fallbacks
    assert r.fallbacks[0].startswith("opt/mu: step 3 chunk of process 0: local source own memory of process 0 "
                                     "failed (ChecksumError: opt/mu: step 3 chunk (45056,)..(49152,) of process 0")
    assert "failed its crc32c check" in r.fallbacks[0] and r.fallbacks[0].endswith("read from node source node agent")
    assert "runs past the end" in r.fallbacks[1] and f"({(n - 1) * size},)..({n * size},)" in r.fallbacks[1]
    # every source failing a chunk: its error names the array, the step, the chunk and each source
    gone = ChunkReader({0: [Source("local", "own memory of process 0", "n0", buffer_reader(memoryview(bad)))]}, 3,
                       workers=workers)
    with pytest.raises(ChecksumError, match=r"^opt/mu: step 3 chunk \(45056,\)\.\.\(49152,\) of process 0 failed its "
                                            r"crc32c check \(corrupt\) at own memory of process 0$"):
        gone.prefetch([("opt/mu", c) for c in chunks])
