"""A node agent's protection pull reads only the spans of chunks its blocks use, and checks each span against the
whole chunk's crc32c (real node agents, real peer transport; ``backends/agent/protection_pull.py``).

Two simulated source nodes, A and C, each hold a committed step of one process with chunks of uneven sizes; on
node B a protection slot asks its agent to build an ``xor-group`` stripe whose units cover parts of several
chunks on A and C (the cut a stream striped into units makes). The stripe must come out bit for bit, with only
the spans crossing the transport; a bit flipped in a stored chunk outside the span must still fail the pull with
a ChecksumError naming the chunk, since the holder's crc32c of the rest of the chunk comes from the bytes it holds.
"""
import os
import uuid

import msgpack
import numpy as np
import pytest

from jaxckpt.backends.agent import protocol as proto
from jaxckpt.backends.shm import ShmStore
from jaxckpt.core import manifest as mf
from jaxckpt.core.box import Box
from jaxckpt.core.checksum import crc32c
from jaxckpt.errors import AgentError
from jaxckpt.protection.plan import ChunkRange, ProtectionPlan, SavedChunk, Stripe, Unit
from jaxckpt.protection.plan_wire import encode_plan
from jaxckpt.protection.slot import PROTECT_BASE
from jaxckpt.testing import remove_agents

from agent_nodes import node_store, peer_of

BASE = f"/dev/shm/jaxckpt-pull-{os.getpid()}-{uuid.uuid4().hex[:8]}"
JOB = "pull"


@pytest.fixture(scope="module", autouse=True)
def base_dir():
    os.makedirs(BASE, mode=0o700)
    yield BASE
    remove_agents(BASE)


def _save(node: str, process: int, sizes: list[int], seed: int, step: int):
    """A committed step of ``process`` on ``node``: one uint8 array per chunk size; returns (store, data, chunks)."""
    data = np.random.default_rng(seed).integers(0, 256, sum(sizes), dtype=np.uint8)
    store = node_store(BASE, JOB, node, process)
    slot = store.reserve(step, data.nbytes)
    np.frombuffer(slot.buffer, np.uint8)[:] = data
    arrays, chunks, at = [], [], 0
    for i, n in enumerate(sizes):
        c = mf.ChunkMeta(Box((0,), (n,)), at, n, crc32c(data[at:at + n]), process)
        arrays.append(mf.ArrayMeta(f"a{i}", (("key", f"a{i}"),), (n,), "uint8", "numpy", chunks=(c,)))
        chunks.append(SavedChunk(process, 0 if node == "nodeA" else 2, at, n, f"a{i}", Box((0,), (n,)),
                                 Box((0,), (n,)), (process,), "xor-group"))
        at += n
    store.commit(slot, mf.encode(mf.Manifest(step, process, 2, "numpy", tuple(arrays),
                                             order=tuple(a.path for a in arrays), nbytes=data.nbytes)))
    return store, data, chunks


def _peer(node: str) -> list:
    return peer_of(BASE, node)


def _stripe_plan(chunks_a, chunks_c, cut_a, cut_c, rest_a, rest_c) -> tuple[ProtectionPlan, Stripe]:
    """Stripe 0, held by node B (1): A's unit = ranges ``cut_a``, C's = ``cut_c`` ((chunk, lo, hi)); stripe 1, held
    by a node 3, covers the rest of the chunks (``rest_a``, ``rest_c``), as a plan must."""
    chunks = tuple(chunks_a) + tuple(chunks_c)

    def stripe(sid, node, a, c):
        return Stripe(sid, "xor-group", node, -1, (Unit(0, tuple(ChunkRange(i, lo, hi) for i, lo, hi in a)),
                                                    Unit(2, tuple(ChunkRange(len(chunks_a) + i, lo, hi)
                                                                  for i, lo, hi in c))))
    s0 = stripe(0, 1, cut_a, cut_c)
    plan = ProtectionPlan("xor-group", 1, 4, 1 << 30, (0, 2), ((0, 1, 2, 3),), chunks,
                          (s0, stripe(1, 3, rest_a, rest_c)), ())
    return plan, s0


def _expected(data_a, chunks_a, cut_a, data_c, chunks_c, cut_c, n) -> np.ndarray:
    out = np.zeros(n, np.uint8)
    for data, chunks, cut in ((data_a, chunks_a, cut_a), (data_c, chunks_c, cut_c)):
        unit = np.concatenate([data[chunks[i].offset + lo:chunks[i].offset + hi] for i, lo, hi in cut])
        out[:unit.size] ^= unit
    return out


