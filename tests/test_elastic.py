"""Distributed restore from node agents' memory, onto other process counts, nodes and shardings (real processes).

One job of 4 processes (2 simulated nodes x 2, ``store="shm"``, an agent per node) saves steps 1..4 with FSDP
shardings; process 3 then loses step 4 (as if it died before committing it) and the job exits; the agents keep
the memory. New jobs with their own coordination service then restore, with no filesystem involved:
- 2 processes (2 nodes x 1), tensor-parallel on 'model': every process agrees on step 3 (the newest step held for
  all 4 saving processes) and reads its bytes from its own memory, its node's agent and the other node's agent;
- 8 processes (4 nodes x 2, 1 device each, two fresh nodes), another mesh: nodes 2 and 3 read everything remotely;
- a corrupted byte in one agent's segment: ChecksumError naming path, step and process when no other copy exists;
  with a mirror of that node's memory served by another agent, the read is routed around it, bit for bit.
A second job is SIGKILLed mid-training (a save in flight), relaunched with the same 4 processes, restores from its
node agents and continues bit for bit. Agents are stopped and /dev/shm cleaned by the module fixture.
"""
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from jaxckpt.backends.agent import protocol as proto
from jaxckpt.backends.agent.peer_files import PEER_NAME, TOKEN_NAME, read_peer_info
from jaxckpt.backends.transport import ZmqTransport
from jaxckpt.core.box import Box
from jaxckpt.core.checksum import crc32c
from jaxckpt.errors import AgentError, ChecksumError, PeerError, StepNotFoundError
from jaxckpt.core.fetch import ChunkReader
from jaxckpt.core.manifest import ChunkMeta, decode
from jaxckpt.core.sources import HeldEntry, RestoreReport, Source, Version, choose_version, complete_steps, \
    missing_processes, newest_common
from jaxckpt.testing import expect_ok, launch, node_info, remove_agents, start

BASE = f"/dev/shm/jaxckpt-elastic-{os.getpid()}-{uuid.uuid4().hex[:8]}"
JOB, KILL_JOB = "elastic", "elastic-kill"
ENV = {"JAXCKPT_LOG_LEVEL": "WARNING"}
CHUNK = 256  # small: arrays are cut into several chunks per process


# ------------------------------------------------------------------------------------------- the fixture
@pytest.fixture(scope="module", autouse=True)
def base_dir():
    os.makedirs(BASE, mode=0o700)
    yield BASE
    left = remove_agents(BASE)
    assert not left, f"agents did not clean up {left}"


def node_dir(job: str, node) -> str:
    return f"{BASE}/{job}-node{node}"


# ---------------------------------------------------------------------------- runs in the launched processes
def _config(base: str, job: str, node: int, agent_dirs: str = "", **changes):
    import jaxckpt

    return jaxckpt.Config(store="shm", job_id=job, shm_dir=f"{base}/{job}-node{node}", keep=2, chunk_bytes=CHUNK,
                          agent_dirs=agent_dirs or f"{base}/{job}-node*", commit_timeout_s=60.0, peer_timeout_s=30.0,
                          **changes)


def host_state(step: int) -> dict:
    """The saved state at ``step`` as host arrays: the same in every process, NaN payloads included."""
    import ml_dtypes

    rng = np.random.default_rng([11, step])
    w = rng.standard_normal((16, 12)).astype(np.float32)
    w.reshape(-1)[[3, 50, 99]] = np.array([0x7FC00001, 0x7FA00002, 0xFFC00003], np.uint32).view(np.float32)
    return {"w": w, "emb": rng.standard_normal((8, 16)).astype(ml_dtypes.bfloat16),
            "b": rng.standard_normal(12).astype(np.float32),
            "mu": rng.integers(-2**31, 2**31 - 1, (16, 12), dtype=np.int32),
            "rng": rng.integers(0, 2**32, (8, 2), dtype=np.uint32)}  # the data of 8 threefry keys


