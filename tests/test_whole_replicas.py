"""``Config.replicas="whole"`` with real processes: 4 simulated nodes x 1 process (2 CPU devices each).

A job saves a tiny state (an array replicated everywhere, one data-parallel over the nodes, one fully sharded)
with ``hybrid`` protection and exits; the agents keep the memory. With whole replicas every node keeps a whole
copy of the arrays it holds replicated, so the relaunched job's restore reads its own node's memory only (no
byte over the host transport), and those arrays get no parity: after a node is lost (its agent SIGKILLed, its
memory removed) the replacement reads them from another node's copy, bit for bit, and only the fully sharded
array is rebuilt from protection. The same job with split replicas (REFT's 1/R) reads the other replicas' shares
over the transport: the contrast that shows the check can fail.

One launch saves both jobs and one restores both with every agent alive (each job its own Checkpointer, agents and
memory); the restore after the node loss is a launch of its own.
"""
import os
import shutil
import uuid

import numpy as np
import pytest

from jaxckpt.backends.agent import protocol as proto
from jaxckpt.testing import expect_ok, launch, node_info, remove_agents
from agent_nodes import flip_chunk
import sharded_state

BASE = f"/dev/shm/jaxckpt-whole-{os.getpid()}-{uuid.uuid4().hex[:8]}"
ENV = {"JAXCKPT_LOG_LEVEL": "WARNING"}
NODES = 4
SPECS = {"rep": (), "dp": (None, "model"), "fsdp": (("data", "model"),)}


@pytest.fixture(scope="module", autouse=True)
def base_dir():
    os.makedirs(BASE, mode=0o700)
    yield BASE
    remove_agents(BASE)


# ---------------------------------------------------------------------------- runs in the launched processes
def _config(base: str, job: str, replicas: str):
    from test_protection_runtime import _config as protected  # the same jobs, hybrid protection

    return protected(base, job, "hybrid").replace(replicas=replicas)


def host_state(step: int) -> dict:
    rng = np.random.default_rng([11, step])
    rep = rng.standard_normal((16, 12)).astype(np.float32)
    rep.reshape(-1)[[3, 50]] = np.array([0x7FC00001, 0xFFA00002], np.uint32).view(np.float32)  # NaN payloads
    return {"rep": rep, "dp": rng.integers(-2**31, 2**31 - 1, (8, 20), dtype=np.int32),
            "fsdp": rng.standard_normal((32, 6)).astype(np.float32)}


def save_job(base: str, job: str, replicas: str, steps: list):
    import jaxckpt

    mesh = sharded_state.node_mesh(NODES)
    with jaxckpt.Checkpointer(_config(base, job, replicas)) as ck:
        for step in steps:
            ck.save(step, sharded_state.device_state(mesh, host_state(step), SPECS, step))
        ck.wait()
        protected = ck.engine.protection.protected_steps()
        plan = next(iter(ck.engine.protection.plans().values()))
    return {"protected": protected, "policies": {k: list(v) for k, v in plan.policies().items()},
            "stripes": len(plan.stripes), "data_bytes": plan.data_bytes()[plan.nodes[node_info().process_id]]}


def restore_job(base: str, job: str, replicas: str):
    import jax
    import jaxckpt
    from jax.experimental import multihost_utils

    mesh = sharded_state.node_mesh(NODES)
    target = {k: jax.ShapeDtypeStruct(h.shape, h.dtype, sharding=sharded_state.sharding(mesh, SPECS[k]))
              for k, h in host_state(0).items()} | {"step": 0}
    with jaxckpt.Checkpointer(_config(base, job, replicas)) as ck:
        latest = ck.latest_step()
        got = ck.restore(target)
        sharded_state.check_bitwise(got, host_state(latest), latest)
        report = ck.last_restore_report.to_dict()
        multihost_utils.sync_global_devices("restored")
    return {"latest": latest, "report": report}


def save_jobs(base: str, jobs: list):
    """``jobs`` [[job, replicas, steps], ...] saved one after the other in this process; job -> save_job's."""
    return {job: save_job(base, job, replicas, steps) for job, replicas, steps in jobs}


def restore_jobs(base: str, jobs: list):
    """``jobs`` [[job, replicas], ...] restored one after the other in this process; job -> restore_job's."""
    return {job: restore_job(base, job, replicas) for job, replicas in jobs}


# ----------------------------------------------------------------------------------------------- helpers
def run(fn, *args):
    return expect_ok(launch(fn, nodes=NODES, procs_per_node=1, devices_per_proc=2, args=(BASE, *args), env=ENV,
                            timeout=240))


