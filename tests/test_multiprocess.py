"""Checkpointer across real JAX processes (launcher): ownership, balance, commit agreement, restore anywhere.

Each launch runs one scenario function in every process; the bitwise checks run inside the processes (a
failure comes back as the process's traceback), the cross-process checks (every box saved exactly once,
replica balance, identical commit view) run here on the chunk tables the processes return.
"""
import os

import numpy as np
import pytest

from jaxckpt.core.box import Box, disjoint
from jaxckpt.testing import expect_ok, launch, node_info

N_STEPS = 4
CHUNK_BYTES = 128  # small: replicated pieces are cut into several chunks, so "within one chunk" is tested


# ---------------------------------------------------------------------------- runs in every launched process
def _state_and_specs(mesh):
    """A small state over a data x model mesh: fully sharded, fully and partially replicated, keys, host leaves."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    rng = np.random.default_rng(1234)  # the same global values in every process
    sharded = rng.standard_normal((16, 8)).astype(np.float32)
    nan_bits = np.array([0x7FC00001, 0x7FA00002, 0xFFC00003], dtype=np.uint32)  # NaNs with payloads
    sharded.reshape(-1)[[3, 50, 99]] = nan_bits.view(np.float32)
    values = {
        "sharded": (sharded, P("data", "model")),
        "replicated": (rng.standard_normal((26, 8)).astype(np.float32), P()),
        "rows": (rng.integers(-1000, 1000, (16, 6)).astype(np.int32), P("data", None)),
        "cols": (rng.standard_normal((12, 16)).astype(jnp.bfloat16), P(None, "model")),
    }
    state = {"params": {}}
    for name, (host, spec) in values.items():
        sharding = NamedSharding(mesh, spec)
        state["params"][name] = jax.make_array_from_callback(host.shape, sharding, lambda idx, h=host: h[idx])
    make_keys = jax.jit(lambda: jax.random.split(jax.random.key(7), 4), out_shardings=NamedSharding(mesh, P("data")))
    state["keys"] = make_keys()
    state["host"] = np.arange(10, dtype=np.float64) / 3
    state["lr"] = np.float32(0.25)
    state["step"] = 0
    return state


def _train_step_fn(state):
    import jax
    import jax.numpy as jnp

    def update(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.vmap(lambda k: jax.random.fold_in(k, 1))(x)
        return x * 2 + 1

    device_state = {"params": state["params"], "keys": state["keys"]}
    shardings = jax.tree.map(lambda x: x.sharding, device_state)
    return jax.jit(lambda s: jax.tree.map(update, s), donate_argnums=0, out_shardings=shardings)


def _global_host(x):
    """The whole array's bytes on this process (an all-gather), taken before the next step can touch them."""
    import jax
    from jax.experimental import multihost_utils

    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True)).copy()


def _bits(a):
    a = np.ascontiguousarray(np.asarray(a))
    return a.view(np.uint8) if a.dtype.itemsize == 1 or a.ndim == 0 else a.view(f"u{a.dtype.itemsize}")


def _check_local_shards(x, want: np.ndarray, what: str):
    """Every addressable shard of ``x`` equals the global reference ``want`` at its index, bit for bit."""
    import jax

    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    assert x.shape == want.shape, (what, x.shape, want.shape)
    for shard in x.addressable_shards:
        np.testing.assert_array_equal(_bits(shard.data), _bits(want[shard.index]), err_msg=what)


def _holders(x) -> list:
    """For each distinct box of ``x``: [start, stop, processes holding it]."""
    import jax

    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    out: dict[Box, set] = {}
    for dev, index in x.sharding.devices_indices_map(x.shape).items():
        out.setdefault(Box.from_index(index, x.shape), set()).add(dev.process_index)
    return [[list(b.start), list(b.stop), sorted(p)] for b, p in sorted(out.items())]


