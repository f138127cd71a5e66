"""A node agent whose SLURM step ends a moment before its allocation does, on an emulated cluster
(jaxckpt/testing/slurm.py; KillWait 15 s, SLURM's default being 30).

An agent that gets SIGTERM while its allocation runs keeps the node's memory for the next step's agent
(backends/agent/lifetime.py). A spawned agent's step may end with the step of the process that spawned it, just
before the allocation ends: with Open MPI's mpirun in a batch script, mpirun's end took the agent's step along
and the script's end followed within a second, and no agent was left to free the node's memory (measured: the
directory stayed after the job ended). The agent now asks again for a share of KillWait and frees the memory when
the allocation ends meanwhile.

- an agent step is signalled (``scancel --signal=TERM``: a step's end while the job runs), keeps the memory, then
  the allocation ends: the memory is freed;
- mpirun in a batch script, twice, one rank per node: the second run restores from each node's memory; the
  script's end frees every node's memory;
- torchrun under srun, one per node, workers restarted by torchelastic: they restore from each node's memory.

One 2-node cluster for the module; it skips with the reason where it cannot run, except under CI=true
(tests/requires.py). About 80 s on 2 cores.
"""
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import uuid

import pytest

from jaxckpt.backends.agent import protocol as proto
from jaxckpt.config import Config
from jaxckpt.testing import slurm
from requires import available, missing
from scheduler_trainer import early_agent_calls, results

HERE = os.path.dirname(os.path.abspath(__file__))
SHM = proto.shm_base(Config().with_env())
TRAINER = os.path.join(HERE, "scheduler_trainer.py")
KILL_WAIT_S = 15
FREED_WITHIN_S = KILL_WAIT_S + 30.0  # the agent's watch is a share of KillWait; room for a loaded machine
STEP_TIMEOUT_S = 240.0

pytestmark = available(slurm.unavailable() or missing("mpirun"))


@pytest.fixture(scope="module")
def cluster():
    with slurm.running("jaxckpt-slurm-ends-", nodes=2, kill_wait=KILL_WAIT_S) as c:
        yield c


@pytest.fixture
def name():
    return f"e{uuid.uuid4().hex[:8]}"


def _dirs(name: str, job: str) -> list[str]:
    return slurm.agent_dirs(SHM, name, job)


def _step_of(pid: int, job: str) -> str:
    """The step of ``job`` that process ``pid`` runs in (its freezer cgroup: proctrack/cgroup)."""
    with open(f"/proc/{pid}/cgroup") as f:
        return re.search(rf"job_{job}/step_(\d+)", f.read()).group(1)


def _log(path) -> str:
    return path.read_text() if path.exists() else ""


def test_an_agent_that_kept_the_memory_frees_it_when_the_allocation_ends_next(cluster, name, tmp_path):
    """An agent step serving a trainer's two saves gets SIGTERM while the job runs (``scancel --signal=TERM`` of
    its step, as a step's end sends it): it keeps the memory and lets the directory go. The allocation then ends
    (``scancel``): the agent, still asking, sees the job end and removes the memory; its log says so."""
    job = cluster.salloc(1, name)
    log_path = tmp_path / "agent.log"
    agent = cluster.agent_step(job, name, str(log_path))
    try:
        assert slurm.until(lambda: f"KillWait is {KILL_WAIT_S} s" in _log(log_path), 60), _log(log_path)
        r = cluster.run(["srun", f"--jobid={job}", "-N1", "-n1", "--overlap", sys.executable, TRAINER, "jax",
                         "--out", str(tmp_path), "--job", name, "--steps", "2"], timeout=STEP_TIMEOUT_S,
                        env={"JAXCKPT_LOG_LEVEL": "WARNING"})
        assert r.returncode == 0 and results(str(tmp_path), "first", 1)[0]["bitwise"], r.stdout[-2000:]
        (directory,) = _dirs(name, job)
        step = _step_of(proto.read_pid_file(f"{SHM}/{directory}")[0], job)
        cluster.run(["scancel", "--signal=TERM", f"{job}.{step}"])
        assert slurm.until(lambda: "leaving the node's memory to the next agent" in _log(log_path), 60), _log(log_path)
        assert _dirs(name, job) == [directory]  # kept: the allocation runs
        cluster.run(["scancel", job])
        assert slurm.until(lambda: not _dirs(name, job), FREED_WITHIN_S), (_dirs(name, job), _log(log_path),
                                                                      cluster.job_log(job))
        assert re.search(rf"SLURM job {job} is [A-Z]+ [\d.]+ s after the SIGTERM: removed .*{re.escape(directory)}",
                         _log(log_path)), _log(log_path)
    finally:
        cluster.run(["scancel", job], check=False)
        agent.wait(60)
        cluster.wait_gone(job, 120.0)


