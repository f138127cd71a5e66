"""``jaxckpt bench memory``: host memory per node that snapshots take, per store and per protection policy.

Measured, per state size (the state of ``jaxckpt bench save``, one process with 8 CPU devices = one node), for
``store="memory"`` and ``store="shm"`` with ``keep=1`` after warm-up saves: the bytes the store reports holding,
the growth of the trainer's resident memory, and (shm) the pages the node agent's segments occupy on tmpfs.
Issue 4's bound is (keep + 1) x the node's snapshot bytes plus metadata.

Planned, for the same total state on 4 simulated nodes x 2 processes: the bytes each node holds for one snapshot
under every protection policy, from :func:`jaxckpt.protection.plan.plan_for_config` (``data_bytes`` / ``extra_bytes``
/ ``sent_bytes``) on two layouts: data-parallel (every array tensor-parallel over a node's 2 processes and
replicated over the 4 nodes, REFT's case) and fully sharded (every array split over all 8 processes, FSDP's).
These are the accounting functions the protection code uses, not a measurement of a running job.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Mapping

from jaxckpt.tools.bench import report, runner
from jaxckpt.tools.bench.save import parse_size

log = logging.getLogger("jaxckpt.tools.bench")

FULL = {"sizes": "256M,1G", "saves": 4}
QUICK = {"sizes": "4M", "saves": 3}
NODES, PROCS_PER_NODE = 4, 2
N_ARRAYS, COLS, ITEMSIZE = 8, 1024, 4
POLICIES = ("none", "replica", "parity", "xor-group", "hybrid")
REPLICAS = ("split", "whole")  # Config.replicas
LAYOUTS = {"data-parallel": "each array split over a node's 2 processes (tensor-parallel) and replicated over the "
                            "4 nodes (data-parallel): R = 4",
           "fully-sharded": "each array split over all 8 processes (FSDP / ZeRO-3): no replicas"}
MEMORY_FACTOR = 3.5  # state + two snapshot slots, plus slack for the process
MEMORY_MARGIN = 1536 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``jaxckpt bench memory``."""
    p.add_argument("--sizes", default=None, help=f"state sizes, K/M/G binary (default {FULL['sizes']}, --quick "
                                                 f"{QUICK['sizes']})")
    runner.output_arguments(p, "memory", "a tiny state: seconds, for CI", timeout=1200.0)
    p.set_defaults(run=run)


def options(args: argparse.Namespace) -> dict[str, Any]:
    """Effective settings: explicit flags over the --quick or full defaults."""
    out = dict(QUICK if args.quick else FULL)
    if args.sizes is not None:
        out["sizes"] = args.sizes
    out["sizes"] = [parse_size(s) for s in str(out["sizes"]).split(",") if s.strip()]
    if not out["sizes"]:
        raise ValueError("bench memory needs at least one size")
    return out


def command(args: argparse.Namespace) -> str:
    """The command line that repeats this run."""
    return runner.command_line("memory", args, (("--sizes", "sizes"),))


def run(args: argparse.Namespace) -> int:
    """``jaxckpt bench memory``: measure (or render ``--from-json``), write JSON, print and update the section."""
    return runner.run(args, "memory", options,
                      lambda a, o: measure(o, command(a), quick=a.quick, timeout=a.timeout), render)


# ------------------------------------------------------------------------------------------------- the driver
def measure(opts: Mapping[str, Any], cmd: str, *, quick: bool, timeout: float) -> dict[str, Any]:
    """Measured store memory (a launched process) and planned protection memory, per size."""
    from jaxckpt.testing import expect_ok, launch, remove_agents

    machine = report.machine_facts()
    stores, skipped = [], []
    for size in opts["sizes"]:
        need = int(size * MEMORY_FACTOR) + MEMORY_MARGIN
        avail = report.available_memory_bytes()
        if need > avail:
            why = f"needs about {report.fmt_size(need)} of host memory, {report.fmt_size(avail)} available"
            log.warning("bench memory: skipping %s: %s", report.fmt_size(size), why)
            skipped.append({"size_bytes": size, "reason": why})
            continue
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        base = os.path.join(report.agent_root(), f"jaxckpt-bench-memory-{tag}")
        shm_dir = os.path.join(base, "agent")
        spec = {"size": size, "saves": opts["saves"], "job": f"bench-memory-{tag}", "shm_dir": shm_dir}
        try:
            log.info("bench memory: %s", report.fmt_size(size))
            stores.append(expect_ok(launch(store_phase, nodes=1, procs_per_node=1, distributed=False, args=(spec,),
                                           timeout=timeout))[0])
        finally:
            remove_agents(base, timeout_s=60)  # stopped (killed if it does not answer); memory, directory and log
        gc.collect()
    protection = [protection_row(size, layout, policy, replicas) for size in opts["sizes"] for layout in LAYOUTS
                  for replicas in REPLICAS for policy in POLICIES
                  if replicas == "split" or layout == "data-parallel"]  # whole changes nothing without replicas
    return {"bench": "memory", "mode": "quick" if quick else "full", "machine": machine, "date": report.now_utc(),
            "command": cmd,
            "setup": {"devices": 8, "mesh": "2x4", "arrays": N_ARRAYS, "keep": 1, "saves": opts["saves"],
                      "nodes": NODES, "procs_per_node": PROCS_PER_NODE, "layouts": dict(LAYOUTS)},
            "stores": stores, "protection": protection, "skipped": skipped}