SAVE_SPECS = {"w": ("data", None), "emb": ("data", None), "b": (), "mu": ("data", "model"), "rng": ("data",)}
TP_SPECS = {"w": (None, "model"), "emb": (None, "model"), "b": ("model",), "mu": ("model", None), "rng": ("model",)}
MIXED_SPECS = {"w": ("model", "data"), "emb": (None, ("data", "model")), "b": (), "mu": ("data", "model"),
               "rng": (("data", "model"),)}
SPECS = {"save": SAVE_SPECS, "tp": TP_SPECS, "mixed": MIXED_SPECS}


def _mesh(shape):
    import jax

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return jax.sharding.Mesh(np.array(devices).reshape(shape), ("data", "model"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)


def device_state(mesh, step: int, specs: dict) -> dict:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    host = host_state(step)
    out = {}
    for k, h in host.items():
        sharding = NamedSharding(mesh, P(*specs[k], *((None,) if k == "rng" else ())))
        out[k] = jax.make_array_from_callback(h.shape, sharding, lambda idx, h=h: h[idx])
    out["rng"] = jax.random.wrap_key_data(out["rng"], impl="threefry2x32")
    return {"params": {k: out[k] for k in ("w", "emb", "b")}, "opt": {"mu": out["mu"]}, "rng": out["rng"],
            "step": step}


def target_of(mesh, specs: dict) -> dict:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    host = host_state(0)
    key_dtype = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), 8)).dtype

    def sds(k):
        shape, dtype = (8,) if k == "rng" else host[k].shape, key_dtype if k == "rng" else host[k].dtype
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*specs[k])))
    return {"params": {k: sds(k) for k in ("w", "emb", "b")}, "opt": {"mu": sds("mu")}, "rng": sds("rng"), "step": 0}


def _bits(a):
    a = np.ascontiguousarray(np.asarray(a))
    return a.view(np.uint8) if a.dtype.itemsize == 1 or a.ndim == 0 else a.view(f"u{a.dtype.itemsize}")


def check_bitwise(got: dict, target: dict, step: int) -> None:
    """Every local shard of every restored array equals the saved state of ``step``, with the target's sharding."""
    import jax

    host = host_state(step)
    flat = {"w": got["params"]["w"], "emb": got["params"]["emb"], "b": got["params"]["b"], "mu": got["opt"]["mu"],
            "rng": got["rng"]}
    want_sharding = {"w": target["params"]["w"], "emb": target["params"]["emb"], "b": target["params"]["b"],
                     "mu": target["opt"]["mu"], "rng": target["rng"]}
    for k, x in flat.items():
        assert x.sharding == want_sharding[k].sharding, k
        data = jax.random.key_data(x) if k == "rng" else x
        for shard in data.addressable_shards:
            np.testing.assert_array_equal(_bits(shard.data), _bits(host[k][shard.index]), err_msg=f"{k} step {step}")
    assert got["step"] == step


def save_job(base: str, job: str):
    import jaxckpt

    info = node_info()
    mesh = _mesh((4, 2))
    with jaxckpt.Checkpointer(_config(base, job, info.node)) as ck:
        for step in (1, 2, 3, 4):
            ck.save(step, device_state(mesh, step, SAVE_SPECS)).result()
        latest = ck.latest_step()
        if info.process_id == 3:
            ck.store.delete(4)  # as if process 3 had died before committing step 4
        held = ck.store.steps()
    return {"latest": latest, "held": held}


def restore_job(base: str, job: str, mesh_shape: list, specs: str, modes: list):
    """Restore the newest step once per mode ("fetch", "collective": ``Config.restore_collective``), each with a
    Checkpointer of its own, in the same processes (one launch serves both paths); the report of each."""
    import jaxckpt
    from jax.experimental import multihost_utils

    info = node_info()
    mesh = _mesh(tuple(mesh_shape))
    out = {"node": info.node}
    for mode in modes:
        with jaxckpt.Checkpointer(_config(base, job, info.node, restore_collective=mode == "collective")) as ck:
            latest = ck.latest_step()
            target = target_of(mesh, SPECS[specs])
            got = ck.restore(target)
            check_bitwise(got, target, latest)
            out[mode] = {"latest": latest, "report": ck.last_restore_report.to_dict()}
            multihost_utils.sync_global_devices(f"restored {mode}")
    return out


