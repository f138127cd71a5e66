"""jaxckpt under the real launchers users start jobs with, on this machine (one node), with the trainers of
tests/scheduler_trainer.py and the default agent directory (the node being the host name, as neither launcher
names nodes):

- torchrun (``--max-restarts=1``, with torch's opt-out of its shared rendezvous store, as docs/deploy.md says):
  a worker SIGKILLs itself once step 3 is committed; torchelastic stops the other and restarts both in place, and
  both restore step 3 from the node agent (torch front end) and, beside it, load the same step through
  ``torch.distributed.checkpoint`` from jaxckpt's storage, then train on bit for bit; without the opt-out the
  torch front end and ``jaxckpt doctor`` name it;
- mpirun (Open MPI, JAX's own detection in ``jax.distributed.initialize()``), and MPICH's mpiexec (Hydra, JAX
  initialized from PMI's variables): a rank SIGKILLs itself at step 3, the launcher ends the job; the job is
  launched again and restores from the node agent bit for bit.

In both the agent is the one the first attempt's trainers spawned (its own session, so the launcher's kills do
not reach it): the restarted or relaunched trainers find it with the memory, same pid. Each test stops its
agents at the end.
"""
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

import jaxckpt
from jaxckpt.backends.agent import protocol as proto
from jaxckpt.testing import free_ports
from jaxckpt.node_identity import ENV_TORCH_UNSHARE_STORE
from requires import available, missing
from scheduler_trainer import early_agent_calls, live_pids, results

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