def lose_node(job: str, node: int) -> None:
    d = f"{BASE}/{job}-node{node}"
    proto.kill_agent(d, remove_memory=True)
    shutil.rmtree(d, ignore_errors=True)


def far_kinds(report: dict) -> set:
    return {k for k, v in report["bytes_by_kind"].items() if v and k not in ("local", "node")}


# ----------------------------------------------------------------------------------------------- tests
JOBS = {"whole": ["whole", [1, 2]], "split": ["split", [1]]}  # job -> [replicas, steps saved]


@pytest.fixture(scope="module")
def saved() -> dict:
    """job -> every process's save_job result, then restore_job result with every agent alive (the trainers
    relaunched): both jobs saved in one launch and restored in one."""
    saves = run(save_jobs, [[job, *spec] for job, spec in JOBS.items()])
    restores = run(restore_jobs, [[job, replicas] for job, (replicas, _) in JOBS.items()])
    return {job: ([v[job] for v in saves], [v[job] for v in restores]) for job in JOBS}


def test_whole_replicas_restore_from_own_node_and_survive_a_node_loss(saved):
    job = "whole"
    host = host_state(2)
    out, restored = saved[job]
    assert all(r["protected"] == [1, 2] for r in out), out
    # the replicated arrays' own copies on the other nodes protect them: no parity; the sharded one is XORed
    assert out[0]["policies"] == {"rep": ["whole"], "dp": ["whole"], "fsdp": ["xor-group"]}, out[0]
    whole = host["rep"].nbytes + host["dp"].nbytes + host["fsdp"].nbytes // NODES
    assert [r["data_bytes"] for r in out] == [whole] * NODES, out  # a full copy of rep and dp on every node

    out = restored  # every trainer restarted, the agents alive
    assert [r["latest"] for r in out] == [2] * NODES, out  # checked bit for bit in every process
    for r in out:
        assert r["report"]["transport_bytes"] == 0 and not far_kinds(r["report"]), r["report"]
        # its own manifest only: no other node asked anything
        assert r["report"]["manifests_by_kind"] == {"local": 1} and r["report"]["widened"] == "", r["report"]

    lost = 1
    # One flipped byte of the replicated array in the memory of node 1's agent: process 1's restore from its
    # node's manifest alone fails that chunk's crc32c, opens every process's manifest and reads the box from
    # another node's whole copy (protection's rebuild); the other processes still read their node only.
    flip_chunk(f"{BASE}/{job}-node{lost}", lost, 2, "rep")
    out = run(restore_job, job, "whole")
    assert [r["latest"] for r in out] == [2] * NODES, out  # bit for bit, the corrupt chunk included
    for i, r in enumerate(out):
        rep = r["report"]
        if i == lost:
            assert rep["widened"].startswith("ChecksumError: rep: step 2 chunk "), rep
            assert len(rep["fallbacks"]) == 1 and rep["bytes_by_kind"].get("rebuild", 0) > 0, rep
            assert rep["manifests_by_kind"]["local"] == 1 and sum(rep["manifests_by_kind"].values()) == NODES, rep
        else:
            assert rep["manifests_by_kind"] == {"local": 1} and rep["transport_bytes"] == 0, rep

    lose_node(job, lost)
    out = run(restore_job, job, "whole")
    assert [r["latest"] for r in out] == [2] * NODES, out
    for i, r in enumerate(out):
        rep = r["report"]
        if i == lost:  # the replacement holds nothing: the replicas from another node, its shard rebuilt
            assert rep["bytes_by_kind"].get("remote", 0) == host["rep"].nbytes + host["dp"].nbytes, rep
            assert rep["bytes_by_kind"].get("rebuild", 0) == host["fsdp"].nbytes // NODES, rep
        else:  # the survivors still read only their own node
            assert rep["transport_bytes"] == 0 and not far_kinds(rep), rep


def test_split_replicas_read_the_other_replicas_shares(saved):
    """Split (1/R per replica): the same restore fetches 3/4 of each replicated array from the other
    nodes, and the replicated arrays are protected by parity."""
    out, restored = saved["split"]
    assert out[0]["policies"] == {"rep": ["parity"], "dp": ["parity"], "fsdp": ["xor-group"]}, out[0]
    out = restored
    assert [r["latest"] for r in out] == [1] * NODES, out
    assert all(r["report"]["transport_bytes"] > 0 for r in out), out
    for r in out:  # its node holds 1/4 of each replicated array: every process's manifest opened at once
        assert r["report"]["widened"] == "", r["report"]
        assert r["report"]["manifests_by_kind"] == {"local": 1, "remote": NODES - 1}, r["report"]
