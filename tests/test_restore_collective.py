"""Restore through the collective (jaxckpt.core.routes, jaxckpt.jax.gather) with real JAX processes on loopback.

Each simulated node is one process with 2 CPU devices; XLA's collectives run on gloo. Arrays replicated over the
processes are saved 1/R per replica; on restore each process reads only its own share and the jitted program
forms the replicas:

1. onto the same mesh and onto a changed mesh: bit for bit, every replicated array routed ``collective``, the
   host transport carries 0 bytes, the collective brings each process exactly the bytes of its shards it did
   not read itself;
2. a target on a mesh of one process's devices splits the saved replica group: fetched over the host transport,
   and the report says why; with ``restore_collective=False`` every process fetches the other's share;
3. a node lost (store="shm", protection="hybrid"): the relaunched process rebuilds its lost share over the host
   transport once, the survivor reads only its own memory, the collective forms the rest, bit for bit;
4. the planner's rule as a pure function (no processes).
"""
import os
import shutil
import uuid

import numpy as np
import pytest

from jaxckpt.core.box import Box
from jaxckpt.core.manifest import ArrayMeta, ChunkMeta
from jaxckpt.core import routes
from jaxckpt.testing import expect_ok, launch, node_info, remove_agents

BASE = f"/dev/shm/jaxckpt-rcol-{os.getpid()}-{uuid.uuid4().hex[:8]}"
ENV = {"JAXCKPT_LOG_LEVEL": "WARNING"}
NODES = 2


@pytest.fixture(scope="module", autouse=True)
def base_dir():
    os.makedirs(BASE, mode=0o700)
    yield BASE
    left = remove_agents(BASE)
    shutil.rmtree(BASE, ignore_errors=True)
    assert not left, f"agents did not clean up {left}"


# ---------------------------------------------------------------------------- runs in the launched processes
def _config(base: str, job: str, store: str, **kw):
    import jaxckpt

    node = node_info().node
    kw.setdefault("restore_collective", True)  # what this file tests (off by default)
    kw.setdefault("replicas", "split")  # a collective serves split replicas; whole ones read their own node
    return jaxckpt.Config(store=store, job_id=job, shm_dir=f"{base}/{job}-node{node}", keep=1, chunk_bytes=256,
                          agent_dirs=f"{base}/{job}-node*", commit_timeout_s=60.0, peer_timeout_s=20.0, **kw)


def host_state(step: int) -> dict:
    import ml_dtypes

    rng = np.random.default_rng([41, step])
    rep = rng.standard_normal((18, 12)).astype(np.float32)  # 18 rows: pieces of uneven length
    rep.reshape(-1)[[3, 50, 99]] = np.array([0x7FC00001, 0x7FA00002, 0xFFC00003], np.uint32).view(np.float32)
    return {"rep": rep, "cols": rng.standard_normal((10, 8)).astype(ml_dtypes.bfloat16),
            "fsdp": rng.standard_normal((32, 6)).astype(np.float32),
            "mu": rng.integers(-2**31, 2**31 - 1, (7, 6), dtype=np.int32),
            "flags": rng.integers(0, 2, (10,)).astype(bool)}


SAVE = {"rep": (), "cols": (None, "model"), "fsdp": (("data", "model"),), "mu": (), "flags": ()}
CHANGED = {"rep": ("data",), "cols": ("model", None), "fsdp": (), "mu": (None, "data"), "flags": ("model",)}


def _mesh(shape, order="process"):
    import jax

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if order == "interleaved":  # the changed mesh: each data row spans both processes
        devices = [devices[0], devices[2], devices[1], devices[3]]
    return jax.sharding.Mesh(np.array(devices).reshape(shape), ("data", "model"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _shardings(mesh, specs):
    from jax.sharding import NamedSharding, PartitionSpec as P

    return {k: NamedSharding(mesh, P(*s)) for k, s in specs.items()}


def device_state(step: int) -> dict:
    import jax

    sh = _shardings(_mesh((NODES, 2)), SAVE)
    return {k: jax.make_array_from_callback(h.shape, sh[k], lambda i, h=h: h[i]) for k, h in host_state(step).items()}


def _target(shardings) -> dict:
    import jax

    return {k: jax.ShapeDtypeStruct(h.shape, h.dtype, sharding=shardings[k]) for k, h in host_state(0).items()}


def _check(got: dict, shardings: dict, step: int) -> None:
    for k, h in host_state(step).items():
        assert got[k].sharding == shardings[k], k
        for shard in got[k].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data).view(np.uint8), h[shard.index].view(np.uint8),
                                          err_msg=f"{k} step {step}")