def run(cmd: list[str], job: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a launcher to its end, its output kept for the assertion messages. Bounded: past RUN_TIMEOUT_S every
    trainer of ``job`` gets SIGUSR1 (it prints its threads' stacks), then the launcher and its trainers SIGKILL."""
    env = {**os.environ, "JAXCKPT_LOG_LEVEL": "WARNING", **(env or {})}
    p = subprocess.Popen(cmd, env=env, cwd=HERE, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=RUN_TIMEOUT_S)
        return subprocess.CompletedProcess(cmd, p.returncode, out)
    except subprocess.TimeoutExpired:
        trainers = trainer_pids(job)
        signal_all(trainers, signal.SIGUSR1)
        time.sleep(2)
        signal_all(trainers, signal.SIGKILL)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = p.communicate()
        raise AssertionError(f"{cmd[0]} did not finish in {RUN_TIMEOUT_S:g}s:\n{out[-6000:]}")


def trainer_pids(job: str) -> list[int]:
    """Live trainers of ``job``, wherever the launcher put them (torchrun's workers may outlive it)."""
    return live_pids(TRAINER, job)


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def agent_dir(job: str) -> str:
    """Where the trainers' agent of ``job`` is, by the environment they run in (a site's JAXCKPT_SHM_ROOT too)."""
    return proto.agent_dir(jaxckpt.Config(job_id=job).with_env())


def stop_agents(*jobs: str) -> None:
    for job in jobs:
        proto.stop_agent(agent_dir(job), job)


@pytest.fixture
def job():
    name = f"l{uuid.uuid4().hex[:8]}"
    yield name
    signal_all(trainer_pids(name), signal.SIGKILL)  # none, unless the test failed midway
    stop_agents(name, f"{name}-dcp")
    assert not os.path.exists(agent_dir(name)) and not os.path.exists(agent_dir(f"{name}-dcp"))


@available(_torchrun_missing())
def test_torchrun_restarted_workers_restore_from_the_agent(job, tmp_path):
    """torchrun --standalone --max-restarts=1, 2 workers; worker 1 SIGKILLs itself at step 3, torchelastic stops
    the other and restarts both in place: they restore step 3 from the agent the first attempt's workers spawned
    and load it through DCP on jaxckpt's storage, then train to 5 bit for bit; torchrun succeeds. torchrun runs
    with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs/deploy.md), so nothing warns of its shared store."""
    out = str(tmp_path)
    cmd = [*TORCHRUN, "--standalone", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1",
           "--monitor-interval=0.5", TRAINER, "torch", "--out", out, "--job", job, "--steps", "5",
           "--fail-rank", "1", "--fail-at", "3", "--early-agent", "w"]
    done = run(cmd, job, {ENV_TORCH_UNSHARE_STORE: "1"})
    assert done.returncode == 0, done.stdout[-4000:]
    assert ENV_TORCH_UNSHARE_STORE not in done.stdout, done.stdout[-4000:]
    assert os.path.exists(os.path.join(out, "failed-1"))
    assert not os.path.exists(os.path.join(out, "result-0-first.json"))  # the first attempt's group was stopped
    agent = proto.read_pid_file(agent_dir(job))
    assert agent is not None and proto.pid_alive(agent[0])  # the agent outlived the restart and torchrun
    got = results(out, "relaunch", 2)
    for d in got:
        assert d["attempt"] == 1 and d["restored"] == 3 and d["latest"] == 5, d
        assert d["bitwise"] and d["dcp_matches_restore"], d
        assert d["kinds"] and set(d["kinds"]) <= MEMORY_KINDS, d
        assert d["scheduler"] == "torchrun" and d["source"] == "host name", d
    assert {(d["node"], d["agent_dir"], d["agent_pid"]) for d in got} == {
        (got[0]["node"], agent_dir(job), agent[0])}, (got, agent)  # one node, one agent
    # Every worker called jaxckpt.start_agent() first thing, before importing torch's jaxckpt front end or jax: the
    # first attempt's calls started the agent (one of them, or both racing for its lock), the restarted workers'
    # found it serving and started none.
    calls = early_agent_calls(out, "w")
    assert len(calls) == 4 and not any(c["jax_imported"] for c in calls), calls
    assert any(c["started"] for c in calls if c["restart"] == "0"), calls
    assert [c["started"] for c in calls if c["restart"] == "1"] == [False, False], calls


HAZARD_WORKER = """
import json, logging, subprocess, sys
import jaxckpt
from jaxckpt.torch import Checkpointer
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
cfg = jaxckpt.Config(store="memory", job_id=sys.argv[1])
for _ in range(2):
    Checkpointer(cfg).close()
r = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "doctor", "--job", sys.argv[1], "--json"],
                   capture_output=True, text=True, timeout=120)
print("DOCTOR " + json.dumps(json.loads(r.stdout)["warnings"]))
"""


@available(_torchrun_missing())
def test_torchrun_shared_store_is_named_where_a_restart_could_hang(job, tmp_path):
    """torchrun --max-restarts=1 with its default shared rendezvous store (a restarted worker group can hang in
    init_process_group, docs/deploy.md): a worker's torch front end logs it once (two Checkpointers, one warning)
    naming torch's opt-out, and ``jaxckpt doctor`` run in the worker warns of it."""
    script = tmp_path / "worker.py"
    script.write_text(HAZARD_WORKER)
    env = {k: v for k, v in os.environ.items() if k != ENV_TORCH_UNSHARE_STORE}
    done = subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node=1", "--max-restarts=1", str(script), job],
                          env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    said = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("jaxckpt.torch: ")]
    assert len(said) == 1 and "--max-restarts=1" in said[0] and f"{ENV_TORCH_UNSHARE_STORE}=1" in said[0], said
    doctor = json.loads(done.stdout.split("DOCTOR ", 1)[1].splitlines()[0])
    assert [w for w in doctor if f"{ENV_TORCH_UNSHARE_STORE}=1" in w] == [said[0].split(": ", 1)[1]], doctor


@available(missing("mpirun"))
def test_mpirun_relaunched_job_restores_from_the_agent(job, tmp_path):
    """mpirun -np 2 of the JAX trainer (JAX detects Open MPI); rank 1 dies at step 3 and mpirun ends the job; the
    same mpirun again restores step 3 from the agent the first run spawned and trains to 5 bit for bit."""
    out = str(tmp_path)
    cmd = ["mpirun", "--oversubscribe", "--allow-run-as-root", "-np", "2", "-x", "JAXCKPT_LOG_LEVEL",
           sys.executable, TRAINER, "jax", "--out", out, "--job", job, "--steps", "5"]
    first = run(cmd + ["--fail-rank", "1", "--fail-at", "3", "--early-agent", "first"], job)
    assert first.returncode != 0 and os.path.exists(os.path.join(out, "failed-1")), first.stdout[-4000:]
    agent = proto.read_pid_file(agent_dir(job))
    assert agent is not None
    # jaxckpt.start_agent() as each rank's first act: the first run's ranks started the agent (one, or both racing
    # for its lock; one serves); the relaunch's found it serving.
    calls = early_agent_calls(out, "first")
    assert len(calls) == 2 and any(c["started"] for c in calls) and not any(c["jax_imported"] for c in calls), calls
    again = run(cmd + ["--fail-rank", "1", "--fail-at", "3", "--early-agent", "again"], job)
    assert again.returncode == 0, again.stdout[-4000:]
    got = results(out, "relaunch", 2)
    for d in got:
        assert d["restored"] == 3 and d["latest"] == 5 and d["bitwise"], d
        assert d["kinds"] and set(d["kinds"]) <= MEMORY_KINDS, d
        assert d["scheduler"] == "mpirun" and d["source"] == "host name" and d["processes"] == 2, d
    assert {d["agent_pid"] for d in got} == {agent[0]}, (got, agent)  # the memory outlived the first job
    assert [c["started"] for c in early_agent_calls(out, "again")] == [False, False]
    assert [d["processes_on_node"] for d in got] == [2, 2], got  # OMPI_COMM_WORLD_LOCAL_SIZE: the budget's count


@available(missing("mpiexec.hydra"))
def test_mpich_hydra_relaunched_job_restores_from_the_agent(job, tmp_path):
    """MPICH's mpiexec (Hydra; Intel MPI's is the same launcher) -n 2 of the JAX trainer, which initializes JAX as
    an MPICH user does (JAX detects no Hydra: the coordinator's address and the PMI ranks); rank 1 dies at step 3
    and Hydra ends the job; the same mpiexec again restores step 3 from the agent the first run spawned and trains
    to 5 bit for bit. jaxckpt sees the launcher: mpirun, Hydra, 2 processes on the node (the memory budget's
    count; it counted 1)."""
    out = str(tmp_path)
    first_port, again_port = free_ports(2)

    def cmd(port: int, tag: str) -> list[str]:
        return ["mpiexec.hydra", "-n", "2", sys.executable, TRAINER, "jax", "--out", out, "--job", job, "--steps",
                "5", "--coordinator", f"127.0.0.1:{port}", "--fail-rank", "1", "--fail-at", "3", "--early-agent", tag]

    first = run(cmd(first_port, "first"), job)
    assert first.returncode != 0 and os.path.exists(os.path.join(out, "failed-1")), first.stdout[-4000:]
    agent = proto.read_pid_file(agent_dir(job))
    assert agent is not None and proto.pid_alive(agent[0])  # its own session: Hydra's kills did not reach it
    calls = early_agent_calls(out, "first")
    assert len(calls) == 2 and any(c["started"] for c in calls), calls
    again = run(cmd(again_port, "again"), job)
    assert again.returncode == 0, again.stdout[-4000:]
    got = results(out, "relaunch", 2)
    for d in got:
        assert d["restored"] == 3 and d["latest"] == 5 and d["bitwise"], d
        assert d["kinds"] and set(d["kinds"]) <= MEMORY_KINDS, d
        assert d["scheduler"] == "mpirun" and d["scheduler_details"]["launcher"].startswith("Hydra"), d
        assert d["processes_on_node"] == 2 and d["source"] == "host name" and d["processes"] == 2, d
    assert {d["agent_pid"] for d in got} == {agent[0]}, (got, agent)  # the memory outlived the first job
    assert [c["started"] for c in early_agent_calls(out, "again")] == [False, False]