def corrupt_job(base: str, job: str, mirror: str, modes: list):
    """Per mode (as in restore_job): restore with the corrupt node only (ChecksumError), then with a mirror of
    that node also served."""
    import jaxckpt
    from jax.experimental import multihost_utils

    info = node_info()
    mesh = _mesh((1, 2))
    target = target_of(mesh, TP_SPECS)
    out = {}
    for mode in modes:
        collective = mode == "collective"
        with jaxckpt.Checkpointer(_config(base, job, info.node, restore_collective=collective)) as ck:
            try:
                ck.restore(target)
                error = None
            except ChecksumError as e:
                error = str(e)
            multihost_utils.sync_global_devices(f"failed {mode}")
        with jaxckpt.Checkpointer(_config(base, job, info.node, f"{base}/{job}-node*,{mirror}",
                                          restore_collective=collective)) as ck:
            latest = ck.latest_step()
            got = ck.restore(target)
            check_bitwise(got, target, latest)
            report = ck.last_restore_report.to_dict()
            multihost_utils.sync_global_devices(f"restored {mode}")
        out[mode] = {"error": error, "latest": latest, "report": report}
    return out


def _train_step():
    import jax

    def update(x):
        if x.dtype == np.int32:
            return x * 3 + 1
        return (x * 1.5 + 0.25).astype(x.dtype)
    return jax.jit(lambda s: jax.tree.map(update, s), donate_argnums=0)


def _initial(mesh):
    st = device_state(mesh, 0, SAVE_SPECS)
    return {"params": st["params"], "opt": st["opt"]}


def _trained(mesh, steps: int):
    train = _train_step()
    st = _initial(mesh)
    for _ in range(steps):
        st = train(st)
    return st


def _same(a: dict, b: dict) -> bool:
    import jax

    return all(all(np.array_equal(_bits(s.data), _bits(t.data)) for s, t in zip(x.addressable_shards,
                                                                                  y.addressable_shards))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def kill_job(base: str, job: str):
    """Train and save steps 1..3, start the save of step 4 and say so; the test SIGKILLs every trainer then."""
    import jaxckpt
    from jax.experimental import multihost_utils

    info = node_info()
    mesh = _mesh((2, 2))
    train = _train_step()
    st = _initial(mesh)
    with jaxckpt.Checkpointer(_config(base, job, info.node)) as ck:
        for step in (1, 2, 3):
            st = train(st)
            ck.save(step, {**st, "step": step})
        ck.wait()
        multihost_utils.sync_global_devices("3 saved")
        st = train(st)
        ck.save(4, {**st, "step": 4})  # not waited for: the kill may land at any point of it
        open(os.path.join(info.launch_dir, f"saving-{info.process_id}"), "w").close()
        time.sleep(120)  # killed before this ends
    return "not killed"


def relaunch_job(base: str, job: str):
    import jax
    import jaxckpt
    from jax.experimental import multihost_utils

    info = node_info()
    mesh = _mesh((2, 2))
    with jaxckpt.Checkpointer(_config(base, job, info.node)) as ck:
        latest = ck.latest_step()
        ref = _trained(mesh, latest)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), ref)
        got = ck.restore({**abstract, "step": 0})  # through the collective (COLLECTIVE_ENV)
        collective = ck.last_restore_report.to_dict()
        restored_collective = got["step"] == latest and _same({k: got[k] for k in ("params", "opt")}, ref)
        ck.config = dataclasses.replace(ck.config, restore_collective=False)  # each process fetches what it needs
        got = ck.restore({**abstract, "step": 0})
        assert got["step"] == latest
        report = ck.last_restore_report.to_dict()
        restored = _same({k: got[k] for k in ("params", "opt")}, ref) and restored_collective
        st, train = {k: got[k] for k in ("params", "opt")}, _train_step()
        for step in range(latest + 1, 7):  # continue training, saving as before
            st = train(st)
            ck.save(step, {**st, "step": step}).result()
        continued = _same(st, _trained(mesh, 6))
        steps = ck.all_steps()
        multihost_utils.sync_global_devices("continued")
    return {"latest": latest, "restored": restored, "continued": continued, "report": report, "steps": steps,
            "collective": collective}


