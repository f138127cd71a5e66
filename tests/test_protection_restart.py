"""Protection across restarts, its bandwidth bound, and the protect/skip decision (real processes: 2 simulated
nodes x 1 process with 2 CPU devices each, real node agents, keep=1, protection="hybrid").

1. the restart window: a plain restart (no data lost) whose newest committed step was never protected keeps
   the older protected step (own bytes and protection slots) and holds it; a node lost after that restart is
   rebuilt from it, bit for bit;
2. ``Config.protection_bandwidth``: every protection pull goes through the process's token bucket, whose own
   accounting (bytes admitted, sleep asked for, its clock) shows the bound held; the step still rebuilds;
3. a non-leader keeps a queued step until process 0's protect/skip decision arrives: here process 1 sees the
   commit that makes step 2 stale before process 0 decides step 2, and process 0 decides to protect it (gates
   in the stores and commit hooks make that order certain); step 2 must still become protected.
"""
import os
import shutil
import threading
import uuid

import numpy as np
import pytest

from jaxckpt.backends.agent import protocol as proto
from jaxckpt.protection.slot import PROTECT_BASE
from jaxckpt.backends.shm import ShmStore
from jaxckpt.errors import StoreUnavailableError
from jaxckpt.testing import expect_ok, launch, node_info, remove_agents

BASE = f"/dev/shm/jaxckpt-prst-{os.getpid()}-{uuid.uuid4().hex[:8]}"
ENV = {"JAXCKPT_LOG_LEVEL": "WARNING"}
NODES = 2
HERE = __name__  # the module name the launched processes import this file by
RATE = 256  # bytes per second for the bandwidth test: each process pulls 384 bytes of the other node


@pytest.fixture(scope="module", autouse=True)
def base_dir():
    os.makedirs(BASE, mode=0o700)
    yield BASE
    remove_agents(BASE)


class RefusingProtectionStore(ShmStore):
    """The real ShmStore, except that protection slots (pseudo processes >= PROTECT_BASE) of steps >= 2 are
    refused, as an agent out of room would."""

    def reserve(self, step, nbytes):
        if self.process_index >= PROTECT_BASE and step >= 2:
            raise StoreUnavailableError(f"step {step}: protection slot refused by the test")
        return super().reserve(step, nbytes)


class GatedStepOneStore(ShmStore):
    """The real ShmStore; process 1's protection slot of step 1 waits for ``gate`` (opened by a commit hook once
    process 1 has seen step 3 committed), so process 1's protection worker reaches step 2 only after that."""

    gate = threading.Event()

    def reserve(self, step, nbytes):
        if self.process_index == PROTECT_BASE + 1 and step == 1 and not GatedStepOneStore.gate.wait(120):
            raise TimeoutError("the test never opened the gate")
        return super().reserve(step, nbytes)


# ---------------------------------------------------------------------------- runs in the launched processes
def _config(base: str, job: str, store: str = "shm", **kw):
    import jaxckpt

    node = node_info().node
    return jaxckpt.Config(store=store, job_id=job, shm_dir=f"{base}/{job}-node{node}", keep=1, chunk_bytes=256,
                          agent_dirs=f"{base}/{job}-node*", commit_timeout_s=60.0, peer_timeout_s=20.0,
                          protection="hybrid", **kw)


def host_state(step: int) -> dict:
    rng = np.random.default_rng([29, step])
    rep = rng.standard_normal((16, 12)).astype(np.float32)
    rep.reshape(-1)[[3, 50]] = np.array([0x7FC00001, 0xFFA00002], np.uint32).view(np.float32)  # NaN payloads
    return {"rep": rep, "fsdp": rng.standard_normal((32, 6)).astype(np.float32)}


def _shardings():
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.array(devices).reshape(NODES, 2), ("data", "model"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
    return {"rep": NamedSharding(mesh, P()), "fsdp": NamedSharding(mesh, P(("data", "model")))}


def _device_state(step: int) -> dict:
    import jax

    sh = _shardings()
    return {k: jax.make_array_from_callback(h.shape, sh[k], lambda i, h=h: h[i]) for k, h in host_state(step).items()}


def _restore_checked(ck) -> int:
    import jax

    sh = _shardings()
    target = {k: jax.ShapeDtypeStruct(h.shape, h.dtype, sharding=sh[k]) for k, h in host_state(0).items()}
    latest = ck.latest_step()
    got = ck.restore(target)
    for k, h in host_state(latest).items():
        for shard in got[k].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data).view(np.uint8), h[shard.index].view(np.uint8),
                                          err_msg=f"{k} step {latest}")
    return latest


def save_refused_job(base: str, job: str):
    """Step 1 protected; step 2 committed but its protection refused; then a normal exit."""
    import jaxckpt

    with jaxckpt.Checkpointer(_config(base, job, f"{HERE}:RefusingProtectionStore")) as ck:
        for step in (1, 2):
            ck.save(step, _device_state(step))
            ck.wait()
        prot = ck.engine.protection
        return {"latest": ck.latest_step(), "protected": prot.protected_steps(), "failed": sorted(prot.failures())}


def plain_restart_job(base: str, job: str):
    """A restart that lost nothing: restore the newest step, bit for bit, and exit."""
    import jaxckpt

    with jaxckpt.Checkpointer(_config(base, job)) as ck:
        latest = _restore_checked(ck)
        return {"latest": latest, "held": ck.store.steps(), "protected": ck.engine.protection.protected_steps()}


def restore_job(base: str, job: str):
    import jaxckpt

    with jaxckpt.Checkpointer(_config(base, job)) as ck:
        latest = _restore_checked(ck)
        return {"latest": latest, "report": ck.last_restore_report.to_dict()}


