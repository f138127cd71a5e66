"""A trainer in a SLURM step of a job with ``--mem`` under ``TaskPlugin=task/cgroup`` and ``ConstrainRAMSpace``
(tests/test_slurm_memory.py): the node agent it spawns (a step of its own, ``srun --overlap``) is charged in the
job's memory cgroup, which is SLURM's, not the test's.

It saves two steps of ``--small`` MiB, then one of ``--big`` MiB (``--copies`` leaves of one array: the agent
needs them all, the trainer holds one), restores the newest committed step, saves ``--after`` MiB, and writes
``<out>/result.json``: the big save's refusal (its message, or None if it committed), the steps held afterwards,
whether each restore was bit for bit what was saved, and, looked at while this trainer's agent surely serves (its
step may end with this one's: backends/agent/lifetime.py), the agent: its status reply's memory cgroup, the
memory cgroup its process runs in, the OOM kills counted there and at every level above it, and what ``jaxckpt
doctor --json`` run beside it reports.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

MIB = 1 << 20


def state(step: int, mib: int, copies: int = 1) -> dict:
    """``copies`` leaves, each the same array of ``mib`` MiB whose every element depends on ``step`` (a restore of
    another step differs)."""
    x = np.arange(mib * MIB // 4, dtype=np.uint32) * np.uint32(step + 1)
    return {f"x{k}": x for k in range(copies)}


def same(got, want: np.ndarray) -> bool:
    """Bit for bit: dtype, shape and bytes."""
    got = np.asarray(got)
    return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


def agent_facts(config) -> dict:
    """What the node agent serving ``config``'s job says of its memory cgroup, where its process runs, the OOM kills
    counted from its cgroup up, and doctor's view of it (in a process beside this one)."""
    import subprocess
    import sys

    from jaxckpt.backends.agent import protocol as proto

    status = proto.agent_status(proto.agent_dir(config), config.job_id, timeout_s=30.0)
    with open(f"/proc/{status['pid']}/cgroup") as f:
        rel = next(line.split(":", 2)[2].strip() for line in f if line.split(":")[1] == "memory")
    root, kills, level = "/sys/fs/cgroup/memory", {}, rel
    while level not in ("", "/"):
        with open(f"{root}{level}/memory.oom_control") as f:
            kills[level] = int(dict(ln.split() for ln in f if ln.strip()).get("oom_kill", "0"))
        level = os.path.dirname(level)
    doctor = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "doctor", "--json"], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "JAXCKPT_STORE": "shm"})
    return {"pid": status["pid"], "status_cgroup": status["memory_cgroup"], "cgroup": root + rel,
            "oom_kills": kills, "doctor": json.loads(doctor.stdout)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", type=int, default=32)
    ap.add_argument("--big", type=int, required=True)
    ap.add_argument("--copies", type=int, default=1)
    ap.add_argument("--after", type=int, default=16)
    a = ap.parse_args()

    import jaxckpt
    from jaxckpt import Config
    from jaxckpt.errors import BudgetExceededError

    ck = jaxckpt.Checkpointer(Config(store="shm", keep=1))
    doc: dict = {}
    try:
        for step in (0, 1):
            ck.save(step, state(step, a.small))
            ck.wait()
        try:
            ck.save(2, state(2, a.big, a.copies))
            ck.wait()
            doc["refused"] = None
        except BudgetExceededError as e:
            doc["refused"] = str(e)
        doc["steps"] = ck.all_steps()
        doc["restored"] = newest = doc["steps"][-1]
        want = state(newest, a.small) if newest < 2 else state(2, a.big, a.copies)
        got = ck.restore(step=newest)
        doc["bitwise"] = sorted(got) == sorted(want) and all(same(got[k], want[k]) for k in want)
        ck.save(3, state(3, a.after))
        ck.wait()
        doc["after_bitwise"] = same(ck.restore(step=3)["x0"], state(3, a.after)["x0"])
        doc["agent"] = agent_facts(Config(store="shm").with_env())
    finally:
        ck.close()
    with open(os.path.join(a.out, "result.json.tmp"), "w") as f:
        json.dump(doc, f)
    os.replace(os.path.join(a.out, "result.json.tmp"), os.path.join(a.out, "result.json"))


if __name__ == "__main__":
    main()
