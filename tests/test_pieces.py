"""Copies in pieces across real JAX processes: on an accelerator the fused path copies an array replicated inside
a process to pinned host memory once, one piece per device (``jaxckpt.jax.shards.local_pieces``), never cut across
processes, and saves those pieces. As in tests/test_pinned_path.py, each process turns the accelerator's path on
for its CPU arrays (``shards.pinned_sharding`` answering as a GPU's devices do); the copies are JAX's real
``device_put`` to the ``pinned_host`` memory kind inside the compiled step.

Two simulated nodes of one process and 4 CPU devices each, mesh node x data x model (2 x 2 x 2): ``node`` spans
the processes, ``data`` and ``model`` each process's devices. Each process trains with ``wrap_step`` and a
snapshot every step, and checks inside itself every restored bit of every step; the test checks which pieces
each process saved.
"""
import numpy as np
import pytest

from jaxckpt.testing import expect_ok, launch, node_info

STEPS = 3


def scenario(job_id, replicas):
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jaxckpt
    from jaxckpt.jax import shards

    shards.pinned_sharding = lambda s: s.with_memory_kind(shards.PINNED)  # as on an accelerator
    info = node_info()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices).reshape(2, 2, 2), ("node", "data", "model"))
    rng = np.random.default_rng(5)  # the same global values in every process
    values = {"cols": (rng.standard_normal((512, 256)).astype(np.float32), P(None, "model")),  # replicated: node, data
              "whole": (rng.integers(0, 1 << 30, (1024, 64)).astype(np.int32), P()),  # replicated everywhere
              "sharded": (rng.standard_normal((64, 32)).astype(np.float32), P(("node", "data"), "model"))}
    state = {k: jax.make_array_from_callback(h.shape, NamedSharding(mesh, spec), lambda idx, h=h: h[idx])
             for k, (h, spec) in values.items()}

    def train(s):
        return {"cols": s["cols"] * 0.5 + 1, "whole": s["whole"] ^ 0x5A5A, "sharded": s["sharded"] - 2}, 0.0

    refs = {}
    with jaxckpt.Checkpointer(jaxckpt.Config(keep=STEPS, job_id=job_id, replicas=replicas,
                                             commit_timeout_s=60.0)) as ck:
        fused = ck.wrap_step(train)
        for step in range(STEPS):
            refs[step] = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)).copy()
                          for k, v in state.items()}
            state, _ = fused(state, save_step=step)  # donates what it copies
        ck.wait()
        assert ck.all_steps() == list(range(STEPS))
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}
        for step in range(STEPS):
            got = ck.restore(target, step=step)
            for k, v in got.items():
                for shard in v.addressable_shards:
                    want = refs[step][k][shard.index]
                    assert np.asarray(shard.data).view(np.uint32).tobytes() == want.view(np.uint32).tobytes(), \
                        (step, k, shard.index)
        with ck.engine.open(STEPS - 1) as (_, manifests, _reader):
            own = next(m for m in manifests if m.process == info.process_id)
            chunks = {a.path: sorted([list(c.box.start), list(c.box.stop)] for c in a.chunks) for a in own.arrays}
        multihost_utils.sync_global_devices("restored")  # nobody stops serving while others still read
    return {"chunks": chunks}


def _pieces(rows: int, cols: int, row_cut: int, col_cut: int) -> list:
    r, c = rows // row_cut, cols // col_cut
    return sorted([[i * r, j * c], [(i + 1) * r, (j + 1) * c]] for i in range(row_cut) for j in range(col_cut))


@pytest.mark.parametrize("replicas", ["whole", "split"])
def test_fused_copies_are_cut_inside_each_process_only(replicas):
    values = expect_ok(launch(scenario, nodes=2, procs_per_node=1, devices_per_proc=4,
                              args=(f"pieces-{replicas}", replicas), timeout=240))
    first, second = (v["chunks"] for v in values)
    if replicas == "whole":
        # Each node saves its whole copy, cut by the 2 data devices of its process (not by the other node):
        # cols in 2 x 2 pieces (data x model), whole in 4 row pieces (data x model on its rows).
        for chunks in (first, second):
            assert chunks["cols"] == _pieces(512, 256, 2, 2), chunks["cols"]
            assert chunks["whole"] == _pieces(1024, 64, 4, 1), chunks["whole"]
    else:
        # The two nodes share one copy: each piece halved between them (rows), all of it saved once.
        for path, (rows, cols) in (("cols", (512, 256)), ("whole", (1024, 64))):
            both = first[path] + second[path]
            assert sum((b[0] - a[0]) * (b[1] - a[1]) for a, b in both) == rows * cols, path
            assert len(both) == 2 * len(_pieces(rows, cols, 2, 2) if path == "cols" else _pieces(rows, cols, 4, 1))
    # the fully sharded array: one box per device, nothing to cut
    assert len(first["sharded"]) == len(second["sharded"]) == 4
