"""Where a relaunched job's first restore spends what later ones do not (issue 26, item 4): a measurement script.

    python -m jaxckpt.tools.bench.first_restore [RELAUNCHES] [MIB] [REPLICAS] [TOUCH_MIB] [LEAVES] [NODES]

A job of 2 simulated nodes x 1 JAX process (2 CPU devices each, mesh 2x2 'data' x 'model') saves a state of MIB
MiB (8 float32 arrays, half replicated over 'data', half split over both axes) to its node agents and exits;
then RELAUNCHES times a fresh job (agents alive) makes a Checkpointer and restores the step 4 times, then makes
a second Checkpointer in the same processes and restores twice more. Each process reports, per restore: wall
time, CPU time (the process's user + system), minor page faults (getrusage), and the restore report's phases.
Printed: the medians over processes and relaunches per restore index, and the first restore's wall and CPU over
the median of the later restores of the same Checkpointer (per relaunch and process, then their median: issue
26's floor is 1.2x). Every restore is checked bit for bit. The node agents' directories are made under
``JAXCKPT_SHM_ROOT`` (``Config.shm_root``) when it is set, else under /dev/shm.
REPLICAS is ``Config.replicas`` (default split, the layout issue 26's item 4 measured; whole: each node keeps the
replicated half whole, so a restore with the agents alive fetches nothing from the other node).
TOUCH_MIB (default 0: none) adds a control arm: every other relaunch, each process maps that much fresh memory,
writes it and unmaps it after making its first Checkpointer, before the first restore (not timed). Both arms are
printed. LEAVES (default 0: the 8 arrays above) makes the state LEAVES float32 arrays of MIB MiB in all on 4 simulated
nodes x 1 process (mesh 4x2), their shardings alternating ``P('data','model')``, ``P(None,'model')``,
``P('data',None)``, ``P()`` (issue 26's mixed layout: per-leaf costs, not bytes, dominate). Every run also prints
the first ``Checkpointer()``'s wall and CPU time (the adoption decodes the held manifests). NODES (default 2, or 4
with LEAVES) sets the simulated nodes. On a virtual machine whose guest reports free memory to the host (virtio-balloon free page reporting),
memory a process maps for the first time is backed again by the host page by page, in system CPU; memory freed
moments ago is not (the guest reports free memory after a delay). The control arm tells that cost (outside the
restore's code) from the restore's own first-run costs.
"""
import os
import resource
import statistics
import sys
import time

import numpy as np

from jaxckpt.testing import expect_ok, launch, node_info, remove_agents
from jaxckpt.tools.bench import report

COLS = 1024
LEAF_COLS = 64  # a leaf of the mixed layout: (rows, 64) float32


def _nodes(leaves: int) -> int:
    return 4 if leaves else 2


