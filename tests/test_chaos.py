"""``jaxckpt chaos``: the quick profile in CI, and the bugs it found, pinned down deterministically.

- one round of the quick profile: every available fault kind once over a 2-node, 2-process job with shm agents
  and protection "hybrid", plus a JAX-trainer trial of each JAX kind: every fault recovered from, 0 wrong
  restores, 0 hangs, 0 committed steps lost to faults that destroy nothing, and no protected step lost with a
  node (the 50-trial quick and 500-trial long profiles are CLI runs: BENCHMARKS.md's reliability section);
- without protection, a round of the faults that destroy data, run and recorded through the CLI: steps with
  bad bytes are passed over inside the restore (no relaunch), wiped memory is lost, and still no wrong restore
  and no hang; its record re-renders the same section;
- a fast process must not run ahead of the commit protocol: found by chaos (a trainer killed after running
  several locally committed steps ahead of a slow peer had its agent free the newest globally committed step on
  disconnect); fixed in CheckpointEngine._throttle, pinned here with two engines and real agents.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from jaxckpt.tools.chaos import cli as chaos_cli
from jaxckpt.tools.chaos import run as chaos
from jaxckpt.tools.chaos.report import format_table
from jaxckpt.backends.agent import protocol as proto
from jaxckpt.cli import build_parser
from shm_trainer import agent_processes


AVAILABLE = sorted(k for k, f in chaos.FAULTS.items() if f.inject is not None)


# 14 trials of a real job: 90 s measured here with a light load, 230 s beside four other test runs (2 cores); every
# wait inside has its own time-out (a hang is reported as such), so pytest's 300 s guard is raised, not relied on.
@pytest.mark.timeout(900)
def test_every_fault_kind_is_recovered_from_with_no_wrong_restore_and_no_hang():
    """One round of the quick profile: every available fault kind exactly once (the driver deals each kind once
    per round of as many trials as there are kinds), plus one JAX trial of each JAX kind."""
    run = chaos.ChaosRun(chaos.PROFILES["quick"], seed=0, trials=len(AVAILABLE))
    rep = run.run()
    table = format_table(rep)
    print(table)
    assert rep["trials"] == len(AVAILABLE) + len(chaos.JAX_KINDS) and rep["jax_trials"] == len(chaos.JAX_KINDS)
    assert rep["wrong_restores"] == 0 and rep["hangs"] == 0 and rep["unexpected_losses"] == 0, table
    assert rep["recoveries"] == rep["trials"], table
    # every kind was exercised, once
    assert {k: v["trials"] for k, v in rep["faults"].items()} == \
        {**{k: 1 for k in AVAILABLE}, **{f"{k} (jax)": 1 for k in chaos.JAX_KINDS}}, table
    # saving came back after every agent and budget fault (the trials where it did not, with their trainers' ends)
    assert rep["saves_not_resumed"] == 0, [(r["kind"], r["mode"], r["detail"]) for r in rep["results"]
                                           if r["saves_resumed"] is False]
    assert rep["unavailable"] == {}  # peer-delay and peer-drop run through jaxckpt/tools/chaos/proxy.py
    # every peer connection spoke CURVE: every agent the driver started published a key
    assert rep["profile"]["peer_security"] == "curve", table
    assert rep["agents_by_peer_security"].get("curve", 0) >= 3 and "token" not in rep["agents_by_peer_security"]
    assert chaos.ok(rep)
    for r in rep["results"]:
        assert r["checks"] >= 1 and r["restored"] is None or r["restored"] <= r["trained"], r
    # Nothing is left behind: no agent, no shared memory, no scratch directory, no log.
    assert not os.path.exists(run.base) and not os.path.exists(run.tmp)
    assert not agent_processes(run.job)
    for d in [*run.node_dirs, run.jax_dir]:
        assert not os.path.exists(proto.default_log_path(d))


DESTROYING = ["corrupt-chunk", "corrupt-record", "kill-agent-wipe", "node-loss"]


@pytest.fixture(scope="module")
def unprotected(tmp_path_factory):
    """One recorded CLI run without protection, a round of the faults that destroy data, shared by the test of
    its outcome and the test of its record (``--update-md`` writes both the section and docs/bench/chaos.json)."""
    d = tmp_path_factory.mktemp("chaos")
    md = d / "BENCHMARKS.md"
    md.write_text("# B\n\n<!-- bench:chaos:begin -->\nold\n<!-- bench:chaos:end -->\n\nprose\n")
    proc = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "chaos", "--protection", "none", "--seed", "3",
                           "--trials", str(len(DESTROYING)), "--jax-trials", "0", "--faults", ",".join(DESTROYING),
                           "--update-md", str(md)], capture_output=True, text=True, timeout=300)
    return {"dir": d, "md": md, "proc": proc}


def test_without_protection_bad_steps_are_dropped_and_wiped_nodes_start_over(unprotected):
    """Without protection a corrupt chunk or record costs its step (the restore falls back past it inside the
    same call, never by a relaunch) and a wiped node's memory costs every step it held; still no wrong
    restore, no hang."""
    from jaxckpt.tools.bench import report

    proc = unprotected["proc"]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]  # exit 0: chaos.ok(report)
    rep = report.read_json(unprotected["dir"] / "docs" / "bench" / "chaos.json")["report"]
    table = format_table(rep)
    assert rep["profile"]["protection"] == "none" and chaos.ok(rep), table
    assert {k: v["trials"] for k, v in rep["faults"].items()} == {k: 1 for k in DESTROYING}, table
    for kind in ("corrupt-chunk", "corrupt-record"):  # bad bytes cost no relaunch (jaxckpt.core.fallback)
        assert rep["faults"][kind].get("relaunches", 0) == 0, table


def test_the_report_splits_the_protection_lag_by_the_trial_s_fault_and_counts_relaunches_for_bad_bytes():
    """Known answer: steps committed at t=0, 1 (trial A) and 10 (trial B), each reported protected 0.5 s, 0.1 s and
    4 s later; the lag table gives each trial's fault its own row, and relaunches say how many were for bad
    bytes."""
    from jaxckpt.tools.chaos import lag, report

    def events(pairs):
        return [e for step, t, dt in pairs for e in ({"ev": "committed", "step": step, "t": t},
                                                      {"ev": "protected", "step": step, "t": t + dt})]
    a = lag.protection_lags(events([(2, 0.0, 0.5), (4, 1.0, 0.1)]))
    b = lag.protection_lags(events([(6, 10.0, 4.0)]))
    assert a == [(0, 0.5), (0, 0.1)] and b == [(0, 4.0)]
    prof = dataclasses.asdict(chaos.PROFILES["long"])
    result = dict(trial=0, kind="peer-drop", mode="numpy", detail="", trained=7, committed=6, protected=6,
                  restored=6, checks=1, recovered=True, lost=1, wrong=0, unexpected_loss=False, hang=False,
                  relaunches=2, relaunches_bad_bytes=1, fell_back=0, saves_resumed=None, seconds=1.0)
    rep = {"profile": prof, "trials": 1, "jax_trials": 0, "seed": 0, "seconds": 1.0, "recoveries": 1,
           "wrong_restores": 0, "hangs": 0, "unexpected_losses": 0, "relaunches": 2, "relaunches_bad_bytes": 1,
           "results": [result], "protection_lag": lag.lag_summary(a + b, 2),
           "protection_lag_by_kind": {"kill-trainer": lag.lag_summary(a, 2), "peer-drop": lag.lag_summary(b, 2)}}
    md = report.render(rep, "jaxckpt chaos", machine={}, date="today")
    assert "| `kill-trainer` | 2 | 500 | 500 | 500 | 100% |" in md, md
    assert "| `peer-drop` | 1 | 4000 | 4000 | 4000 | 100% |" in md, md
    assert "| `peer-drop` | 1 | 1 | 0 | 0 | 2 (1) |" in md, md


def test_an_agent_killed_within_the_restore_may_cost_the_steps_newer_than_the_protected_one_and_no_more():
    """Known answer for the driver's check: a restore of step 338 where 340 was committed and 338 protected. An
    agent killed within that restore takes its memory from the restore as a node loss would (a chunk no other
    source holds: the step is lost to the job, jaxckpt.core.fallback), so 338 is expected there; the same restore
    is an unexpected loss after the same fault at the commit, or when the restore's fault never went off, and so
    is a restore of 336 after any of them. A restore's digest that differs is a wrong restore in every case."""
    from jaxckpt.tools.chaos.incarnation import Incarnation, TrialResult

    run = chaos.ChaosRun(chaos.PROFILES["long"], seed=3, trials=1)
    try:
        def check(step: int, phase: str, fired: bool, digest: str | None = None) -> TrialResult:
            res = TrialResult(0, "kill-agent-phase", detail=f"kill-agent at {phase} on process 1", trained=341,
                              committed=340, protected=338)
            inc = Incarnation.__new__(Incarnation)  # its events alone: no processes
            inc.events = [{"ev": "phase-fault", "p": 1, "phase": phase, "step": 0, "action": "kill-agent"}] * fired
            inc.events += [{"ev": "restored", "p": q, "step": step, "digest": digest or run.reference(step, "numpy")}
                           for q in range(run.n)]
            run.trained_max = 341
            run._check(inc, res, "numpy")
            return res

        got = check(338, "restore", True)
        assert not got.unexpected_loss and got.recovered and got.lost == 3 and got.wrong == 0
        assert check(340, "restore", True).lost == 1
        for step, phase, fired in ((338, "commit", True), (338, "restore", False), (336, "restore", True)):
            assert check(step, phase, fired).unexpected_loss, (step, phase, fired)
        assert check(338, "restore", True, digest="0" * 16).wrong == run.n  # each process's
    finally:
        shutil.rmtree(run.tmp, ignore_errors=True)


