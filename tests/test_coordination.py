"""The one coordination wrapper (jaxckpt.core.collective): results, one error everywhere, bounded keys.

Unit tests run N "processes" as threads over one FileCoordinator directory (each key a file: what is left is
what the directory lists); the multi-process tests run real JAX processes over the coordination service and
list its keys under the job's prefix.
"""
import os
import threading
import time

import numpy as np
import pytest

from jaxckpt.core import slow_wait
from jaxckpt.core.collective import MAX_UNACKED, Collective, instance_namespace
from jaxckpt.core.coordination import LocalCoordinator
from jaxckpt.errors import CommitError, CoordinationError
from jaxckpt.testing import expect_ok, launch, node_info
from jaxckpt.tools.filecoord import FileCoordinator


# ------------------------------------------------------------------------------------------ thread helpers
def _run(n: int, directory: str, body, timeout_s: float = 2.0, join_s: float = 60.0) -> list:
    """``body(collective)`` in ``n`` threads, one per process; each result or the exception it raised."""
    out: list = [None] * n
    colls = [Collective(FileCoordinator(directory, p, n), "jaxckpt/t/0", timeout_s) for p in range(n)]

    def one(p):
        try:
            out[p] = body(colls[p])
        except BaseException as e:  # noqa: BLE001 - compared by the test
            out[p] = e
    threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
        assert not t.is_alive(), f"a process thread did not finish within {join_s}s"
    return out, colls


def _outcomes(rounds, run) -> dict:
    """Per round of ``rounds``: what ``run(round)`` returned, or the message of the CoordinationError it raised."""
    got = {}
    for r in rounds:
        try:
            got[r] = run(r)
        except CoordinationError as e:
            got[r] = str(e)
    return got


def _keys(directory: str) -> list[str]:
    return sorted(f for f in os.listdir(directory) if not f.endswith(".tmp"))


# ---------------------------------------------------------------------------------------------- unit tests
def test_rounds_give_every_process_the_same_result_and_leave_no_key(tmp_path):
    n, rounds = 3, 50

    def body(c):
        ch, got = c.channel("main"), []
        for r in range(rounds):
            got.append(ch.all_gather("gather", [c.process_index, r]))
            got.append(ch.reduce("sum", c.process_index * r, sum))
            got.append(ch.broadcast("bcast", f"from 0 at {r}" if c.process_index == 0 else None))
            ch.barrier("barrier")
        live = len(_keys(str(tmp_path)))
        c.close()
        return got, live

    out, colls = _run(n, str(tmp_path), body)
    for p in range(n):
        got, live = out[p]
        assert got == out[0][0], f"process {p} got other results"
        assert live <= 2 * n, f"{live} keys live after {rounds * 4} rounds"
    want = []
    for r in range(rounds):
        want += [[[q, r] for q in range(n)], sum(q * r for q in range(n)), f"from 0 at {r}"]
    assert out[0][0] == want
    assert _keys(str(tmp_path)) == [], "keys left after close"
    # kv operations per round: the leader O(processes), every other process 2 (a set and a blocking get); the
    # close: its one-way round, and the key that says the process is closing, set and deleted
    per_round = 4 * rounds + 1
    lead, follow = colls[0].stats(), colls[1].stats()
    assert lead["rounds"] == follow["rounds"] == per_round
    assert follow["sets"] == per_round + 1 and follow["gets"] == 4 * rounds and follow["deletes"] == 1
    assert lead["gets"] == (n - 1) * per_round and lead["sets"] == 4 * rounds + 1
    assert lead["deletes"] <= (n - 1) * per_round + 4 * rounds + 1


