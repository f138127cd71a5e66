"""Config.protection at run time with real processes: 4 simulated nodes x 1 process (2 CPU devices each; 4 x 2
with 1 device each when PROTECTION_PROCS_PER_NODE=2).

A job saves a tiny state (a replicated array, a data-parallel one and a fully sharded one) with protection, waits
until every step is protected and exits; the agents keep the memory (one launch saves the jobs of every test,
each job with its own Checkpointer, agents and memory). A node is then lost (its agent SIGKILLed, its
shared memory removed) and a new job of the same size, with a fresh agent on the replacement node, restores the
newest step bit for bit, rebuilding the lost node's chunks from parity (replicated arrays, REFT) or from copies
on the next node (sharded arrays). 4 x 1 rather than 4 x 2: the machine has 2 cores.
"""
import os
import shutil
import time
import uuid

import numpy as np
import pytest

from jaxckpt.backends.agent import protocol as proto
from jaxckpt.errors import StoreUnavailableError
from jaxckpt.testing import expect_ok, launch, node_info, remove_agents
import sharded_state

BASE = f"/dev/shm/jaxckpt-prot-{os.getpid()}-{uuid.uuid4().hex[:8]}"
ENV = {"JAXCKPT_LOG_LEVEL": "WARNING"}
NODES = 4
PROCS = int(os.environ.get("PROTECTION_PROCS_PER_NODE", "1"))  # 2: the 4 x 2 layout (8 JAX processes, slow here)
CHUNK = 256


@pytest.fixture(scope="module", autouse=True)
def base_dir():
    os.makedirs(BASE, mode=0o700)
    yield BASE
    remove_agents(BASE)


# ---------------------------------------------------------------------------- runs in the launched processes
def _config(base: str, job: str, policy: str):
    import jaxckpt

    node = node_info().node
    return jaxckpt.Config(**{"store": "shm", "job_id": job, "shm_dir": f"{base}/{job}-node{node}", "keep": 2,
                             "chunk_bytes": CHUNK, "agent_dirs": f"{base}/{job}-node*", "commit_timeout_s": 60.0,
                             "peer_timeout_s": 20.0, "protection": policy,
                             # REFT's split: what this file's parity and replica cases protect (whole replicas:
                             # tests/test_whole_replicas.py)
                             "replicas": "split",
                             **(rendezvous(base, node) if job.startswith("rdv") else {})})


def rendezvous(base: str, node: int) -> dict:
    """Config of jobs named "rdv*": nodes as separate machines would be, their agents finding each other by
    address alone. Each simulated node has its own loopback address, every agent serves peers on the same known
    port of its node's address with the job's shared token and CURVE (which a real cluster uses off loopback),
    and no agent directories are named."""
    import zlib

    port = 20000 + zlib.crc32(base.encode()) % 20000  # the same in every process of the test (base is)
    return {"agent_dirs": "", "peer_bind": f"127.0.0.{10 + node}", "agent_port": port, "peer_token": "rdv-token",
            "peer_security": "curve", "agent_peers": ",".join(f"127.0.0.{10 + n}" for n in range(NODES))}


def host_state(step: int) -> dict:
    rng = np.random.default_rng([7, step])
    rep = rng.standard_normal((16, 12)).astype(np.float32)
    rep.reshape(-1)[[5, 77]] = np.array([0x7FC00001, 0xFFA00002], np.uint32).view(np.float32)  # NaN payloads
    return {"rep": rep, "dp": rng.integers(-2**31, 2**31 - 1, (8, 20), dtype=np.int32),
            "fsdp": rng.standard_normal((32, 6)).astype(np.float32)}


SPECS = {"rep": (), "dp": (None, "model"), "fsdp": (("data", "model"),)}


def _mesh():
    return sharded_state.node_mesh(NODES)


def _sharding(mesh, k):
    return sharded_state.sharding(mesh, SPECS[k])


def device_state(mesh, step: int) -> dict:
    return sharded_state.device_state(mesh, host_state(step), SPECS, step)


def check_bitwise(got: dict, step: int) -> None:
    sharded_state.check_bitwise(got, host_state(step), step)


