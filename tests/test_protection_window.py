"""The newest protected step outlives ``Config.keep`` until a newer step is protected (real processes, 2 simulated
nodes x 1 process, node agents, keep=1).

Without that, a node lost after step N+1 is committed but before it is protected has nothing to be rebuilt from:
retention already dropped step N's own bytes on the surviving node, and N+1 has no redundancy yet. Here step 2's
protection fails on purpose (its protection slots are refused), node 1 then loses its agent and all its memory,
and the relaunched job must restore step 1, bit for bit, from node 0's own bytes and protection slots.
"""
import dataclasses
import os
import shutil
import uuid

import numpy as np
import pytest

from jaxckpt.backends.agent import protocol as proto
from jaxckpt.backends.shm import ShmStore
from jaxckpt.errors import StoreUnavailableError
from jaxckpt.testing import expect_ok, launch, node_info, remove_agents
from agent_nodes import flip_chunk
import sharded_state

BASE = f"/dev/shm/jaxckpt-pwin-{os.getpid()}-{uuid.uuid4().hex[:8]}"
ENV = {"JAXCKPT_LOG_LEVEL": "WARNING"}
NODES = 2
HERE = __name__


class RefusingProtectionStore(ShmStore):
    """The real ShmStore, except that protection slots (pseudo processes >= PROTECT_BASE) of steps >= 2 are
    refused, as an agent out of room would."""

    def reserve(self, step, nbytes):
        if self.process_index >= proto.PROTECT_BASE and step >= 2:
            raise StoreUnavailableError(f"step {step}: protection slot refused by the test")
        return super().reserve(step, nbytes)


@pytest.fixture(scope="module", autouse=True)
def base_dir():
    os.makedirs(BASE, mode=0o700)
    yield BASE
    remove_agents(BASE)


def _config(base: str, job: str, store: str):
    import jaxckpt

    node = node_info().node
    return jaxckpt.Config(store=store, job_id=job, shm_dir=f"{base}/{job}-node{node}", keep=1, chunk_bytes=256,
                          agent_dirs=f"{base}/{job}-node*", commit_timeout_s=60.0, peer_timeout_s=20.0,
                          protection="hybrid")


def host_state(step: int) -> dict:
    rng = np.random.default_rng([23, step])
    rep = rng.standard_normal((16, 12)).astype(np.float32)
    rep.reshape(-1)[[3, 50]] = np.array([0x7FC00001, 0xFFA00002], np.uint32).view(np.float32)  # NaN payloads
    return {"rep": rep, "fsdp": rng.standard_normal((32, 6)).astype(np.float32)}


def _shardings():
    mesh = sharded_state.node_mesh(NODES)
    return {"rep": sharded_state.sharding(mesh, ()), "fsdp": sharded_state.sharding(mesh, (("data", "model"),))}


def save_job(base: str, job: str):
    """Step 1 protected; step 2 committed but its protection refused; the process then exits normally."""
    import jax
    import jaxckpt

    sh = _shardings()
    with jaxckpt.Checkpointer(_config(base, job, f"{HERE}:RefusingProtectionStore")) as ck:
        for step in (1, 2):
            ck.save(step, {k: jax.make_array_from_callback(h.shape, sh[k], lambda i, h=h: h[i])
                           for k, h in host_state(step).items()})
            ck.wait()
        prot = ck.engine.protection
        return {"latest": ck.latest_step(), "protected": prot.protected_steps(), "failed": sorted(prot.failures())}


def restore_job(base: str, job: str):
    import jax
    import jaxckpt

    sh = _shardings()
    target = {k: jax.ShapeDtypeStruct(h.shape, h.dtype, sharding=sh[k]) for k, h in host_state(0).items()}
    with jaxckpt.Checkpointer(_config(base, job, "shm")) as ck:
        latest = ck.latest_step()
        got = ck.restore(target)
        report = ck.last_restore_report.to_dict()
        restored = ck.latest_step()  # a restore that fell back forgets the steps it passed over
    want = host_state(restored)
    for k, h in want.items():
        for shard in got[k].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data).view(np.uint8), h[shard.index].view(np.uint8),
                                          err_msg=f"{k} step {restored}")
    return {"latest": latest, "restored": restored, "report": report}