# ---------------------------------------------------------------------------------------- pure planning
def test_planning_agrees_on_complete_steps_and_versions():
    e = [HeldEntry(s, q, 4, "L4", 100 + q) for s in (3, 4) for q in range(4) if (s, q) != (4, 3)]
    e += [HeldEntry(5, 0, 2, "L2", 7), HeldEntry(5, 1, 2, "L2", 8)]  # a later run of 2 processes
    e += [HeldEntry(6, 0, 0, "", 9)]  # an unreadable manifest: listed, never complete
    assert complete_steps(e) == [3, 5]
    assert choose_version(e, 3) == Version(3, 4, "L4") and choose_version(e, 4) is None
    assert missing_processes(e, 4) == {Version(4, 4, "L4"): [3]}
    assert newest_common([[3, 5], [3], [1, 3, 5]]) == 3 and newest_common([[3], [4]]) is None
    assert HeldEntry.from_wire(e[0].to_wire()) == e[0]


def test_reader_routes_around_a_corrupt_source_and_reports_bytes():
    good = np.arange(64, dtype=np.uint8)
    bad = good.copy()
    bad[5] ^= 1
    chunk = ChunkMeta(Box((0,), (32,)), 0, 32, crc32c(good[:32]), 2)
    chunk2 = ChunkMeta(Box((32,), (64,)), 32, 32, crc32c(good[32:]), 2)

    def src(kind, name, node, buf):
        return Source(kind, name, node, lambda o, n: memoryview(buf)[o:o + n])
    reader = ChunkReader({2: [src("remote", "agent A", "n1", bad), src("remote", "agent B", "n2", good)]}, 9,
                         workers=2, process=1)
    reader.prefetch([("w", chunk), ("w", chunk2), ("w", chunk)])
    np.testing.assert_array_equal(np.frombuffer(reader.raw("w", chunk), np.uint8), good[:32])
    r = reader.finish()
    assert r.chunks == 2 and r.planned_by_kind == {"remote": 64} and r.planned_by_node == {"n1": 64}
    assert r.bytes_by_source == {"agent B": 32, "agent A": 32} and r.bytes_by_node == {"n1": 32, "n2": 32}
    assert len(r.fallbacks) == 1 and "w: step 9 chunk of process 2: remote source agent A failed" in r.fallbacks[0]
    only_bad = ChunkReader({2: [src("remote", "agent A", "n1", bad)]}, 9)
    with pytest.raises(ChecksumError, match=r"w: step 9 chunk \(0,\)\.\.\(32,\) of process 2 failed its crc32c "
                                            r"check \(corrupt\) at agent A"):
        only_bad.raw("w", chunk)
    with pytest.raises(StepNotFoundError, match="held by process 3, which this process cannot reach"):
        only_bad.raw("w", ChunkMeta(Box((0,), (8,)), 0, 8, 0, 3))
    assert isinstance(RestoreReport(1, 0).summary(), str)


# ------------------------------------------------------------------------------------- multi-process jobs
@pytest.fixture(scope="module")
def saved():
    values = expect_ok(launch(save_job, nodes=2, procs_per_node=2, devices_per_proc=2, args=(BASE, JOB), env=ENV,
                              timeout=180))
    assert [v["latest"] for v in values] == [4] * 4
    assert [v["held"] for v in values] == [[3, 4]] * 3 + [[3]]
    return values


