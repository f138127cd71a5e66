"""A node agent under a memory cgroup limit (a Kubernetes container's or pod's, a SLURM job's ``--mem``;
under SLURM itself: tests/test_slurm_memory.py).

The snapshots' tmpfs pages are charged to the agent, which allocates them. A save that would take it over its
cgroup's limit set off the kernel's OOM killer in that cgroup: the agent was SIGKILLed and every trainer of the
node skipped its saves until an agent served again. Now the agent refuses that save (BudgetExceededError naming
the limit and the cgroup), goes on serving, and what was committed stays restorable bit for bit; a smaller save
after it fits again, since nothing this process no longer uses keeps the pages of the segments the agent
unlinked (an idle copy worker held the last snapshot buffer it had seen; a refused reserve kept the mappings
the trainer had cached).

The real thing runs where it can: a v1 memory cgroup of the test's own, the agent moved into it, real saves and
restores (root and the v1 memory controller; CI has both). The unified (v2) hierarchy is not mounted with the
memory controller here: its reading is checked on a directory laid out as the kernel lays it out.
"""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from typing import Iterator

import numpy as np
import pytest

import jaxckpt
from jaxckpt import Config
from jaxckpt.backends.agent import cgroup
from jaxckpt.backends.agent import protocol as proto
from jaxckpt.core.copier import Copier, CopyTask
from jaxckpt.core.store import Slot
from jaxckpt.errors import BudgetExceededError
from requires import available

V1 = cgroup.V1_ROOT
MIB = 1 << 20


def _why_no_v1() -> str | None:
    if os.geteuid() != 0:
        return "needs root: a memory cgroup of its own"
    if not os.path.isfile(os.path.join(V1, "memory.limit_in_bytes")):
        return f"no cgroup v1 memory controller at {V1}"
    return None


def _deleted_maps(directory: str) -> list[str]:
    """Files of ``directory`` this process still maps although they were unlinked."""
    with open("/proc/self/maps") as f:
        return [ln.split()[-2] for ln in f if directory in ln and ln.rstrip().endswith("(deleted)")]


def _state(step: int, mib: int) -> dict:
    return {"x": np.arange(mib * MIB // 4, dtype=np.uint32) * np.uint32(step + 1)}


@contextlib.contextmanager
def _agent_in_cgroup(log_dir: str) -> Iterator[tuple[str, str, str, subprocess.Popen]]:
    """A node agent of a new job, serving, moved into a v1 memory cgroup of its own (no limit yet): (job, its
    directory, the cgroup, the agent). On exit the agent gets SIGTERM (and must exit 0), its memory and the cgroup
    go."""
    job = f"cg-{uuid.uuid4().hex[:6]}"
    d = f"/dev/shm/jaxckpt-cgtest-{job}"
    cg = os.path.join(V1, f"jaxckpt-test-{job}")
    os.mkdir(cg)
    agent = subprocess.Popen([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", job, "--dir", d, "--log",
                              os.path.join(log_dir, f"agent-{job}.log")])
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(d, proto.SOCKET_NAME)):
            assert agent.poll() is None and time.monotonic() < deadline, "the agent did not start"
            time.sleep(0.01)
        with open(os.path.join(cg, "cgroup.procs"), "w") as f:
            f.write(str(agent.pid))  # from here its allocations are charged to the cgroup
        yield job, d, cg, agent
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=60)
        proto.kill_agent(d, remove_memory=True)
        os.rmdir(cg)
    assert agent.returncode == 0