# ------------------------------------------------------------------------------------------ measured memory
def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _tmpfs_usage(directory: str) -> int:
    """Bytes of pages the files of ``directory`` occupy (allocated blocks, not apparent sizes)."""
    total = 0
    for name in os.listdir(directory):
        st = os.lstat(os.path.join(directory, name))
        total += st.st_blocks * 512
    return total


def store_phase(spec: dict) -> dict:
    """A launched process with 8 CPU devices: the memory each store takes for the state, keep=1."""
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    from jaxckpt import Checkpointer, Config
    from jaxckpt.tools.bench.state import make_state

    state = make_state(spec["size"])
    nbytes = sum(x.nbytes for x in state.values())
    out: dict[str, Any] = {"size_bytes": nbytes}
    for store in ("memory", "shm"):
        gc.collect()
        rss0 = _rss_bytes()
        cfg = Config(store=store, keep=1, job_id=spec["job"], shm_dir=spec["shm_dir"] if store == "shm" else "")
        with Checkpointer(cfg) as ck:
            for step in range(1, spec["saves"] + 1):
                ck.save(step, state).result()
            row = {"held_bytes": ck.store.held_bytes(), "rss_growth_bytes": max(_rss_bytes() - rss0, 0),
                   "bound_bytes": (cfg.keep + 1) * nbytes}
            if store == "shm":
                row["tmpfs_bytes"] = _tmpfs_usage(spec["shm_dir"])
        out[store] = row
    return out