def _pull(owner: ShmStore, plan: ProtectionPlan, stripe: Stripe, step: int):
    slot = owner.reserve(step, stripe.nbytes)
    try:
        reply = owner.pull(slot, plan=encode_plan(plan), tasks=[["stripe", stripe.id, 0]],
                           sources={"0": _peer("nodeA"), "1": _peer("nodeC")}, rate=0, timeout=20.0)
        return reply, np.frombuffer(slot.buffer, np.uint8).copy()
    finally:
        owner.abort(slot)


@pytest.mark.parametrize("scale", [1 << 10, 1 << 20], ids=["small", "behind-the-build"])
def test_a_pull_reads_only_the_spans_its_stripe_uses_and_builds_it_bit_for_bit(scale):
    # "behind-the-build": over the size where the sources are fetched on threads while the stripe is built
    step = 10 + (scale > 1024)  # the agents live for the module: a step of each case's own
    sizes_a, sizes_c = [3 * scale, 5 * scale + 64, 2 * scale], [4 * scale, 4 * scale]
    node_a, data_a, chunks_a = _save("nodeA", 0, sizes_a, seed=1, step=step)
    node_c, data_c, chunks_c = _save("nodeC", 1, sizes_c, seed=2, step=step)
    owner = node_store(BASE, JOB, "nodeB", PROTECT_BASE + 1)
    try:
        # A's unit ends inside its second chunk, C's starts inside its first: neither chunk is read whole
        cut_a = [(0, 0, 3 * scale), (1, 0, 2 * scale + 64)]
        cut_c = [(0, scale, 4 * scale), (1, 0, 2 * scale)]
        rest_a = [(1, 2 * scale + 64, 5 * scale + 64), (2, 0, 2 * scale)]
        rest_c = [(0, 0, scale), (1, 2 * scale, 4 * scale)]
        plan, stripe = _stripe_plan(chunks_a, chunks_c, cut_a, cut_c, rest_a, rest_c)
        reply, got = _pull(owner, plan, stripe, step)
        want = _expected(data_a, chunks_a, cut_a, data_c, chunks_c, cut_c, stripe.nbytes)
        np.testing.assert_array_equal(got, want)
        assert reply["crcs"] == [crc32c(want)]
        assert reply["pulled"] == sum(hi - lo for _, lo, hi in cut_a + cut_c) < sum(sizes_a[:2]) + sum(sizes_c)
    finally:
        for s in (owner, node_a, node_c):
            s.close()


@pytest.mark.parametrize("scale", [1 << 10, 1 << 20], ids=["small", "behind-the-build"])
def test_a_flipped_bit_outside_the_span_still_fails_the_pull_naming_the_chunk(scale):
    step = 20 + (scale > 1024)
    node_a, data_a, chunks_a = _save("nodeA", 0, [4 * scale, 4 * scale], seed=3, step=step)
    node_c, data_c, chunks_c = _save("nodeC", 1, [8 * scale], seed=4, step=step)
    owner = node_store(BASE, JOB, "nodeB", PROTECT_BASE + 1)
    try:
        # flip a bit of A's second chunk at its very end, which the stripe's span of it does not cover
        d = f"{BASE}/nodeA"
        name = next(n for n in os.listdir(d)
                    if (m := proto.REC_RE.match(n)) and int(m.group(2)) == step and int(m.group(1)) == 0)
        with open(os.path.join(d, name), "rb") as f:
            seg = msgpack.unpackb(f.read(), raw=False)["seg"]
        fd = os.open(os.path.join(d, seg), os.O_RDWR)
        try:
            off = 8 * scale - 1
            os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ 0x10]), off)
        finally:
            os.close(fd)
        cut_a = [(0, 0, 4 * scale), (1, 0, 2 * scale)]
        plan, stripe = _stripe_plan(chunks_a, chunks_c, cut_a, [(0, 0, 6 * scale)], [(1, 2 * scale, 4 * scale)],
                                    [(0, 6 * scale, 8 * scale)])
        slot = owner.reserve(step, stripe.nbytes)
        try:
            with pytest.raises(AgentError, match=rf"ChecksumError: a1: step {step} chunk of process 0 \(bytes 0\.\."
                                                 rf"{2 * scale} read from tcp://[^)]+\) failed its crc32c check"):
                owner.pull(slot, plan=encode_plan(plan), tasks=[["stripe", 0, 0]],
                           sources={"0": _peer("nodeA"), "1": _peer("nodeC")}, rate=0, timeout=20.0)
        finally:
            owner.abort(slot)
    finally:
        for s in (owner, node_a, node_c):
            s.close()