@available(_why_no_v1())
def test_a_save_over_the_agents_memory_cgroup_limit_is_refused_not_killed(tmp_path):
    with contextlib.ExitStack() as stack:
        job, d, cg, agent = stack.enter_context(_agent_in_cgroup(str(tmp_path)))
        with open(os.path.join(cg, "memory.usage_in_bytes")) as f:
            limit = int(f.read()) + 80 * MIB  # room for two 32 MiB segments and the margin, not for 64 more
        with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))
        ck = jaxckpt.Checkpointer(Config(store="shm", job_id=job, shm_dir=d, keep=1))
        stack.callback(ck.close)  # before the agent's end
        for step in (0, 1):
            ck.save(step, _state(step, 32))
            ck.wait()
        with pytest.raises(BudgetExceededError) as got:
            ck.save(2, _state(2, 64))
        said = str(got.value)
        assert f"step 2 of process 0: a segment of {64 * MIB} bytes does not fit the memory cgroup limit of the " \
               f"node agent ({limit} bytes at {cg}," in said and "committed steps [1] are kept" in said, said
        assert agent.poll() is None, "the agent was killed"
        # the refusal freed the idle pooled segment, and nothing here maps it any more (its pages are gone)
        assert _deleted_maps(d) == [], _deleted_maps(d)
        with open(os.path.join(cg, "memory.oom_control")) as f:
            oom = dict(ln.split() for ln in f if ln.strip())
        assert oom.get("oom_kill", "0") == "0", oom
        assert ck.all_steps() == [1]
        assert np.array_equal(ck.restore()["x"], _state(1, 32)["x"])
        ck.save(3, _state(3, 16))  # a smaller save fits in what the refusal freed
        ck.wait()
        assert np.array_equal(ck.restore()["x"], _state(3, 16)["x"])
        assert agent.poll() is None


@available(_why_no_v1())
def test_doctor_reports_the_memory_cgroup_a_spawned_agent_shares():
    """``jaxckpt doctor`` run as a job's process (here in a cgroup of 256 MiB, as a SLURM job's --mem would make
    it) shows the limit, and a node budget that does not fit it is a problem (exit 1)."""
    import json

    cg = os.path.join(V1, f"jaxckpt-doctor-{uuid.uuid4().hex[:6]}")
    os.mkdir(cg)
    try:
        with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as f:
            f.write(str(256 * MIB))
        env = {**os.environ, "JAXCKPT_STORE": "shm", "JAXCKPT_MEMORY_BUDGET_BYTES": str(1 << 30)}
        r = subprocess.run(["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" -m jaxckpt.cli doctor --json',
                            sys.executable], env=env, capture_output=True, text=True, timeout=120)
        got = json.loads(r.stdout)
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert got["memory_cgroup"]["path"] == cg and got["memory_cgroup"]["limit"] == 256 * MIB, got
        assert any(p.startswith("the node's memory budget, 1.0 GiB (1 process(es) x Config.memory_budget_bytes), "
                                f"does not fit this process's memory cgroup: limit 256.0 MiB at {cg}")
                   for p in got["problems"]), got["problems"]
    finally:
        os.rmdir(cg)


@available(_why_no_v1())
def test_doctor_reads_the_memory_cgroup_of_the_agent_that_serves(tmp_path):
    """An agent in a cgroup of its own, as a Kubernetes DaemonSet's runs in another pod than the trainers: ``jaxckpt
    doctor`` (in this process's cgroup, which has no limit) reports the agent's cgroup from the agent's status
    reply, with the snapshots it holds, and a node budget past it as a problem naming the agent; also from another
    PID namespace, where the agent's pid is not visible (its socket answers); ``jaxckpt ls`` shows the cgroup."""
    import json

    with contextlib.ExitStack() as stack:
        job, d, cg, agent = stack.enter_context(_agent_in_cgroup(str(tmp_path)))
        with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as f:
            f.write(str(512 * MIB))
        ck = jaxckpt.Checkpointer(Config(store="shm", job_id=job, shm_dir=d, keep=1))
        stack.callback(ck.close)  # before the agent's end
        ck.save(0, _state(0, 32))
        ck.wait()
        env = {**os.environ, "JAXCKPT_STORE": "shm", "JAXCKPT_JOB_ID": job, "JAXCKPT_SHM_DIR": d,
               "JAXCKPT_MEMORY_BUDGET_BYTES": str(1 << 30)}
        r = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "doctor", "--json"], env=env, capture_output=True,
                           text=True, timeout=120)
        got = json.loads(r.stdout)
        assert r.returncode == 1, (r.stdout, r.stderr)
        g = got["memory_cgroup"]
        assert (g["of"], g["path"], g["limit"]) == ("agent", cg, 512 * MIB), g
        assert g["held"] >= 32 * MIB and g["used"] >= 32 * MIB, g  # the step's segment, charged to the agent
        assert any(p.startswith("the node's memory budget, 1.0 GiB (1 process(es) x Config.memory_budget_bytes), "
                                f"does not fit the node agent's memory cgroup (pid {agent.pid}): limit 512.0 MiB "
                                f"at {cg}") for p in got["problems"]), got["problems"]
        text = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "doctor"], env=env, capture_output=True,
                              text=True, timeout=120).stdout
        assert f"memory cgroup  {cg} (the node agent's): limit 512.0 MiB, " in text, text
        # from another PID namespace (a trainer pod beside a DaemonSet's agent), where the agent's pid means
        # nothing: the agent still answers on its socket, and its cgroup is the one reported
        r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "jaxckpt.cli",
                            "doctor", "--json"], env=env, capture_output=True, text=True, timeout=120)
        got = json.loads(r.stdout)
        assert got["agent"]["running"] and got["agent"]["pid"] == agent.pid, got["agent"]  # the agent's own pid
        assert (got["memory_cgroup"]["of"], got["memory_cgroup"]["path"]) == ("agent", cg), got["memory_cgroup"]
        listed = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "ls", "--dir", d, "--job", job], env=env,
                                capture_output=True, text=True, timeout=120)
        assert f"\nmemory cgroup {cg}: limit 512.0 MiB, " in listed.stdout, (listed.stdout, listed.stderr)


