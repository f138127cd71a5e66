"""A lightweight trainer for the agent tests: numpy state, the core engine, store="shm", no JAX.

    python tests/shm_trainer.py train   JOB DIR SEED [--die PHASE --die-step S] [--steps N] [--kill-agent S]
    python tests/shm_trainer.py restore JOB DIR SEED [--clear]
    python tests/shm_trainer.py jax-train|jax-restore JOB DIR SEED [--steps N]

``train`` saves steps 1..N of a state that is a pure function of (seed, step), waiting for each commit and
printing ``committed S`` after it. ``--die PHASE`` makes the process SIGKILL itself at that phase of the save
of step S (reserve: before the request; reserved: after it; copy: between two chunk copies; commit: before
the commit request; committed: right after it; delete: inside the retention of the previous step; idle: after
the save, before the next). ``--kill-agent S`` SIGKILLs the node agent in the middle of step S's copy (with
``--wipe`` also removes its memory, then checks that restore names what was lost) and trains on until saving
has recovered.
``restore`` starts a new engine (which adopts what the agent holds), restores the latest step and compares it
bit for bit with the state of that step, saves the next step, and prints one JSON line. ``jax-train`` saves
steps 1..N of a sharded JAX state on 4 devices through ``jaxckpt.Checkpointer`` and SIGKILLs itself while step
N+1 is being snapshotted; ``jax-restore`` restores the latest step onto 2 devices with other shardings.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import numpy as np

from jaxckpt.core import manifest as mf
from jaxckpt.backends.agent import protocol as proto
from jaxckpt.backends.shm import ShmStore
from jaxckpt.core.box import Box
from jaxckpt.config import Config
from jaxckpt.core.coordination import LocalCoordinator
from jaxckpt.core.dtypes import dtype_from_name, dtype_name
from jaxckpt.core.engine import ArrayRecord, CheckpointEngine
from jaxckpt.errors import StepNotFoundError
from jaxckpt.core.plan import HOST, ArrayLayout, Placement
from jaxckpt.registry import register_store
from jaxckpt.testing.agents import agent_processes  # noqa: F401 - the agent tests import it from here

DIE = {"phase": None, "step": -1}
CURRENT = {"step": 0}
HOOKS: dict = {}  # phase -> a function to run once when the save reaches it


def maybe_die(phase: str) -> None:
    hook = HOOKS.pop(phase, None)
    if hook is not None:
        hook()
    if DIE["phase"] == phase and CURRENT["step"] == DIE["step"]:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


class KillingShmStore(ShmStore):
    """ShmStore that dies at a chosen phase; everything else is the real store."""

    def reserve(self, step, nbytes):
        maybe_die("reserve")
        slot = super().reserve(step, nbytes)
        maybe_die("reserved")
        return slot

    def commit(self, slot, manifest):
        maybe_die("commit")
        super().commit(slot, manifest)
        maybe_die("committed")

    def delete(self, step):
        maybe_die("delete")
        super().delete(step)


register_store("shm-kill", KillingShmStore)


def state(seed: int, step: int) -> dict[str, np.ndarray]:
    """The training state at ``step``: a few arrays of several dtypes, NaNs with payloads included."""
    rng = np.random.default_rng([seed, step])
    w = rng.standard_normal((48, 256)).astype(np.float32)
    w.reshape(-1)[[5, 77, 901]] = np.array([0x7FC00001, 0x7FA00002, 0xFFC00003], np.uint32).view(np.float32)
    return {"w": w, "b": rng.standard_normal(300), "i": rng.integers(-2**31, 2**31 - 1, 2000, dtype=np.int32),
            "h": rng.integers(0, 2**16, (7, 33), dtype=np.uint16), "s": np.array(step, dtype=np.int64)}


def records(st: dict[str, np.ndarray]) -> list[ArrayRecord]:
    out = []
    for k, (path, arr) in enumerate(st.items()):
        layout = ArrayLayout(path, arr.shape, dtype_name(arr.dtype), arr.dtype.itemsize,
                             (Placement(Box.full(arr.shape), 0, HOST),))
        meta = mf.ArrayMeta(path, (("key", path),), arr.shape, dtype_name(arr.dtype), "numpy")

        def fetch(arr=arr, k=k):
            if k == 2:  # the first arrays' chunks are copied by now, the rest not yet
                maybe_die("copy")
            return arr
        out.append(ArrayRecord(path, ("numpy", arr.shape, arr.dtype.str), lambda lay=layout: lay,
                               lambda m=meta: m, lambda devs, f=fetch: {HOST: (f, None)}))
    return out


def engine(job: str, directory: str, store: str = "shm") -> CheckpointEngine:
    config = Config(store=store, job_id=job, shm_dir=directory, keep=1, max_pending_saves=1, workers=1,
                    chunk_bytes=8192, commit_timeout_s=30.0)
    return CheckpointEngine(config, LocalCoordinator(), framework="numpy")


def restore(eng: CheckpointEngine, step: int | None = None) -> tuple[int, dict[str, np.ndarray]]:
    with eng.open(step) as (step, manifests, reader):
        out = {}
        for path, a in mf.merge_chunks(manifests).items():
            arr = np.empty(a.shape, dtype=dtype_from_name(a.dtype))
            for c in a.chunks:
                arr[tuple(slice(lo, hi) for lo, hi in zip(c.box.start, c.box.stop))] = \
                    reader.array(path, c, arr.dtype)
            out[path] = arr
    return step, out


def same_bits(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and
        np.array_equal(np.ascontiguousarray(a[k]).view(np.uint8), np.ascontiguousarray(b[k]).view(np.uint8))
        for k in a)


def train(args: argparse.Namespace) -> int:
    DIE["phase"], DIE["step"] = args.die, args.die_step
    eng = engine(args.job, args.dir, "shm-kill")
    print(f"ready {os.getpid()}", flush=True)
    events, stop_at, recovered = [], args.steps, not args.kill_agent
    for step in range(1, 100_000):
        if step > stop_at:
            break
        CURRENT["step"] = step
        if step == args.kill_agent:
            kill_agent_mid_copy(eng, args.wipe)
        h = eng.save(step, records(state(args.seed, step)), [], ())
        try:
            h.result()
            print(f"committed {step}", flush=True)
            if not recovered and step > args.kill_agent:
                recovered, stop_at = True, step + 2  # saving is back: two more saves, then stop

        except Exception as e:  # noqa: BLE001 - reported to the test
            events.append(f"step {step}: {type(e).__name__}: {e}")
            print(f"failed {step}", flush=True)
        maybe_die("idle")
        if args.kill_agent and step == args.kill_agent and args.wipe:
            try:
                restore(eng, step - 1)
                events.append("restore of a lost step succeeded")
            except StepNotFoundError as e:
                events.append(f"restore: {e}")
        if not recovered and step >= args.kill_agent:
            stop_at = step + 1  # train on; saves are skipped until the agent is back
            time.sleep(0.01)
    latest, got = restore(eng)
    print(json.dumps({"latest": latest, "bitwise": same_bits(got, state(args.seed, latest)),
                      "metrics": eng.store.metrics, "steps": eng.store.steps(), "events": events}), flush=True)
    eng.close()
    return 0


def kill_agent_mid_copy(eng: CheckpointEngine, wipe: bool) -> None:
    """Arrange for the agent to be SIGKILLed (and, with ``wipe``, its memory removed) during the next copy."""
    def kill() -> None:
        pid, _ = proto.read_pid_file(eng.store.directory)
        os.kill(pid, signal.SIGKILL)
        while _state(pid) not in ("Z", "X"):
            time.sleep(0.005)
        if wipe:
            for n in os.listdir(eng.store.directory):
                if n.startswith(("seg-", "rec-")):
                    os.unlink(os.path.join(eng.store.directory, n))
    HOOKS["copy"] = kill


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # gone; or reaped between the open and the read (ESRCH)
        return "X"


def restore_cmd(args: argparse.Namespace) -> int:
    eng = engine(args.job, args.dir)
    latest, result = eng.latest_step(), {}
    result["latest"], result["held"] = latest, eng.store.steps()
    if latest is not None:
        step, got = restore(eng)
        result["bitwise"] = same_bits(got, state(args.seed, step))
    nxt = (latest or 0) + 1
    eng.save(nxt, records(state(args.seed, nxt)), [], ()).result()
    result["saved_next"] = eng.latest_step() == nxt and eng.store.steps() == [nxt]
    if args.clear:
        eng.store.retain(set())
    eng.close()
    print(json.dumps(result), flush=True)
    return 0


# ------------------------------------------------------------------------------------- the JAX trainer
def jax_state(seed: int, step: int, devices: int):
    """A JAX state on a ``devices``-way mesh: sharded, replicated, bf16, PRNG keys, NaN payloads, host leaves."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("x",),
                             axis_types=(jax.sharding.AxisType.Auto,))
    host = jax_host(seed, step)
    specs = {"w": P("x", None), "b": P(), "e": P(None, "x")}
    st = {k: jax.device_put(jnp.asarray(host[k]), NamedSharding(mesh, spec)) for k, spec in specs.items()}
    st["key"] = jax.random.fold_in(jax.random.key(seed), step)
    st["opt"] = {"count": np.int64(step), "host": host["host"], "lr": 0.5}
    return st, mesh


