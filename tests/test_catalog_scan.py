"""The restore right after ``Checkpointer()`` takes the agents' answers of the start-up scan instead of asking
every agent again (jaxckpt.core.catalog: a round of requests to every node's agent, 6-180 ms measured on the
relaunch path of ``bench cluster``); later restores, and a restore whose scanned holders cannot open the step,
ask anew. Real processes on two simulated nodes, each with its real node agent."""
import os
import shutil
import uuid

import numpy as np
import pytest

from jaxckpt.testing import expect_ok, launch, node_info, remove_agents

BASE = f"/dev/shm/jaxckpt-scan-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module", autouse=True)
def base_dir():
    os.makedirs(BASE, mode=0o700)
    yield BASE
    remove_agents(BASE)
    shutil.rmtree(BASE, ignore_errors=True)


# ---------------------------------------------------------------------------- runs in the launched processes
def _config(base: str, job: str, protection: str = "none"):
    import jaxckpt

    return jaxckpt.Config(store="shm", job_id=job, shm_dir=f"{base}/{job}-node{node_info().node}", keep=2,
                          agent_dirs=f"{base}/{job}-node*", commit_timeout_s=60.0, peer_timeout_s=20.0,
                          protection=protection)


def _state(step: int):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((2, 2), ("data", "model"))
    rng = np.random.default_rng([3, step])
    host = {"w": rng.standard_normal((16, 8)).astype(np.float32), "r": rng.integers(0, 99, (6, 4)).astype(np.int32)}
    specs = {"w": P("data", "model"), "r": P()}
    return host, {k: jax.make_array_from_callback(h.shape, NamedSharding(mesh, specs[k]), lambda i, h=h: h[i])
                  for k, h in host.items()}


def _restored_equal(ck, step: int, resharded: bool = False) -> None:
    """Restore ``step`` onto the saved shardings (this node's memory holds all of it), or with ``resharded``
    onto ones that need the other node's bytes; check every local shard bit for bit and what the report says."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    host, state = _state(step)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    if resharded:  # w's rows now split over 'model': half of them were saved by the other node's process
        w = state["w"]
        target["w"] = jax.ShapeDtypeStruct(w.shape, w.dtype,
                                           sharding=NamedSharding(w.sharding.mesh, P("model", "data")))
    got = ck.restore(target, step=step)
    for k, v in got.items():
        assert v.sharding == target[k].sharding, k
        for shard in v.addressable_shards:
            assert np.asarray(shard.data).tobytes() == host[k][shard.index].tobytes(), (step, k)
    report = ck.last_restore_report
    if resharded:  # planned from this node's manifest, which did not cover it: opened again, every manifest
        assert report.widened.startswith("PlanError: w: step "), report.widened
        assert report.manifests_by_kind == {"local": 1, "remote": 1}, report.manifests_by_kind
        assert report.bytes_by_kind.get("remote", 0) > 0, report.bytes_by_kind
    else:  # only its own manifest opened: no other node asked anything
        assert report.widened == "" and report.manifests_by_kind == {"local": 1}, report
        assert set(report.bytes_by_kind) == {"local"}, report.bytes_by_kind


def _count_asks(ck) -> dict:
    """Count each agent holder's answers to "what do you hold" (the real call runs)."""
    asked = {"n": 0}
    for h in ck.engine.catalog.holders():
        if h.kind in ("node", "remote"):
            held = h.held

            def counted(held=held):
                asked["n"] += 1
                return held()
            h.held = counted
    return asked


def save_job(base: str, job: str, protection: str = "none") -> dict:
    import jaxckpt

    with jaxckpt.Checkpointer(_config(base, job, protection)) as ck:
        for step in (1, 2):
            ck.save(step, _state(step)[1])
        ck.wait()
        prot = ck.engine.protection
        return {"latest": ck.latest_step(), "protected": prot.protected_steps() if prot is not None else []}


