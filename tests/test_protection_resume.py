"""Protection comes back after a node agent is SIGKILLed with its memory while the job trains on (real processes,
3 simulated nodes x 1 process, node agents; issue 9's kill-agent-wipe fault), and its bytes are moved by the
node agents (backends/agent/protection_pull.py).

The node's agent restarts (the trainer spawns it) and saves resume; the steps saved after that must become
protected again, or the next node loss has nothing newer than the last step protected before the wipe to rebuild
from (the chaos run saw the job go back thousands of steps that way). Then the node is lost for good, and the
relaunched job restores the newest protected step, bit for bit.

Both jobs (agents found through the directories, "local", and through the coordination service, "remote") train
in one launch and restore in another (each job its own Checkpointer, agents and memory).
"""
import contextlib
import io
import os
import re
import shutil
import time
import uuid

import numpy as np
import pytest

from jaxckpt import cli
from jaxckpt.backends.agent import protocol as proto
from jaxckpt.tools.chaos import trainer as ct
from jaxckpt.testing import expect_ok, launch, node_info, remove_agents
import sharded_state

BASE = f"/dev/shm/jaxckpt-pres-{os.getpid()}-{uuid.uuid4().hex[:8]}"
ENV = {"JAXCKPT_LOG_LEVEL": "WARNING"}
NODES = 3
SPECS = {"rep": (), "fsdp": (("data", "model"),)}


@pytest.fixture(scope="module", autouse=True)
def base_dir():
    os.makedirs(BASE, mode=0o700)
    yield BASE
    remove_agents(BASE)


def _config(base: str, job: str):
    """``agent_dirs`` names every node's directory (simulated nodes on one host) or, for jobs named "remote-*",
    nothing: each process sees its own node's agent only, as on separate hosts, and learns of a restarted agent
    on another node through the coordination service."""
    import jaxckpt

    node = node_info().node
    return jaxckpt.Config(store="shm", job_id=job, shm_dir=f"{base}/{job}-node{node}", keep=2, chunk_bytes=256,
                          agent_dirs="" if job.startswith("remote") else f"{base}/{job}-node*",
                          commit_timeout_s=60.0, peer_timeout_s=20.0, protection="hybrid")


def host_state(step: int) -> dict:
    rng = np.random.default_rng([29, step])
    return {"rep": rng.standard_normal((12, 10)).astype(np.float32),
            "fsdp": rng.standard_normal((36, 6)).astype(np.float32)}


def train_through_a_wipe(base: str, job: str):
    """Steps 1..3 protected; node 1's agent SIGKILLed with its memory; steps 4.. saved until one is protected."""
    import jaxckpt
    from jaxckpt.errors import CommitError

    mesh = sharded_state.node_mesh(NODES)
    me = node_info().node
    c = _config(base, job)

    with jaxckpt.Checkpointer(c) as ck:
        prot = ck.engine.protection
        for step in (1, 2, 3):
            ck.save(step, sharded_state.device_state(mesh, host_state(step), SPECS, step))
            ck.wait()
            assert prot.wait(step, timeout=120), f"step {step}: protection did not finish"
        before = prot.protected_steps()
        kv = ck.engine.coordinator
        if me == 1:
            d = f"{base}/{job}-node1"
            ct.kill_agent(d, wipe=True)  # SIGKILL, wait until it is dead, then its memory goes
            kv.set(f"test/{job}/wiped", b"1")
        kv.get(f"test/{job}/wiped", 120)
        step, resumed, skipped = 3, None, []
        while step < 400 and resumed is None:  # bounded: the agent is back well within 40 s
            step += 1
            time.sleep(0.05)  # a training step: the restarted agent takes a moment to come up
            ck.save(step, sharded_state.device_state(mesh, host_state(step), SPECS, step))
            try:
                ck.wait()
            except CommitError:  # node 1 skipped its save while its agent was coming back
                skipped.append(step)
                continue
            if prot.wait(step, timeout=120) and step in prot.protected_steps():
                resumed = step
        return {"before": before, "resumed": resumed, "latest": ck.latest_step(), "skipped": skipped,
                "pulled": prot.last_pull.get("pulled", 0),
                "protected": prot.protected_steps(), "failed": {s: str(e)[:300] for s, e in prot.failures().items()}}