def _setup(base: str, mib: int, replicas: str = "split", leaves: int = 0):
    import jax
    import jaxckpt
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devs).reshape(len(devs) // 2, 2), ("data", "model"))  # a node: 1 process, 2 devices
    if leaves:
        kinds = (P("data", "model"), P(None, "model"), P("data", None), P())
        shape = (max(8, mib * (1 << 20) // (leaves * LEAF_COLS * 4) // 8 * 8), LEAF_COLS)
        specs = {f"l{i:05d}": kinds[i % 4] for i in range(leaves)}
    else:
        shape = (mib * (1 << 20) // (8 * COLS * 4) // 8 * 8, COLS)
        specs = {f"a{i}": (P("data", "model") if i % 2 else P(None, "model")) for i in range(8)}
    cfg = jaxckpt.Config(store="shm", job_id="first", shm_dir=f"{base}/node{node_info().node}",
                         agent_dirs=f"{base}/node*", peer_timeout_s=30.0, replicas=replicas)
    return jax, jaxckpt, mesh, shape, specs, cfg, NamedSharding


def _value(i: int, shape: tuple[int, int]) -> np.ndarray:
    return np.arange(shape[0] * shape[1], dtype=np.float32).reshape(shape) + np.float32(i)


def save(base: str, mib: int, replicas: str = "split", leaves: int = 0) -> int:
    jax, jaxckpt, mesh, shape, specs, cfg, ns = _setup(base, mib, replicas, leaves)
    state = {k: jax.make_array_from_callback(shape, ns(mesh, s), lambda idx, i=i: _value(i, shape)[idx])
             for i, (k, s) in enumerate(specs.items())}
    with jaxckpt.Checkpointer(cfg) as ck:
        ck.save(1, state)
        ck.wait()
    return 1


def _touch(mib: int) -> None:
    """Map ``mib`` MiB of fresh memory in plain pages, as a restore's buffers are (core/hostbuf), write it, unmap it."""
    import mmap

    m = mmap.mmap(-1, mib << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        np.frombuffer(m, dtype=np.uint8)[:] = 1
    finally:
        m.close()


def restore(base: str, mib: int, replicas: str = "split", touch: int = 0, leaves: int = 0) -> list:
    jax, jaxckpt, mesh, shape, specs, cfg, ns = _setup(base, mib, replicas, leaves)
    from jax.experimental import multihost_utils

    target = {k: jax.ShapeDtypeStruct(shape, np.float32, sharding=ns(mesh, s)) for k, s in specs.items()}
    out = []
    for checkpointer, count in (("first", 4), ("second", 2)):
        multihost_utils.sync_global_devices(f"{checkpointer} Checkpointer")
        c0, t0 = time.process_time(), time.perf_counter()
        with jaxckpt.Checkpointer(cfg) as ck:
            made = {"ctor_wall_s": time.perf_counter() - t0, "ctor_cpu_s": time.process_time() - c0}
            if touch and checkpointer == "first":
                _touch(touch)
            for k in range(count):
                multihost_utils.sync_global_devices(f"{checkpointer}-{k}")
                r0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
                got = jax.block_until_ready(ck.restore(target))
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                faults, system = r1.ru_minflt - r0.ru_minflt, r1.ru_stime - r0.ru_stime
                for i, (name, arr) in enumerate(got.items()):
                    for shard in arr.addressable_shards:
                        assert np.array_equal(np.asarray(shard.data), _value(i, shape)[shard.index]), name
                phases = ck.last_restore_report.to_dict()["timeline"]
                out.append({"arm": "touched" if touch else "plain", "checkpointer": checkpointer, "restore": k, "wall_s": wall, "cpu_s": cpu,
                            "system_s": system, "faults": faults, "phases": {p: v["busy_s"] for p, v in phases.items() if v["count"]},
                            **made})
                del got
    return out


def _print(rows: dict[tuple, list]) -> None:
    first = rows[("first", 0)]
    print(f"first Checkpointer(): wall {1e3 * statistics.median(x['ctor_wall_s'] for x in first):.0f} ms, CPU "
          f"{1e3 * statistics.median(x['ctor_cpu_s'] for x in first):.0f} ms (median over processes and relaunches)")
    for (ckp, k), xs in rows.items():
        med = {f: statistics.median(x[f] for x in xs) for f in ("wall_s", "cpu_s", "system_s", "faults")}
        busy = {p: statistics.median(x["phases"].get(p, 0.0) for x in xs) for p in xs[0]["phases"]}
        print(f"{ckp} Checkpointer, restore {k}: wall {1e3 * med['wall_s']:.0f} ms, CPU {1e3 * med['cpu_s']:.0f} ms "
              f"(system {1e3 * med['system_s']:.0f}), minor faults {med['faults']:.0f}; busy ms "
              + ", ".join(f"{p} {1e3 * v:.0f}" for p, v in busy.items()))
    # Issue 26's floor: the first restore of a relaunched job at most 1.2x a later one. Per relaunch and process,
    # the first restore over the median of the first Checkpointer's later restores; the median of those ratios.
    runs = list(zip(*(rows[("first", k)] for k in range(4))))
    for f, name in (("wall_s", "wall"), ("cpu_s", "CPU"), ("system_s", "system CPU")):
        ratios = [r[0][f] / max(statistics.median(x[f] for x in r[1:]), 1e-4) for r in runs]
        print(f"first restore / later ones, {name}: median {statistics.median(ratios):.2f}x (each relaunch and "
              f"process: {', '.join(f'{x:.2f}' for x in ratios)}); at most 1.2x: "
              f"{'met' if statistics.median(ratios) <= 1.2 else 'not met'}")


def main() -> None:
    relaunches = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    mib = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    replicas = sys.argv[3] if len(sys.argv) > 3 else "split"
    touch = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    leaves = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    nodes = int(sys.argv[6]) if len(sys.argv) > 6 else _nodes(leaves)
    base = os.path.join(report.agent_root(), f"jaxckpt-first-restore-{os.getpid()}")
    os.makedirs(base, exist_ok=True)
    env = {"JAXCKPT_LOG_LEVEL": "WARNING"}
    try:
        expect_ok(launch(save, nodes=nodes, procs_per_node=1, devices_per_proc=2, args=(base, mib, replicas, leaves),
                         env=env, timeout=600))
        arms: dict[str, dict[tuple, list]] = {}
        for i in range(relaunches * (2 if touch else 1)):
            args = (base, mib, replicas, touch if i % 2 else 0, leaves)
            for r in expect_ok(launch(restore, nodes=nodes, procs_per_node=1, devices_per_proc=2, args=args, env=env,
                                      timeout=600)):
                for x in r:
                    arms.setdefault(x["arm"], {}).setdefault((x["checkpointer"], x["restore"]), []).append(x)
    finally:
        remove_agents(base)
    for arm, rows in arms.items():
        print(f"{mib} MiB{f' in {leaves} leaves (mixed layout)' if leaves else ''}, {nodes} nodes x 1 process, "
              f"replicas {replicas}, {relaunches} relaunches"
              + (f" (plain and touched: {touch} MiB of fresh memory written and unmapped before the first restore,"
                 f" alternating)" if touch else "")
              + f"; arm {arm}; medians over processes and relaunches")
        _print(rows)


if __name__ == "__main__":
    main()