def test_the_protection_lag_is_measured_at_the_commit_and_the_announcement_not_when_a_trainer_looks():
    """Known answer: trainers look between 11 ms steps (``t``), the events carry the times the commit was decided
    and the step announced protected (``at``); the lag and the steps committed meanwhile come from those."""
    from jaxckpt.tools.chaos import lag

    def ev(kind, step, t, at=None):
        return {"ev": kind, "step": step, "t": t, **({"at": at} if at is not None else {})}
    events = [ev("committed", 2, 0.011, 0.003), ev("protected", 2, 0.011, 0.009), ev("committed", 4, 0.033, 0.025),
              ev("committed", 6, 0.055, 0.047), ev("protected", 4, 0.055, 0.050), ev("protected", 6, 0.066, 0.058)]
    assert lag.protection_lags(events) == [(0, 0.006), (2, 0.025), (0, 0.011)]
    # a step committed on two processes counts from the later one; an old record without ``at`` from its report
    events = [ev("committed", 2, 0.02, 0.010), ev("committed", 2, 0.02, 0.012), ev("protected", 2, 0.03)]
    assert lag.protection_lags(events) == [(0, 0.018)]


@pytest.mark.timeout(300)
def test_a_hang_says_why_the_job_stopped_and_keeps_every_process_s_logs_and_stacks(tmp_path, caplog):
    """A real hang: every node's budget holds less than one snapshot, so the job trains on and every save is
    refused, and the driver's wait for a commit expires. The driver must say why at once (each process's
    refused saves, from its events: no log line shows them) and keep, in a folder of ``--keep-hangs``, each
    trainer's and agent's log with every thread's stack, the events and the coordination keys."""
    from jaxckpt.tools.chaos.incarnation import TrialResult

    profile = dataclasses.replace(chaos.PROFILES["quick"], timeout_s=10.0)
    run = chaos.ChaosRun(profile, seed=0, trials=1, jax_trials=0, keep_hangs=str(tmp_path))
    run.budget = 4096
    try:
        for d in run.node_dirs:
            run.start_agent(d)
        inc = run.launch(None, "numpy")
        assert inc is not None
        res = TrialResult(trial=7, kind="test")
        run._kind = "test"
        with caplog.at_level("ERROR", logger="jaxckpt.tools.chaos.run"):
            assert not run.warm_up(inc, res)
        run.stop(inc)
    finally:
        run.close()
    assert res.hang and run.hung == 1
    said = caplog.text
    assert "hang: incarnation 1 committed no step past" in said, said
    for q in range(run.n):
        assert f"hang: process {q}: " in said and "BudgetExceededError" in said, said
    kept = tmp_path / "hang-1-trial-7-test"
    assert f"logs, events and every thread's stack kept in {kept}" in said
    files = sorted(p.name for p in kept.iterdir())
    assert files == sorted(["coordination.txt", "events.jsonl", *(f"trainer-{q}.log" for q in range(run.n)),
                            *(f"agent-node{k}.log" for k in range(run.profile.nodes))]), files
    for name in files:
        if name.endswith(".log"):  # faulthandler's dump of every thread, from the trainer's or agent's own handler
            text = (kept / name).read_text(errors="replace")
            assert "most recent call first" in text and "Thread 0x" in text, (name, text[-2000:])
    events = [json.loads(line) for line in (kept / "events.jsonl").read_text().splitlines()]
    assert any(e["ev"] == "save-failed" and "BudgetExceededError" in e["error"] for e in events)
    assert (kept / "coordination.txt").read_text().count("bytes") >= 1


