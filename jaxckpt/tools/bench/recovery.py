"""How fast a replacement node's agent brings its node's share back (issue 26, item 2): a measurement script.

    python -m jaxckpt.tools.bench.recovery [MIB] [ROUNDS] [ARRAYS]

A job of 4 simulated nodes x 1 JAX process (2 CPU devices each, mesh 4x2 'data' x 'model') saves a state of MIB
MiB (default 512) in ARRAYS float32 arrays (default 8), half replicated over 'data', half split over both axes
(whole replicas, ``hybrid`` protection) to its node agents, waits until its newest step is protected, and exits;
the agents stay. Then ROUNDS times (default 3): node 1's agent is SIGKILLed and its memory removed, and a fresh agent is started
there as a launcher starts a replacement's (``jaxckpt agent --agent-dirs``); its recovery of the node's share runs
with nothing else on the machine (in ``bench cluster`` it runs beside the relaunched trainers' JAX start-up). Each
round prints the agent's recovery report; then the median seconds and rate, beside the raw loopback TCP rate and
the peer transport's, measured in the same run (``jaxckpt.tools.bench.loopback``). The recovered bytes are checked
by the recovery itself (every chunk against its manifest's crc32c).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid

import numpy as np

from jaxckpt.testing import expect_ok, launch, node_info, remove_agents
from jaxckpt.tools.bench import report

JOB = "recovery"
COLS = 1024


def _save(base: str, mib: int, arrays: int = 8) -> dict:
    """In each launched process: save steps 1-3 and wait until step 3 is protected."""
    import jax
    import jaxckpt
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devs).reshape(len(devs) // 2, 2), ("data", "model"))
    rows = max(8, mib * (1 << 20) // (arrays * COLS * 4) // 8 * 8)
    cfg = jaxckpt.Config(store="shm", job_id=JOB, shm_dir=f"{base}/node{node_info().node}",
                         agent_dirs=f"{base}/node*", protection="hybrid", keep=2, replicas="whole")
    state = {}
    for i in range(arrays):
        spec = P("data", "model") if i % 2 else P(None, "model")
        host = np.full((rows, COLS), i, np.float32)
        state[f"a{i}"] = jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda idx, h=host: h[idx])
    with jaxckpt.Checkpointer(cfg) as ck:
        for step in (1, 2, 3):
            ck.save(step, state).result()
        deadline = time.monotonic() + 120
        while 3 not in ck.engine.protection.protected_steps():
            if time.monotonic() > deadline:
                raise RuntimeError("step 3 was not protected within 120 s")
            time.sleep(0.05)
    return {}


def _recover(base: str, rnd: int) -> dict:
    """Lose node 1 (agent SIGKILLed, memory removed), start a fresh agent there, wait for its recovery."""
    from jaxckpt.backends.agent import protocol as proto
    from jaxckpt.errors import StoreUnavailableError

    d = f"{base}/node1"
    proto.kill_agent(d, remove_memory=True)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d, mode=0o700)
    agent = subprocess.Popen([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", JOB, "--dir", d, "--node", "node1",
                              "--agent-dirs", f"{base}/node*", "--log", f"{base}/agent-{rnd}.log"],
                             stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while True:
        if agent.poll() is not None:
            raise RuntimeError(f"the replacement agent exited ({agent.returncode}); see {base}/agent-{rnd}.log")
        if time.monotonic() > deadline:
            raise RuntimeError("the replacement agent did not end its recovery within 120 s")
        try:
            rec = proto.agent_status(d, JOB)["recovery"]
        except StoreUnavailableError:  # not serving yet
            rec = {}
        if rec.get("state") not in (None, "pending", "running"):
            return rec
        time.sleep(0.02)


def main(argv: list[str]) -> None:
    from jaxckpt.tools.bench.loopback import probe

    mib = int(argv[0]) if argv else 512
    rounds = int(argv[1]) if len(argv) > 1 else 3
    arrays = int(argv[2]) if len(argv) > 2 else 8
    base = os.path.join(report.agent_root(), f"jaxckpt-bench-recovery-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    os.makedirs(base, mode=0o700)
    try:
        expect_ok(launch(_save, nodes=4, procs_per_node=1, devices_per_proc=2, args=(base, mib, arrays), timeout=300))
        reports = []
        for rnd in range(rounds):
            rec = _recover(base, rnd)
            if rec.get("state") != "done":
                raise RuntimeError(f"round {rnd}: the recovery did not rebuild the node's share: {rec}")
            reports.append(rec)
            keys = ("state", "step", "bytes", "received", "rebuilt_at", "scan_seconds", "seconds")
            print(json.dumps({k: rec.get(k) for k in keys}), flush=True)
    finally:
        remove_agents(base)
    net = probe()
    secs = statistics.median(r["seconds"] for r in reports)
    nbytes = reports[0]["bytes"]
    print(f"recovery of {nbytes / 2**20:.0f} MiB in {arrays} arrays (received "
          f"{reports[0]['received'] / 2**20:.0f} MiB): median "
          f"{secs * 1e3:.0f} ms over {rounds} rounds ({min(r['seconds'] for r in reports) * 1e3:.0f}-"
          f"{max(r['seconds'] for r in reports) * 1e3:.0f}), {nbytes / secs / 1e9:.2f} GB/s; loopback raw TCP "
          f"{net['tcp']['gbps']:.2f} GB/s, the peer transport {net['transport']['gbps']:.2f} GB/s: the recovery "
          f"takes {secs / (reports[0]['received'] / (net['tcp']['gbps'] * 1e9)):.2f}x the raw TCP time of the bytes "
          f"it received")


if __name__ == "__main__":
    main(sys.argv[1:])
