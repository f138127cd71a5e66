"""jaxckpt under the real launchers users start jobs with, on this machine (one node), with the trainers of
tests/scheduler_trainer.py and the default agent directory (the node being the host name, as neither launcher
names nodes):

- torchrun --max-restarts=1: a worker SIGKILLs itself once step 3 is committed; torchelastic stops the other and
  restarts both, which restore step 3 from the node agent (torch front end) and, beside it, load the same step
  through ``torch.distributed.checkpoint`` from jaxckpt's storage, then train on bit for bit;
- mpirun (Open MPI, JAX's own detection in ``jax.distributed.initialize()``): a rank SIGKILLs itself at step 3,
  mpirun ends the job; the job is launched again and restores from the node agent bit for bit.

In both the agent is the one the first attempt's trainers spawned (its own session, so the launcher's kills do
not reach it): the relaunched trainers find it with the memory, same pid. Each test stops its agents at the end.
"""
import json
import os
import subprocess
import sys
import uuid

import pytest

import jaxckpt
from jaxckpt.backends.agent import protocol as proto
from requires import available, missing

HERE = os.path.dirname(os.path.abspath(__file__))
TRAINER = os.path.join(HERE, "scheduler_trainer.py")
# torchrun's console script is torch.distributed.run's main: the script beside this interpreter when pip put one
# there, else the same module through this interpreter (a venv that sees a system torch has no script of its own).
_SCRIPT = os.path.join(os.path.dirname(sys.executable), "torchrun")
TORCHRUN = [_SCRIPT] if os.path.exists(_SCRIPT) else [sys.executable, "-m", "torch.distributed.run"]
RUN_TIMEOUT_S = 240.0
MEMORY_KINDS = {"local", "node", "remote"}  # restored from memory: no persistent tier, no rebuild


def _torchrun_missing() -> str | None:
    try:
        import torch.distributed.run  # noqa: F401
    except ImportError:
        return "torch not installed"
    return None


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run a launcher to its end (bounded), its output kept for the assertion messages."""
    try:
        return subprocess.run(cmd, env={**os.environ, "JAXCKPT_LOG_LEVEL": "WARNING"}, cwd=HERE, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{cmd[0]} did not finish in {RUN_TIMEOUT_S:g}s:\n{(e.stdout or '')[-4000:]}")


def results(out_dir: str, attempt: str, ranks: int) -> list[dict]:
    docs = []
    for r in range(ranks):
        with open(os.path.join(out_dir, f"result-{r}-{attempt}.json")) as f:
            docs.append(json.load(f))
    return docs


def stop_agents(*jobs: str) -> None:
    for job in jobs:
        proto.stop_agent(proto.agent_dir(jaxckpt.Config(job_id=job)), job)


@pytest.fixture
def job():
    name = f"l{uuid.uuid4().hex[:8]}"
    yield name
    stop_agents(name, f"{name}-dcp")
    assert not os.path.exists(proto.agent_dir(jaxckpt.Config(job_id=name)))


@available(_torchrun_missing())
def test_torchrun_restarted_workers_restore_from_the_agent(job, tmp_path):
    """torchrun --standalone, 2 workers, --max-restarts=1; worker 1 dies at step 3: both restart (restart count 1),
    restore step 3 from the agent and load it through DCP on jaxckpt's storage, train to 5 bit for bit."""
    out = str(tmp_path)
    r = run([*TORCHRUN, "--standalone", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1",
             "--monitor-interval=0.5", TRAINER, "torch", "--out", out, "--job", job, "--steps", "5",
             "--fail-rank", "1", "--fail-at", "3"])
    assert r.returncode == 0, r.stdout[-4000:]
    assert os.path.exists(os.path.join(out, "failed-1"))
    assert not os.path.exists(os.path.join(out, "result-0-0.json"))  # the first attempt was stopped
    got = results(out, "1", 2)
    for d in got:
        assert d["attempt"] == 1 and d["restored"] == 3 and d["latest"] == 5, d
        assert d["bitwise"] and d["dcp_matches_restore"], d
        assert d["kinds"] and set(d["kinds"]) <= MEMORY_KINDS, d
        assert d["scheduler"] == "torchrun" and d["source"] == "host name", d
    assert len({(d["node"], d["agent_dir"], d["agent_pid"]) for d in got}) == 1, got  # one node, one agent


@available(missing("mpirun"))
def test_mpirun_relaunched_job_restores_from_the_agent(job, tmp_path):
    """mpirun -np 2 of the JAX trainer (JAX detects Open MPI); rank 1 dies at step 3 and mpirun ends the job; the
    same mpirun again restores step 3 from the agent the first run spawned and trains to 5 bit for bit."""
    out = str(tmp_path)
    cmd = ["mpirun", "--oversubscribe", "--allow-run-as-root", "-np", "2", "-x", "JAXCKPT_LOG_LEVEL",
           sys.executable, TRAINER, "jax", "--out", out, "--job", job, "--steps", "5"]
    first = run(cmd + ["--fail-rank", "1", "--fail-at", "3"])
    assert first.returncode != 0 and os.path.exists(os.path.join(out, "failed-1")), first.stdout[-4000:]
    agent = proto.read_pid_file(proto.agent_dir(jaxckpt.Config(job_id=job)))
    assert agent is not None
    again = run(cmd + ["--fail-rank", "1", "--fail-at", "3"])
    assert again.returncode == 0, again.stdout[-4000:]
    got = results(out, "relaunch", 2)
    for d in got:
        assert d["restored"] == 3 and d["latest"] == 5 and d["bitwise"], d
        assert d["kinds"] and set(d["kinds"]) <= MEMORY_KINDS, d
        assert d["scheduler"] == "mpirun" and d["source"] == "host name" and d["processes"] == 2, d
    assert {d["agent_pid"] for d in got} == {agent[0]}, (got, agent)  # the memory outlived the first job