def test_cli_parses_the_profiles_and_refuses_unknown_faults():
    args = build_parser().parse_args(["chaos", "--profile", "long", "--seed", "3", "--json"])
    assert (args.profile, args.seed, args.json, args.run) == ("long", 3, True, chaos_cli.run_cli)
    assert chaos.PROFILES["long"].trials == 500
    with pytest.raises(ValueError, match="unknown fault kind"):
        chaos.ChaosRun(chaos.PROFILES["quick"], 0, faults=["kill-everything"])


def test_a_recorded_run_keeps_its_record_beside_the_plots_and_rerenders_the_same_section(unprotected, tmp_path):
    """``--update-md`` keeps the run's record in docs/bench/chaos.json next to the markdown file (a real,
    small run), and ``--from-json`` renders the very same section from it without running anything."""
    from jaxckpt import cli
    from jaxckpt.tools.bench import report

    assert unprotected["proc"].returncode == 0, unprotected["proc"].stderr[-4000:]
    kept = unprotected["dir"] / "docs" / "bench" / "chaos.json"
    record = report.read_json(kept)
    assert record["bench"] == "chaos" and record["report"]["trials"] == len(DESTROYING), record
    assert record["command"] == ("jaxckpt chaos --profile quick --seed 3 --trials 4 --jax-trials 0 --faults "
                                 "corrupt-chunk,corrupt-record,kill-agent-wipe,node-loss --protection none")
    again = tmp_path / "again" / "BENCHMARKS.md"
    again.parent.mkdir()
    again.write_text("<!-- bench:chaos:begin -->\n<!-- bench:chaos:end -->\n")
    assert cli.main(["chaos", "--from-json", str(kept), "--update-md", str(again)]) == 0
    begin, end = report.markers("chaos")
    text, want = again.read_text(), unprotected["md"].read_text()
    assert text[text.index(begin):text.index(end)] == want[want.index(begin):want.index(end)]
    assert "\nold\n" not in want and want.endswith("\n\nprose\n")
    (tmp_path / "other.json").write_text('{"bench": "save"}')
    assert cli.main(["chaos", "--from-json", str(tmp_path / "other.json")]) == 2  # not a chaos record


