"""``Config.protection_bandwidth`` holds per process over time, not per pull (real node agents, real peer transport).

Two node agents, as two simulated nodes: node A holds a committed step of process 0; on node B the protection
slot of another process asks its agent, pull after pull, to copy that step's chunk from node A's agent
(``backends/agent/protection_pull.py``, the path ``jaxckpt.protection.runtime`` takes). Each pull is smaller than
the bucket's burst, so a bucket made per pull would admit every one at once; the agent's one bucket per slot owner
must hold the whole run to the rate: N pulls of B bytes at rate C take at least (N * B - burst) / C seconds.
That is the bucket's guarantee (a lower bound on elapsed time), not a speed measurement.
"""
import os
import time
import uuid

import numpy as np
import pytest

from jaxckpt.backends.shm import ShmStore
from jaxckpt.core import manifest as mf
from jaxckpt.core.box import Box
from jaxckpt.core.checksum import crc32c
from jaxckpt.protection.plan import CopyBlock, ProtectionPlan, SavedChunk, validate_protection
from jaxckpt.protection.plan_wire import encode_plan
from jaxckpt.protection.slot import PROTECT_BASE
from jaxckpt.testing import remove_agents

from agent_nodes import node_store, peer_of

BASE = f"/dev/shm/jaxckpt-bw-{os.getpid()}-{uuid.uuid4().hex[:8]}"
JOB = "bw"
STEP = 1
B = 4096  # bytes per pull: under the default burst (a tenth of a second's worth) at RATE
RATE = 64 << 10  # bytes per second
PULLS = 24


@pytest.fixture(scope="module", autouse=True)
def base_dir():
    os.makedirs(BASE, mode=0o700)
    yield BASE
    remove_agents(BASE)


def _save_on_node_a(data: np.ndarray) -> ShmStore:
    """Process 0's committed step on node A, with the manifest a real save writes for one uint8 array."""
    store = node_store(BASE, JOB, "nodeA", 0)
    slot = store.reserve(STEP, data.nbytes)
    np.frombuffer(slot.buffer, np.uint8)[:] = data
    chunk = mf.ChunkMeta(Box((0,), (data.size,)), 0, data.nbytes, crc32c(data), 0)
    array = mf.ArrayMeta("x", (("key", "x"),), (data.size,), "uint8", "numpy", chunks=(chunk,))
    store.commit(slot, mf.encode(mf.Manifest(STEP, 0, 2, "numpy", (array,), order=("x",), nbytes=data.nbytes)))
    return store


def _copy_plan() -> bytes:
    """Node B (1) keeps a copy of process 0's only chunk, saved on node A (0)."""
    box = Box((0,), (B,))
    chunk = SavedChunk(0, 0, 0, B, "x", box, box, (0,), "replica")
    plan = ProtectionPlan("replica", 1, 4, 64, (0, 1), ((0, 1),), (chunk,), (), (CopyBlock(0, 1, 0, 0, (0,), (0,), B),))
    validate_protection(plan)
    return encode_plan(plan)


def _peer_of_node_a() -> list:
    return peer_of(BASE, "nodeA")


def _pull(store: ShmStore, plan: bytes, source: list, want: np.ndarray) -> dict:
    """One protection pull into a fresh slot of ``store``'s owner; the copy must be bit for bit."""
    slot = store.reserve(STEP, B)
    try:
        reply = store.pull(slot, plan=plan, tasks=[["copy", 0, 0]], sources={"0": source}, rate=RATE,
                           timeout=20.0)
        np.testing.assert_array_equal(np.frombuffer(slot.buffer, np.uint8), want)
        assert reply["crcs"] == [crc32c(want)] and reply["pulled"] == B, reply
        return reply
    finally:
        store.abort(slot)


def test_many_small_pulls_of_one_process_are_held_to_the_rate_over_time():
    data = np.random.default_rng(5).integers(0, 256, B, dtype=np.uint8)
    node_a = _save_on_node_a(data)
    # process 1's protection slots, as the protection runtime opens them
    owner = node_store(BASE, JOB, "nodeB", PROTECT_BASE + 1)
    other = node_store(BASE, JOB, "nodeB", PROTECT_BASE + 0)
    try:
        plan, source = _copy_plan(), _peer_of_node_a()
        t0 = time.monotonic()
        for _ in range(PULLS):
            reply = _pull(owner, plan, source, data)
        elapsed = time.monotonic() - t0
        bw = reply["bandwidth"]
        burst = bw["burst"]
        assert bw["rate"] == RATE and B < burst, bw  # each pull alone fits the burst
        # The run as a whole kept to the rate (the bucket's bound, computed from the cap) ...
        bound = (PULLS * B - burst) / RATE
        assert elapsed >= bound, f"{PULLS} pulls of {B} bytes at {RATE} B/s took {elapsed:.3f} s, under {bound:.3f} s"
        # ... because one bucket served the owner across its pulls: its account covers all of them.
        assert bw["admitted"] == PULLS * B and bw["pull_bytes"] == B, bw
        assert bw["admitted"] <= burst + RATE * bw["span"] + 1e-6, bw
        # Another process's pulls have their own bucket, with its own burst.
        first = _pull(other, plan, source, data)["bandwidth"]
        assert first["admitted"] == B and first["pull_slept"] == 0.0, first
    finally:
        for s in (owner, other, node_a):
            s.close()
