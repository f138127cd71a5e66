"""A trainer with a persistent tier and store="shm", for the import test of the persistent tier.

    python tests/persist_relaunch.py train    JOB SHM_DIR PERSISTENT_DIR
    python tests/persist_relaunch.py relaunch JOB SHM_DIR PERSISTENT_DIR

``train`` saves steps 0..3 (keep=2, every 2nd persisted), waits for each commit and persist, and SIGKILLs itself:
its node agent keeps steps 2 and 3 in memory, the directory holds 0 and 2. ``relaunch`` is the trainer started
again: it constructs the Checkpointer, restores step 3 from memory, then step 0 from disk, then saves and persists
step 4, and prints one JSON line saying what it got and whether Orbax or TensorStore was imported at each point.
It imports nothing that imports Orbax itself.
"""
from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np

ORBAX = ("orbax.checkpoint", "tensorstore")


def _imported() -> list[str]:
    return [m for m in ORBAX if m in sys.modules]


def _host(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([step, 26])
    w = rng.standard_normal((16, 8)).astype(np.float32)
    w.reshape(-1)[[3, 77]] = np.array([0x7FC00001, 0xFFA00002], np.uint32).view(np.float32)  # NaN payloads
    return {"w": w, "ids": rng.integers(-99, 99, (8, 16)).astype(np.int32)}


def _state(step: int, mesh):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    h = _host(step)
    return {"w": jax.device_put(h["w"], NamedSharding(mesh, P("x", None))),
            "ids": jax.device_put(h["ids"], NamedSharding(mesh, P(None, "x"))), "count": np.int64(step)}


def _same(got: dict, step: int) -> bool:
    h = _host(step)
    return all(np.array_equal(np.asarray(got[k]).reshape(-1).view(np.uint8), h[k].reshape(-1).view(np.uint8))
               for k in ("w", "ids")) and int(got["count"]) == step


def main(argv: list[str]) -> int:
    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    import jaxckpt

    cmd, job, shm, persistent = argv
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    cfg = jaxckpt.Config(store="shm", job_id=job, shm_dir=shm, keep=2, persistent_dir=persistent,
                         persistent_interval=2)
    ck = jaxckpt.Checkpointer(cfg)
    if cmd == "train":
        for step in range(4):
            ck.save(step, _state(step, mesh)).result()
            ck.persister.wait()
        print("trained", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    out = {"constructed": _imported(), "latest": ck.latest_step(), "persisted": ck.persister.steps()}
    target = jax.tree_util.tree_map(lambda x: x, _state(0, mesh))  # the shardings and dtypes to restore onto
    r = ck.restore_with_extra(target, 3)
    out.update(memory=[r.source, _same(r.state, 3)], after_memory_restore=_imported())
    r = ck.restore_with_extra(target, 0)
    out.update(disk=[r.source, _same(r.state, 0)], after_disk_restore=_imported())
    ck.save(4, _state(4, mesh)).result()
    ck.persister.wait()
    out.update(persisted_now=ck.persister.persisted, listed=ck.persister.steps())
    ck.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