def test_agents_serve_their_node_with_a_private_token(saved):
    for n in (0, 1):
        d = node_dir(JOB, n)
        for name in (PEER_NAME, TOKEN_NAME):
            assert os.stat(os.path.join(d, name)).st_mode & 0o777 == 0o600
        info = read_peer_info(d)
        assert info["address"].startswith("tcp://127.0.0.1:") and info["job"] == JOB
        t = ZmqTransport()
        good = t.connect(info["address"], token=info["token"], timeout_s=20)
        bad = t.connect(info["address"], token=b"not-the-token", timeout_s=20)
        try:
            held = {(e[0], e[1]) for e in good.held()}
            procs = {2 * n, 2 * n + 1}
            assert {(q, 3) for q in procs} <= held and all(q in procs for q, _ in held)
            with pytest.raises(PeerError, match="refused .*wrong or missing token"):
                bad.held()
            with pytest.raises(StepNotFoundError, match=f"step 3 is not held by node agent at {d} for process 7"):
                good.manifest(3, process=7)
        finally:
            good.close()
            bad.close()
        # On its Unix socket, a reader of the job may list and pin any process's slot, and nothing else.
        conn = proto.AgentConnection(d)
        try:
            conn.call("hello", job=JOB, role="reader")
            assert {(e[0], e[1]) for e in conn.call("index")["held"]} == held
            with pytest.raises(AgentError, match="not permitted operation 'delete'"):
                conn.call("delete", step=3)
            with pytest.raises(AgentError, match=f"serves job '{JOB}', not 'other'"):
                other = proto.AgentConnection(d)
                try:
                    other.call("hello", job="other", role="reader")
                finally:
                    other.close()
        finally:
            conn.close()


def test_a_remote_agent_opened_for_a_restore_connects_every_client_and_reads_bit_for_bit(saved):
    """Opening another node's agent for a restore makes all its transport clients at once (their connections
    are set up while the restore plans), and reads on every client at the same time give the agent's bytes."""
    from concurrent.futures import ThreadPoolExecutor

    from jaxckpt.backends.agent.readers import NodeAgentHolder, RemoteAgentHolder, local_agents

    d = node_dir(JOB, 1)
    (info,) = local_agents(JOB, [d])
    remote = RemoteAgentHolder(info, node="node0", timeout_s=20.0, clients=3)
    local = NodeAgentHolder(d, JOB, "node1", timeout_s=20.0)
    try:
        assert remote.clients == 0
        (entry, *_) = [e for e in remote.held() if e.step == 3]
        assert remote.clients == 1
        # the manifest alone (protection's start-up scan): one request on the one client, none made for reads
        assert remote.manifest(entry.process, 3) == local.manifest(entry.process, 3)
        assert remote.clients == 1
        with pytest.raises(StepNotFoundError, match=r"step 99"):
            remote.manifest(entry.process, 99)
        far, near = remote.open(entry.process, 3), local.open(entry.process, 3)
        assert remote.clients == 3
        try:
            assert bytes(far.manifest) == bytes(near.manifest)
            size = max(c.offset + c.nbytes for a in decode(near.manifest).arrays for c in a.chunks)
            parts = [(o, min(size - o, 200_000)) for o in range(0, size, 200_000)][:12]
            with ThreadPoolExecutor(max_workers=3) as ex:
                got = list(ex.map(lambda p: bytes(far.read(*p)), parts))
            assert got == [bytes(near.read(*p)) for p in parts]
            assert remote.clients == 3
        finally:
            far.close()
            near.close()
    finally:
        remote.close()
        local.close()
    # A job keeping replicas whole (Config.replicas, the default) opens every agent for its manifest and mostly
    # reads none: its holder makes the fetch threads' clients at the first read instead.
    lazy = RemoteAgentHolder(info, node="node0", timeout_s=20.0, clients=3, connect_at_open=False)
    near = NodeAgentHolder(d, JOB, "node1", timeout_s=20.0)
    try:
        far = lazy.open(entry.process, 3)
        assert lazy.clients == 1
        mine = near.open(entry.process, 3)
        try:
            assert bytes(far.manifest) == bytes(mine.manifest)
            n = max(c.offset + c.nbytes for a in decode(mine.manifest).arrays for c in a.chunks)
            assert bytes(far.read(0, n)) == bytes(mine.read(0, n))
            assert lazy.clients == 3
        finally:
            far.close()
            mine.close()
    finally:
        lazy.close()
        near.close()