def test_an_error_in_one_process_is_raised_on_every_process_naming_it(tmp_path):
    n = 4

    def body(c):
        ch = c.channel("commit")
        ch.barrier("warm up")

        def mine():
            if c.process_index == 2:
                raise ValueError("disk on fire")
            return c.process_index
        try:
            ch.reduce("boom", mine, sum)
        except CoordinationError as e:
            err = e
        else:
            err = None
        after = ch.all_gather("after", c.process_index)  # the channel goes on
        c.close()
        return err, after

    out, _ = _run(n, str(tmp_path), body)
    messages = {str(err) for err, _ in out}
    assert len(messages) == 1, messages  # the same error on every process
    err = out[0][0]
    assert isinstance(err, CoordinationError) and isinstance(err, CommitError)
    assert err.processes == (2,) and err.round_name == "boom" and err.round_number == 1
    assert "round 'boom' #1 of channel 'commit'" in str(err) and "process 2 raised ValueError: disk on fire" in str(err)
    assert all(e.errors == {2: "ValueError"} for e, _ in out)  # what it raised, by class name, everywhere ...
    assert isinstance(out[2][0].__cause__, ValueError) and out[0][0].__cause__ is None  # ... and itself there
    assert all(after == list(range(n)) for _, after in out)
    assert _keys(str(tmp_path)) == []


def test_a_process_that_does_not_arrive_fails_the_round_everywhere_within_the_time_out(tmp_path):
    n, timeout = 3, 0.5

    def body(c):
        ch = c.channel("main")
        t0 = time.monotonic()
        if c.process_index == 1:
            time.sleep(4 * timeout)  # late: past the leader's time-out
        try:
            ch.all_gather("late", c.process_index)
            err = None
        except CoordinationError as e:
            err = e
        took = time.monotonic() - t0
        ch.barrier("next", timeout_s=10)  # the late one catches up; its late key goes once it is seen again
        c.close()
        return err, took

    out, _ = _run(n, str(tmp_path), body, timeout_s=timeout)
    assert len({str(e) for e, _ in out}) == 1, [str(e) for e, _ in out]
    err = out[0][0]
    assert err.processes == (1,) and "process 1 did not arrive within 0.5s" in str(err) and "'late' #0" in str(err)
    assert out[0][1] < 3 * timeout and out[2][1] < 3 * timeout, "the round's time-out bounds the wait"
    assert _keys(str(tmp_path)) == []


def test_a_leader_that_does_not_arrive_is_named_by_the_followers(tmp_path):
    c = Collective(FileCoordinator(str(tmp_path), 1, 2), "jaxckpt/t/0", 0.2)
    with pytest.raises(CoordinationError, match=r"round 'x' #0 of channel 'main' .*: process 0 \(the leader\) "
                                                r"published no result within 0.4s") as e:
        c.channel("main").barrier("x")
    assert e.value.processes == (0,)


def test_processes_in_different_rounds_fail_instead_of_mixing_results(tmp_path):
    def body(c):
        return c.channel("main").all_gather("commit 5" if c.process_index == 0 else "commit 6", 1)

    out, _ = _run(2, str(tmp_path), body)
    assert all(isinstance(e, CoordinationError) and "process 1 is in round 'commit 6' instead" in str(e) for e in out)


def test_a_process_that_skips_a_numbered_round_fails_that_round_only(tmp_path):
    """Commit rounds are numbered by step: a process whose save was refused before it reported the step (so it
    never joins that round) costs that step, not every later one. The leader learns it skipped the round from
    where it waits (a later round) and fails the round then, not at the time-out."""
    n, timeout = 3, 10.0

    def body(c):
        ch, got = c.channel("commit"), {}
        for step in (1, 2, 3, 4, 5):
            if step == 3 and c.process_index == 2:
                continue
            try:
                got[step] = ch.reduce(f"commit {step}", True, all, number=step, timeout_s=timeout)
            except CoordinationError as e:
                got[step] = str(e)
        c.close()
        return got

    out, _ = _run(n, str(tmp_path), body, timeout_s=timeout)
    for p in range(n):
        assert [out[p][s] for s in (1, 2, 4, 5)] == [True] * 4, out[p]
    assert out[0][3] == out[1][3] and 3 not in out[2]
    assert out[0][3].endswith("process 2 skipped it: it waits in round 'commit 4' #4 already (the processes ran "
                              "different rounds)"), out[0][3]
    assert _keys(str(tmp_path)) == []
    with pytest.raises(ValueError, match="round numbers must grow"):
        Collective(LocalCoordinator(), "jaxckpt/t/0", 1.0).channel("commit").reduce("x", 1, sum, number=-1)