def _write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_the_tightest_level_of_a_v2_hierarchy_is_the_room(tmp_path):
    """memory.max at every level from the process's cgroup up (a pod's limit above its container's), reclaimable
    file cache not counted as use; "max" everywhere is no limit."""
    root = tmp_path / "cgroup"
    _write(root / "cgroup.controllers", "cpu memory pids\n")
    _write(tmp_path / "self", "0::/pod/ctr\n")
    stat = "anon 1000\nfile 9000\nactive_file 3000\ninactive_file 2000\nshmem 4000\n"
    for level, limit, current in (("pod", "100000000\n", "60000000\n"), ("pod/ctr", "max\n", "50000000\n")):
        _write(root / level / "memory.max", limit)
        _write(root / level / "memory.current", current)
        _write(root / level / "memory.stat", stat)
    got = cgroup.room(str(tmp_path / "self"), str(tmp_path / "no-v1"), str(root))
    assert got == cgroup.Room(str(root / "pod"), 100_000_000, 60_000_000 - 5000), got
    assert got.free == 100_000_000 - (60_000_000 - 5000) - cgroup.MARGIN
    _write(root / "pod" / "memory.max", "max\n")
    assert cgroup.room(str(tmp_path / "self"), str(tmp_path / "no-v1"), str(root)) is None
    # a container that mounts its own cgroup at the root while /proc names the host's path: the root alone
    _write(root / "memory.max", "70000000\n")
    _write(root / "memory.current", "20000000\n")
    _write(root / "memory.stat", stat)
    _write(tmp_path / "self", "0::/kubepods/burstable/pod-1/ctr-2\n")
    assert cgroup.room(str(tmp_path / "self"), str(tmp_path / "no-v1"), str(root)) == \
        cgroup.Room(str(root), 70_000_000, 20_000_000 - 5000)


def test_no_memory_cgroup_is_no_limit(tmp_path):
    _write(tmp_path / "self", "garbage\n4:memory:/\n0::/\n")
    assert cgroup.room(str(tmp_path / "self"), str(tmp_path / "none"), str(tmp_path / "none")) is None
    assert cgroup.room(str(tmp_path / "missing")) is None


def test_an_idle_copy_worker_keeps_no_snapshot_buffer():
    """Once a snapshot is copied, nothing of the copier holds its slot's buffer (a segment the agent unlinks
    must not stay mapped, its pages alive, until the next save)."""
    copier = Copier(workers=2)
    try:
        for _ in range(20):  # at the old code an idle worker kept the last job it had looked at, most times
            buf = np.zeros(8 * MIB, np.uint8)
            alive = weakref.ref(buf)
            src = np.ones(MIB, np.uint8)
            tasks = [CopyTask(fetch=lambda: src, offset=i * MIB, nbytes=MIB) for i in range(8)]
            done = threading.Event()
            fut: Future = copier.submit(Slot(0, buf.nbytes, memoryview(buf)), tasks, on_done=lambda f: done.set())
            assert done.wait(60)
            assert len(fut.result().crcs) == 8 and buf[-1] == 1
            del buf, fut, tasks
            deadline = time.monotonic() + 10
            while alive() is not None and time.monotonic() < deadline:  # the workers go idle
                gc.collect()
                time.sleep(0.01)
            assert alive() is None, "the copier still holds the copied slot's buffer"
    finally:
        copier.close()