# The emulated nodes share this machine's loopback, which Open MPI leaves out of its daemons' wiring between
# nodes unless told (on a machine with loopback alone it finds no interface); real nodes have networks of their own.
MPIRUN_BATCH = """#!/bin/bash
export JAXCKPT_LOG_LEVEL=WARNING
run() {{
    mpirun --allow-run-as-root --oversubscribe -np 2 --map-by ppr:1:node -x JAXCKPT_LOG_LEVEL -x PATH \\
        --mca oob_tcp_if_include lo \\
        {py} {trainer} jax --out {out} --job {name} --steps 4 --fail-rank 1 --fail-at 2 --early-agent "$1"
}}
run first
echo "first exit $?"
run again
echo "again exit $?"
"""


def test_mpirun_in_a_batch_script_relaunches_from_memory_and_the_end_frees_it(cluster, name, tmp_path):
    """sbatch on 2 nodes whose script runs Open MPI's mpirun twice, one rank per node (Open MPI starts its ranks
    through SLURM; JAX detects SLURM, the node is SLURMD_NODENAME): in the first run rank 1 dies at step 2 and
    mpirun aborts the job; the second run restores step 2 from each node's memory and trains to 4 bit for bit;
    the script's end frees every node's memory, also where mpirun's end took an agent's step along (SIGTERM, the
    job still running), or, where SLURM SIGKILLed an agent, ``jaxckpt doctor --sweep`` does."""
    out = str(tmp_path)
    script = tmp_path / "job.sh"
    script.write_text(MPIRUN_BATCH.format(py=sys.executable, name=name, trainer=TRAINER, out=out))
    r = cluster.run(["sbatch", "-N2", "-J", name, "-o", str(tmp_path / "job.out"), str(script)])
    job = r.stdout.split()[-1]
    cluster.wait_gone(job, 2 * STEP_TIMEOUT_S)
    log = (tmp_path / "job.out").read_text()
    assert re.search(r"first exit [1-9]", log) and "again exit 0" in log, log[-4000:]
    assert os.path.exists(os.path.join(out, "failed-1"))
    first = early_agent_calls(out, "first")
    assert len(first) == 2 and all(c["started"] for c in first), first  # one agent per node, by its trainer
    # The second run's trainers find those agents serving, or, where mpirun's end took an agent's step along,
    # start one that adopts its files: memory either way.
    got = results(out, "relaunch", 2)
    for d in got:
        assert d["restored"] == 2 and d["bitwise"] and d["latest"] == 4, d
        assert set(d["kinds"]) == {"local"}, d  # each node's own memory
        assert d["scheduler"] == "slurm" and d["source"] == "SLURMD_NODENAME (SLURM)" and d["processes"] == 2, d
    assert [d["node"] for d in got] == cluster.nodes[:2]
    _freed_or_swept(cluster, job, name)


def _freed_or_swept(cluster, job: str, *names: str) -> None:
    """Every node's memory of jaxckpt jobs ``names`` in allocation ``job`` freed by the agents at its end; where SLURM
    SIGKILLed an agent with the step that started it (its srun died there; backends/agent/lifetime.py), nothing of
    jaxckpt's ran to free it, and what is left must be unserved: the next agent of the user on the node, or
    ``jaxckpt doctor --sweep`` (run here), removes it."""
    def left() -> list[str]:
        return [d for n in names for d in _dirs(n, job)]

    def held(d: str) -> bool:  # an agent lives there (it holds the directory's lock until it exits)
        fd = proto.open_lock(os.path.join(SHM, d))
        if fd is None:
            return os.path.isdir(os.path.join(SHM, d))  # a directory being made or removed: look again
        try:
            return proto.lock_held(fd)
        finally:
            os.close(fd)

    # Until every directory is gone or no agent is left to free it (a SIGKILLed one's: waiting longer is no use).
    if not slurm.until(lambda: not any(held(d) for d in left()), FREED_WITHIN_S) or left():
        kept = sorted(left())
        served = [d for d in kept if (info := proto.read_pid_file(f"{SHM}/{d}")) and proto.pid_alive(info[0])]
        assert served == [], (served, cluster.job_log(job, 80))
        r = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "doctor", "--sweep", "--json"], capture_output=True,
                           text=True, timeout=120, env={**cluster.env, "JAXCKPT_JOB_ID": names[0]})
        assert set(kept) <= {os.path.basename(p) for p in json.loads(r.stdout)["swept"]}, r.stdout[-2000:]
        print(f"left by an agent SLURM SIGKILLed with its spawner's step, swept: {kept}")
    assert left() == []