def test_only_a_job_with_split_replicas_connects_to_remote_agents_at_the_open(saved):
    """Split replicas: a restore reads the other nodes' agents, whose clients connect while it plans. Whole: it
    reads its own node's memory when the agents live, and connects no more than it asks."""
    import jaxckpt
    from jaxckpt.backends.agent.handle import AgentHandle
    from jaxckpt.backends.agent.readers import local_agents
    from jaxckpt.backends.shm import ShmStore

    (info,) = local_agents(JOB, [node_dir(JOB, 1)])
    for replicas, early in (("split", True), ("whole", False)):
        store = ShmStore(jaxckpt.Config(store="shm", job_id=JOB, shm_dir=node_dir(JOB, 0), replicas=replicas))
        try:
            holder = AgentHandle(store).remote_holder(info, "node1")
            try:
                (entry, *_) = [e for e in holder.held() if e.step == 3]
                holder.open(entry.process, 3).close()
                assert holder.clients == (store.config.restore_workers if early else 1), replicas
            finally:
                holder.close()
        finally:
            store.close()


# The fetch path (every process reads what it needs from whichever agent holds it) and the collective path
# (Config.restore_collective, off by default: slower on CPU) of the same restores; also in
# tests/test_restore_collective.py.
COLLECTIVE_ENV = {**ENV, "JAXCKPT_RESTORE_COLLECTIVE": "1"}


@pytest.fixture(scope="module")
def restored_4_to_2(saved):
    """One launch of 2 processes (2 nodes x 1), tensor-parallel: the fetch restore, then the collective one."""
    return expect_ok(launch(restore_job, nodes=2, procs_per_node=1, devices_per_proc=2,
                            args=(BASE, JOB, [1, 4], "tp", ["fetch", "collective"]), env=ENV, timeout=180))


def test_restore_4_to_2_processes_tensor_parallel(restored_4_to_2):
    values = [{**v["fetch"], "node": v["node"]} for v in restored_4_to_2]
    assert [v["latest"] for v in values] == [3, 3]  # step 4 lacks process 3: the newest step held for all is 3
    for v in values:
        r = v["report"]
        assert r["step"] == 3 and not r["fallbacks"] and r["nbytes"] > 0
        assert set(r["bytes_by_kind"]) == {"local", "node", "remote"} if v["node"] == 0 else \
            set(r["bytes_by_kind"]) == {"node", "remote"}  # new process 1 (node 1) held nothing of old process 1
        assert r["planned_by_kind"] == r["bytes_by_kind"] and len(r["bytes_by_node"]) == 2
        assert set(r["bytes_by_process"]) == {"0", "1", "2", "3"}


def test_restore_4_to_2_processes_through_the_collective(restored_4_to_2):
    """The same restore with the collective: each new process reads only its node's agent (the old processes of
    its node); what it lacks the collective brings, so nothing crosses the host transport."""
    values = [v["collective"] for v in restored_4_to_2]
    assert [v["latest"] for v in values] == [3, 3]
    for v in values:
        r = v["report"]
        assert r["step"] == 3 and not r["fallbacks"]
        assert set(r["bytes_by_kind"]) <= {"local", "node"} and r["transport_bytes"] == 0, r["bytes_by_kind"]
        assert "collective" in r["routes"].values() and r["collective_bytes"] > 0, r["routes"]
        assert r["timeline"]["collective"]["nbytes"] == r["collective_bytes"]