def scenario(mesh_shape, job_id, replicas):
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jaxckpt
    from jaxckpt.core.manifest import merge_chunks

    info = node_info()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices).reshape(mesh_shape), ("data", "model"))
    state = _state_and_specs(mesh)
    train_step = _train_step_fn(state)
    cfg = jaxckpt.Config(keep=N_STEPS, chunk_bytes=CHUNK_BYTES, job_id=job_id, max_pending_saves=2,
                         commit_timeout_s=60.0, replicas=replicas)
    refs = {}
    with jaxckpt.Checkpointer(cfg) as ck:
        assert ck.engine.peers is not None
        for step in range(N_STEPS):
            state["step"] = step
            ck.save(step, state)  # several saves in flight; the next line donates the buffers just saved
            refs[step] = {"params": {k: _global_host(v) for k, v in state["params"].items()},
                          "keys": _global_host(state["keys"])}
            device_state = train_step({"params": state["params"], "keys": state["keys"]})
            state.update(device_state)
        ck.wait()
        latest, steps = ck.latest_step(), ck.all_steps()
        holders = {f"params/{k}": _holders(v) for k, v in state["params"].items()}
        holders["keys"] = _holders(state["keys"])

        # Every saved step, restored onto the shardings it was saved with, bit for bit.
        same = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                            if isinstance(x, jax.Array) else x, state)
        for step in steps:
            out = ck.restore(same, step=step)
            for k, v in out["params"].items():
                _check_local_shards(v, refs[step]["params"][k], f"step {step} params/{k}")
            _check_local_shards(out["keys"], refs[step]["keys"], f"step {step} keys")
            assert out["step"] == step and out["lr"] == np.float32(0.25)
            np.testing.assert_array_equal(out["host"], np.arange(10, dtype=np.float64) / 3)

        # The latest step onto a different mesh (devices reversed, axes swapped): chunks come from other processes.
        mesh2 = Mesh(np.array(devices[::-1]).reshape(mesh_shape[::-1]), ("data", "model"))
        specs = {"sharded": P("model", "data"), "replicated": P(None, "model"), "rows": P(), "cols": P("model", None)}
        other = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh2, specs[k]))
                            for k, v in state["params"].items()},
                 "keys": jax.ShapeDtypeStruct(state["keys"].shape, state["keys"].dtype,
                                              sharding=NamedSharding(mesh2, P("model"))),
                 "host": np.zeros(10), "lr": np.float32(0), "step": 0}
        out = ck.restore(other, step=latest)
        for k, v in out["params"].items():
            assert v.sharding == other["params"][k].sharding
            _check_local_shards(v, refs[latest]["params"][k], f"resharded params/{k}")
        _check_local_shards(out["keys"], refs[latest]["keys"], "resharded keys")

        # Whole arrays on the host (no target): every process's chunks, fetched through the peer transport.
        whole = ck.restore(None, step=latest)
        for k, want in refs[latest]["params"].items():
            np.testing.assert_array_equal(_bits(whole["params"][k]), _bits(want), err_msg=f"host params/{k}")

        with ck.engine.open(latest) as (_, manifests, reader):
            assert sorted(m.process for m in manifests) == list(range(info.process_count))
            for path, meta in merge_chunks(manifests).items():  # the gathered table covers each array once
                boxes = [c.box for c in meta.chunks]
                if replicas == "whole":  # a box saved on several nodes: the copies are cut alike
                    boxes = list(dict.fromkeys(boxes))
                assert disjoint(boxes) and sum(b.size for b in boxes) == Box.full(meta.shape).size, path
            for m in manifests:  # every chunk of every process, fetched and crc-checked
                for a in m.arrays:
                    for c in a.chunks:
                        assert len(reader.raw(a.path, c)) == c.nbytes
            own = next(m for m in manifests if m.process == info.process_id)
            chunks = {a.path: [[list(c.box.start), list(c.box.stop), c.nbytes, c.process] for c in a.chunks]
                      for a in own.arrays}
        remote = {str(q): n for q, n in reader.bytes_by_process.items() if q != info.process_id}
        multihost_utils.sync_global_devices("restored")  # nobody stops serving while others still read
    return {"latest": latest, "steps": steps, "chunks": chunks, "holders": holders,
            "shapes": {f"params/{k}": [list(v.shape), v.dtype.itemsize] for k, v in state["params"].items()},
            "remote_bytes": remote, "pid": os.getpid()}


# --------------------------------------------------------------------------------------------- the tests
def _check_ownership(values, replicas, procs_per_node):
    """Every box saved exactly once (split) or once per node holding it (whole), by processes holding it, each
    replica saving about 1/R of a replicated box (whole: 1/R of its node's copy, R its replicas on the node)."""
    n = len(values)
    assert {v["latest"] for v in values} == {N_STEPS - 1}, [v["latest"] for v in values]
    assert all(v["steps"] == list(range(N_STEPS)) for v in values)
    assert all(v["remote_bytes"] for v in values), "every process read chunks from another process"
    holders = values[0]["holders"]
    assert all(v["holders"] == holders for v in values)
    # the processes that together save one copy: all of them (split), or each node's (whole)
    groups = [set(range(n))] if replicas == "split" else \
        [set(range(i, i + procs_per_node)) for i in range(0, n, procs_per_node)]
    tables: dict[str, list] = {}
    for q, v in enumerate(values):
        for path, chunks in v["chunks"].items():
            assert all(c[3] == q for c in chunks), f"{path}: process {q} lists another process's chunks"
            tables.setdefault(path, []).extend((Box(tuple(a), tuple(b)), nbytes, p) for a, b, nbytes, p in chunks)
    assert set(holders) <= set(tables)
    replicated_somewhere = False
    for path, boxes in holders.items():
        for group in groups:
            chunks = [c for c in tables[path] if c[2] in group]
            held = [(Box(tuple(a), tuple(s)), set(procs) & group) for a, s, procs in boxes if set(procs) & group]
            every = [b for b, _, _ in chunks]
            # every box the group holds saved exactly once by the group
            assert disjoint(every), f"{path}: overlapping chunks"
            assert sum(b.size for b in every) == sum(box.size for box, _ in held), path
            biggest = max((nb for _, nb, _ in chunks), default=0)
            for box, procs in held:
                inside = [(b, nb, p) for b, nb, p in chunks if box.contains(b)]
                assert sum(b.size for b, _, _ in inside) == box.size, f"{path}: box {box} not saved exactly once"
                assert {p for _, _, p in inside} <= procs, f"{path}: box {box} saved by a process not holding it"
                if len(procs) > 1:
                    replicated_somewhere = True
                    share = sum(nb for _, nb, _ in inside) / len(procs)
                    for q in procs:
                        got = sum(nb for _, nb, p in inside if p == q)
                        assert abs(got - share) <= biggest, f"{path}: box {box}: process {q} saved {got}, 1/R={share}"
        shape = tuple(values[0]["shapes"][path][0]) if path in values[0]["shapes"] else None
        if shape and replicas == "split":
            assert sum(b.size for b, _, _ in tables[path]) == Box.full(shape).size, path
    assert replicated_somewhere
    assert len({v["pid"] for v in values}) == n