def jax_host(seed: int, step: int) -> dict[str, np.ndarray]:
    import ml_dtypes

    rng = np.random.default_rng([seed, step, 7])
    w = rng.standard_normal((16, 24)).astype(np.float32)
    w.reshape(-1)[[1, 100]] = np.array([0x7FC00001, 0xFFA00002], np.uint32).view(np.float32)
    return {"w": w, "b": rng.standard_normal(40).astype(np.float32),
            "e": rng.standard_normal((6, 8)).astype(ml_dtypes.bfloat16), "host": rng.integers(0, 9, 5)}


def jax_train(args: argparse.Namespace) -> int:
    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    import jaxckpt

    ckpt = jaxckpt.Checkpointer(Config(store="shm", job_id=args.job, shm_dir=args.dir, keep=1))
    for step in range(1, args.steps + 1):
        st, _ = jax_state(args.seed, step, 4)
        ckpt.save(step, st).result()
        print(f"committed {step}", flush=True)
    st, _ = jax_state(args.seed, args.steps + 1, 4)
    ckpt.save(args.steps + 1, st)  # and die while it is being snapshotted
    os.kill(os.getpid(), signal.SIGKILL)
    return 1


def jax_restore(args: argparse.Namespace) -> int:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    jax.config.update("jax_num_cpu_devices", 2)
    import jaxckpt

    ckpt = jaxckpt.Checkpointer(Config(store="shm", job_id=args.job, shm_dir=args.dir, keep=1))
    step = ckpt.latest_step()
    want, mesh = jax_state(args.seed, step, 2)  # another mesh: 2 devices, other shardings
    target = {"w": jax.ShapeDtypeStruct((16, 24), np.float32, sharding=NamedSharding(mesh, P(None, "x"))),
              "b": jax.ShapeDtypeStruct((40,), np.float32, sharding=NamedSharding(mesh, P("x"))),
              "e": jax.ShapeDtypeStruct((6, 8), want["e"].dtype, sharding=NamedSharding(mesh, P("x", None))),
              "key": want["key"], "opt": {"count": np.int64(0), "host": np.zeros(5, np.int64), "lr": 0.0}}
    got = ckpt.restore(target)

    def bits(x):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)
    same = all(np.array_equal(bits(got[k]), bits(want[k])) for k in ("w", "b", "e", "key"))
    same = same and np.array_equal(got["opt"]["host"], want["opt"]["host"]) and got["opt"]["lr"] == 0.5
    shardings = all(got[k].sharding == target[k].sharding for k in ("w", "b", "e"))
    ckpt.close()
    print(json.dumps({"latest": step, "bitwise": bool(same), "shardings": bool(shardings)}), flush=True)
    return 0




def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=("train", "restore", "jax-train", "jax-restore"))
    p.add_argument("job")
    p.add_argument("dir")
    p.add_argument("seed", type=int)
    p.add_argument("--die", default=None)
    p.add_argument("--die-step", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--kill-agent", type=int, default=0)
    p.add_argument("--wipe", action="store_true")
    p.add_argument("--clear", action="store_true")
    args = p.parse_args(argv)
    return {"train": train, "restore": restore_cmd, "jax-train": jax_train, "jax-restore": jax_restore}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