def restart_job(base: str, job: str, fresh_s: float | None = None, protection: str = "none",
                resharded: bool = True) -> dict:
    import jaxckpt
    from jax.experimental import multihost_utils
    from jaxckpt.core import catalog

    if fresh_s is not None:
        catalog.SCAN_FRESH_S = fresh_s
    with jaxckpt.Checkpointer(_config(base, job, protection)) as ck:  # its start-up scan asks every agent
        prot = ck.engine.protection
        asked = _count_asks(ck)
        step = ck.latest_step()
        _restored_equal(ck, step, resharded)
        first = asked["n"]
        _restored_equal(ck, step, resharded)
        later = asked["n"] - first
        multihost_utils.sync_global_devices("restored")  # nobody stops serving while others still read
        protected = prot.protected_steps() if prot is not None else []
    return {"step": step, "first": first, "later": later, "protected": protected}


def gone_job(base: str, job: str) -> dict:
    """Every process deletes its snapshot of step 2 after the start-up scan listed it: the restore of step 2 fails
    at the holders the scan named, asks every agent anew, and says step 2 cannot be restored."""
    import jaxckpt
    from jax.experimental import multihost_utils
    from jaxckpt.errors import StepNotFoundError

    with jaxckpt.Checkpointer(_config(base, job)) as ck:
        asked = _count_asks(ck)
        ck.engine.store.delete(2)
        multihost_utils.sync_global_devices("deleted")
        try:
            _restored_equal(ck, 2)
            error = ""
        except StepNotFoundError as e:
            error = f"{type(e).__name__}: {e}"
        asked_then = asked["n"]
        _restored_equal(ck, 1)  # what is still held restores
        multihost_utils.sync_global_devices("tried")
    return {"error": error, "asked": asked_then}


# --------------------------------------------------------------------------------------------- the tests
def _launch(fn, job, *args):
    return expect_ok(launch(fn, nodes=2, procs_per_node=1, devices_per_proc=2, args=(BASE, job, *args), timeout=180))


def test_the_restore_after_a_restart_takes_the_start_up_scan_and_later_ones_ask_again():
    """Restores that need the other node's bytes: the first (near, then every manifest) asks no agent, a later
    one asks its own node's agent (the near open) and then both agents once each."""
    assert [v["latest"] for v in _launch(save_job, "restart")] == [2, 2]
    for v in _launch(restart_job, "restart"):
        assert v["step"] == 2
        assert v["first"] == 0, v  # the scan of Checkpointer() answered it
        assert v["later"] == 3, v  # its own node's agent for the near open, then both agents again, once each
    for v in _launch(restart_job, "restart", 0.0):  # a scan older than SCAN_FRESH_S is not taken
        assert v["first"] == 3 and v["later"] == 3, v


def test_a_restore_of_the_saved_layout_asks_no_other_node():
    """Restores onto the shardings the job saved (whole replicas: each node holds all it restores) open only
    their own snapshot: the scan's answer for this node stands in for asking its agent, within SCAN_FRESH_S."""
    assert [v["latest"] for v in _launch(save_job, "near")] == [2, 2]
    for v in _launch(restart_job, "near", None, "none", False):
        assert v["step"] == 2 and v["first"] == 0 and v["later"] == 0, v
    for v in _launch(restart_job, "near", 0.0, "none", False):  # asks its own node's agent only, once a restore
        assert v["first"] == 1 and v["later"] == 1, v


def test_protection_lists_from_the_agents_answers_of_the_same_restore():
    """With protection, the rebuild holder lists what can be rebuilt from the agents' answers the restore has
    (Holder.held_given: the start-up scan's for the first restore, its own listing's for a later one), not by
    asking every agent a second time."""
    assert all(v["latest"] == 2 and 2 in v["protected"] for v in _launch(save_job, "protected", "replica"))
    for v in _launch(restart_job, "protected", None, "replica"):
        assert v["step"] == 2
        assert v["first"] == 0, v  # the scan of Checkpointer() answered the catalog and the rebuild holder
        # its own node's agent for the near open; then each agent once: by the catalog, the rebuild holder
        # listing from that
        assert v["later"] == 3, v
        assert 2 in v["protected"], v


def test_a_restore_the_scanned_holders_cannot_open_asks_anew():
    assert [v["latest"] for v in _launch(save_job, "gone")] == [2, 2]
    for v in _launch(gone_job, "gone"):
        assert v["error"].startswith("StepNotFoundError: step 2"), v
        assert v["asked"] >= 2, v  # not the scan's word: every agent asked again