def save_job(base: str, job: str, policy: str, steps: list, drop_protection: list | None = None,
             wrapped: bool = False):
    """Save ``steps`` protected; ``drop_protection`` = [node, step]: that node then drops its protection of
    that step (as if it had never completed there). ``wrapped``: each step's state goes through a donating
    ``wrap_step`` with ``save_step`` (on these CPU devices a save waited for before the step, parity included);
    the result then names the leaves whose donation the snapshot held back."""
    import jax
    import jaxckpt

    mesh = _mesh()
    held = []
    with jaxckpt.Checkpointer(_config(base, job, policy)) as ck:
        fused = ck.wrap_step(lambda s: jax.tree.map(lambda x: x + x, s)) if wrapped else None
        for step in steps:
            if fused is None:
                ck.save(step, device_state(mesh, step))
                continue
            state = device_state(mesh, step)
            jax.block_until_ready(fused(state, save_step=step))
            held += [f"{k}@{step}" for k, v in state.items() if isinstance(v, jax.Array) and not v.is_deleted()]
        ck.wait()
        protected = ck.engine.protection.protected_steps()
        if drop_protection and node_info().node == drop_protection[0]:
            ck.engine.protection._store.delete(drop_protection[1])
        policies = next(iter(ck.engine.protection.plans().values())).policies()
    failed = {s: repr(e) for s, e in ck.engine.protection.failures().items()}
    return {"protected": protected, "policies": {k: list(v) for k, v in policies.items()}, "failed": failed,
            "held": held}


def save_jobs(base: str, specs: list) -> dict:
    """``save_job`` for each spec ``[job, policy, steps, drop_protection]`` in turn, in the same processes (one
    launch saves the jobs of every test below; each job has its own Checkpointer, agents and memory)."""
    return {spec[0]: save_job(base, *spec) for spec in specs}


def restore_job(base: str, job: str, policy: str, save_next: int = 0):
    import jax
    import jaxckpt
    from jax.experimental import multihost_utils

    mesh = _mesh()
    target = {k: jax.ShapeDtypeStruct(h.shape, h.dtype, sharding=_sharding(mesh, k))
              for k, h in host_state(0).items()} | {"step": 0}
    with jaxckpt.Checkpointer(_config(base, job, policy)) as ck:
        latest = ck.latest_step()
        try:
            got = ck.restore(target)
        except jaxckpt.errors.DataLossError as e:
            multihost_utils.sync_global_devices("failed")
            return {"error": str(e), "type": type(e).__name__, "latest": latest}
        check_bitwise(got, latest)
        report = ck.last_restore_report.to_dict()
        protected = []
        if save_next:
            ck.save(save_next, device_state(mesh, save_next))
            ck.wait()
            protected = ck.engine.protection.protected_steps()
        multihost_utils.sync_global_devices("restored")
    return {"latest": latest, "report": report, "protected": protected}


def restore_alone(base: str, job: str):
    """A job of one process on node 0 (its 2 devices) restores the 4-node job's newest step bit for bit; with it,
    the restore report and the warnings the rebuild logged."""
    import logging

    import jax
    import jaxckpt

    got_logged: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got_logged.append(record.getMessage())
    logger = logging.getLogger("jaxckpt.protection.holder")
    logger.addHandler(Keep(logging.WARNING))
    mesh = sharded_state.node_mesh(1)
    target = {k: jax.ShapeDtypeStruct(h.shape, h.dtype, sharding=_sharding(mesh, k))
              for k, h in host_state(0).items()} | {"step": 0}
    with jaxckpt.Checkpointer(_config(base, job, "hybrid")) as ck:
        latest = ck.latest_step()
        check_bitwise(ck.restore(target), latest)
        report = ck.last_restore_report.to_dict()
    return {"latest": latest, "report": report, "logged": got_logged}


def save_and_train_on(base: str, job: str, policy: str, steps: list, ready: str):
    """Save ``steps`` protected, say so (a file per process in ``ready``), then train on until killed."""
    import time

    import jaxckpt

    mesh = _mesh()
    with jaxckpt.Checkpointer(_config(base, job, policy)) as ck:
        for step in steps:
            ck.save(step, device_state(mesh, step))
        ck.wait()
        assert ck.engine.protection.protected_steps() == steps, ck.engine.protection.protected_steps()
        with open(os.path.join(ready, f"ready-{node_info().process_id}"), "w") as f:
            f.write(str(os.getpid()))
        while True:  # a live trainer: its node is lost under it
            time.sleep(0.05)