# ----------------------------------------------------------------------------------- found by chaos
def _agent(d: str, job: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", job, "--dir", d,
                          "--log", d + ".log"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(d, proto.SOCKET_NAME)):
        assert p.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    return p


_status = proto.agent_status


def _held(d: str, job: str, process: int) -> list[int]:
    return sorted(s["step"] for s in _status(d, job)["slots"] if s["process"] == process and s["state"] == "committed")


AHEAD = """
import json, sys, time
from jaxckpt.config import Config
from jaxckpt.core.engine import CheckpointEngine
from jaxckpt.tools.chaos import trainer as ct
from jaxckpt.tools.filecoord import FileCoordinator
p, job, d, coord = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
cfg = Config(store="shm", job_id=job, shm_dir=d, keep=1, max_pending_saves=1, workers=1, commit_timeout_s=30.0,
             peer_timeout_s=30.0)
eng = CheckpointEngine(cfg, FileCoordinator(coord, p, 2), framework="numpy")
slow = lambda phase: time.sleep(0.3) if phase == "copy" and p == 0 else None
for step in range(1, 7):
    arrays, values = ct.state(0, step, 2)
    eng.save(step, ct.records(arrays, p, 2, slow), [], ())
    latest = eng.latest_step() or 0
    print(json.dumps({"undecided": len([s for s in eng.store.steps() if s > latest])}), flush=True)
print(json.dumps({"committed": eng.latest_step() or 0}), flush=True)
if p == 0:
    eng.close()
else:
    time.sleep(600)  # killed here
"""