def test_processes_whose_rounds_interleave_fail_each_round_without_waiting_out_the_time_out(tmp_path, monkeypatch):
    """Process 0 commits steps 2, 4, 6, 8 and process 1 steps 3, 5, 7 (a user's processes saving different
    steps), then both step 9. Each waits in its round, says so, and sees the other waiting in a later round: every
    round of one process fails, on both, naming the round the other is in, long before the 30 s time-out (the
    messages say it: a round that ran out says "did not arrive" or "published no result"); round 9 commits,
    nothing is left after close, and the waits' extra operations are counted apart ("slow")."""
    steps = {0: (2, 4, 6, 8, 9), 1: (3, 5, 7, 9)}
    monkeypatch.setattr(slow_wait, "SLOW_WAIT_S", 0.2)  # a shorter grace: the same protocol, sooner

    def body(c):
        ch, got = c.channel("commit"), {}
        for step in steps[c.process_index]:
            try:
                got[step] = ch.reduce(f"commit {step}", True, all, number=step)
            except CoordinationError as e:
                got[step] = str(e)
        c.close()
        return got, c.stats()

    out, _ = _run(2, str(tmp_path), body, timeout_s=30.0, join_s=60.0)
    (lead, lead_stats), (follow, follow_stats) = out
    for step in (2, 4, 6, 8):
        assert lead[step].endswith(f"process 1 skipped it: it waits in round 'commit {step + 1}' #{step + 1} already "
                                   f"(the processes ran different rounds)"), (step, lead[step])
    for step in (3, 5, 7):
        assert follow[step].endswith(f"process 0 (the leader) skipped it: it waits in round 'commit {step + 1}' "
                                     f"#{step + 1} already (the processes ran different rounds)"), (step, follow[step])
    assert lead[9] is True and follow[9] is True
    assert lead_stats["slow"] > 0 and follow_stats["slow"] > 0
    # a contribution per round, the close's and its closing key: the waits' own sets are apart
    assert follow_stats["sets"] == 6
    assert _keys(str(tmp_path)) == []


@pytest.mark.parametrize("extra", [0, 1])
def test_a_round_the_awaited_process_closed_without_fails_without_waiting_out_the_time_out(tmp_path, monkeypatch,
                                                                                          extra):
    """Both processes commit steps 1 and 2, then process ``extra`` commits step 3 alone (a user's last save on one
    process only) while the other closes (a barrier of its own first, as a Checkpointer with peers does). The
    round of step 3 fails on both, naming the process that is closing, long before the 30 s time-out (a round
    that ran out says "did not arrive" or "published no result"); both close, and no key is left."""
    monkeypatch.setattr(slow_wait, "SLOW_WAIT_S", 0.2)
    gone = 1 - extra

    def body(c):
        ch = c.channel("commit")
        got = _outcomes((1, 2, 3) if c.process_index == extra else (1, 2),
                        lambda step: ch.reduce(f"commit {step}", True, all, number=step))
        c.closing()
        c.channel("main").barrier("close", timeout_s=30.0)
        c.close()
        return got, c.is_closing

    out, _ = _run(2, str(tmp_path), body, timeout_s=30.0, join_s=60.0)
    (mine, closing), (theirs, _) = out[extra], out[gone]
    assert mine[1] is True and mine[2] is True and theirs == {1: True, 2: True} and closing
    who = "process 0 (the leader)" if gone == 0 else "process 1"
    assert mine[3].startswith("round 'commit 3' #3 of channel 'commit'"), mine[3]
    assert mine[3].endswith(f"{who} is closing: it will not run this round (the processes ran different rounds)"), \
        mine[3]
    assert _keys(str(tmp_path)) == []


