"""jaxckpt where SLURM enforces memory: an emulated cluster (jaxckpt/testing/slurm.py) with
``TaskPlugin=task/cgroup``, ``ConstrainRAMSpace=yes`` and memory a consumable resource, so a job's ``--mem`` is
the limit of a memory cgroup SLURM makes for the job on each node, with one under it for each step.

The node agent the trainers spawn runs as a step of its own (``srun --overlap``, backends/agent/lifetime.py), in
the job's memory cgroup beside the trainers: the snapshots' pages are charged there, and the trainers' own memory
counts against the same limit. A save past what the job has left is refused in the trainer (BudgetExceededError
naming the limit and the job's cgroup, as SLURM made it) instead of the kernel's OOM killer ending the agent or a
trainer; the agent serves on, the committed step restores bit for bit, a smaller save fits again. ``jaxckpt
doctor``, run as a step of the job, shows the job's limit and a node budget past it.

One single-node cluster for the module (its teardown checks that no daemon, step process or cgroup is left); it
skips with the reason where it cannot run, except under CI=true (tests/requires.py). About 30 s on 2 cores.
"""
import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from jaxckpt.backends.agent import protocol as proto
from jaxckpt.config import Config
from jaxckpt.testing import slurm
from requires import available

HERE = os.path.dirname(os.path.abspath(__file__))
SHM = proto.shm_base(Config().with_env())
MEMORY_CG = os.path.join(slurm.CGROUP_ROOT, "memory")
JOB_MEM_MB = 1000  # the job's --mem: a trainer importing jax (about 250 MB here) and the agent's snapshots
STEP_TIMEOUT_S = 240.0

pytestmark = available(slurm.unavailable(memory=True))


@pytest.fixture(scope="module")
def cluster():
    with slurm.running("jaxckpt-slurm-mem-", nodes=1, memory_mb=4000) as c:
        yield c


def _step_run(cluster, job: str, args: list[str], *, env: dict | None = None) -> subprocess.CompletedProcess:
    """One task of a new step of ``job`` running this interpreter with ``args``; its output in the result."""
    srun = shutil.which("srun") or "/usr/bin/srun"  # found here: a step's PATH may be the test's to set
    return cluster.run([srun, f"--jobid={job}", "-N1", "-n1", "--overlap", sys.executable, *args],
                       check=False, timeout=STEP_TIMEOUT_S, env={"JAXCKPT_LOG_LEVEL": "WARNING", **(env or {})})


def _job_dirs(name: str, job: str) -> list[str]:
    return slurm.agent_dirs(SHM, name, job)


def test_a_save_past_the_jobs_mem_is_refused_and_the_spawned_agent_lives(cluster, tmp_path):
    """A job of --mem=1000M; its trainer (tests/cgroup_trainer.py) spawns the node agent (a step of its own),
    saves two steps of 32 MiB, then one of 768 MiB (six leaves of one 128 MiB array: the trainer holds 128 MiB of
    it, the agent would need all of it). That save is refused with the job's limit and cgroup named; nothing is
    OOM-killed; step 1 restores bit for bit and a 16 MiB save after it commits. The agent, in a step of its own
    under the job's memory cgroup, still serves, and doctor beside the trainer reads its cgroup."""
    name = f"m{uuid.uuid4().hex[:8]}"
    job = cluster.salloc(1, name, extra=[f"--mem={JOB_MEM_MB}M"])
    job_cg = os.path.join(MEMORY_CG, f"slurm_{cluster.nodes[0]}", f"uid_{os.geteuid()}", f"job_{job}")
    try:
        r = _step_run(cluster, job, [os.path.join(HERE, "cgroup_trainer.py"), "--out", str(tmp_path),
                                     "--small", "32", "--big", "128", "--copies", "6", "--after", "16"],
                      env={"JAXCKPT_JOB_ID": name})
        assert r.returncode == 0 and "oom" not in (r.stdout + r.stderr).lower(), (r.returncode, r.stdout, r.stderr)
        with open(tmp_path / "result.json") as f:
            got = json.load(f)
        refused = got["refused"] or ""
        assert refused.startswith(f"step 2 of process 0: a segment of {768 << 20} bytes does not fit the memory "
                                  f"cgroup limit of the node agent ({JOB_MEM_MB << 20} bytes at {job_cg}, "), got
        assert "raise that limit (the agent's container's; under SLURM the job's --mem, which its steps share)" \
            in refused and refused.endswith("(committed steps [1] are kept)"), refused
        assert got["steps"] == [1] and got["restored"] == 1 and got["bitwise"] and got["after_bitwise"], got

        agent = got["agent"]
        # the agent's own step, under the job's cgroup: charged with the trainers, limited by the job's --mem
        assert agent["cgroup"].startswith(job_cg + "/step_"), agent
        assert agent["status_cgroup"]["path"] == job_cg and agent["status_cgroup"]["limit"] == JOB_MEM_MB << 20, agent
        assert agent["oom_kills"] and not any(agent["oom_kills"].values()), agent  # the job's level among them
        # doctor beside the trainer, while the agent serves, reads the agent's cgroup from its status
        g = agent["doctor"]["memory_cgroup"]
        assert (g["of"], g["path"], g["limit"]) == ("agent", job_cg, JOB_MEM_MB << 20), g
    finally:
        cluster.run(["scancel", job], check=False)
    cluster.wait_gone(job, 120.0)
    # freed by the agent at the allocation's end (within KillWait), unless SLURM SIGKILLed it with the trainer's
    # step (tests/test_slurm_ends.py covers that case and its sweep)
    slurm.until(lambda: not _job_dirs(name, job), 30.0)
    left = _job_dirs(name, job)
    assert not left or not any((i := proto.read_pid_file(os.path.join(SHM, d))) and proto.pid_alive(i[0])
                               for d in left), f"the allocation's end left {left} served"
    for d in left:
        shutil.rmtree(os.path.join(SHM, d))


