"""The node agent with real processes and real SIGKILL (tests/shm_trainer.py is the trainer).

- a trainer killed at every phase of a save (a seeded trial per phase, self-inflicted SIGKILL at that phase, and
  one external SIGKILL at a random instant): the agent serves exactly the newest committed step, never a half-written
  slot, and a new trainer process restores it bit for bit and saves on; a JAX trainer the same, resharded;
- the agent killed mid-save: the trainer skips that save (logged, counted), respawns the agent, saves on;
  with the agent's memory wiped, restore names the step and says the memory was lost;
- two trainers of one node see only their own slots; a live process cannot be impersonated, a dead one's
  successor takes over; a 2-process JAX job restarts and agrees on the newest step both processes hold;
- the CLI agent logs to a file, and on SIGTERM frees everything and exits 0. Nothing is left in /dev/shm.
"""
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from jaxckpt.backends.agent import protocol as proto
from jaxckpt.backends.shm import ShmStore
from jaxckpt.config import Config
from jaxckpt.errors import AgentError
from jaxckpt.testing import expect_ok, launch, remove_agents
from jaxckpt.testing.store import manifest_of, pattern

HERE = os.path.dirname(os.path.abspath(__file__))
TRAINER = os.path.join(HERE, "shm_trainer.py")
BASE = f"/dev/shm/jaxckpt-agenttest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
PHASES = ("reserve", "reserved", "copy", "commit", "committed", "delete", "idle", "random")
# Where the newest committed step is when the trainer dies at a phase of the save of step S.
NEWEST = {"reserve": -1, "reserved": -1, "copy": -1, "commit": -1, "committed": 0, "delete": 0, "idle": 0}


@pytest.fixture(scope="module", autouse=True)
def base_dir():
    os.makedirs(BASE, mode=0o700)
    yield BASE
    left = remove_agents(BASE, also=[_dir(job) for job in ("kill", "jax", "akill0", "akill1", "two", "mp", "cli",
                                                           "early", "waitterm")])
    assert not left, f"agents did not clean up {left}"


def _dir(job: str) -> str:
    return os.path.join(BASE, f"{job}@node0")


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TRAINER, *args], capture_output=True, text=True, timeout=timeout)


def _json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


_status = proto.agent_status


def _settled_status(d: str, job: str) -> dict:
    """The agent's status once it has noticed every dead connection (no trainer connected any more)."""
    deadline = time.monotonic() + 30
    while True:
        st = _status(d, job)
        if not st["trainers"] or time.monotonic() > deadline:
            return st
        time.sleep(0.01)


def _serving(agent: subprocess.Popen, d: str) -> None:
    """Until ``agent`` serves ``d`` (its socket there): a store made sooner would spawn an agent of its own."""
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(d, proto.SOCKET_NAME)):
        assert agent.poll() is None, f"the agent of {d} exited with {agent.returncode}"
        assert time.monotonic() < deadline, f"no agent serves {d} after 60 s"
        time.sleep(0.01)


def _reap(*procs: subprocess.Popen | None) -> None:
    """Kill and reap what a test started and did not see end."""
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


def _stop(d: str, job: str) -> None:
    assert proto.stop_agent(d, job, timeout_s=30)
    assert not os.path.exists(d), f"the agent left {os.listdir(d)}"