@pytest.mark.parametrize("early", [0, 1])
def test_a_close_after_different_rounds_ends_without_waiting_out_the_time_out(tmp_path, monkeypatch, early):
    """Both processes run rounds 'save 1' and 'save 2' of the main channel; process ``early`` then closes as a
    Checkpointer does (closing, its close barrier, the channels' last rounds) while the other runs 'save 3'
    (a user's save on one process only) and closes after it. Both are closing in the close barrier, so a closing
    key says nothing there: the barrier of the process that closes last fails at once because the other closed
    (its closed key, or the leader waiting in its last round), where it waited out the 30 s time-out (twice that
    for a follower) and its close with it. Every round fails saying so (a round that ran out says "did not
    arrive" or "published no result"); the one key left says that the process whose close barrier failed closed."""
    monkeypatch.setattr(slow_wait, "SLOW_WAIT_S", 0.2)
    late = 1 - early

    def body(c):
        ch = c.channel("main")
        got = _outcomes((1, 2, 3) if c.process_index == late else (1, 2),
                        lambda r: ch.all_gather(f"save {r}", c.process_index))
        c.closing()
        got.update(_outcomes(["close"], lambda _: ch.barrier("close", timeout_s=30.0) or True))
        c.close()
        return got

    out, _ = _run(2, str(tmp_path), body, timeout_s=30.0, join_s=50.0)
    first, last = out[early], out[late]
    assert first[1] == last[1] == [0, 1] and first[2] == last[2] == [0, 1]
    for said in (last[3], first["close"], last["close"]):
        assert isinstance(said, str) and said.endswith("(the processes ran different rounds)"), said
    who = "process 0 (the leader)" if early == 0 else "process 1"
    assert last["close"].startswith("round 'close' #3 of channel 'main'"), last["close"]
    assert f"{who} is closing: it will not run this round" in last["close"] or \
        f"{who} has closed: it will not run this round" in last["close"], last["close"]
    assert _keys(str(tmp_path)) == ["jaxckpt%2Ft%2F0%2Fpub%2Fclosed%2F1"]


def test_channels_are_independent_and_numbered_on_their_own(tmp_path):
    def body(c):
        a, b = c.channel("commit"), c.channel("protect")
        res = {}

        def other():
            res["protect"] = [b.reduce("p", c.process_index, max) for _ in range(20)]
        t = threading.Thread(target=other)
        t.start()
        res["commit"] = [a.reduce("c", c.process_index, min) for _ in range(30)]
        t.join(30)
        assert not t.is_alive()
        c.close()
        return res, a.rounds, b.rounds

    out, _ = _run(3, str(tmp_path), body)
    for res, na, nb in out:
        assert res == {"commit": [0] * 30, "protect": [2] * 20} and (na, nb) == (31, 21)
    assert _keys(str(tmp_path)) == []


def test_a_result_never_acknowledged_is_dropped_after_a_bounded_number_of_rounds(tmp_path):
    """A follower that died: the leader's rounds fail, and what it would have read does not pile up."""
    lead = Collective(FileCoordinator(str(tmp_path), 0, 2), "jaxckpt/t/0", 0.01)
    ch = lead.channel("main")
    for r in range(3 * MAX_UNACKED):
        with pytest.raises(CoordinationError, match="process 1 did not arrive"):
            ch.barrier("alone")
    assert len(_keys(str(tmp_path))) <= MAX_UNACKED + 1


def test_close_does_not_wait_for_a_follower_that_died(tmp_path):
    """A follower that missed a round on one channel (it died) is not waited for when any channel closes."""
    lead = Collective(FileCoordinator(str(tmp_path), 0, 2), "jaxckpt/t/0", 0.2)
    follow = Collective(FileCoordinator(str(tmp_path), 1, 2), "jaxckpt/t/0", 0.2)
    t = threading.Thread(target=lambda: follow.channel("main").barrier("start", timeout_s=30))
    t.start()
    lead.channel("main").barrier("start", timeout_s=30)
    t.join(30)
    with pytest.raises(CoordinationError, match="process 1 did not arrive"):  # then it died
        lead.channel("commit").reduce("commit 1", True, all)
    t0 = time.monotonic()
    lead.close(timeout_s=30)
    assert time.monotonic() - t0 < 10, "close waited for a process known to be gone"
    # one key says it closed without its follower (which may yet wait for it, as far as it knows): nothing else
    assert _keys(str(tmp_path)) == ["jaxckpt%2Ft%2F0%2Fpub%2Fclosed%2F0"], "close left keys behind"