def bandwidth_job(base: str, job: str, rate: int):
    import jaxckpt

    with jaxckpt.Checkpointer(_config(base, job, protection_bandwidth=rate)) as ck:
        ck.save(1, _device_state(1))
        ck.wait()
        b = ck.engine.protection.last_pull["bandwidth"]  # the node agent pulled, within the bound
        return {"protected": ck.engine.protection.protected_steps(), **b}


def race_job(base: str, job: str):
    import jaxckpt

    p = node_info().process_id
    with jaxckpt.Checkpointer(_config(base, job, f"{HERE}:GatedStepOneStore")) as ck:
        eng = ck.engine
        if p == 1:
            def open_gate(step, committed):  # after the protection hook: step 2 is stale here now
                if step == 3:
                    GatedStepOneStore.gate.set()
            eng.add_commit_hook(open_gate)
        else:
            def wait_for_decision(step, committed):
                # Before the protection hook sees step 3: process 0 still counts step 2 as one of the newest
                # ``keep`` steps when its worker decides it (after step 1 is protected everywhere).
                if step == 3:
                    prot = eng.protection  # until its worker has decided step 2 (bounded: the test then fails)
                    with prot._cond:
                        prot._cond.wait_for(lambda: 2 in prot.decisions, 120)
            eng._commit_hooks.insert(0, wait_for_decision)
        for step in (1, 2, 3):
            ck.save(step, _device_state(step))
        ck.wait()
        prot = ck.engine.protection
        go = prot.decisions.get(2)  # process 0's decision, as every process got it in the round "decide 2"
        return {"protected": prot.protected_steps(), "failed": {s: str(e) for s, e in prot.failures().items()},
                "skipped": prot.skipped_steps(), "go2": None if go is None else ("1" if go else "0")}


def first_jobs(base: str, rate: int) -> dict:
    """What the tests below launch first, in one launch (a Checkpointer, agents and memory per job)."""
    return {"rst": save_refused_job(base, "rst"), "bw": bandwidth_job(base, "bw", rate), "race": race_job(base, "race")}


# ------------------------------------------------------------------------------------------------- the tests
def _lose_node(job: str, node: int) -> None:
    lost = f"{BASE}/{job}-node{node}"
    proto.stop_agent(lost, timeout_s=20)
    proto.kill_agent(lost, remove_memory=True)  # the whole node: its agent and every byte it held
    shutil.rmtree(lost, ignore_errors=True)


def _launch(fn, *args):
    return expect_ok(launch(fn, nodes=NODES, procs_per_node=1, devices_per_proc=2, args=(BASE, *args), env=ENV,
                            timeout=180))


@pytest.fixture(scope="module")
def first() -> dict:
    """first_jobs' results: job -> every process's."""
    values = _launch(first_jobs, RATE)
    return {job: [v[job] for v in values] for job in ("rst", "bw", "race")}


def test_a_plain_restart_keeps_the_protected_step_for_a_later_node_loss(first):
    job = "rst"
    for r in first[job]:
        assert r["latest"] == 2 and r["protected"] == [1] and r["failed"] == [2], r
    for r in _launch(plain_restart_job, job):
        # step 2 restored; step 1 (the newest protected) kept and known as protected
        assert r["latest"] == 2 and r["held"] == [1, 2] and r["protected"] == [1], r
    _lose_node(job, 1)
    out = _launch(restore_job, job)
    assert [r["latest"] for r in out] == [1, 1], out
    assert out[1]["report"]["bytes_by_kind"].get("rebuild", 0) > 0, out[1]["report"]


def test_protection_pulls_keep_to_the_bandwidth_bound_and_still_rebuild(first):
    job = "bw"
    out = first[job]
    for r in out:
        assert r["protected"] == [1] and r["rate"] == RATE, r
        # the other node's half of "fsdp" (held once: copied here) passed through the bucket
        assert r["admitted"] >= 32 * 6 * 4 // 2, r
        assert r["admitted"] > r["burst"] and r["slept"] > 0, r
        assert r["admitted"] <= r["burst"] + r["rate"] * r["span"], r
    _lose_node(job, 1)
    out = _launch(restore_job, job)
    assert [r["latest"] for r in out] == [1, 1], out
    assert out[1]["report"]["bytes_by_kind"].get("rebuild", 0) > 0, out[1]["report"]


def test_a_step_stale_on_a_non_leader_but_protected_by_process_0_is_protected(first):
    out = first["race"]
    for r in out:
        assert r["go2"] == "1", r  # process 0 decided to protect step 2 ...
        assert r["protected"] == [1, 2, 3] and r["failed"] == {} and r["skipped"] == [], r  # ... and it is


def test_protection_bandwidth_is_validated_like_the_other_fields():
    import jaxckpt
    from jaxckpt.errors import ConfigError

    assert jaxckpt.Config().protection_bandwidth == 0  # unlimited
    assert jaxckpt.Config().with_env({"JAXCKPT_PROTECTION_BANDWIDTH": "1_000_000"}).protection_bandwidth == 10**6
    with pytest.raises(ConfigError, match=r"Config.protection_bandwidth=-1: must not be negative"):
        jaxckpt.Config(protection_bandwidth=-1)
    with pytest.raises(ConfigError, match=r"Config.protection_bandwidth=1.5: expected int, got float"):
        jaxckpt.Config(protection_bandwidth=1.5)
    with pytest.raises(ConfigError, match=r"JAXCKPT_PROTECTION_BANDWIDTH='fast': expected int"):
        jaxckpt.Config().with_env({"JAXCKPT_PROTECTION_BANDWIDTH": "fast"})