def save_jobs(base: str, jobs: list) -> dict:
    """``save_job`` for each job in turn, in the same processes (a Checkpointer, agents and memory per job)."""
    return {job: save_job(base, job) for job in jobs}


JOBS = ["win", "fallback", "corrupt-after-loss", "tight"]  # saved by one launch for the tests below, one job each


@pytest.fixture(scope="module")
def saved() -> dict:
    """job -> every process's save_job result, for each of JOBS."""
    values = _run(save_jobs, JOBS)
    return {job: [v[job] for v in values] for job in JOBS}


def test_a_node_lost_while_the_newest_step_is_unprotected_restores_the_protected_one(saved):
    job = "win"
    out = saved[job]
    for r in out:
        assert r["latest"] == 2 and r["protected"] == [1] and r["failed"] == [2], r
    lost = f"{BASE}/{job}-node1"
    proto.stop_agent(lost, timeout_s=20)
    proto.kill_agent(lost, remove_memory=True)  # the whole node: its agent and every byte it held
    shutil.rmtree(lost, ignore_errors=True)
    out = expect_ok(launch(restore_job, nodes=NODES, procs_per_node=1, devices_per_proc=2, args=(BASE, job),
                           env=ENV, timeout=180))
    assert [r["latest"] for r in out] == [1, 1], out
    assert out[1]["report"]["bytes_by_kind"].get("rebuild", 0) > 0, out[1]["report"]


def save_more_job(base: str, job: str, step: int):
    """Restore what is there (a lost node's part rebuilt), then save ``step`` (its protection refused)."""
    import jax
    import jaxckpt

    sh = _shardings()
    target = {k: jax.ShapeDtypeStruct(h.shape, h.dtype, sharding=sh[k]) for k, h in host_state(0).items()}
    with jaxckpt.Checkpointer(_config(base, job, f"{HERE}:RefusingProtectionStore")) as ck:
        restored = ck.latest_step()
        ck.restore(target)
        ck.save(step, {k: jax.make_array_from_callback(h.shape, sh[k], lambda i, h=h: h[i])
                       for k, h in host_state(step).items()})
        ck.wait()
        return {"restored": restored, "latest": ck.latest_step(), "protected": ck.engine.protection.protected_steps()}


def _wipe(node_dir: str) -> None:
    proto.stop_agent(node_dir, timeout_s=20)
    proto.kill_agent(node_dir, remove_memory=True)  # the whole node: its agent and every byte it held
    shutil.rmtree(node_dir, ignore_errors=True)


def save_more_jobs(base: str, jobs: list, step: int) -> dict:
    """``save_more_job`` for each job in turn, in the same processes."""
    return {job: save_more_job(base, job, step) for job in jobs}


AFTER_LOSS = ["fallback", "corrupt-after-loss", "tight"]


@pytest.fixture(scope="module")
def resaved(saved) -> dict:
    """The jobs of AFTER_LOSS: step 1 protected and step 2 not, then node 1 lost (wiped), then one launch
    restores each (node 1's part rebuilt) and commits step 3, whose protection fails. job -> every process's
    save_more_job result."""
    for job in AFTER_LOSS:
        assert all(r["protected"] == [1] for r in saved[job]), "step 1 protected, step 2 not"
        _wipe(f"{BASE}/{job}-node1")
    values = _run(save_more_jobs, AFTER_LOSS, 3)
    return {job: [v[job] for v in values] for job in AFTER_LOSS}


def _run(fn, *args):
    return expect_ok(launch(fn, nodes=NODES, procs_per_node=1, devices_per_proc=2, args=(BASE, *args), env=ENV,
                            timeout=180))


def test_a_step_restored_by_rebuilding_stays_the_fallback_until_a_newer_step_is_protected(resaved):
    """Node 1 is lost after step 1 (protected); the job restores step 1 by rebuilding node 1's part and commits
    step 3, whose protection fails; a plain restart restores step 3; then node 1 is lost again. Step 1 (which no
    node holds whole, so it is not "protected") must still be there to rebuild: the restart may not drop it,
    since nothing newer is protected."""
    job = "fallback"
    lost = f"{BASE}/{job}-node1"
    out = resaved[job]
    assert [(r["restored"], r["latest"]) for r in out] == [(1, 3), (1, 3)], out
    assert [r["latest"] for r in _run(restore_job, job)] == [3, 3]  # a plain restart
    _wipe(lost)
    out = _run(restore_job, job)
    assert [r["latest"] for r in out] == [1, 1], out
    assert out[1]["report"]["bytes_by_kind"].get("rebuild", 0) > 0, out[1]["report"]