def _expected_collective_bytes(ck, shardings: dict, routed: dict) -> int:
    """Bytes of this process's shards (distinct boxes) of the collective arrays not in its own saved chunks."""
    import jax

    me = jax.process_index()
    n = 0
    for k, h in host_state(0).items():
        if routed.get(k) != "collective":
            continue
        own = _own_chunks(ck, k)
        boxes = {Box.from_index(i, h.shape) for d, i in shardings[k].devices_indices_map(h.shape).items()
                 if d.process_index == me}
        for b in boxes:
            mine = sum(p.size for p in (c.box.intersect(b) for c in own) if p is not None)
            n += (b.size - mine) * h.dtype.itemsize
    return n


def _report(ck) -> dict:
    r = ck.last_restore_report
    return {**r.to_dict(), "transport": r.transport_bytes}


def meshes_job(base: str, job: str, store: str):
    """Save once; restore onto the saved mesh, a changed mesh, one process's devices, and without collective."""
    import jax
    import jaxckpt
    from jax.experimental import multihost_utils

    out = {}
    with jaxckpt.Checkpointer(_config(base, job, store)) as ck:
        ck.save(1, device_state(1)).result()
        for name, mesh, specs in (("same", _mesh((NODES, 2)), SAVE),
                                  ("changed", _mesh((2, 2), "interleaved"), CHANGED)):
            sh = _shardings(mesh, specs)
            _check(ck.restore(_target(sh)), sh, 1)
            rep = _report(ck)
            own = {k: sum(c.box.size for c in _own_chunks(ck, k)) for k in SAVE}
            rep["own_elements"] = own
            rep["expected_collective"] = _expected_collective_bytes(ck, sh, rep["routes"])
            out[name] = rep
        # a target on process 0's devices only: the saved replica group (both processes) is split
        sub = jax.sharding.Mesh(np.array([d for d in jax.devices() if d.process_index == 0]).reshape(1, 2),
                                ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        sh = _shardings(sub, {k: () for k in SAVE})
        _check(ck.restore(_target(sh)), sh, 1)
        out["split"] = _report(ck)
        multihost_utils.sync_global_devices("restored")
    with jaxckpt.Checkpointer(_config(base, job + "-off", store, restore_collective=False)) as ck:
        ck.save(1, device_state(1)).result()
        sh = _shardings(_mesh((NODES, 2)), SAVE)
        _check(ck.restore(_target(sh)), sh, 1)
        out["off"] = _report(ck)
        multihost_utils.sync_global_devices("restored off")
    return out


def _own_chunks(ck, path):
    with ck.engine.open(None) as (_, manifests, _reader):
        m = next(m for m in manifests if m.process == ck.engine.process_index)
        return list(m.array(path).chunks)


def save_job(base: str, job: str):
    import jaxckpt

    with jaxckpt.Checkpointer(_config(base, job, "shm", protection="hybrid")) as ck:
        for step in (1, 2):
            ck.save(step, device_state(step)).result()
        ck.wait()
        return ck.latest_step()


def first_jobs(base: str) -> dict:
    """What the tests below run first, in one launch: ``meshes_job`` with each store, then the save of the
    node-loss job (a Checkpointer per job)."""
    return {**{store: meshes_job(base, f"meshes-{store}", store) for store in ("memory", "shm")},
            "loss": save_job(base, "loss")}


def node_loss_restore_job(base: str, job: str):
    import jaxckpt
    from jax.experimental import multihost_utils

    with jaxckpt.Checkpointer(_config(base, job, "shm", protection="hybrid")) as ck:
        latest = ck.latest_step()
        sh = _shardings(_mesh((NODES, 2)), SAVE)
        _check(ck.restore(_target(sh)), sh, latest)
        rep = _report(ck)
        multihost_utils.sync_global_devices("restored")
    return {"latest": latest, "report": rep}


# ------------------------------------------------------------------------------------------------- the tests
def _launch(fn, *args):
    return expect_ok(launch(fn, nodes=NODES, procs_per_node=1, devices_per_proc=2, args=(BASE, *args), env=ENV,
                            timeout=240))


@pytest.fixture(scope="module")
def first() -> dict:
    """first_jobs' results: name -> every process's."""
    values = _launch(first_jobs)
    return {name: [v[name] for v in values] for name in ("memory", "shm", "loss")}


@pytest.mark.parametrize("store", ["memory", "shm"])
def test_restore_through_collective_onto_same_and_changed_mesh(store, first):
    out = first[store]
    for p, r in enumerate(out):
        for name in ("same", "changed"):
            rep = r[name]
            routed = rep["routes"]
            # what a process lacks goes by collective, the rest is read locally; nothing crosses the host transport
            assert routed["rep"] == routed["mu"] == "collective", (p, name, routed)
            assert all(v == "collective" or v.startswith("fetch: local") for v in routed.values()), routed
            assert rep["transport"] == 0, (p, name, rep["bytes_by_kind"])
            assert set(rep["bytes_by_kind"]) <= {"local", "node"}, (p, name, rep["bytes_by_kind"])
            assert rep["collective_bytes"] == rep["expected_collective"] > 0, (p, name)
            assert rep["timeline"]["collective"]["nbytes"] == rep["collective_bytes"]
        # onto the saved mesh the fsdp shards are each process's own: read locally, no collective needed
        assert r["same"]["routes"]["fsdp"].startswith("fetch: local"), r["same"]["routes"]
        assert r["same"]["routes"]["flags"] == r["same"]["routes"]["cols"] == "collective"
        # the collective replaced what each process would otherwise read of the other's share: it reads only its own
        own_rep = r["same"]["own_elements"]["rep"] * 4
        assert own_rep < 18 * 12 * 4
        assert r["changed"]["routes"]["fsdp"] == "collective"
        split = r["split"]
        assert all(v.startswith("fetch: saved pieces outside the target's mesh") for v in split["routes"].values()), \
            split["routes"]
        if p == 0:  # it needs the whole arrays; the other process's shares come over the host transport
            assert split["transport"] > 0 and split["collective_bytes"] == 0
        else:  # holds no shard of these arrays: reads nothing
            assert split["nbytes"] == 0
        assert r["off"]["routes"] == {} and r["off"]["transport"] > 0


def test_node_loss_restore_uses_collective_and_host_transport(first):
    job = "loss"
    assert first[job] == [2, 2]
    lost = f"{BASE}/{job}-node1"
    from jaxckpt.backends.agent import protocol as proto
    proto.stop_agent(lost, timeout_s=20)
    proto.kill_agent(lost, remove_memory=True)  # the whole node: its agent and every byte it held
    shutil.rmtree(lost, ignore_errors=True)
    out = _launch(node_loss_restore_job, job)
    r0, r1 = out[0]["report"], out[1]["report"]
    assert out[0]["latest"] == out[1]["latest"] == 2
    for r in (r0, r1):
        assert r["routes"]["rep"] == r["routes"]["mu"] == r["routes"]["flags"] == "collective", r["routes"]
        assert r["collective_bytes"] > 0
    # the survivor reads only its own node's memory; the relaunched process rebuilds its lost share over the
    # host transport, once, and the collective brings each what the other contributed
    assert set(r0["bytes_by_kind"]) <= {"local", "node"}, r0["bytes_by_kind"]
    assert r1["bytes_by_kind"].get("rebuild", 0) + r1["transport"] > 0, r1["bytes_by_kind"]
    assert "local" not in r1["bytes_by_kind"] and "node" not in r1["bytes_by_kind"]


# --------------------------------------------------------------------------------------- the rule, pure
def _meta(path, shape, pieces):
    """An int32 array saved as ``pieces``: (process, start, stop) along axis 0."""
    cols = shape[1]
    chunks, off = [], {}
    for q, a, b in pieces:
        box = Box((a, 0), (b, cols))
        chunks.append(ChunkMeta(box, off.get(q, 0), box.size * 4, 0, q))
        off[q] = off.get(q, 0) + box.size * 4
    return ArrayMeta(path, (), shape, "int32", "jax", chunks=tuple(chunks))


def _layout(shape, devices):
    """devices: (id, process, rows) with rows (a, b) or None for the whole array."""
    return routes.TargetLayout(tuple((d, p, Box((a, 0), (b, shape[1])) if rows else Box.full(shape))
                                     for d, p, rows in devices for a, b in [rows or (0, 0)]))


def test_rule_routes_each_array_and_says_why():
    shape = (10, 3)
    meta = _meta("w", shape, [(0, 0, 5), (1, 5, 10)])
    full = _layout(shape, [(0, 0, None), (1, 0, None), (2, 1, None), (3, 1, None)])
    holders = {0: [0], 1: [1]}
    assert routes.plan_route(meta, full, holders, process_count=1).reason == "single process"
    r = routes.plan_route(meta, full, holders, process_count=2)
    assert r.kind == routes.COLLECTIVE and {c.process for c in r.contributions} == {0, 1}
    # each chunk once, by the process holding it, on one of its own devices
    assert sorted((c.chunk.process, c.process) for c in r.contributions) == [(0, 0), (1, 1)]
    assert all(c.device in ((0, 1) if c.process == 0 else (2, 3)) for c in r.contributions)
    assert routes.received_elements(r, full, 0) == 15 and routes.received_elements(r, full, 1) == 15
    # every process needs only what it holds: local reads, no collective
    own = _layout(shape, [(0, 0, (0, 5)), (1, 0, (0, 5)), (2, 1, (5, 10)), (3, 1, (5, 10))])
    assert routes.plan_route(meta, own, holders, process_count=2).reason.startswith("local")
    # a target on process 0's devices: process 1's piece is held outside the target's mesh
    sub = _layout(shape, [(0, 0, None), (1, 0, None)])
    r = routes.plan_route(meta, sub, holders, process_count=2)
    assert r.kind == routes.FETCH and "outside the target's mesh" in r.reason and "saving process 1" in r.reason
    # a lost node: its chunk is contributed (fetched or rebuilt) once, by its namesake
    r = routes.plan_route(meta, full, {0: [0]}, process_count=2)
    assert r.kind == routes.COLLECTIVE and "host transport once" in r.reason
    assert sorted((c.chunk.process, c.process) for c in r.contributions) == [(0, 0), (1, 1)]
    # two processes of one node both read both shares from their node's memory: no collective needed
    assert routes.plan_route(meta, full, {0: [0, 1], 1: [0, 1]}, process_count=2).reason.startswith("local")
    # a host target
    assert routes.plan_route(meta, None, holders, process_count=2).kind == routes.FETCH


def test_rule_with_whole_replicas_takes_each_box_once():
    """Whole replicas: processes 0 and 1 (two nodes) each saved the whole array. Every process reads its own node's
    copy: local; with node 1 lost, the collective carries one copy, process 0's, never both."""
    shape = (10, 3)
    meta = _meta("w", shape, [(0, 0, 5), (0, 5, 10), (1, 0, 5), (1, 5, 10)])
    full = _layout(shape, [(0, 0, None), (1, 0, None), (2, 1, None), (3, 1, None)])
    assert routes.plan_route(meta, full, {0: [0], 1: [1]}, process_count=2).reason.startswith("local")
    r = routes.plan_route(meta, full, {0: [0]}, process_count=2)
    assert r.kind == routes.COLLECTIVE and "host transport" not in r.reason
    assert sorted((c.chunk.process, c.chunk.box.start[0]) for c in r.contributions) == [(0, 0), (0, 5)]
    assert r.row_elements == 15 and routes.received_elements(r, full, 1) == 30


def test_prefetch_reads_every_transport_source_at_once():
    """Chunks of two processes served over the transport: ``workers`` requests in flight per source, handed out
    in turn, so both sources are read at once (the first three reads meet at a barrier: with one pool of
    ``workers`` threads over chunks listed by process, they never would)."""
    import threading

    from jaxckpt.core.checksum import crc32c
    from jaxckpt.core.fetch import ChunkReader
    from jaxckpt.core.sources import Source

    data = {q: np.arange(64, dtype=np.uint8) + q for q in (0, 1)}
    meet = threading.Barrier(3, timeout=30)
    seen, lock = [], threading.Lock()

    def source(q):
        def read(offset, nbytes):
            with lock:
                seen.append(q)
                first = len(seen) <= 3
            if first:
                meet.wait()  # raises BrokenBarrierError (a failed read) unless three reads are in flight at once
            return memoryview(data[q][offset:offset + nbytes].tobytes())
        return [Source("remote", f"agent {q}", f"node{q}", read)]

    chunks = [("w", ChunkMeta(Box((i,), (i + 8,)), i, 8, crc32c(data[q][i:i + 8].tobytes()), q))
              for q in (0, 1) for i in range(0, 64, 8)]
    reader = ChunkReader({0: source(0), 1: source(1)}, 1, workers=2)
    reader.prefetch(chunks)
    assert reader.report.chunks == 16 and reader.report.bytes_by_kind == {"remote": 128}
    assert set(seen[:3]) == {0, 1}  # both sources among the first requests