# ------------------------------------------------------------------------------------------ trainer killed
def test_trainer_killed_at_every_phase_of_a_save_restores_the_newest_committed_step():
    job = "kill"
    d = _dir(job)
    for seed, phase in enumerate(PHASES):  # each phase once (a seeded die step), and one kill at a random instant
        rng = random.Random(seed)
        if phase == "random":
            p = subprocess.Popen([sys.executable, TRAINER, "train", job, d, str(seed), "--steps", "500"],
                                 stdout=subprocess.PIPE, text=True)
            assert p.stdout.readline().startswith("ready")
            time.sleep(rng.uniform(0.0, 0.3))
            p.send_signal(signal.SIGKILL)
            out = p.communicate(timeout=60)[0]
            assert p.returncode == -signal.SIGKILL, out
            done = [int(line.split()[1]) for line in out.splitlines() if line.startswith("committed")]
            last = done[-1] if done else None
            allowed = {last, (last or 0) + 1}  # the kill may land after the agent committed, before we heard
        else:
            die_step = rng.randint(1, 4)
            r = _run("train", job, d, str(seed), "--die", phase, "--die-step", str(die_step), "--steps", "6")
            assert r.returncode == -signal.SIGKILL, (phase, r.stdout, r.stderr)
            newest = die_step + NEWEST[phase]
            allowed = {newest if newest > 0 else None}
        st = _settled_status(d, job)
        states = {s["state"] for s in st["slots"]}
        assert states <= {"committed"}, (seed, phase, st["slots"])  # half-written slots are gone, not served
        held = [s["step"] for s in st["slots"]]
        newest_held = max(held) if held else None
        assert newest_held in allowed, (seed, phase, held, allowed)
        r = _run("restore", job, d, str(seed), "--clear")
        assert r.returncode == 0, (seed, phase, r.stderr)
        got = _json(r.stdout)
        assert got["latest"] == newest_held, (seed, phase, got)
        if newest_held is not None:
            assert got["bitwise"] is True, (seed, phase, got)
        assert got["saved_next"] is True, (seed, phase, got)
    st = _settled_status(d, job)
    # Only pooled segments are left, at most keep + 1 = 2 of one snapshot's size (60 KiB): reused, never grown.
    assert st["slots"] == [] and st["held_bytes"] <= 2 * 64 * 1024
    _stop(d, job)


def test_jax_trainer_killed_mid_save_restores_bitwise_on_another_mesh():
    job = "jax"
    d = _dir(job)
    r = _run("jax-train", job, d, "5", "--steps", "3")
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert "committed 3" in r.stdout
    held = [s["step"] for s in _settled_status(d, job)["slots"]]
    r = _run("jax-restore", job, d, "5")
    assert r.returncode == 0, r.stderr
    got = _json(r.stdout)
    assert got == {"latest": max(held), "bitwise": True, "shardings": True} and max(held) in (3, 4)
    _stop(d, job)


# -------------------------------------------------------------------------------------------- agent killed
@pytest.mark.parametrize("wipe", [False, True], ids=["agent-killed", "agent-killed-memory-lost"])
def test_agent_killed_mid_save_trainer_skips_respawns_and_saves_on(wipe):
    job = f"akill{int(wipe)}"
    d = _dir(job)
    r = _run("train", job, d, "3", "--steps", "4", "--kill-agent", "3", *(["--wipe"] if wipe else []))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    failed = [int(x.split()[1]) for x in lines if x.startswith("failed")]
    committed = [int(x.split()[1]) for x in lines if x.startswith("committed")]
    assert committed[:2] == [1, 2] and failed[0] == 3 and committed[-1] > 3  # trained on, saving came back
    assert sorted(failed + committed) == list(range(1, committed[-1] + 1))
    got = _json(r.stdout)
    assert got["latest"] == committed[-1] and got["bitwise"] is True and got["steps"] == [committed[-1]]
    assert got["metrics"]["saves_skipped"] == len(failed)  # every skipped save counted
    assert got["metrics"]["agent_spawns"] >= 1
    assert any("step 3: StoreUnavailableError: step 3: save skipped" in e for e in got["events"]), got["events"]
    assert "save skipped" in r.stderr  # logged, never silent
    if wipe:
        assert any(e.startswith("restore: step 2 of process 0 is gone") and "memory was lost" in e
                   for e in got["events"]), got["events"]
    _stop(d, job)


# ---------------------------------------------------------------------------------------- two trainers
HOLDER = """
import sys, numpy as np
from jaxckpt.backends.shm import ShmStore
from jaxckpt.config import Config
from jaxckpt.testing.store import manifest_of, pattern
s = ShmStore(Config(store="shm", job_id=sys.argv[1], shm_dir=sys.argv[2]), process_index=0, process_count=2)
for step in (1, 2):
    slot = s.reserve(step, 8192)
    np.frombuffer(slot.buffer, dtype=np.uint8)[:] = pattern(step, 8192)
    s.commit(slot, manifest_of(step))
half = s.reserve(3, 8192)
print("ready", flush=True)
sys.stdin.read()
"""