def test_a_corrupt_newest_step_after_a_node_loss_falls_back_to_the_rebuildable_step_in_the_same_restore(resaved):
    """Node 1 is lost after step 1 (protected); the job restores step 1 by rebuilding node 1's part and commits
    step 3, whose protection fails, so node 1 holds step 3 only. A bit of step 3 then flips in node 1's memory.
    The restart's restore must fall back to step 1 (rebuilt again) inside the same call, on both processes, bit
    for bit, and say so; before, node 1 held no older committed step and the job had to relaunch."""
    job = "corrupt-after-loss"
    lost = f"{BASE}/{job}-node1"
    out = resaved[job]
    assert [(r["restored"], r["latest"]) for r in out] == [(1, 3), (1, 3)], out
    flip_chunk(lost, 1, 3, "fsdp")
    out = _run(restore_job, job)
    assert [r["latest"] for r in out] == [3, 3], out  # what the engine offered before the restore
    for r in out:
        assert r["restored"] == 1, r
        skipped = r["report"]["skipped"]
        assert len(skipped) == 1 and "step 3: process 1 could not read it (ChecksumError" in skipped[0] and \
            "fell back to step 1" in skipped[0], skipped
    assert out[1]["report"]["bytes_by_kind"].get("rebuild", 0) > 0, out[1]["report"]


def tight_job(base: str, job: str):
    """Restart with a budget of two and a half of this process's snapshots (the held steps' size, measured by a
    first Checkpointer), restore, save step 4 and restore it; the steps held after, and what was logged."""
    import logging

    import jax
    import jaxckpt
    from jaxckpt.core import manifest as mf

    with jaxckpt.Checkpointer(_config(base, job, "shm")) as ck:
        store = ck.engine.store
        held = store.steps()
        size = max(proto.round_to_pages(mf.decode(store.manifest(s)).nbytes) for s in held)
        pinned = ck.engine.pinned_steps()
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("jaxckpt.core.slots").addHandler(handler)
    sh = _shardings()
    target = {k: jax.ShapeDtypeStruct(h.shape, h.dtype, sharding=sh[k]) for k, h in host_state(0).items()}
    config = dataclasses.replace(_config(base, job, "shm"), memory_budget_bytes=size * 5 // 2)
    with jaxckpt.Checkpointer(config) as ck:
        restored = ck.latest_step()
        ck.restore(target)
        ck.save(4, {k: jax.make_array_from_callback(h.shape, sh[k], lambda i, h=h: h[i])
                    for k, h in host_state(4).items()})
        ck.wait()
        got = ck.restore(target)
        after = ck.engine.store.steps()
    for k, h in host_state(4).items():
        for shard in got[k].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data).view(np.uint8), h[shard.index].view(np.uint8),
                                          err_msg=f"{k} step 4")
    return {"held": held, "pinned": pinned, "restored": restored, "after": after, "said": said}


def test_a_start_up_fallback_gives_way_to_a_save_that_would_not_fit_the_budget_otherwise(resaved):
    """Node 0 holds step 3 (kept, keep=1) and step 1, the fallback a restart keeps until a newer step is
    protected. With room for two and a half snapshots a process, step 4 fits only without step 1: before,
    the save was refused, so no newer step was ever protected to release step 1, and the job never saved
    again (jaxckpt chaos --profile long: 60 s of refused saves). Now step 1 is deleted for it, with a warning,
    and step 4 is saved, protected and restored bit for bit."""
    job = "tight"
    out = _run(tight_job, job)
    assert out[0]["held"] == [1, 3] and out[0]["pinned"] == [1], out[0]
    for r in out:
        assert r["restored"] == 3 and r["after"] == [4], r
    assert any("step 1, kept past retention only as the start-up fallback, is deleted to make room" in m and
               "step 4 of process 0" in m for m in out[0]["said"]), out[0]["said"]