def restore_on_replacement(base: str, job: str, policy: str):
    """Restore the newest step bit for bit; with it, what this process's node agent says of itself: whether this
    process's ``Checkpointer()`` spawned it, its start-up (exec -> serving) and the frameworks it imported."""
    import jax
    import jaxckpt
    from jax.experimental import multihost_utils

    mesh = _mesh()
    target = {k: jax.ShapeDtypeStruct(h.shape, h.dtype, sharding=_sharding(mesh, k))
              for k, h in host_state(0).items()} | {"step": 0}
    with jaxckpt.Checkpointer(_config(base, job, policy)) as ck:
        spawns = ck.engine.store.metrics["agent_spawns"]
        latest = ck.latest_step()
        check_bitwise(ck.restore(target), latest)
        report = ck.last_restore_report.to_dict()
        st = proto.agent_status(ck.engine.store.directory, job)
        hello = ck.engine.store.agent
        multihost_utils.sync_global_devices("restored")
    frameworks = [m for m in ("numpy", "jax", "jaxlib", "ml_dtypes", "torch") if m in st["modules"]]
    return {"latest": latest, "report": report, "spawns": spawns, "startup": st["startup"],
            "agent_frameworks": frameworks, "created": ck.startup, "hello_recovery": hello["recovery"],
            "hello_recovery_wait_s": hello["recovery_wait_s"]}


# ----------------------------------------------------------------------------------------------- helpers
def lose_node(job: str, node: int) -> None:
    """A node is lost: its agent SIGKILLed and its shared memory removed (the replacement starts empty)."""
    d = f"{BASE}/{job}-node{node}"
    proto.kill_agent(d, remove_memory=True)
    shutil.rmtree(d, ignore_errors=True)


def lose_node_under_running_job(job: str, lost: int, ready: str) -> None:
    """Steps 1 and 2 saved protected ("hybrid") by a job that trains on; node ``lost`` is lost under it (its
    trainers and agent SIGKILLed, its memory removed), then the rest of the job is killed as a scheduler would."""
    from jaxckpt.testing import start

    with start(save_and_train_on, nodes=NODES, procs_per_node=PROCS, devices_per_proc=2 // PROCS,
               args=(BASE, job, "hybrid", [1, 2], str(ready)), env=ENV) as running:
        deadline = time.monotonic() + 240
        while len([n for n in os.listdir(ready) if n.startswith("ready-")]) < NODES * PROCS:
            if any(c is not None for c in running.poll()):  # one ended: say why
                running.close()
                raise AssertionError(running.results())
            assert time.monotonic() < deadline, "the job did not protect its steps within 240 s"
            time.sleep(0.1)
        assert running.kill_node(lost) == list(range(lost * PROCS, (lost + 1) * PROCS))
        lose_node(job, lost)  # its agent SIGKILLed, then its memory goes