def test_one_process_touches_no_key_and_raises_its_own_error():
    coord = LocalCoordinator()
    c = Collective(coord, "jaxckpt/t/0", 1.0)
    ch = c.channel("main")
    assert ch.all_gather("a", 5) == [5] and ch.reduce("b", 3, sum) == 3 and ch.broadcast("c", "x") == "x"
    ch.barrier("d")
    assert ch.gather("e", 1) == [1]
    with pytest.raises(CoordinationError, match=r"round 'f' #5 .*process 0 raised KeyError"):
        ch.reduce("f", lambda: {}["k"], sum)
    with pytest.raises(CoordinationError, match=r"process 0 raised ZeroDivisionError: division by zero while "
                                                r"reducing"):
        ch.reduce("g", 0, lambda xs: 1 / xs[0])
    c.close()
    assert c.stats() == {"sets": 0, "gets": 0, "try_gets": 0, "deletes": 0, "slow": 0, "rounds": 7}
    assert coord.keys() == []


def test_published_state_and_instance_namespaces(tmp_path):
    a, b = instance_namespace("same-job"), instance_namespace("same-job")
    assert a != b and a.startswith("jaxckpt/same-job/") and b.startswith("jaxckpt/same-job/")
    assert instance_namespace("other-job") == "jaxckpt/other-job/0"
    w = Collective(FileCoordinator(str(tmp_path), 0, 2), "jaxckpt/t/0", 1.0)
    r = Collective(FileCoordinator(str(tmp_path), 1, 2), "jaxckpt/t/0", 1.0)
    assert r.peek("agent-of/0/0") is None
    w.publish("agent-of/0/0", [0, {"address": "tcp://x", "token": b"\x00\x01"}])
    assert r.peek("agent-of/0/0") == [0, {"address": "tcp://x", "token": b"\x00\x01"}]
    w.unpublish("agent-of/0/0")
    w.unpublish("agent-of/0/0")  # not set: nothing to do
    assert r.peek("agent-of/0/0") is None and _keys(str(tmp_path)) == []


def test_a_versioned_value_lives_in_a_ring_of_two_keys(tmp_path):
    """A restarted agent's address (the catalog's agent-of): the newest version always readable, two keys at most."""
    w = Collective(FileCoordinator(str(tmp_path), 0, 2), "jaxckpt/t/0", 1.0)
    r = Collective(FileCoordinator(str(tmp_path), 1, 2), "jaxckpt/t/0", 1.0)
    assert r.peek_versions("agent-of/0") == []
    seen = 0
    for k in range(25):
        w.publish_version("agent-of/0", k, f"tcp://host:{k}")
        assert len(_keys(str(tmp_path))) <= 2
        if k % 7 == 3:  # a reader that looks now and then gets what is newer than it saw, the newest last
            got = r.peek_versions("agent-of/0", seen)
            assert got[-1] == (k, f"tcp://host:{k}") and all(v >= seen for v, _ in got) and len(got) <= 2, got
            seen = k + 1
    assert seen == 25 and r.peek_versions("agent-of/0", seen) == []  # nothing newer than it read
    assert r.peek_versions("agent-of/0", 20) == [(23, "tcp://host:23"), (24, "tcp://host:24")]  # fell behind
    w.unpublish_versions("agent-of/0")
    assert _keys(str(tmp_path)) == []


# ------------------------------------------------------------------------------ real JAX processes (launch)
def _small_state(step: int):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    host = (np.arange(64, dtype=np.float32) + step).reshape(8, 8)
    x = jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("d")), lambda idx: host[idx])
    return {"x": x, "step": step}, host