@pytest.mark.parametrize("nodes,procs_per_node,mesh_shape,replicas",
                         [(2, 2, (4, 2), "whole"), (2, 2, (4, 2), "split"), (1, 4, (2, 4), "whole")],
                         ids=["2nodes-x-2procs", "2nodes-x-2procs-split", "1node-x-4procs"])
def test_checkpointer_across_processes(nodes, procs_per_node, mesh_shape, replicas):
    results = launch(scenario, nodes=nodes, procs_per_node=procs_per_node, devices_per_proc=2,
                     args=(list(mesh_shape), f"mp-{nodes}x{procs_per_node}-{replicas}", replicas), timeout=240)
    values = expect_ok(results)
    _check_ownership(values, replicas, procs_per_node)
    if mesh_shape == (4, 2):
        # data spans the 4 processes: the replicated and data-replicated arrays are split 4 ways
        assert [len(p) for _, _, p in values[0]["holders"]["params/replicated"]] == [4]
        assert {len(p) for _, _, p in values[0]["holders"]["params/cols"]} == {4}
        assert {len(p) for _, _, p in values[0]["holders"]["params/rows"]} == {1}  # replicated within a process
    else:
        # model spans 2 processes: rows (replicated over model) is shared by 2 processes, cols by 2
        assert {len(p) for _, _, p in values[0]["holders"]["params/rows"]} == {2}
        assert {len(p) for _, _, p in values[0]["holders"]["params/cols"]} == {2}


def coordinator_and_tokens(job_id):
    """JaxCoordinator semantics, then a job whose processes disagree on the peer token: restore is refused."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxckpt
    from jaxckpt.errors import PeerError
    from jaxckpt.jax.coordination import JaxCoordinator

    me = node_info().process_id
    coord = JaxCoordinator()
    assert (coord.process_index, coord.process_count) == (me, 2)
    coord.set(f"{job_id}/hello/{me}", f"from {me}".encode())
    other = coord.get(f"{job_id}/hello/{1 - me}", 60.0)
    missing = coord.try_get(f"{job_id}/never-set")
    try:
        coord.get(f"{job_id}/never-set", 0.2)
        timed_out = False
    except TimeoutError as e:
        timed_out = "never-set" in str(e)

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    x = jax.device_put(jnp.arange(64, dtype=jnp.float32), NamedSharding(mesh, P()))
    # split replicas: each process saves half of x, so each restore needs the other's snapshot (with whole ones
    # each process holds all of x and never asks the other)
    cfg = jaxckpt.Config(job_id=job_id, peer_token=f"token-of-{me}", peer_timeout_s=20.0, replicas="split")
    with jaxckpt.Checkpointer(cfg) as ck:
        ck.save(0, {"x": x})
        ck.wait()
        try:
            ck.restore({"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)})
            refused = ""
        except PeerError as e:
            refused = str(e)
        multihost_utils.sync_global_devices("refused")
        refused_count = ck.engine.peers.server.refused
    return {"other": other.decode(), "missing": missing, "timed_out": timed_out, "refused": refused,
            "refused_count": refused_count}


def test_jax_coordinator_and_mismatched_tokens():
    values = expect_ok(launch(coordinator_and_tokens, nodes=2, procs_per_node=1, devices_per_proc=1,
                              args=("coord-test",), timeout=120))
    for q, v in enumerate(values):
        assert v["other"] == f"from {1 - q}" and v["missing"] is None and v["timed_out"]
        assert "refused the manifest of step 0: refused: wrong or missing token" in v["refused"], v["refused"]
        assert v["refused_count"] >= 1