# torchrun with torch's opt-out of its shared rendezvous store (docs/deploy.md, torchrun): with the store shared,
# and the gloo group's keys kept apart per TORCHELASTIC_RESTART_COUNT, this job hung in 1 of 5 runs here (the
# failed node counts a restart, the other restarts its worker for the new round at its old count: two prefixes).
TORCHRUN_BATCH = """#!/bin/bash
export JAXCKPT_LOG_LEVEL=WARNING TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
srun --ntasks-per-node=1 {py} -m torch.distributed.run --nnodes=2 --nproc-per-node=1 --max-restarts=1 \\
    --monitor-interval=0.5 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:{port} --rdzv-id={name} \\
    {trainer} torch --out {out} --job {name} --steps 5 --fail-rank 1 --fail-at 3 --early-agent w
echo "torchrun exit $?"
"""


@available(None if importlib.util.find_spec("torch") else "torch not installed")
def test_torchrun_under_srun_restarts_workers_from_memory(cluster, name, tmp_path):
    """sbatch on 2 nodes: ``srun`` starts one torchrun per node (c10d rendezvous, ``--max-restarts=1``), one worker
    each; worker 1 dies at step 3, torchelastic restarts both workers, which restore step 3 from their node's memory
    (jaxckpt's torch front end, and DCP on jaxckpt's storage) and train to 5 bit for bit; the node is SLURM's. At the
    script's end every node's memory of both jobs is freed (or swept, as above)."""
    out = str(tmp_path)
    script = tmp_path / "job.sh"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script.write_text(TORCHRUN_BATCH.format(py=sys.executable, name=name, trainer=TRAINER, out=out, port=port))
    r = cluster.run(["sbatch", "-N2", "-J", name, "-o", str(tmp_path / "job.out"), str(script)])
    job = r.stdout.split()[-1]
    ended = slurm.until(lambda: cluster.job_state(job) in ("GONE", "COMPLETED", "CANCELLED", "FAILED"),
                        STEP_TIMEOUT_S, 0.5)
    log = (tmp_path / "job.out").read_text()
    if not ended:  # said here, with the job's output, rather than by the suite's time-out
        cluster.run(["scancel", job], check=False)
        cluster.wait_gone(job, 60)
        pytest.fail(f"job {job} did not end within {STEP_TIMEOUT_S:g}s:\n{log[-4000:]}\n{cluster.job_log(job)}")
    assert "torchrun exit 0" in log and os.path.exists(os.path.join(out, "failed-1")), log[-4000:]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in log, log[-4000:]  # nothing warned of a shared store
    got = results(out, "relaunch", 2)
    for d in got:
        assert d["attempt"] in (0, 1) and d["restored"] == 3 and d["latest"] == 5, d
        assert d["bitwise"] and d["dcp_matches_restore"], d
        assert set(d["kinds"]) == {"local"}, d  # each node's own memory
        assert d["scheduler"] == "slurm" and d["source"] == "SLURMD_NODENAME (SLURM)", d
    # the failed node's torchrun counts a restart; the other counts one where its worker failed too (its
    # all-reduce with the dead rank), else it restarts its worker for the new round at its count (in 1 of 8 runs)
    assert max(d["attempt"] for d in got) == 1, got
    assert sorted(d["node"] for d in got) == cluster.nodes[:2]
    _freed_or_swept(cluster, job, name, f"{name}-dcp")