# ------------------------------------------------------------------------------------------- planned memory
def layouts(size: int, kind: str) -> tuple[list, list[int]]:
    """``N_ARRAYS`` float32 arrays of about ``size`` bytes in all, laid out on NODES x PROCS_PER_NODE processes."""
    from jaxckpt.core.box import Box
    from jaxckpt.core.plan import ArrayLayout, Placement

    procs = NODES * PROCS_PER_NODE
    nodes = [p // PROCS_PER_NODE for p in range(procs)]
    rows = max(procs, size // (N_ARRAYS * ITEMSIZE * COLS) // procs * procs)
    out = []
    for i in range(N_ARRAYS):
        full = Box.full((rows, COLS))
        if kind == "data-parallel":
            parts = full.split(PROCS_PER_NODE)
            placements = tuple(Placement(parts[p % PROCS_PER_NODE], p, 0) for p in range(procs))
        elif kind == "fully-sharded":
            placements = tuple(Placement(b, p, 0) for p, b in enumerate(full.split(procs)))
        else:
            raise ValueError(f"unknown layout {kind!r} (known: {', '.join(LAYOUTS)})")
        out.append(ArrayLayout(f"layer{i}/w", (rows, COLS), "float32", ITEMSIZE, placements))
    return out, nodes


def protection_row(size: int, kind: str, policy: str, replicas: str = "split") -> dict[str, Any]:
    """Per-node snapshot, protection and sent bytes of one snapshot under ``policy`` and ``replicas`` (Config
    defaults otherwise)."""
    from jaxckpt.config import Config
    from jaxckpt.core.plan import plan_save
    from jaxckpt.protection.plan import plan_for_config

    arrays, nodes = layouts(size, kind)
    cfg = Config(protection=policy, replicas=replicas)
    plans = plan_save(arrays, len(nodes), cfg.chunk_bytes, nodes=nodes if replicas == "whole" else None)
    prot = plan_for_config(arrays, plans, nodes, cfg)
    data, extra, sent = prot.data_bytes(), prot.extra_bytes(), prot.sent_bytes()
    state = sum(a.nbytes for a in arrays)
    worst = max(data, key=lambda n: data[n] + extra[n])
    return {"size_bytes": state, "layout": kind, "policy": policy, "replicas": replicas,
            "chosen": sorted({c.policy for c in prot.chunks}),
            "data_bytes_per_node": data[worst], "extra_bytes_per_node": extra[worst],
            "sent_bytes_per_node": max(sent.values()),
            "extra_over_data": extra[worst] / data[worst] if data[worst] else 0.0}


# --------------------------------------------------------------------------------------------------- markdown
def render(result: Mapping[str, Any]) -> str:
    """The BENCHMARKS.md section of a ``bench memory`` result (every number from the JSON)."""
    fn, fs = report.fmt_num, report.fmt_size
    st = result["setup"]
    parts = ["### `jaxckpt bench memory`: host memory per node, per store and per protection policy", ""]
    if result.get("mode") == "quick":
        parts += ["> **Quick run, placeholder until the full run.** A tiny state on a shared machine: these numbers "
                  "show the shape of the tables. Regenerate with the full command.", ""]
    parts += [f"Command: `{result['command']}`", "", report.machine_line(result), "",
              f"Measured: the state of `jaxckpt bench save` ({st['arrays']} float32 arrays, {st['devices']} CPU "
              f"devices, one process = one node), `keep={st['keep']}`, after {st['saves']} committed saves. Held = "
              f"bytes the store reports (shm: the node agent, for this process); RSS growth = the trainer's resident "
              f"memory growth over the saves (shm: the agent's pages it has mapped); tmpfs = pages the agent's "
              f"segments occupy in /dev/shm. Bound = (keep + 1) x state (issue 4).", ""]
    rows = []
    for r in result["stores"]:
        m, sh = r["memory"], r["shm"]
        rows.append([fs(r["size_bytes"]), f"{fs(m['held_bytes'])} ({fn(m['held_bytes'] / r['size_bytes'])}x)",
                     fs(m["rss_growth_bytes"]), f"{fs(sh['held_bytes'])} ({fn(sh['held_bytes'] / r['size_bytes'])}x)",
                     fs(sh["tmpfs_bytes"]), fs(sh["rss_growth_bytes"]), fs(m["bound_bytes"])])
    parts.append(report.table(["state", "memory: held (x state)", "memory: RSS growth", "shm: held (x state)",
                               "shm: tmpfs pages", "shm: trainer RSS growth", "bound"], rows))
    for sk in result.get("skipped", []):
        parts += ["", f"Skipped {fs(sk['size_bytes'])}: {sk['reason']}."]
    parts += ["", f"Planned, one snapshot of the same state on {st['nodes']} nodes x {st['procs_per_node']} processes "
                  f"(`jaxckpt.protection.plan.plan_for_config` with Config defaults: 1 copy, xor groups of 4, 64 MiB "
                  f"units; `ProtectionPlan.data_bytes()` / `extra_bytes()` / `sent_bytes()`), for the node holding "
                  f"the most. Layouts: " + "; ".join(f"{k}: {v}" for k, v in st["layouts"].items()) + ".", ""]
    rows = []
    for r in result["protection"]:
        rows.append([fs(r["size_bytes"]), r["layout"], r.get("replicas", "split"), r["policy"], ", ".join(r["chosen"]),
                     fs(r["data_bytes_per_node"]), fs(r["extra_bytes_per_node"]),
                     f"{fn(r['extra_over_data'] * 100)}%" if r["extra_over_data"] else "0%",
                     fs(r["data_bytes_per_node"] + r["extra_bytes_per_node"]),
                     fs(r["sent_bytes_per_node"])])
    parts.append(report.table(["state", "layout", "replicas", "policy", "chosen per chunk", "snapshot per node",
                               "protection per node", "extra", "total per node", "sent per node per snapshot"],
                              rows))
    parts += ["", "REFT parity over R node replicas costs 1/(R-1) extra (33% for R = 4) and sends nothing; an xor "
                  "group of G nodes costs 1/(G-1) and sends the data once; a replica costs 100% per copy. Whole "
                  "replicas (`Config.replicas=\"whole\"`) keep a full copy of each replicated array on every node "
                  "holding it (R/1 of split's 1/R share: R = 4 here) and need no protection of their own."]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxckpt.tools.bench.memory``: the same options as ``jaxckpt bench memory``."""
    return runner.main("jaxckpt.tools.bench.memory", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