def test_two_trainers_on_one_node_see_only_their_own_slots():
    job = "two"
    d = _dir(job)
    cfg = Config(store="shm", job_id=job, shm_dir=d)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, job, d], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        p1 = ShmStore(cfg, process_index=1, process_count=2)
        slot = p1.reserve(3, 4096)
        np.frombuffer(slot.buffer, dtype=np.uint8)[:] = pattern(33, 4096)
        p1.commit(slot, manifest_of(3))
        assert p1.steps() == [3]
        assert p1.open(1) is None and p1.open(2) is None  # process 0's steps are not ours
        assert p1._maps and all(n.startswith("seg-p1-") for n in p1._maps)
        with pytest.raises(AgentError, match=rf"process 0 of job {job} is already connected \(pid {holder.pid}\)"):
            ShmStore(cfg, process_index=0, process_count=2)
        holder.kill()
        holder.wait(timeout=30)
        p0 = ShmStore(cfg, process_index=0, process_count=2)  # the successor takes over process 0
        try:
            assert p0.steps() == [1, 2]  # its half-written step 3 was discarded
            # a held step's manifest alone (what a start-up's adoption reads): nothing mapped, nothing left pinned
            assert [p0.manifest(s) for s in (1, 2, 3)] == [manifest_of(1), manifest_of(2), None]
            assert not p0._maps
            pins = {(sl["process"], sl["step"]): sl["pins"] for sl in proto.agent_status(d, job)["slots"]}
            assert pins[(0, 1)] == pins[(0, 2)] == 0, pins  # unpinned: retention frees them as if never read
            p0.delete(1)
            with p0.open(2) as v:
                np.testing.assert_array_equal(np.frombuffer(v.buffer, np.uint8), pattern(2, 8192))
            assert p0.open(1) is None and p0.open(3) is None
            with p1.open(3) as v:
                np.testing.assert_array_equal(np.frombuffer(v.buffer, np.uint8), pattern(33, 4096))
        finally:
            p0.close()
            p1.close()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    _stop(d, job)