def _job_keys(prefix: str) -> list[str]:
    from jax._src import distributed

    return sorted(k for k, _ in distributed.global_state.client.key_value_dir_get_bytes(prefix))


def long_run_job(job_id: str, steps: int):
    """Save every step; the coordination keys under the job's prefix after ``steps`` and ``2 * steps``."""
    import jax
    from jax.experimental import multihost_utils

    import jaxckpt

    cfg = jaxckpt.Config(job_id=job_id, keep=1, commit_timeout_s=60.0)
    out = {}
    with jaxckpt.Checkpointer(cfg) as ck:
        coll = ck.engine.collective
        for phase, last in (("first", steps), ("second", 2 * steps)):
            before = coll.stats()
            for step in range(last - steps + 1, last + 1):
                state, _ = _small_state(step)
                ck.save(step, state)
            ck.wait()
            multihost_utils.sync_global_devices(f"{phase} saved")  # every process is done with its rounds
            after = coll.stats()
            out[phase] = {"keys": _job_keys(f"jaxckpt/{job_id}/"), "latest": ck.latest_step(),
                          "ops": {k: after[k] - before[k] for k in after}}
            multihost_utils.sync_global_devices(f"{phase} listed")
        state, host = _small_state(0)
        restored = ck.restore(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                           {"x": state["x"]}) | {"step": 0})
        got = np.asarray(multihost_utils.process_allgather(restored["x"], tiled=True))
        out["restored_ok"] = bool(np.array_equal(got.view(np.uint32), (host + 2 * steps).view(np.uint32)))
    multihost_utils.sync_global_devices("closed")
    out["after_close"] = _job_keys(f"jaxckpt/{job_id}/")
    return out


LONG_RUN = (4, 300)  # processes, steps of each phase
ROUND_TIMEOUT_S = 3.0


def long_run_and_failing_round_jobs(job_id: str, steps: int, timeout_s: float):
    """Both jobs in the same launched processes, one after the other: the long run (its own Checkpointer and key
    prefix) then the failing rounds (their own Collective and namespace)."""
    return {"long": long_run_job(job_id, steps), "fail": failing_round_job(timeout_s)}


@pytest.fixture(scope="module")
def four_process_jobs() -> dict:
    """The long run and the failing rounds on 4 processes, in one launch: job -> every process's result."""
    values = expect_ok(launch(long_run_and_failing_round_jobs, nodes=LONG_RUN[0], procs_per_node=1,
                              devices_per_proc=1, args=("longrun", LONG_RUN[1], ROUND_TIMEOUT_S), timeout=300))
    return {job: [v[job] for v in values] for job in ("long", "fail")}


def test_live_coordination_keys_do_not_grow_with_the_step_count(four_process_jobs):
    n, steps = LONG_RUN
    values = four_process_jobs["long"]
    first, second = values[0]["first"], values[0]["second"]
    assert first["latest"] == steps and second["latest"] == 2 * steps
    assert len(first["keys"]) <= 2 * n, first["keys"]  # a small constant x processes ...
    assert len(second["keys"]) == len(first["keys"]), (first["keys"], second["keys"])  # ... whatever the steps
    assert all(k.startswith("jaxckpt/longrun/") for k in first["keys"])
    assert all(v["restored_ok"] for v in values)
    assert values[0]["after_close"] == [], values[0]["after_close"]
    # per step: the leader O(processes) kv operations, every other process O(1)
    lead, follow = values[0]["second"]["ops"], values[1]["second"]["ops"]
    assert lead["rounds"] == follow["rounds"] == steps  # one commit round per step
    lead_ops = (lead["sets"] + lead["gets"] + lead["try_gets"] + lead["deletes"]) / steps
    follow_ops = (follow["sets"] + follow["gets"] + follow["try_gets"] + follow["deletes"]) / steps
    assert lead_ops <= 2 * n + 1 and follow_ops <= 2, (lead, follow)