def test_a_restore_of_the_saved_layout_opens_only_its_own_nodes_snapshots(saved):
    """2 nodes x 2 processes restore the layout they saved, every agent alive: each process opens its own
    snapshot and the ones its node's agent holds for the other process of its node (whole replicas: a
    replicated array is saved once per node), never another node's, and reads every byte from its node."""
    values = [{**v["fetch"], "node": v["node"]} for v in
              expect_ok(launch(restore_job, nodes=2, procs_per_node=2, devices_per_proc=2,
                               args=(BASE, JOB, [4, 2], "save", ["fetch"]), env=ENV, timeout=180))]
    assert [v["latest"] for v in values] == [3] * 4  # checked bit for bit in every process
    for v in values:
        r = v["report"]
        assert r["widened"] == "" and set(r["manifests_by_kind"]) <= {"local", "node"}, r
        assert r["manifests_by_kind"]["local"] == 1 and r["transport_bytes"] == 0, r
        assert set(r["bytes_by_kind"]) <= {"local", "node"}, r["bytes_by_kind"]
    assert any(v["report"]["manifests_by_kind"].get("node") == 1 for v in values), values  # the other process's


def test_restore_4_to_8_processes_on_4_nodes_other_mesh(saved):
    values = [{**v["fetch"], "node": v["node"]} for v in
              expect_ok(launch(restore_job, nodes=4, procs_per_node=2, devices_per_proc=1,
                               args=(BASE, JOB, [2, 4], "mixed", ["fetch"]), env=ENV, timeout=240))]
    assert [v["latest"] for v in values] == [3] * 8
    for i, v in enumerate(values):
        kinds = set(v["report"]["bytes_by_kind"])
        assert kinds == {"remote"} if v["node"] >= 2 else "remote" in kinds and kinds <= {"local", "node", "remote"}
        assert not v["report"]["fallbacks"]
    # the new processes on the old nodes read their own old process's memory without a copy
    assert all("local" in values[i]["report"]["bytes_by_kind"] for i in range(4))


def test_corrupt_agent_memory_is_routed_around_or_named(saved):
    import msgpack
    from jaxckpt.core import manifest as mf

    node1 = node_dir(JOB, 1)
    mirror = os.path.join(BASE, f"{JOB}-mirror1")  # a copy of node 1's memory, clean, served by another agent
    os.mkdir(mirror, 0o700)
    for name in os.listdir(node1):
        if name.startswith(("seg-", "rec-")):
            shutil.copy(os.path.join(node1, name), os.path.join(mirror, name))
            os.chmod(os.path.join(mirror, name), 0o600)
    agent = subprocess.Popen([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", JOB, "--dir", mirror,
                              "--node", "node1-mirror"], start_new_session=True)  # sorts after node1: tried after its agent
    try:
        deadline = time.monotonic() + 60
        while read_peer_info(mirror) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        with open(os.path.join(node1, "rec-p2-s3"), "rb") as f:
            rec = msgpack.unpackb(f.read(), raw=False)
        chunk = mf.decode(rec["manifest"]).array("params/w").chunks[0]
        with open(os.path.join(node1, rec["seg"]), "r+b") as f:  # one flipped byte in node 1's agent memory
            f.seek(chunk.offset + 5)
            byte = f.read(1)[0]
            f.seek(chunk.offset + 5)
            f.write(bytes([byte ^ 0x40]))
        # fetch, then through the collective: node 1's chunks are read by one process each, so one process meets
        # the corrupt chunk; every process still raises its ChecksumError (the others naming that process)
        both = expect_ok(launch(corrupt_job, nodes=1, procs_per_node=2, devices_per_proc=1,
                                args=(BASE, JOB, mirror, ["fetch", "collective"]), env=ENV, timeout=180))
        values, collective = [v["fetch"] for v in both], [v["collective"] for v in both]
    finally:
        proto.stop_agent(mirror, JOB, timeout_s=30)
        agent.wait(timeout=30)
        try:
            os.unlink(proto.default_log_path(mirror))
        except FileNotFoundError:
            pass
    box = f"{chunk.box.start}..{chunk.box.stop}".replace("(", r"\(").replace(")", r"\)")
    for v in values:
        assert v["error"] is not None
        assert re.search(rf"params/w: step 3 chunk {box} of process 2 failed its crc32c "
                                                rf"check \(corrupt\) at agent of node .* at tcp://", v["error"])
        r = v["report"]
        assert v["latest"] == 3 and len(r["fallbacks"]) == 1 and "params/w: step 3 chunk of process 2" in \
            r["fallbacks"][0] and "read from remote source agent of node node1-mirror" in r["fallbacks"][0]
        assert any("node1-mirror" in s for s in r["bytes_by_source"])
    for v in collective:
        assert re.search(rf"params/w: step 3 chunk {box} of process 2 failed its crc32c "
                         rf"check \(corrupt\) at agent of node .* at tcp://", v["error"]), v["error"]
        assert v["latest"] == 3 and v["report"]["routes"]["params/w"] == "collective"
    assert sum(len(v["report"]["fallbacks"]) for v in collective) == 1
    assert sum(any("node1-mirror" in s for s in v["report"]["bytes_by_source"]) for v in collective) == 1
    assert agent.returncode == 0 and not os.path.exists(mirror)


