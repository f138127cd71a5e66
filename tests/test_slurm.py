"""jaxckpt under a real SLURM: an emulated cluster of 3 nodes (slurmctld, one ``slurmd -N`` each, proctrack/cgroup),
jobs through real ``salloc``/``srun``/``sbatch``, trainers that call ``jax.distributed.initialize()`` with no
arguments (tests/scheduler_trainer.py), the node being SLURM's (SLURMD_NODENAME) and the agent's directory the
default one, per job, allocation and node.

- a step that fails in a running allocation is relaunched and restores from memory, bit for bit (agents spawned by
  the trainers as steps of their own: they outlive the failed step); the allocation's end frees every node's
  memory (the agents hear of it); what a SIGKILLed agent left is swept by the next agent, or by the epilog;
- agents run as their own step (``srun --overlap ... jaxckpt agent --peers ... --wait``, docs/deploy.md's
  rendezvous): a node is lost with its memory and the job is relaunched on a spare node of the allocation, whose
  agent (started by the trainer's ``jaxckpt.start_agent()``) rebuilds the lost share from the peers' protection
  before the trainer asks, bit for bit; then scancel frees every node's memory and stops every agent;
- a batch script that ends normally frees the memory its agent step held.

One cluster for the module, started and stopped here (its teardown checks that no daemon, step process or cgroup
is left, also after a failed test); every test skips with the reason where it cannot run (not root, the packages
absent), except under CI=true, where that is an error (tests/requires.py). Each test states what it takes in its docstring; the whole module is about 2-3 minutes
on 2 cores.
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from jaxckpt.backends.agent import protocol as proto
from jaxckpt.backends.agent.protocol import kill_agent, read_pid_file
from jaxckpt.config import Config
from jaxckpt.testing import free_ports, slurm
from requires import available
from scheduler_trainer import early_agent_calls, live_pids, results

HERE = os.path.dirname(os.path.abspath(__file__))
# Where the jobs' default agent directories are: /dev/shm, or the memory filesystem a site names for every process
# (JAXCKPT_SHM_ROOT, which the emulated cluster's steps inherit).
SHM = proto.shm_base(Config().with_env())
TRAINER = os.path.join(HERE, "scheduler_trainer.py")
FREED_WITHIN_S = 30.0  # KillWait (5 s here) plus the agent's own exit, with room for a loaded machine
# SLURM's own end of an allocation (the controller and each slurmd signalling, waiting KillWait, reaping the steps):
# its daemons' pace on a loaded 2-core machine, not jaxckpt's, so it gets a bound of its own.
JOB_END_S = 180.0
STEP_TIMEOUT_S = 240.0

pytestmark = available(slurm.unavailable())


@pytest.fixture(scope="module")
def cluster():
    with slurm.running(nodes=3) as c:
        yield c


@pytest.fixture
def job_name():
    return f"t{uuid.uuid4().hex[:8]}"


# ----------------------------------------------------------------------------------------------- helpers
def nodes(cluster, *index: int) -> str:
    """The node list of the cluster's nodes ``index`` (0-based)."""
    return ",".join(cluster.nodes[i] for i in index)