def two_instances_job(job_id: str, directory: str):
    """Two Checkpointers of one job_id at once (and a TieredCheckpointManager beside them, persisting to
    ``directory``), then one more after the first's close(): bit-for-bit restores."""
    import jax
    from jax.experimental import multihost_utils

    import jaxckpt
    from jaxckpt.orbax import TieredCheckpointManager

    cfg = jaxckpt.Config(job_id=job_id, commit_timeout_s=60.0)

    def check(ck, step, host):
        state, _ = _small_state(0)
        target = {"x": jax.ShapeDtypeStruct(state["x"].shape, state["x"].dtype, sharding=state["x"].sharding),
                  "step": 0}
        got = ck.restore(target)
        full = np.asarray(multihost_utils.process_allgather(got["x"], tiled=True))
        return bool(np.array_equal(full.view(np.uint32), host.view(np.uint32))) and got["step"] == step

    ok = []
    a, b = jaxckpt.Checkpointer(cfg), jaxckpt.Checkpointer(cfg)
    tiered = TieredCheckpointManager(directory, config=cfg, memory_interval=1, persistent_interval=2)
    for step in (1, 2):
        a.save(step, _small_state(step)[0])
        b.save(step, _small_state(100 + step)[0] | {"step": step})
        tiered.save(step, _small_state(200 + step)[0] | {"step": step})
    a.wait()
    b.wait()
    tiered.wait_until_finished()
    ok += [check(a, 2, _small_state(2)[1]), check(b, 2, _small_state(102)[1])]
    state, _ = _small_state(0)
    target = {"x": jax.ShapeDtypeStruct(state["x"].shape, state["x"].dtype, sharding=state["x"].sharding), "step": 0}
    for step, source in ((2, "memory"), (2, "persistent")):
        if source == "persistent":
            tiered.close()
            tiered = TieredCheckpointManager(directory, config=cfg, memory_interval=1, persistent_interval=2)
        r = tiered.restore(step, target=target)
        full = np.asarray(multihost_utils.process_allgather(r.state["x"], tiled=True))
        ok.append(r.source == source and bool(np.array_equal(full.view(np.uint32),
                                                             _small_state(202)[1].view(np.uint32))))
    tiered.close()
    a.close()
    c = jaxckpt.Checkpointer(cfg)  # after a's close: its own keys again
    c.save(7, _small_state(7)[0])
    b.save(3, _small_state(103)[0] | {"step": 3})
    c.wait()
    b.wait()
    ok += [check(c, 7, _small_state(7)[1]), check(b, 3, _small_state(103)[1])]
    spaces = [a.engine.collective.namespace, b.engine.collective.namespace, c.engine.collective.namespace]
    c.close()
    b.close()
    return {"ok": ok, "spaces": spaces}


def test_two_checkpointers_of_one_job_and_one_after_close_keep_their_own_keys(tmp_path):
    values = expect_ok(launch(two_instances_job, nodes=2, procs_per_node=1, devices_per_proc=1,
                              args=("twice", str(tmp_path / "tiered")), timeout=180))
    for v in values:
        assert v["ok"] == [True] * 6, v
        assert len(set(v["spaces"])) == 3 and v["spaces"] == values[0]["spaces"], v


def failing_round_job(timeout_s: float):
    """A Collective over the JAX coordination service: process 2 raises in round 'boom', process 3 never
    arrives in round 'late'."""
    import jax

    from jaxckpt.jax.coordination import JaxCoordinator

    p = node_info().process_id
    coll = Collective(JaxCoordinator(), "jaxckpt/fail/0", timeout_s)
    ch = coll.channel("main")
    assert ch.all_gather("hello", p) == list(range(jax.process_count()))

    def mine():
        if p == 2:
            raise RuntimeError(f"process {p} cannot go on")
        return p
    out = {}
    try:
        ch.reduce("boom", mine, sum)
    except CoordinationError as e:
        out["boom"] = [str(e), list(e.processes), e.round_name, e.round_number, e.errors]
    t0 = time.monotonic()
    if p != 3:
        try:
            ch.barrier("late")
        except CoordinationError as e:
            out["late"] = [str(e), list(e.processes)]
    out["late_took"] = time.monotonic() - t0
    return out