def restore_job(base: str, job: str):
    import jax
    import jaxckpt

    mesh = sharded_state.node_mesh(NODES)
    target = {k: jax.ShapeDtypeStruct(h.shape, h.dtype, sharding=sharded_state.sharding(mesh, SPECS[k]))
              for k, h in host_state(0).items()} | {"step": 0}
    with jaxckpt.Checkpointer(_config(base, job)) as ck:
        latest = ck.latest_step()
        got = ck.restore(target)
        sharded_state.check_bitwise(got, host_state(latest), latest)
        return {"latest": latest, "report": ck.last_restore_report.to_dict()}


def train_jobs(base: str, jobs: list):
    """``jobs`` trained through the wipe one after the other in this process; job -> train_through_a_wipe's."""
    return {job: train_through_a_wipe(base, job) for job in jobs}


def restore_jobs(base: str, jobs: list):
    """``jobs`` restored one after the other in this process; job -> restore_job's."""
    return {job: restore_job(base, job) for job in jobs}


JOBS = ["local", "remote"]


@pytest.fixture(scope="module")
def runs() -> dict:
    """Every job trained through the wipe (one launch); what its agents and ``jaxckpt ls`` then said; node 2 of
    every job lost for good; every job restored (one launch). job -> {"trained", "pulled_bytes", "ls", "ls_out",
    "restored"}."""
    trained = expect_ok(launch(train_jobs, nodes=NODES, procs_per_node=1, devices_per_proc=2, args=(BASE, JOBS),
                               env=ENV, timeout=300))
    out = {}
    for job in JOBS:
        ls = io.StringIO()
        with contextlib.redirect_stdout(ls):
            rc = cli.main(["ls", "--job", job, "--dir", f"{BASE}/{job}-node0"])
        out[job] = {"trained": [v[job] for v in trained], "ls": rc, "ls_out": ls.getvalue(),
                    "pulled_bytes": [proto.agent_status(f"{BASE}/{job}-node{node}")["pulled_bytes"]
                                     for node in range(NODES)]}
    for job in JOBS:
        lost = f"{BASE}/{job}-node2"  # now lose another node for good: the newest protected step must come back
        proto.stop_agent(lost, timeout_s=20)
        proto.kill_agent(lost, remove_memory=True)
        shutil.rmtree(lost, ignore_errors=True)
    restored = expect_ok(launch(restore_jobs, nodes=NODES, procs_per_node=1, devices_per_proc=2, args=(BASE, JOBS),
                                env=ENV, timeout=300))
    for job in JOBS:
        out[job]["restored"] = [v[job] for v in restored]
    return out


@pytest.mark.parametrize("job", JOBS)
def test_protection_resumes_after_an_agent_is_killed_with_its_memory_and_a_later_node_loss_uses_it(job, runs):
    run = runs[job]
    out = run["trained"]
    for r in out:
        assert r["before"] and max(r["before"]) == 3, r
        assert r["resumed"] is not None, r  # a step saved after the wipe is protected on every node
    resumed = out[0]["resumed"]
    assert all(r["resumed"] == resumed for r in out), out
    # The node agents moved the protection bytes (backends/agent/protection_pull.py), not the trainers.
    assert all(r["pulled"] > 0 for r in out), out
    assert all(b > 0 for b in run["pulled_bytes"]), run["pulled_bytes"]
    assert run["ls"] == 0
    assert re.search(r"protection bytes pulled from other nodes: [1-9]", run["ls_out"]), run["ls_out"]
    out = run["restored"]  # after node 2 was lost for good
    assert all(r["latest"] >= resumed for r in out), (resumed, out)
    assert out[2]["report"]["bytes_by_kind"].get("rebuild", 0) > 0, out[2]["report"]