def srun(cluster, job: str, nodes: str, args: list[str], *, extra: tuple = (), env: dict | None = None
         ) -> subprocess.Popen:
    """``srun`` of the trainer in allocation ``job`` on ``nodes`` (one task per node), with this interpreter, in
    ``env`` (default: the cluster's)."""
    cmd = ["srun", f"--jobid={job}", f"--nodelist={nodes}", f"-N{len(nodes.split(','))}", "--ntasks-per-node=1",
           "--kill-on-bad-exit=1", *extra, sys.executable, TRAINER, "jax", *args]
    return subprocess.Popen(cmd, env={**(env or cluster.env), "JAXCKPT_LOG_LEVEL": "WARNING"}, cwd=HERE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(p: subprocess.Popen, timeout: float = STEP_TIMEOUT_S) -> str:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        raise AssertionError(f"srun did not finish in {timeout:g}s:\n{out[-4000:]}")
    return out


def wait_for(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout:g}s: {what}")
        time.sleep(0.1)
    return time.monotonic() - t0


def job_dirs(name: str, job: str) -> list[str]:
    """This job's default agent directories on every emulated node (all in this machine's SHM)."""
    return slurm.agent_dirs(SHM, name, job)


def agent_pids(name: str, job: str) -> list[int]:
    """Live processes running ``jaxckpt agent`` for this job (its command line names the job)."""
    return live_pids("agent", "--job", name)


def agent_step(job: str, directory: str) -> str:
    """The SLURM step id the agent serving ``directory`` runs in, from its freezer cgroup (proctrack/cgroup)."""
    info = read_pid_file(directory)
    assert info is not None, f"no agent serves {directory}"
    with open(f"/proc/{info[0]}/cgroup") as f:
        m = re.search(rf"job_{job}/step_(\w+)", f.read())
    assert m, f"agent {info[0]} of {directory} runs in no step of job {job}"
    return m.group(1)


def _serving(directory: str, job: str) -> bool:
    """Whether an agent answers at ``directory`` (a status round trip)."""
    from jaxckpt.errors import JaxckptError

    try:
        proto.agent_status(directory, job, timeout_s=5.0)
        return True
    except (JaxckptError, OSError):
        return False


def assert_freed(cluster: slurm.SlurmCluster, name: str, job: str) -> float:
    """Every node's memory of the allocation and every agent of it gone: within FREED_WITHIN_S, or, where SLURM is
    still ending the job then (its steps not yet reaped), once it has ended it; the seconds. The failure says what
    was left at the end, the job's state and SLURM's log lines about it."""
    def freed() -> bool:
        return not job_dirs(name, job) and not agent_pids(name, job)

    t0 = time.monotonic()
    if slurm.until(freed, FREED_WITHIN_S):
        return time.monotonic() - t0
    state = cluster.job_state(job)
    ended = state in ("GONE", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT")
    if not ended:  # SLURM has not ended the allocation yet: its steps (the agents among them) may still run
        cluster.wait_gone(job, JOB_END_S)
    if slurm.until(freed, 5.0 if ended else FREED_WITHIN_S):
        return time.monotonic() - t0
    raise AssertionError(f"job {job}'s memory not freed {time.monotonic() - t0:.0f}s after its end began (state "
                         f"{state} at {FREED_WITHIN_S:g}s, now {cluster.job_state(job)}): dirs {job_dirs(name, job)}, "
                         f"agents {agent_pids(name, job)}\n{cluster.job_log(job, 80)}")


# ------------------------------------------------------------------------------------------------- tests
def test_failed_step_relaunched_restores_from_memory_and_allocation_end_frees_it(cluster, job_name, tmp_path):
    """2 nodes, agents spawned by the trainers (``jaxckpt.start_agent()`` first thing in step 0, a Checkpointer's
    spawn where none serves later), each through ``srun --overlap`` as a step of its own.
    In step 0 rank 1 dies once step 3 is committed (SIGKILL; --kill-on-bad-exit ends the step); step 1 restores
    step 3 from the nodes' memory (served by the agents' steps, which usually outlive step 0, or adopted by new
    ones where SLURM cancelled them with it: backends/agent/lifetime.py) and trains to 5 bit for bit. The
    allocation then ends while step 1 runs: the agents get SIGTERM, see the job COMPLETING and free every node's
    memory, with no epilog and no later agent. About 40 s."""
    out = str(tmp_path)
    job = cluster.salloc(2, job_name)
    args = ["--out", out, "--job", job_name, "--steps", "5", "--fail-rank", "1", "--fail-at", "3"]
    finish(srun(cluster, job, nodes(cluster, 0, 1), args + ["--early-agent", "first"]))
    assert os.path.exists(os.path.join(out, "failed-1"))
    dirs = job_dirs(job_name, job)
    assert len(dirs) == 2, dirs
    # Step 0's trainers called jaxckpt.start_agent() first thing, before importing jax: each started its node's
    # agent (checked below to be a step of its own, as the Checkpointer's spawn makes it).
    calls = early_agent_calls(out, "first")
    assert [c["started"] for c in calls] == [True, True] and not any(c["jax_imported"] for c in calls), calls
    p = srun(cluster, job, nodes(cluster, 0, 1), args + ["--linger"])
    wait_for(lambda: all(os.path.exists(os.path.join(out, f"result-{r}-relaunch.json")) for r in (0, 1))
             or p.poll() is not None, STEP_TIMEOUT_S, "the relaunched step's results")
    got = results(out, "relaunch", 2)
    for r in got:
        assert r["restored"] == 3 and r["bitwise"] and r["latest"] == 5, r
        assert set(r["kinds"]) <= {"local", "node", "remote"} and r["kinds"], r  # from memory, no other tier
        assert r["scheduler"] == "slurm" and r["source"] == "SLURMD_NODENAME (SLURM)", r
    assert [r["node"] for r in got] == cluster.nodes[:2]
    assert [os.path.basename(r["agent_dir"]) for r in got] == dirs
    # The serving agents are steps of their own. Counted by the agents that serve, not by the steps listed: an agent
    # step SLURM cancelled with step 0 may still be listed while it ends, beside the one that adopted its memory.
    names = dict(line.split(None, 1) for line in
                 cluster.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"]).stdout.splitlines() if line.strip())
    serving = [agent_step(job, os.path.join(SHM, d)) for d in dirs]
    assert len(set(serving)) == 2 and all(names.get(f"{job}.{s}") == "jaxckpt-agent" for s in serving), \
        (serving, names)
    cluster.run(["scancel", job])
    finish(p)
    took = assert_freed(cluster, job_name, job)
    print(f"the allocation's end freed the memory in {took:.1f}s (agents spawned by the trainers)")


def test_next_agent_sweeps_what_a_killed_agent_left(cluster, job_name):
    """An agent SIGKILLed (a crash: nothing of jaxckpt's left to hear of the allocation's end) leaves its node's
    memory when the allocation ends; the next agent of the user on the node, in a later allocation, removes it.
    About 10 s."""
    job = cluster.salloc(1, job_name)
    first = subprocess.Popen(["srun", f"--jobid={job}", "--overlap", sys.executable, "-m", "jaxckpt.cli", "agent",
                              "--job", job_name], env=cluster.env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    wait_for(lambda: any(os.path.exists(f"{SHM}/{d}/agent.sock") for d in job_dirs(job_name, job)), 60,
             "the first agent serving")
    os.kill(read_pid_file(f"{SHM}/{job_dirs(job_name, job)[0]}")[0], signal.SIGKILL)
    first.wait(60)
    cluster.run(["scancel", job])
    cluster.wait_gone(job)
    assert len(job_dirs(job_name, job)) == 1  # nobody freed it
    later, name = cluster.salloc(1, f"{job_name}-later"), f"{job_name}-later"
    agent = subprocess.Popen(["srun", f"--jobid={later}", "--overlap", sys.executable, "-m", "jaxckpt.cli", "agent",
                              "--job", name], env=cluster.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: not job_dirs(job_name, job), 60, "the next agent's sweep of the ended allocation's memory")
        wait_for(lambda: job_dirs(name, later), 60, "the next agent serving")
        cluster.run(["scancel", later])
        assert_freed(cluster, name, later)
    finally:
        agent.wait(60)


def test_agent_decides_within_kill_wait_when_the_controller_does_not_answer(cluster, job_name, tmp_path):
    """An agent step in a running allocation learns SLURM's KillWait (5 s here) as it starts. The controller is then
    stopped (SIGSTOP: it answers nothing, as one swamped by job ends) and the agent gets SIGTERM, as a step's
    cancel sends it: it asks SLURM within half of KillWait, gets no answer, frees the node's memory and exits by
    itself, where an agent that waited longer would be SIGKILLed by slurmd and leave the memory to no one. About
    10 s."""
    job = cluster.salloc(1, job_name)
    log_path = tmp_path / "agent.log"
    agent = cluster.agent_step(job, job_name, str(log_path))
    try:
        wait_for(lambda: "KillWait is 5 s" in (log_path.read_text() if log_path.exists() else ""), 60,
                 "the agent serving, KillWait learnt")
        (directory,) = job_dirs(job_name, job)
        pid = read_pid_file(f"{SHM}/{directory}")[0]
        with cluster.controller_stopped():
            os.kill(pid, signal.SIGTERM)
            wait_for(lambda: not proto.pid_alive(pid), 60, "the agent's own exit")
        text = log_path.read_text()
        budget = re.search(r"SIGTERM \d+ ms ago; deciding within ([\d.]+) s \(KillWait 5 s\)", text)
        assert budget and float(budget.group(1)) <= 2.5, text  # half of KillWait, less the time since the signal
        assert re.search(rf"SIGTERM \(the state of SLURM job {job} is unknown, asked in \d+ ms\): freeing the "
                         rf"node's memory", text), text
        assert not job_dirs(job_name, job) and "stopped: freed" in text, text
    finally:
        cluster.run(["scancel", job])
        agent.wait(60)
        cluster.wait_gone(job)


def test_node_lost_replaced_by_a_spare_whose_agent_recovers_its_share(cluster, job_name, tmp_path):
    """docs/deploy.md's rendezvous recipe under srun. 3 nodes; an agent step on each of the first two (``srun
    --overlap ... jaxckpt agent --peer-port P --peers <every node's address> --wait``, the job's token in the
    environment); trainers there with protection; rank 1 dies at step 3 (protected) and the second node is lost
    with its memory. The job is relaunched on the first and the third (a spare, no agent): each trainer's first act
    is ``jaxckpt.start_agent()``, which on the spare starts an agent (a step of its own) told the peers: it finds
    the first node's agent and rebuilds the lost node's share into its own memory, receiving at most 1.1x what it
    rebuilt, while the trainer imports JAX; the trainers restore step 3 from their nodes' memory (nothing rebuilt
    by them) bit for bit and protect again. The spare then gets the recipe's agent step too (it waits behind the
    spawned agent, or adopts what that one left where SLURM cancelled it with the trainer's step: lifetime.py's
    srun race); scancel then frees every node and stops every agent. About 35 s."""
    out = str(tmp_path)
    job = cluster.salloc(3, job_name)
    ports = dict(zip(cluster.nodes[:3], free_ports(3)))  # the emulated nodes share 127.0.0.1: a port each
    peers = ",".join(f"127.0.0.1:{p}" for p in ports.values())
    env = {**cluster.env, "JAXCKPT_PEER_TOKEN": "9f" * 32, "JAXCKPT_AGENT_PEERS": peers}
    agents = [subprocess.Popen(["srun", f"--jobid={job}", "--overlap", f"--nodelist={n}", "-N1", "--ntasks=1",
                                sys.executable, "-m", "jaxckpt.cli", "agent", "--job", job_name, "--peer-port",
                                str(ports[n]), "--peers", peers, "--wait", "--log", f"{out}/agent-step-{n}.log"],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
              for n in cluster.nodes[:2]]
    try:
        wait_for(lambda: len([d for d in job_dirs(job_name, job)
                              if os.path.exists(f"{SHM}/{d}/agent.sock")]) == 2, 60, "2 agent steps listening")
        args = ["--out", out, "--job", job_name, "--steps", "5", "--fail-rank", "1", "--fail-at", "3",
                "--protection", "hybrid", "--agent-ports", ",".join(f"{n}={p}" for n, p in ports.items())]
        finish(srun(cluster, job, nodes(cluster, 0, 1), args, env=env))
        assert os.path.exists(os.path.join(out, "failed-1"))
        lost = f"{SHM}/jaxckpt-{os.geteuid()}-{job_name}@slurm{job}@{cluster.nodes[1]}"
        assert proto.kill_agent(lost, remove_memory=True) is not None  # the second node is lost with its memory
        subprocess.run(["rm", "-rf", lost], check=True)
        finish(srun(cluster, job, nodes(cluster, 0, 2), args + ["--early-agent", "relaunch"], env=env))
        calls = early_agent_calls(out, "relaunch")
        assert sorted(c["started"] for c in calls) == [False, True], calls  # the spare's; the first node's serves
        got = results(out, "relaunch", 2)
        # the spare's agent's recovery as its trainer's hello saw it: that agent, a step srun started from the
        # trainer's step, may be cancelled with that step (backends/agent/lifetime.py's srun race)
        recovery = got[1]["agent_recovery"]
        assert recovery["state"] == "done" and recovery["step"] == 3 and recovery["processes"] == [1], recovery
        assert recovery["peers"] == [f"{cluster.nodes[0]} at tcp://127.0.0.1:{ports[cluster.nodes[0]]}"], recovery
        assert 0 < recovery["received"] <= 1.1 * recovery["bytes"], recovery
        for r in got:
            assert r["restored"] == 3 and r["bitwise"] and r["latest"] == 5, r
            assert r["kinds"] and "rebuild" not in r["kinds"], r  # the spare's agent had rebuilt it: read locally
        assert [r["node"] for r in got] == [cluster.nodes[0], cluster.nodes[2]]
        assert all(5 in r["protected"] for r in got), got  # protection resumed on the new node set
        # deploy.md's agent step on the spare, as a batch script runs one on every node: it waits behind the spawned
        # agent, or adopts the memory that one left if SLURM cancelled it with the trainer's step
        agents.append(subprocess.Popen(
            ["srun", f"--jobid={job}", "--overlap", f"--nodelist={cluster.nodes[2]}", "-N1", "--ntasks=1",
             sys.executable, "-m", "jaxckpt.cli", "agent", "--job", job_name, "--peer-port", str(ports[cluster.nodes[2]]),
             "--peers", peers, "--wait", "--log", f"{out}/agent-step-{cluster.nodes[2]}.log"], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        spare = f"{SHM}/jaxckpt-{os.geteuid()}-{job_name}@slurm{job}@{cluster.nodes[2]}"
        wait_for(lambda: _serving(spare, job_name), 60, f"an agent serving {spare}")
        cluster.run(["scancel", job])
        try:
            took = assert_freed(cluster, job_name, job)
        except AssertionError as e:  # what each agent step decided at the allocation's end, and SLURM's view
            logs = "".join(f"{p.name}:\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("agent-step-*.log")))
            raise AssertionError(f"{e}\n{logs}\n{cluster.job_log(job, 120)}") from None
        print(f"allocation end freed the memory in {took:.1f}s")
    finally:
        for a in agents:
            if a.poll() is None:
                a.send_signal(signal.SIGTERM)
            a.wait(60)


BATCH = """#!/bin/bash
srun --overlap --ntasks-per-node=1 bash -c 'exec {py} -m jaxckpt.cli agent --job {name} --wait --log {out}/agent-$SLURMD_NODENAME.log' &
srun --ntasks-per-node=1 --kill-on-bad-exit=1 {py} {trainer} jax --out {out} --job {name} --steps 2
echo "trainer exit $?"
"""


def test_batch_script_end_frees_the_memory(cluster, job_name, tmp_path):
    """sbatch on 2 nodes: an agent step in the background, one trainer step, then the script ends normally: the
    allocation's end stops the agent step, which frees each node's memory. About 30 s."""
    out = str(tmp_path)
    script = tmp_path / "job.sh"
    script.write_text(BATCH.format(py=sys.executable, name=job_name, trainer=TRAINER, out=out))
    r = cluster.run(["sbatch", "-N2", "-J", job_name, "-o", str(tmp_path / "job.out"), str(script)])
    job = r.stdout.split()[-1]
    cluster.wait_gone(job, STEP_TIMEOUT_S)
    try:
        took = assert_freed(cluster, job_name, job)
    except AssertionError as e:  # what each agent decided at the allocation's end, and the controller's view
        logs = "".join(f"{p.name}:\n{p.read_text()[-2000:]}" for p in sorted(tmp_path.glob("agent-*.log")))
        out_file = tmp_path / "job.out"  # the agents' own stderr (a traceback) comes through their srun to here
        raise AssertionError(f"{e}\n{logs}\njob.out:\n{out_file.read_text()[-2000:] if out_file.exists() else ''}\n"
                             f"{cluster.job_log(job)}") from None
    log = (tmp_path / "job.out").read_text()
    assert "trainer exit 0" in log, log[-3000:]
    got = results(out, "first", 2)
    assert all(r["bitwise"] and r["latest"] == 2 for r in got), got
    print(f"the batch script's end freed the memory in {took:.1f}s")


def test_shipped_epilog_frees_an_ended_allocations_memory(job_name, tmp_path):
    """A cluster of its own whose slurm.conf names examples/slurm/epilog.sh as Epilog. The agents are SIGKILLed
    (nothing of jaxckpt's is left to hear of the allocation's end); scancel while the step runs: the epilog
    removes each node's memory, with no later agent to sweep it. About 25 s."""
    epilog = os.path.join(os.path.dirname(HERE), "examples", "slurm", "epilog.sh")
    root = tempfile.mkdtemp(prefix="jaxckpt-slurm-epilog-")
    if SHM != "/dev/shm":  # a site's own root, added to the shipped script's ROOTS as its comment says
        with open(epilog) as f:
            text = f.read()
        assert '\nROOTS="/dev/shm"\n' in text
        epilog = os.path.join(root, "epilog.sh")
        with open(epilog, "w") as f:
            f.write(text.replace('\nROOTS="/dev/shm"\n', f'\nROOTS="/dev/shm {SHM}"\n'))
        os.chmod(epilog, 0o755)
    c = slurm.SlurmCluster(root, nodes=2, epilog=epilog)
    try:
        c.start()
        out = str(tmp_path)
        job = c.salloc(2, job_name)
        p = srun(c, job, nodes(c, 0, 1), ["--out", out, "--job", job_name, "--steps", "2", "--linger"])
        wait_for(lambda: all(os.path.exists(os.path.join(out, f"result-{r}-first.json")) for r in (0, 1))
                 or p.poll() is not None, STEP_TIMEOUT_S, "the step's results")
        assert all(r["bitwise"] for r in results(out, "first", 2))
        assert len(job_dirs(job_name, job)) == 2
        for d in job_dirs(job_name, job):
            assert kill_agent(f"{SHM}/{d}") is not None
        c.run(["scancel", job])
        finish(p)
        took = assert_freed(cluster, job_name, job)
        print(f"the epilog freed the memory {took:.1f}s after the step ended")
    finally:
        try:
            c.stop()
            assert not c.leftovers(), f"the emulated cluster left {c.leftovers()}"
        finally:
            subprocess.run(["rm", "-rf", root], check=False)