def test_a_process_that_raises_makes_every_process_raise_the_same_error(four_process_jobs):
    timeout = ROUND_TIMEOUT_S
    values = four_process_jobs["fail"]
    boom = {tuple(map(str, v["boom"])) for v in values}
    assert len(boom) == 1, boom  # the same error on every process
    message, processes, name, number, errors = values[0]["boom"]
    assert processes == [2] and name == "boom" and number == 1 and {int(q): k for q, k in errors.items()} == {2: "RuntimeError"}
    assert "round 'boom' #1 of channel 'main' (jaxckpt/fail/0): process 2 raised RuntimeError: process 2 cannot " \
           "go on" == message
    late = {v["late"][0] for v in values[:3]}
    assert len(late) == 1 and "process 3 did not arrive within 3s" in late.pop()
    assert all(v["late"][1] == [3] for v in values[:3])
    assert all(v["late_took"] < 2 * timeout + 5 for v in values[:3]), "raised within the round's time-out"


def test_a_round_answered_early_costs_a_follower_one_read_and_leaves_no_key(tmp_path):
    """The leader settles rounds ahead of its own thread (protection's skips): followers that come later read
    the answer without contributing, one already waiting in the round gets it and takes its key back, the
    leader runs none of those rounds, and nothing is left after close."""
    import urllib.parse
    n, steps, raced = 3, 30, 7
    early = {s for s in range(1, steps + 1) if s % 3}  # the leader answers these; it leads the others
    answered, raced_answered = threading.Event(), threading.Event()

    def answer(c):
        ch = c.channel("protect")
        for s in sorted(early - {raced}):
            ch.answer_early(f"decide {s}", False, number=2 * s)
        answered.set()
        waiting = os.path.join(str(tmp_path), urllib.parse.quote(f"jaxckpt/t/0/protect/{2 * raced}/1", safe=""))
        deadline = time.monotonic() + 30
        while not os.path.exists(waiting) and time.monotonic() < deadline:  # process 1 waits in that round
            time.sleep(0.005)
        assert os.path.exists(waiting), ("process 1 never entered the raced round", _keys(str(tmp_path)))
        ch.answer_early(f"decide {raced}", False, number=2 * raced)
        raced_answered.set()

    def body(c):
        ch, got = c.channel("protect"), {}
        helper = None
        if c.process_index == 0:
            helper = threading.Thread(target=answer, args=(c,))
            helper.start()
        assert answered.wait(30)
        for s in range(1, steps + 1):
            if c.process_index == 0 and s in early:
                # the leader's own thread runs no round it answered (as protection's worker, once the answer
                # is out: it never passes a round whose answer may still come)
                assert s != raced or raced_answered.wait(30)
                got[s] = False
                continue
            got[s] = ch.broadcast(f"decide {s}", s if c.process_index == 0 else None, number=2 * s, early=True)
        if helper is not None:
            helper.join(30)
        stats = c.stats()
        c.close()
        return got, stats

    out, _ = _run(n, str(tmp_path), body, timeout_s=20.0)
    want = {s: False if s in early else s for s in range(1, steps + 1)}
    for p in range(n):
        assert not isinstance(out[p], BaseException), out[p]
        assert out[p][0] == want, p
    led = steps - len(early)
    lead, one, two = (out[p][1] for p in range(n))
    assert lead["rounds"] == led and lead["sets"] == led + len(early)  # its results and its early answers
    assert one["sets"] == led + 1  # its contributions to the led rounds, and to the round it waited in
    assert two["sets"] in (led, led + 1)  # process 2 may or may not have come to the raced round first
    assert one["try_gets"] == steps  # one look per round for an early answer
    assert _keys(str(tmp_path)) == [], "keys left after close"
    with pytest.raises(ValueError, match="answered early after it was due"):
        c = Collective(FileCoordinator(str(tmp_path), 0, 2), "jaxckpt/t/1", 1.0)
        c.channel("x")._next = 5
        c.channel("x").answer_early("late", 0, number=4)