def test_a_fast_process_never_runs_ahead_of_the_commit_protocol(tmp_path):
    """Process 1 saves fast, process 0 slowly. Process 1 may hold at most max_pending_saves undecided steps
    beyond the committed ones, so that when it dies its agent (which keeps keep + max_pending_saves of a dead
    trainer's steps) still holds the newest committed step."""
    import json

    job = f"ahead-{uuid.uuid4().hex[:6]}"
    base = f"/dev/shm/jaxckpt-ahead-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    dirs = [os.path.join(base, f"node{p}") for p in (0, 1)]
    agents = [_agent(d, job) for d in dirs]
    procs = []
    try:
        procs = [subprocess.Popen([sys.executable, "-c", AHEAD, str(p), job, dirs[p], str(tmp_path / "coord")],
                                  stdout=subprocess.PIPE, text=True) for p in (0, 1)]
        lines = [json.loads(procs[1].stdout.readline()) for _ in range(7)]
        # Process 1 dies now: its connection drops, and its agent applies the dead trainer's retention.
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(60)
        deadline = time.monotonic() + 30
        while "1" in _status(dirs[1], job)["trainers"] and time.monotonic() < deadline:
            time.sleep(0.005)
        held = _held(dirs[1], job, 1)
        undecided, committed = [x["undecided"] for x in lines[:6]], lines[6]["committed"]
        assert max(undecided) <= 1, undecided  # never more than max_pending_saves undecided steps
        assert committed >= 4 and committed in held, (committed, held)  # the newest committed step survived
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for d, a in zip(dirs, agents):
            proto.stop_agent(d, job, timeout_s=30)
            if a.poll() is None:
                a.send_signal(signal.SIGKILL)
            a.wait()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("processes", [2, 3])
def test_every_process_reaches_the_copy_phase_of_a_save(processes):
    """A ``copy``-phase fault must fire on whichever process it targets: the hook fires at the third array each
    process itself holds (an array held by process 0 alone, sorted third, once left process 1's hook unreached and
    its trials hung until the time-out)."""
    from jaxckpt.tools.chaos import trainer as ct

    arrays, _ = ct.state(1, 4, processes)
    arrays = dict(sorted(arrays.items()))  # the order the front end hands them in
    for p in range(processes):
        fired = []
        reads = ct.shard_reads(arrays, p, processes, fired.append)
        held = [r[p][0] for r in reads if r]
        assert len(held) >= 3
        for i, fetch in enumerate(held):
            fetch()
            assert fired == (["copy"] if i >= 2 else []), (p, i)