def test_doctor_in_a_step_reads_the_jobs_limit_and_how_the_agent_will_be_spawned(cluster):
    """``jaxckpt doctor`` as a step of a job of --mem=1000M, before any agent runs: the job's memory cgroup and
    limit, a node budget of 2 GiB past it as a problem; with ``srun`` at hand the trainers spawn the agent as a
    step of its own, which SLURM sometimes kills with theirs; where the step's PATH has no ``srun`` they would
    spawn it inside their step, which dies with it: either way a warning recommends the agent as its own step."""
    name = f"d{uuid.uuid4().hex[:8]}"
    job = cluster.salloc(1, name, extra=[f"--mem={JOB_MEM_MB}M"])
    job_cg = os.path.join(MEMORY_CG, f"slurm_{cluster.nodes[0]}", f"uid_{os.geteuid()}", f"job_{job}")
    env = {"JAXCKPT_STORE": "shm", "JAXCKPT_JOB_ID": name, "JAXCKPT_MEMORY_BUDGET_BYTES": str(2 << 30)}
    try:
        r = _step_run(cluster, job, ["-m", "jaxckpt.cli", "doctor", "--json"], env=env)
        report = json.loads(r.stdout)
        assert r.returncode == 1, (r.stdout, r.stderr)  # the budget is a problem
        assert report["memory_cgroup"]["limit"] == JOB_MEM_MB << 20, report["memory_cgroup"]
        assert report["memory_cgroup"]["path"].startswith(job_cg), report["memory_cgroup"]
        assert [p for p in report["problems"] if p.startswith("the node's memory budget, 2.0 GiB")] == [
            f"the node's memory budget, 2.0 GiB (1 process(es) x Config.memory_budget_bytes), does not fit this "
            f"process's memory cgroup: limit {JOB_MEM_MB}.0 MiB at {report['memory_cgroup']['path']}, "
            f"{report['memory_cgroup']['used'] / (1 << 20):.1f} MiB in use; an agent it spawns is charged there "
            f"and refuses saves past the limit: raise the limit (a SLURM job's --mem, the container's) or lower "
            f"the budget"], report["problems"]
        assert report["agent"]["running"] is False and report["agent"]["spawn"] == "own step", report["agent"]
        assert any(w.startswith("no agent runs for this job on this node: the trainers will spawn one as a step of "
                                "its own, which SLURM sometimes kills with their step") and
                   f"srun --overlap --ntasks-per-node=1 jaxckpt agent --job {name} --wait &" in w
                   for w in report["warnings"]), report["warnings"]

        bare = _step_run(cluster, job, ["-m", "jaxckpt.cli", "doctor", "--json"],
                         env={**env, "PATH": os.path.dirname(sys.executable)})  # no srun here
        report = json.loads(bare.stdout)
        assert report["agent"]["spawn"] == "trainers' step", report["agent"]
        said = "no agent runs for this job on this node: srun is not on PATH or this is no allocation: the " \
               "trainers will spawn one inside their step"
        assert any(w.startswith(said) for w in report["warnings"]), report["warnings"]
    finally:
        cluster.run(["scancel", job], check=False)
    cluster.wait_gone(job, 120.0)
