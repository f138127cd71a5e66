"""A restore of many small leaves in one process, against JAX's own part of it (issue 26): a measurement script.

    python -m jaxckpt.tools.bench.restore_leaves [LEAVES] [DEVICES] [LAYOUT] [REPEATS]

One process with DEVICES CPU devices (default 8, mesh (DEVICES/2) x 2, 'data' x 'model') saves LEAVES float32
leaves of 8 x 1024 (default 1,024: 32 MiB) to its node agent (``store="shm"``) and restores them REPEATS times
(default 20) onto the same shardings, each checked bit for bit against the saved state. LAYOUT is ``sharded``
(default: the leaves alternate ``P('data','model')`` and ``P(None,'model')``, the shape of ``bench cluster
--arrays``) or ``mixed`` (they cycle through ``P('data','model')``, ``P(None,'model')``, ``P('data',None)``,
``P()``: issue 26's mixed layout). In the same run, alternated with the restores: JAX's own part, every leaf
made again from numpy copies of its pieces (one ``make_array_from_callback`` a leaf), and one thread's memory
copy of the restored bytes. Printed: the medians (and 10th percentiles) of wall and CPU time, the last
restore's phases, and the restore as a multiple of each floor. With ``PYTHONPATH`` naming another checkout the
same command measures that code (an A/B run alternates the two).
"""
from __future__ import annotations

import os
import statistics
import sys
import time
import uuid

import numpy as np

SHAPE = (8, 1024)


def _state(jax, leaves: int, layout: str):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devs = jax.devices()
    mesh = Mesh(np.array(devs).reshape(len(devs) // 2, 2), ("data", "model"))
    kinds = (P("data", "model"), P(None, "model")) if layout == "sharded" else \
        (P("data", "model"), P(None, "model"), P("data", None), P())
    hosts = {f"l{i:05d}": np.arange(SHAPE[0] * SHAPE[1], dtype=np.float32).reshape(SHAPE) + np.float32(i)
             for i in range(leaves)}
    shardings = {k: NamedSharding(mesh, kinds[i % len(kinds)]) for i, k in enumerate(hosts)}
    state = {k: jax.make_array_from_callback(SHAPE, shardings[k], lambda idx, h=h: h[idx]) for k, h in hosts.items()}
    return hosts, shardings, state


def _jax_floor(jax, hosts: dict, shardings: dict) -> list:
    """Every leaf made again from host copies of its pieces (numpy's, whatever their alignment: JAX copies or
    adopts them in its own C++), the part of a restore that JAX does whatever the checkpointer does."""
    return [jax.make_array_from_callback(SHAPE, shardings[k], lambda idx, h=h: np.array(h[idx]))
            for k, h in hosts.items()]


def main(argv: list[str]) -> None:
    leaves = int(argv[0]) if argv else 1024
    devices = int(argv[1]) if len(argv) > 1 else 8
    layout = argv[2] if len(argv) > 2 else "sharded"
    repeats = int(argv[3]) if len(argv) > 3 else 20
    if layout not in ("sharded", "mixed") or devices < 2 or devices % 2:
        raise SystemExit("LAYOUT is sharded or mixed; DEVICES an even number of at least 2")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    import jaxckpt
    from jaxckpt.testing import remove_agents
    from jaxckpt.tools.bench.memcpy import memcpy_seconds
    from jaxckpt.tools.bench import report
    from jaxckpt.tools.bench.report import fmt_size

    hosts, shardings, state = _state(jax, leaves, layout)
    nbytes = sum(h.nbytes for h in hosts.values())
    base = os.path.join(report.agent_root(), f"jaxckpt-restore-leaves-{uuid.uuid4().hex[:8]}")
    shm = os.path.join(base, "agent")
    cfg = jaxckpt.Config(store="shm", job_id="restore-leaves", shm_dir=shm)
    wall: dict[str, list[float]] = {"restore": [], "jax": []}
    cpu: dict[str, list[float]] = {"restore": [], "jax": []}
    try:
        with jaxckpt.Checkpointer(cfg) as ck:
            ck.save(1, state).result()
            target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
            for r in range(repeats + 2):  # the first two of each are warm-up
                for name, run in (("restore", lambda: ck.restore(target, 1)),
                                  ("jax", lambda: _jax_floor(jax, hosts, shardings))):
                    c0, t0 = time.process_time(), time.perf_counter()
                    out = run()
                    jax.block_until_ready(out)
                    t, c = time.perf_counter() - t0, time.process_time() - c0
                    if name == "restore" and (r < 2 or r == repeats + 1):  # checked bit for bit, not timed in
                        for k, h in hosts.items():
                            if not np.array_equal(np.asarray(out[k]), h):
                                raise SystemExit(f"{k}: restored bytes differ from the saved ones")
                    if r >= 2:
                        wall[name].append(t)
                        cpu[name].append(c)
                    del out
            phases = ck.last_restore_report.timeline.summary()
    finally:  # its agent stopped (killed if it does not answer), its memory, directory and log removed
        remove_agents(base)
    copy = statistics.median(memcpy_seconds(nbytes, 9))

    def med(xs: list[float]) -> float:
        return statistics.median(xs) * 1e3

    def p10(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 10] * 1e3
    print(f"{leaves} leaves of {SHAPE[0]}x{SHAPE[1]} float32 ({fmt_size(nbytes)}), {layout} layout, "
          f"{devices} CPU devices in one process, {repeats} restores from the node agent")
    for name, what in (("restore", "restore"), ("jax", "JAX's own part (make_array_from_callback of host copies)")):
        print(f"{what}: wall median {med(wall[name]):.1f} ms (p10 {p10(wall[name]):.1f}), CPU median "
              f"{med(cpu[name]):.1f} ms (p10 {p10(cpu[name]):.1f})")
    print(f"one thread's memory copy of the {fmt_size(nbytes)}: {copy * 1e3:.2f} ms")
    print(f"restore / JAX's own part {med(wall['restore']) / med(wall['jax']):.2f}x; restore / memory copy "
          f"{med(wall['restore']) / (copy * 1e3):.1f}x")
    print(f"last restore's phases: {phases}")


if __name__ == "__main__":
    main(sys.argv[1:])