@pytest.mark.parametrize("replicas", ["whole", "split"])
def test_same_job_restarts_after_sigkill_from_its_node_agents(replicas):
    env = {**ENV, "JAXCKPT_REPLICAS": replicas}
    with start(kill_job, nodes=2, procs_per_node=2, devices_per_proc=1, args=(BASE, f"{KILL_JOB}-{replicas}"),
               env=env) as job:
        deadline = time.monotonic() + 180
        while not all(os.path.exists(os.path.join(job.launch_dir, f"saving-{i}")) for i in range(4)):
            assert time.monotonic() < deadline and None in job.poll(), "the trainers did not reach step 4"
            time.sleep(0.005)
        job.kill_node(1)
        job.kill_node(0)
        assert job.wait(60)
    killed = job.results()
    bad = [r for r in killed if not r.killed or r.reported]
    assert not bad, [(r.process_id, r.returncode, r.error, r.output[-1500:]) for r in bad]
    values = expect_ok(launch(relaunch_job, nodes=2, procs_per_node=2, devices_per_proc=1,
                              args=(BASE, f"{KILL_JOB}-{replicas}"), env={**COLLECTIVE_ENV, **env}, timeout=180))
    latest = values[0]["latest"]
    assert latest in (3, 4) and all(v["latest"] == latest for v in values)
    for v in values:
        assert v["restored"] and v["continued"] and v["steps"] == [5, 6]
        kinds = v["report"]["bytes_by_kind"]
        c = v["collective"]
        if replicas == "whole":  # each node kept a whole copy: its own node's memory only, no collective needed
            assert kinds.get("local", 0) > 0 and set(kinds) <= {"local", "node"}, kinds
            assert set(c["bytes_by_kind"]) <= {"local", "node"} and c["transport_bytes"] == 0, c["bytes_by_kind"]
            assert c["collective_bytes"] == 0 and "collective" not in c["routes"].values(), c["routes"]
            continue
        assert kinds.get("local", 0) > 0 and kinds.get("node", 0) > 0 and kinds.get("remote", 0) > 0, kinds
        # through the collective the other node's share is not fetched: own and node memory only
        assert set(c["bytes_by_kind"]) <= {"local", "node"} and c["transport_bytes"] == 0, c["bytes_by_kind"]
        assert c["collective_bytes"] > 0 and "collective" in c["routes"].values(), c["routes"]