def run_agent(job: str, node: int, log: str, *args: str):
    """Start the agent of ``node`` (``jaxckpt agent ... args``) as a launcher would; returns it once it serves."""
    import subprocess
    import sys

    d = f"{BASE}/{job}-node{node}"
    agent = subprocess.Popen([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", job, "--dir", d, "--node",
                              f"node{node}", "--log", log, *args], stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:  # serving: trainers then find it
        assert agent.poll() is None, f"the agent of node {node} exited ({agent.returncode})"
        assert time.monotonic() < deadline, f"the agent of node {node} did not serve within 60 s"
        try:
            proto.agent_status(d, job)
            return agent
        except StoreUnavailableError:  # not listening yet
            time.sleep(0.05)


def run(fn, *args):
    return expect_ok(launch(fn, nodes=NODES, procs_per_node=PROCS, devices_per_proc=2 // PROCS, args=(BASE, *args),
                            env=ENV, timeout=240))


def rebuilt_bytes(results) -> int:
    return sum(r["report"]["bytes_by_kind"].get("rebuild", 0) for r in results)


# ----------------------------------------------------------------------------------------------- tests
# Every job the tests below restore, saved in one launch: job -> [policy, steps, drop_protection].
SAVED = {"turn-parity": ["parity", [1, 2], None], "turn-replica": ["replica", [1, 2], None],
         "two-bad-replica": ["replica", [1, 2], None], "older": ["parity", [1, 2], [2, 2]],
         "corrupt": ["parity", [1, 2], None], "token": ["replica", [1], None],
         "holder-fallback": ["hybrid", [1, 2], None], "wrapped": ["parity", [1, 2], None, True]}


@pytest.fixture(scope="module")
def saved() -> dict:
    """job -> every process's save_job result, for the jobs of SAVED."""
    values = run(save_jobs, [[job, *spec] for job, spec in SAVED.items()])
    return {job: [v[job] for v in values] for job in SAVED}


@pytest.mark.parametrize("policy", ["parity", "replica"])
def test_lose_two_nodes_in_turn(policy, saved):
    """Save protected; lose node 1, recover bit for bit and save a new protected step; lose node 3, recover."""
    job = f"turn-{policy}"
    out = saved[job]
    assert all(r["protected"] == [1, 2] for r in out), out
    kinds = out[0]["policies"]
    if policy == "parity":
        assert kinds == {"rep": ["parity"], "dp": ["parity"], "fsdp": ["replica"]}, kinds
    else:
        assert set(map(tuple, kinds.values())) == {("replica",)}, kinds
    lose_node(job, 1)
    out = run(restore_job, job, policy, 3)
    assert [r["latest"] for r in out] == [2] * NODES * PROCS, out
    assert rebuilt_bytes(out) > 0
    assert all(3 in r["protected"] for r in out), out
    lose_node(job, 3)
    out = run(restore_job, job, policy)
    assert [r["latest"] for r in out] == [3] * NODES * PROCS, out
    assert rebuilt_bytes(out) > 0


def test_wrap_step_before_the_step_is_protected_and_rebuilt_after_a_loss(saved):
    """``wrap_step`` as a CPU user gets it on a protected job: each save waited for before the plain program, so
    every step's donation went through; both steps protected; a lost node's share of the newest one rebuilt
    from their parity, bit for bit (``restore_job`` checks every shard)."""
    out = saved["wrapped"]
    assert all(r["held"] == [] for r in out), [r["held"] for r in out]
    assert all(r["protected"] == [1, 2] for r in out), out
    assert out[0]["policies"]["rep"] == ["parity"], out[0]["policies"]
    lose_node("wrapped", 2)
    out = run(restore_job, "wrapped", "parity")
    assert [r["latest"] for r in out] == [2] * NODES * PROCS, out
    assert rebuilt_bytes(out) > 0


def _check_clear_error(out, policy: str, lost: tuple[int, int]) -> None:
    """Every process got DataLossError naming step 2, the lost nodes and the boxes they took."""
    for r in out:
        assert r.get("type") == "DataLossError", r
        assert r["latest"] is None
        assert "step 2" in r["error"] and f"node(s) {lost[0]}, {lost[1]}" in r["error"], r["error"]
        # the missing boxes are named: the sharded array's copies were on the other lost node (replica); the
        # replicated arrays' stripes lost two units each (parity; node 0's copies survive on node 1)
        named = ["fsdp"] if policy == "replica" else ["dp", "rep"]
        assert all(f"{k} [" in r["error"] for k in named), r["error"]


def test_two_nodes_in_one_group_is_a_clear_error(saved):
    """Loss beyond the policy (replica: nodes 1 and 2, a copy and its original): every process gets
    DataLossError naming the step, the nodes and missing boxes. The parity case is below, on the job of the
    corrupt-chunk test."""
    job, lost = "two-bad-replica", (1, 2)
    out = saved[job]
    assert all(r["protected"] == [1, 2] for r in out), out
    for n in lost:
        lose_node(job, n)
    _check_clear_error(run(restore_job, job, "replica"), "replica", lost)


def test_falls_back_to_older_protected_step(saved):
    """Step 2's protection never completed on node 2: with node 1 lost, step 1 is restored instead."""
    job = "older"
    out = saved[job]
    assert all(r["protected"] == [1, 2] for r in out), out
    lose_node(job, 1)
    out = run(restore_job, job, "parity")
    assert [r["latest"] for r in out] == [1] * NODES * PROCS, out
    assert rebuilt_bytes(out) > 0


@pytest.fixture(scope="module")
def parity_job(saved):
    """Steps 1 and 2 saved with parity on 4 nodes, shared by the two tests below (in this order: the first
    flips bytes on node 2 and restores, the second loses nodes 0 and 2, that memory included)."""
    job = "corrupt"
    out = saved[job]
    assert all(r["protected"] == [1, 2] for r in out), out
    return job


def test_corrupt_chunk_is_rebuilt_from_protection(parity_job):
    """No node lost; a byte of every snapshot segment of node 2's first process flipped: rebuilt instead."""
    job = parity_job
    d = f"{BASE}/{job}-node2"
    segs = [n for n in os.listdir(d) if n.startswith(f"seg-p{2 * PROCS}-")]  # the first process of node 2
    assert segs
    for n in segs:
        with open(os.path.join(d, n), "r+b") as f:
            b = f.read(1)
            f.seek(0)
            f.write(bytes([b[0] ^ 0x40]))
    out = run(restore_job, job, "parity")
    assert [r["latest"] for r in out] == [2] * NODES * PROCS, out
    assert rebuilt_bytes(out) > 0
    assert any("rebuild" in fb or "crc32c" in fb for r in out for fb in r["report"]["fallbacks"]), out


def test_two_nodes_in_one_parity_group_is_a_clear_error(parity_job):
    """Loss beyond parity (nodes 0 and 2: two units of every stripe; node 2's flipped bytes go with it): every
    process gets DataLossError naming the step, the nodes and missing boxes."""
    lost = (0, 2)
    for n in lost:
        lose_node(parity_job, n)
    _check_clear_error(run(restore_job, parity_job, "parity"), "parity", lost)


@pytest.fixture(scope="module")
def replica_job(saved):
    """Step 1 saved with replica on 4 nodes, shared by the two tests below (in this order: the first only reads
    it, the second loses nodes 0 and 2)."""
    job = "token"
    out = saved[job]
    assert all(r["protected"] == [1] for r in out), out
    return job


def test_wrong_token_is_refused_and_ls_shows_protection(replica_job, capsys):
    """An agent holding protection data gives a peer with a wrong token nothing; `jaxckpt ls` shows protection."""
    import json

    from jaxckpt import cli

    from jaxckpt.backends.agent.peer_files import read_peer_info
    from jaxckpt.protection.slot import PROTECT_BASE
    from jaxckpt.backends.transport import ZmqTransport
    from jaxckpt.errors import PeerError

    job = replica_job
    info = read_peer_info(f"{BASE}/{job}-node1")
    t = ZmqTransport()
    good = t.connect(info["address"], token=info["token"], timeout_s=10)
    try:
        assert [PROTECT_BASE + PROCS, 1] in [e[:2] for e in good.held()]
        assert good.manifest(1, PROTECT_BASE + PROCS)
    finally:
        good.close()
    args = ["ls", "--job", job, "--dir", f"{BASE}/{job}-node1"]
    assert cli.main(args + ["--json"]) == 0
    (st,) = json.loads(capsys.readouterr().out)
    rows = {(s["process"], s["step"]): s["protected"] for s in st["slots"]}
    q = PROCS  # the first process of node 1
    assert rows[(q, 1)] == "yes" and rows[(PROTECT_BASE + q, 1)] == "-", rows
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "protected" in out and f"{q} (protection)" in out, out
    bad = t.connect(info["address"], token=b"not-the-token", timeout_s=5)
    try:
        with pytest.raises(PeerError):
            bad.manifest(1, PROTECT_BASE + PROCS)
        with pytest.raises(PeerError):
            bad.held()
    finally:
        bad.close()


def test_two_nodes_in_different_groups_recover(replica_job):
    """replica, one copy on the next node: nodes 0 and 2 lost together; 1 and 3 hold their copies."""
    lose_node(replica_job, 0)
    lose_node(replica_job, 2)
    out = run(restore_job, replica_job, "replica")
    assert [r["latest"] for r in out] == [1] * NODES * PROCS, out
    assert rebuilt_bytes(out) > 0


def test_replacement_node_restores_bitwise_while_its_agent_starts(tmp_path):
    """A node is lost under a running job: its trainer and its agent SIGKILLed, its memory removed, the rest of
    the job killed as a scheduler would. The relaunched job's first ``Checkpointer()`` on the replacement spawns
    a fresh agent (importing no framework: jax, ml_dtypes, torch, not even numpy before it serves), and its
    restore of the newest protected step, rebuilt from the other nodes, is bit for bit."""
    job, lost = "relaunch", 1
    lose_node_under_running_job(job, lost, tmp_path)
    out = run(restore_on_replacement, job, "hybrid")
    assert [r["latest"] for r in out] == [2] * NODES * PROCS, out  # every array was checked bit for bit
    assert rebuilt_bytes(out) > 0
    on_lost = [r for i, r in enumerate(out) if i // PROCS == lost]
    assert [r["spawns"] for r in on_lost] == [1] + [0] * (PROCS - 1), out  # its first store spawned the agent
    assert all(r["spawns"] == 0 for i, r in enumerate(out) if i // PROCS != lost), out  # the others' lived on
    for r in on_lost:
        # the agent its store spawned was told no peers: it recovers nothing, the hello waited for nothing
        assert r["hello_recovery"] == {} and r["hello_recovery_wait_s"] == 0, r
        # no framework; numpy only if the agent served a peer or a pull by the time it was asked
        assert set(r["agent_frameworks"]) <= {"numpy"} and r["startup"]["serving_s"] > 0, r
    # The lost bytes moved once: every range rebuilt from parity was XORed where its parity lives, and what each
    # process received to rebuild (those results, copies of copied chunks) is at most 1.1x what it rebuilt; the
    # replacement rebuilt all of its own node's share.
    for r in out:
        rep = r["report"]
        assert rep["rebuild_received"] <= 1.1 * rep["rebuilt_bytes"], rep
        assert not [fb for fb in rep["fallbacks"] if "rebuilt here" in fb], rep  # no holder failed to
    for r in on_lost:  # its node held no parity: every range was rebuilt at a holder
        rep = r["report"]
        assert set(rep["rebuilt_at"]) == {"holder"} and rep["rebuilt_bytes"] > 0, rep
        print(f"replacement process: received {rep['rebuild_received']} bytes to rebuild {rep['rebuilt_bytes']} "
              f"(transport {rep['transport_bytes']}, rebuilt at {rep['rebuilt_at']})")


def test_a_replacement_agent_recovers_its_node_share_and_the_restore_reads_it_locally(tmp_path):
    """A node is lost under a running job (trainer and agent SIGKILLed, memory removed). The nodes behave as
    separate machines: each its own loopback address, its agent serving peers there on the job's known port with
    CURVE. The replacement node's agent is started first, as a launcher starts it, knowing only the job's node
    list and token (``--peers``, ``--peer-port``): in a mount namespace of its own where the other nodes' agent
    directories do not exist (so nothing of theirs is read through a file), it asks those addresses for its peers
    and, as soon as it serves, rebuilds the lost node's share of the newest step into its own memory, receiving at
    most 1.1x the bytes it rebuilt. The relaunched trainer there finds that agent (it spawns none), and its
    restore reads its own process's bytes from its node's memory, rebuilding nothing; every array bit for bit."""
    import subprocess
    import sys

    job, lost = "rdv-recover", 1
    lose_node_under_running_job(job, lost, tmp_path)
    d = f"{BASE}/{job}-node{lost}"
    rdv = rendezvous(BASE, lost)
    os.makedirs(d, mode=0o700)
    keep = tmp_path / "keep"
    keep.mkdir()
    # Its own directory stays visible (its trainer meets it there); the other nodes' vanish under a fresh tmpfs.
    hide = (f'set -e; mount --bind "$1" "$2"; mount -t tmpfs -o mode=0700 none "$3"; mkdir -m 0700 "$1"; '
            f'mount --bind "$2" "$1"; test "$(ls -A "$3")" = "$(basename "$1")"; shift 3; exec "$@"')
    unshare = ["unshare", "--mount", "--propagation", "private"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    agent = subprocess.Popen(unshare + ["bash", "-c", hide, "hide", d, str(keep), BASE,
                                        sys.executable, "-m", "jaxckpt.cli", "agent", "--job", job, "--dir", d,
                                        "--node", f"node{lost}", "--peer-bind", rdv["peer_bind"], "--peer-security",
                                        "curve", "--peer-port", str(rdv["agent_port"]), "--peers",
                                        rdv["agent_peers"], "--log", str(tmp_path / "agent.log")],
                             stdin=subprocess.DEVNULL, env={**os.environ, "JAXCKPT_PEER_TOKEN": rdv["peer_token"]})
    try:
        deadline = time.monotonic() + 60
        while True:  # serving: the trainers then find it (the recovery may still run: their hellos wait for it)
            assert agent.poll() is None, f"the replacement agent exited ({agent.returncode})"
            assert time.monotonic() < deadline, "the replacement agent did not serve within 60 s"
            try:
                proto.agent_status(d, job)
                break
            except StoreUnavailableError:  # not listening yet
                time.sleep(0.05)
        out = run(restore_on_replacement, job, "hybrid")
        recovery = proto.agent_status(d, job)["recovery"]
        mine = list(range(lost * PROCS, (lost + 1) * PROCS))
        assert recovery["state"] == "done" and recovery["step"] == 2 and recovery["processes"] == mine, recovery
        assert recovery["peers"] == [f"node{n} at tcp://127.0.0.{10 + n}:{rdv['agent_port']}"
                                     for n in range(NODES) if n != lost], recovery
        assert 0 < recovery["received"] <= 1.1 * recovery["bytes"], recovery
        assert [r["latest"] for r in out] == [2] * NODES * PROCS, out  # every array was checked bit for bit
        for q in mine:
            r = out[q]
            rep = r["report"]
            assert r["spawns"] == 0, r  # the running agent served it
            # its hello joined the recovery (said how long it waited) and says how it ended
            assert r["hello_recovery"] == recovery and r["hello_recovery_wait_s"] >= 0, r
            # where its Checkpointer()'s time went, stage by stage: wall and CPU seconds
            stages = r["created"]
            assert {"protection import", "store", "protection", "own steps", "discover agents", "agent clients",
                    "agent listings", "registered listings", "restorable round", "agree held",
                    "apply adoption"} <= set(stages), stages
            assert all(v["seconds"] >= 0 and v["cpu_s"] >= 0 for v in stages.values()), stages
            assert stages["store"]["seconds"] >= r["hello_recovery_wait_s"], (stages, r["hello_recovery_wait_s"])
            assert rep["bytes_by_kind"].get("rebuild", 0) == 0, rep
            own = rep["bytes_by_process"].get(str(q), 0)
            assert own > 0 and rep["bytes_by_kind"].get("local", 0) + rep["bytes_by_kind"].get("node", 0) >= own, rep
    finally:
        proto.stop_agent(d, job)
        agent.wait(timeout=30)


def test_a_rendezvous_needs_the_jobs_shared_token(tmp_path):
    """An agent told its peers by address but holding no shared token (one made at random would match no other
    node's) refuses to start, saying what it needs, and ``jaxckpt doctor`` reports it; a malformed peer list is a
    ConfigError naming the entry."""
    import subprocess
    import sys

    import jaxckpt

    env = {k: v for k, v in os.environ.items() if k != "JAXCKPT_PEER_TOKEN"}
    r = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", "rdv-token", "--dir",
                        str(tmp_path / "a"), "--peers", "127.0.0.11,127.0.0.12", "--peer-port", "29555", "--log",
                        str(tmp_path / "a.log")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "needs the job's shared peer token" in r.stderr and "JAXCKPT_PEER_TOKEN" in r.stderr, \
        r.stderr
    # `jaxckpt doctor` says so before a job runs, and shows the rendezvous
    r = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "doctor", "--job", "rdv-token"],
                       env={**env, "JAXCKPT_STORE": "shm", "JAXCKPT_SHM_DIR": str(tmp_path / "d"),
                            "JAXCKPT_AGENT_PEERS": "127.0.0.11,127.0.0.12", "JAXCKPT_AGENT_PORT": "29555"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "PROBLEM        Config.agent_peers is set but no shared peer token" in r.stdout, \
        r.stdout + r.stderr
    assert "port 29555 (node agent)" in r.stdout and "rendezvous     127.0.0.11,127.0.0.12" in r.stdout, r.stdout
    with pytest.raises(jaxckpt.errors.ConfigError, match="entry 'node3:x'"):
        jaxckpt.Config(agent_peers="node1,node3:x", agent_port=29555)
    with pytest.raises(jaxckpt.errors.ConfigError, match="no port given and Config.agent_port is 0"):
        jaxckpt.Config(agent_peers="node1")


def test_a_rebuild_its_parity_holder_cannot_make_is_made_by_the_restore(saved, tmp_path):
    """Node 1 is lost, and node 0's agent is restarted (SIGKILLed, its memory kept) serving no peers: node 0's
    units of the parity stripes are then reachable only from node 0 itself. A job of one process on node 0
    restores the step: the other nodes' agents holding the stripes' parity cannot read node 0's units, so each
    such range is rebuilt by the restoring process itself (parity and units read here), bit for bit, logged,
    and said so in its report: ``fallbacks`` (why), ``rebuilt_at["here"]`` (the bytes XORed here) and
    ``rebuild_reads`` / ``rebuild_received`` (what it read, and received over the transport, to do so)."""
    from jaxckpt.backends.agent import peer_files

    job = "holder-fallback"
    assert all(r["protected"] == [1, 2] for r in saved[job]), saved[job]
    lose_node(job, 1)
    d = f"{BASE}/{job}-node0"
    proto.kill_agent(d)  # its memory stays for the next agent of the directory
    assert os.path.exists(os.path.join(d, peer_files.PEER_NAME))  # the killed agent's address, left behind
    agent = run_agent(job, 0, str(tmp_path / "agent.log"), "--peer-bind", "none")
    # the new agent serves no peers: it removed the address, so no reader waits out a connect to a dead one
    assert not os.path.exists(os.path.join(d, peer_files.PEER_NAME))
    try:
        (r,) = expect_ok(launch(restore_alone, nodes=1, procs_per_node=1, devices_per_proc=2, args=(BASE, job),
                                env=ENV, timeout=240))
    finally:
        proto.stop_agent(d, job)
        agent.wait(timeout=30)
    rep = r["report"]
    assert r["latest"] == 2, r  # every array checked bit for bit in the process
    here = [fb for fb in rep["fallbacks"] if "rebuilt here from the parity and the other units" in fb]
    assert here and all("no agent of process 0 serves peers" in fb for fb in here), rep["fallbacks"]
    assert [m for m in r["logged"] if "rebuilt here" in m] == here, r["logged"]
    assert rep["rebuilt_bytes"] > 0, rep
    # Every range was XORed here (each stripe has a unit on node 0), from the parity's bytes of that range alone:
    # the other units are chunks this restore reads anyway (the whole state, one process), received once.
    assert rep["rebuilt_at"] == {"here": rep["rebuilt_bytes"]}, rep
    assert sum(rep["rebuild_reads"].values()) == rep["rebuilt_bytes"], rep
    assert 0 < rep["rebuild_received"] <= rep["rebuilt_bytes"], rep  # the parity held on nodes 2 and 3
    assert rep["transport_bytes"] == rep["bytes_by_kind"]["remote"] + rep["rebuild_received"], rep
    print(f"fallback restore: rebuilt {rep['rebuilt_bytes']} bytes ({rep['rebuilt_at']} by where the XOR ran), "
          f"read {rep['rebuild_reads']} to rebuild them, transport {rep['transport_bytes']}, "
          f"fallbacks {len(here)}")


@pytest.mark.skipif(os.environ.get("RUN_SLOW_TESTS") != "1", reason="slow: set RUN_SLOW_TESTS=1")
@pytest.mark.parametrize("policy", ["parity", "replica", "hybrid"])
def test_lose_every_node_in_turn(policy):
    """Each of the 4 nodes lost in turn; after each recovery the job saves a new protected step."""
    job = f"every-{policy}"
    out = run(save_job, job, policy, [1])
    assert all(r["protected"] == [1] for r in out), out
    if policy == "hybrid":  # copies on 4 nodes: parity; sharded: an XOR group of the 4 nodes
        assert out[0]["policies"] == {"rep": ["parity"], "dp": ["parity"], "fsdp": ["xor-group"]}, out[0]
    for i, node in enumerate(range(NODES)):
        lose_node(job, node)
        out = run(restore_job, job, policy, i + 2)
        assert [r["latest"] for r in out] == [i + 1] * NODES * PROCS, out
        assert rebuilt_bytes(out) > 0
        assert all(i + 2 in r["protected"] for r in out), out