# ------------------------------------------------------------------------- multi-process JAX job restart
def _mp_save(job: str, d: str, drop_on_process0: int):
    """Job 1: save steps 1..3 (keep 2) on 2 processes, then process 0 loses its newest step."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxckpt

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    ckpt = jaxckpt.Checkpointer(Config(store="shm", job_id=job, shm_dir=d, keep=2))
    for step in (1, 2, 3):
        host = np.arange(64, dtype=np.float32).reshape(8, 8) * step
        x = jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("x")), lambda i, h=host: h[i])
        ckpt.save(step, {"x": x, "step": step}).result()
    held = ckpt.store.steps()
    if jax.process_index() == 0:
        ckpt.store.delete(drop_on_process0)
    ckpt.close()  # the snapshots stay with the agent
    return held


def _mp_restore(job: str, d: str):
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxckpt

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    ckpt = jaxckpt.Checkpointer(Config(store="shm", job_id=job, shm_dir=d, keep=2))
    # The adoption read the held steps' manifests only; the step to restore is then mapped (not populated) on a
    # thread of its own (Store.prefetch): one segment, never process 1's step 3 that was dropped.
    deadline = time.monotonic() + 30
    while not ckpt.store._maps and time.monotonic() < deadline:
        time.sleep(0.01)
    mapped = len(ckpt.store._maps)
    latest = ckpt.latest_step()
    target = {"x": jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P(None, "x"))), "step": 0}
    got = ckpt.restore(target)
    want = np.arange(64, dtype=np.float32).reshape(8, 8) * latest
    ok = all(np.array_equal(np.asarray(s.data), want[s.index]) for s in got["x"].addressable_shards)
    held = ckpt.store.steps()
    mapped = [mapped, len(ckpt.store._maps)]  # the restore found the mapping made: no other one
    multihost_utils.sync_global_devices("restored")  # the other process may still read our chunks
    ckpt.close()
    return {"latest": latest, "bitwise": ok, "step": got["step"], "held": held, "mapped": mapped}


def test_multiprocess_job_restarts_and_agrees_on_the_newest_step_every_process_holds():
    job = "mp"
    d = _dir(job)
    env = {"JAXCKPT_LOG_LEVEL": "WARNING"}
    saved = expect_ok(launch(_mp_save, nodes=1, procs_per_node=2, devices_per_proc=2, args=[job, d, 3], env=env,
                             timeout=120))
    assert saved == [[2, 3], [2, 3]]
    got = expect_ok(launch(_mp_restore, nodes=1, procs_per_node=2, devices_per_proc=2, args=[job, d], env=env,
                           timeout=120))
    # Process 0 lost step 3: both agree on step 2, and process 1 drops its step 3 (not held everywhere).
    assert got == [{"latest": 2, "bitwise": True, "step": 2, "held": [2], "mapped": [1, 1]}] * 2
    _stop(d, job)


# ---------------------------------------------------------------------------------------------- the CLI
def test_start_agent_before_the_framework_starts_the_agent_a_checkpointer_then_uses():
    """``jaxckpt.start_agent()``, a training script's first line: it starts the node's agent from the JAXCKPT_*
    environment without importing jax or numpy and without waiting; the trainer's store then finds that agent
    (it spawns none), and a second call while it serves starts nothing."""
    job = "early"
    d = _dir(job)
    env = {**os.environ, "JAXCKPT_STORE": "shm", "JAXCKPT_JOB_ID": job, "JAXCKPT_SHM_DIR": d}
    r = subprocess.run([sys.executable, "-c", "import json, sys, jaxckpt; started = jaxckpt.start_agent(); "
                        "print(json.dumps([started, [m for m in ('jax', 'numpy', 'torch', 'ml_dtypes') "
                        "if m in sys.modules]]))"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert _json(r.stdout) == [True, []], r.stdout
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(d, proto.SOCKET_NAME)):
        assert time.monotonic() < deadline, "the agent start_agent() started did not serve within 60 s"
        time.sleep(0.01)
    import jaxckpt

    config = Config(store="shm", job_id=job, shm_dir=d)
    assert jaxckpt.start_agent(config) is False
    assert jaxckpt.start_agent(config.replace(store="memory")) is False  # no agent to start
    store = ShmStore(config)
    try:
        assert store.metrics["agent_spawns"] == 0 and store.agent["dir"] == d, store.agent
    finally:
        store.close()
    _stop(d, job)


def test_cli_agent_logs_to_a_file_and_frees_everything_on_sigterm(tmp_path):
    job = "cli"
    d = _dir(job)
    log_path = tmp_path / "agent.log"
    agent = subprocess.Popen([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", job, "--dir", d,
                              "--log", str(log_path), "--node", "n7"])
    try:
        _serving(agent, d)
        store = ShmStore(Config(store="shm", job_id=job, shm_dir=d))
        assert store.agent["pid"] == agent.pid and store.agent["node"] == "n7"
        slot = store.reserve(1, 100_000)
        store.commit(slot, manifest_of(1))
        store.close()
        r = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "ls", "--job", job, "--dir", d, "--json"],
                           capture_output=True, text=True, timeout=60)
        (st,) = json.loads(r.stdout)
        assert st["node"] == "n7" and [(s["step"], s["nbytes"]) for s in st["slots"]] == [(1, 100_000)]
        assert st["held_bytes"] == proto.round_to_pages(100_000)
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=60) == 0
    finally:
        _reap(agent)
    assert not os.path.exists(d)
    text = log_path.read_text()
    assert f"of job {job} on node n7" in text and "freed 1 segments" in text


def test_cli_agent_takes_the_trainers_environment(tmp_path):
    """`jaxckpt agent` run on its own (a SLURM step, a DaemonSet) takes the JAXCKPT_* variables its flags do not
    set, as the trainers' Config does: under the trainers' JAXCKPT_NODE_NAME and JAXCKPT_SHM_ROOT it serves the
    directory they look in (it took the host name before, and the trainers spawned a second agent), on their
    JAXCKPT_AGENT_PORT; a flag wins over a variable; an unknown JAXCKPT_ variable is refused by name, as a trainer
    refuses it."""
    import socket

    from jaxckpt.node_identity import agent_dir_name

    job = f"cli-env-{uuid.uuid4().hex[:6]}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAXCKPT_NODE_NAME": "envnode", "JAXCKPT_SHM_ROOT": str(tmp_path),
           "JAXCKPT_AGENT_PORT": str(port)}
    trainers = Config(store="shm", job_id=job).with_env(env)
    d = proto.agent_dir(trainers)
    assert d == os.path.join(str(tmp_path), agent_dir_name(job, "envnode"))
    agent = subprocess.Popen([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", job,
                              "--log", str(tmp_path / "agent.log")], env=env)
    try:
        _serving(agent, d)
        store = ShmStore(trainers)
        try:
            assert store.agent["pid"] == agent.pid and store.agent["node"] == "envnode", store.agent
            assert store.metrics["agent_spawns"] == 0
        finally:
            store.close()
        socket.create_connection(("127.0.0.1", port), timeout=10).close()  # it serves peers where they look
        # a flag over the variable: another node's directory, where no agent runs
        r = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", job, "--node", "flagnode",
                            "--stop"], env=env, capture_output=True, text=True, timeout=60)
        want = os.path.join(str(tmp_path), agent_dir_name(job, "flagnode"))
        assert r.returncode == 0 and f"no agent serves {want}" in r.stdout, (r.stdout, r.stderr)
        r = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", job], env={**env, "JAXCKPT_BOGUS": "1"},
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "ConfigError: environment variable JAXCKPT_BOGUS: no Config field 'bogus'" \
            in r.stderr, r.stderr
        r = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", job, "--stop"], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and f"stopped the agent of {d}" in r.stdout, (r.stdout, r.stderr)
        assert agent.wait(timeout=60) == 0
    finally:
        _reap(agent)
    assert not os.path.exists(d)


def _handles_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has installed a SIGTERM handler (its /proc status' caught-signal mask)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(int(ln.split()[1], 16) for ln in f if ln.startswith("SigCgt:"))
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def test_a_waiting_agent_that_gets_sigterm_frees_what_its_holder_left(tmp_path):
    """``jaxckpt agent --wait`` (a batch script's agent step) waits for the agent holding its directory; the
    allocation's end SIGTERMs it, and the holder ends a moment later leaving its memory (a trainer's spawned
    agent whose own step ended first). The waiting agent takes the directory over and decides for that memory
    (outside SLURM: freed) instead of leaving it with no agent; real processes, a real SIGKILL of the holder."""
    job = "waitterm"
    d = _dir(job)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    holder = subprocess.Popen([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", job, "--dir", d,
                               "--log", str(tmp_path / "holder.log")], env=env)
    waiter = None
    try:
        _serving(holder, d)
        deadline = time.monotonic() + 60
        store = ShmStore(Config(store="shm", job_id=job, shm_dir=d))
        slot = store.reserve(4, 100_000)
        store.commit(slot, manifest_of(4))
        store.close()
        waiter = subprocess.Popen([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", job, "--dir", d, "--wait",
                                   "--log", str(tmp_path / "waiter.log")], env=env)
        while not _handles_sigterm(waiter.pid) and time.monotonic() < deadline:
            time.sleep(0.01)  # from here a SIGTERM is the agent's to handle, not the interpreter's default
        assert waiter.poll() is None, "the waiting agent ended while the holder served"
        waiter.send_signal(signal.SIGTERM)
        holder.kill()  # ends leaving the memory: segments, records, lock file
        holder.wait()
        assert waiter.wait(timeout=60) == 0
    finally:
        _reap(holder, waiter)
    text = (tmp_path / "waiter.log").read_text()
    assert not os.path.exists(d), f"the memory the holder left is still there: {os.listdir(d)}\n{text[-3000:]}"
    assert "SIGTERM while waiting for the holder" in text and "freed 1 segments" in text, text[-3000:]


def test_pid_file_is_read_only_as_a_regular_file(tmp_path):
    """The agent's pid file as it writes it reads back; a link to one is not followed and a FIFO in its place is
    not waited on (doctor, chaos and the tests read directories they did not make)."""
    import msgpack

    real, linked, fifo = (tmp_path / n for n in ("real", "linked", "fifo"))
    for d in (real, linked, fifo):
        d.mkdir()
    (real / proto.PID_NAME).write_bytes(msgpack.packb({"pid": 4321, "generation": "g1", "job": "j"}))
    assert proto.read_pid_file(str(real)) == (4321, "g1")
    os.symlink(real / proto.PID_NAME, linked / proto.PID_NAME)
    assert proto.read_pid_file(str(linked)) is None
    os.mkfifo(fifo / proto.PID_NAME)  # a blocking open would wait here for a writer that never comes
    assert proto.read_pid_file(str(fifo)) is None
    assert proto.read_pid_file(str(tmp_path / "none")) is None


def _agent_on_a_mount_point(d: str, job: str, log: str) -> subprocess.Popen:
    """An agent of ``job`` serving ``d``, made here, in a mount namespace where ``d`` is bound onto itself (as a
    Kubernetes volume is mounted at it): the agent cannot remove it."""
    os.makedirs(d, mode=0o700)
    unshare = ["unshare", "--mount", "--propagation", "private"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    return subprocess.Popen(unshare + ["bash", "-c", 'mount --bind "$1" "$1" && shift && exec "$@"', "bind", d,
                                       sys.executable, "-m", "jaxckpt.cli", "agent", "--job", job, "--dir", d,
                                       "--log", log], stdin=subprocess.DEVNULL)


def test_stop_returns_once_the_agent_has_freed_its_memory_where_its_directory_cannot_go(tmp_path):
    # The agent's directory is a mount point where the agent runs (as a Kubernetes volume is), so the agent frees
    # its memory and cannot remove the directory: `jaxckpt agent --stop` waited its whole time-out for the removal.
    # Its lock, let go only once everything is freed, says it: the stop returns then, whatever the time-out.
    import threading

    job = "mounted"
    d = _dir(job)
    agent = _agent_on_a_mount_point(d, job, str(tmp_path / "agent.log"))
    try:
        _serving(agent, d)
        store = ShmStore(Config(store="shm", job_id=job, shm_dir=d))
        store.commit(store.reserve(1, 100_000), manifest_of(1))
        store.close()
        assert any(proto.SEG_RE.match(n) for n in os.listdir(d)), os.listdir(d)
        done: list[bool] = []
        stopping = threading.Thread(target=lambda: done.append(proto.stop_agent(d, job, timeout_s=600)), daemon=True)
        stopping.start()
        stopping.join(timeout=120)  # the old wait ran out only at the 600 s time-out
        assert done == [True], "stop_agent still waited for a directory the agent cannot remove"
        assert os.listdir(d) == [], os.listdir(d)  # every segment, record, socket and lock freed
        assert agent.wait(timeout=60) == 0
    finally:
        _reap(agent)
        os.rmdir(d)
    text = (tmp_path / "agent.log").read_text()
    assert "freed 1 segments" in text and f"could not remove {d}" in text, text[-2000:]


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
print("open", flush=True)
fcntl.flock(fd, fcntl.LOCK_EX)  # granted once the agent lets its lock go; kept
print("held", flush=True)
time.sleep(600)
"""


def test_stop_raises_when_the_agent_answers_but_its_lock_stays_held(tmp_path):
    # A stop that ran out of time returned True, as if the agent had freed its memory. Here the agent's directory is
    # a mount point (it stays) and another process takes the lock file as the agent lets it go and keeps it: the
    # stop cannot see the agent finish, and says so naming the directory and the agent's pid.
    job = "lockheld"
    d = _dir(job)
    agent = _agent_on_a_mount_point(d, job, str(tmp_path / "agent.log"))
    holder = None
    try:
        _serving(agent, d)
        holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, os.path.join(d, proto.LOCK_NAME)],
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline() == "open\n"
        with pytest.raises(AgentError) as e:
            proto.stop_agent(d, job, timeout_s=8)  # also the time-out of its calls: ample under load
        assert str(e.value).startswith(f"the agent of {d} (pid {agent.pid}) answered the shutdown but still holds "
                                       f"its lock after 8 s"), e.value
        assert agent.wait(timeout=60) == 0 and holder.stdout.readline() == "held\n"
    finally:
        _reap(agent, holder)
        os.rmdir(d)
