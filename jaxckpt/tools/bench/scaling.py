"""``jaxckpt bench scaling``: how save() call, snapshot and restore time scale with state size and process count.

Sizes: one process with 8 CPU devices snapshots the state of ``jaxckpt bench save`` at every size from 64 MiB to
``--max-size`` (default 4 GiB). The save() call should stay flat (it only takes views and queues work) and the
snapshot time should grow with the bytes at close to the memcpy rate measured in the same run. A size whose
state plus its two snapshot slots would not fit in the memory available at that moment is skipped, with a logged
note and a line in the result.

Processes: ``--procs`` JAX processes (1 CPU device each, one simulated node, started by the launcher) each hold
a fixed share (``--bytes-per-proc``) of 8 float32 arrays sharded over all devices and snapshot them together
(commit agreed through the coordination service), then restore it, all at once. Per-process save() call,
snapshot and restore time should stay flat as processes are added; on this 2-core machine processes beyond two share cores, so the aggregate throughput
is the figure to read there. The commit-protocol phase (``--commit-steps``) then runs in the same processes, with a
Checkpointer and job id of its own: one JAX start-up per process for both.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
from typing import Any, Mapping

from jaxckpt.tools.bench import memcpy, report, runner
from jaxckpt.tools.bench.save import parse_size

log = logging.getLogger("jaxckpt.tools.bench")

FULL = {"sizes": "64M,128M,256M,512M,1G,2G,4G", "max_size": "4G", "procs": "2,4,8", "bytes_per_proc": "128M",
        "repeats": 5, "warmup": 2, "memcpy_bytes": 512 << 20, "memcpy_repeats": 10, "commit_steps": 200}
QUICK = {"sizes": "1M,2M,4M", "max_size": "4G", "procs": "2,4", "bytes_per_proc": "1M", "repeats": 3, "warmup": 1,
         "memcpy_bytes": 32 << 20, "memcpy_repeats": 5, "commit_steps": 20}
COMMIT_BYTES = 64 << 10  # per process in the commit-protocol phase: small, so the protocol is what is timed
# The paper extrapolation of BENCHMARKS.md: process counts, and a coordination-service operation's cost there.
EXTRAPOLATE = (1024, 8192)
SLOTS = 2  # keep=1: one committed snapshot plus the one being written
MEMORY_MARGIN = 1536 << 20
CHECK_LIMIT = 1 << 30  # restores are checked bit for bit up to this size
N_ARRAYS = 8
COLS = 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``jaxckpt bench scaling``."""
    p.add_argument("--sizes", default=None, help=f"state sizes for the size sweep, K/M/G binary (default "
                                                 f"{FULL['sizes']}, --quick {QUICK['sizes']})")
    p.add_argument("--max-size", default=None,
                   help=f"skip sizes above this (default {FULL['max_size']}); sizes that do not fit in the "
                        f"memory available are skipped anyway")
    p.add_argument("--procs", default=None, help=f"process counts for the process sweep, comma-separated "
                                                 f"(default {FULL['procs']}, --quick {QUICK['procs']}; 0 = none)")
    p.add_argument("--bytes-per-proc", default=None,
                   help=f"state bytes per process in the process sweep (default {FULL['bytes_per_proc']})")
    p.add_argument("--repeats", type=int, default=None, help=f"timed saves (default {FULL['repeats']})")
    p.add_argument("--commit-steps", type=int, default=None,
                   help=f"steps of the commit-protocol phase per process count (default {FULL['commit_steps']}; 0 = "
                        f"skip it)")
    runner.output_arguments(p, "scaling", "tiny sizes, two process counts: seconds, for CI", timeout=1800.0)
    p.set_defaults(run=run)


def options(args: argparse.Namespace) -> dict[str, Any]:
    """Effective settings: explicit flags over the --quick or full defaults."""
    out = dict(QUICK if args.quick else FULL)
    for k in ("sizes", "max_size", "procs", "bytes_per_proc", "repeats", "commit_steps"):
        if getattr(args, k, None) is not None:
            out[k] = getattr(args, k)
    out["sizes"] = [parse_size(s) for s in str(out["sizes"]).split(",") if s.strip()]
    out["max_size"] = parse_size(str(out["max_size"]))
    out["bytes_per_proc"] = parse_size(str(out["bytes_per_proc"]))
    try:
        out["procs"] = [int(p) for p in str(out["procs"]).split(",") if p.strip() and int(p) > 0]
    except ValueError:
        raise ValueError(f"bench scaling: --procs {out['procs']!r} is not a comma-separated list of integers") \
            from None
    if not out["sizes"] or out["repeats"] < 1 or any(p > 8 for p in out["procs"]):
        raise ValueError(f"bench scaling needs at least one size, --repeats >= 1 and at most 8 processes "
                         f"(got sizes {out['sizes']}, repeats {out['repeats']}, procs {out['procs']})")
    return out


def command(args: argparse.Namespace) -> str:
    """The command line that repeats this run."""
    return runner.command_line("scaling", args, (("--sizes", "sizes"), ("--max-size", "max_size"), ("--procs", "procs"),
                                                 ("--bytes-per-proc", "bytes_per_proc"), ("--repeats", "repeats"),
                                                 ("--commit-steps", "commit_steps")))


def run(args: argparse.Namespace) -> int:
    """``jaxckpt bench scaling``: measure (or render ``--from-json``), write JSON, print and update the section."""
    return runner.run(args, "scaling", options,
                      lambda a, o: measure(o, command(a), quick=a.quick, timeout=a.timeout), render)


# ------------------------------------------------------------------------------------------------- the driver
def measure(opts: Mapping[str, Any], cmd: str, *, quick: bool, timeout: float) -> dict[str, Any]:
    """The size sweep in one launched process, then one launched job per process count."""
    from jaxckpt.testing import expect_ok, launch

    machine = report.machine_facts()
    mem = report.summarize(memcpy.memcpy_gbps(opts["memcpy_bytes"], opts["memcpy_repeats"]))
    sizes = [s for s in opts["sizes"] if s <= opts["max_size"]]
    skipped = [{"size_bytes": s, "reason": f"above --max-size {report.fmt_size(opts['max_size'])}"}
               for s in opts["sizes"] if s > opts["max_size"]]
    spec = {"sizes": sizes, "repeats": opts["repeats"], "warmup": opts["warmup"]}
    log.info("bench scaling: sizes %s", [report.fmt_size(s) for s in sizes])
    swept = expect_ok(launch(size_phase, nodes=1, procs_per_node=1, distributed=False, args=(spec,),
                             timeout=timeout))[0]
    skipped += swept["skipped"]
    by_size = []
    for r in swept["results"]:
        gbps = r["size_bytes"] / r["snapshot_s"]["median"] / 1e9
        by_size.append(dict(r, snapshot_gbps=gbps, snapshot_vs_memcpy=gbps / mem["median"]))
    by_procs, commit = [], []
    for n in opts["procs"]:
        pspec = {"bytes_per_proc": opts["bytes_per_proc"], "repeats": opts["repeats"], "warmup": opts["warmup"],
                 "job": f"bench-scaling-{os.getpid()}-{n}"}
        cspec = ({"steps": opts["commit_steps"], "job": f"bench-commit-{os.getpid()}-{n}"}
                 if opts.get("commit_steps", 0) > 0 else None)
        log.info("bench scaling: %d processes%s", n,
                 f", then the commit protocol x {opts['commit_steps']} steps" if cspec else "")
        per = expect_ok(launch(procs_and_commit_phase, nodes=1, procs_per_node=n, devices_per_proc=1,
                               args=({"procs": pspec, "commit": cspec},), timeout=timeout))
        by_procs.append(_merge_procs(n, [p["procs"] for p in per]))
        if cspec is not None:
            commit.append(merge_commit(n, [p["commit"] for p in per]))
        gc.collect()
    return {"bench": "scaling", "mode": "quick" if quick else "full", "machine": machine, "date": report.now_utc(),
            "ratios": _ratios(by_size, by_procs),
            "command": cmd,
            "setup": {"devices": 8, "mesh": "2x4", "arrays": N_ARRAYS, "repeats": opts["repeats"],
                      "warmup": opts["warmup"], "max_size": opts["max_size"], "bytes_per_proc": opts["bytes_per_proc"],
                      "check_limit": CHECK_LIMIT,
                      "jaxckpt_config": "Config() defaults (store=memory, keep=1)"},
            "memcpy_gbps": mem["median"], "memcpy_gbps_stats": mem, "by_size": by_size, "by_procs": by_procs,
            "commit": commit, "skipped": skipped}


def _ratios(by_size: list[Mapping[str, Any]], by_procs: list[Mapping[str, Any]]) -> dict[str, float]:
    """Largest over smallest state, most over fewest processes: how far from flat (1.0) each cost is."""
    out: dict[str, float] = {}
    if len(by_size) >= 2:
        lo, hi = by_size[0], by_size[-1]
        out["bytes_largest_over_smallest"] = hi["size_bytes"] / lo["size_bytes"]
        for key in ("save_call_s", "snapshot_s"):
            out[f"{key[:-2]}_largest_over_smallest"] = hi[key]["median"] / lo[key]["median"]
    if len(by_procs) >= 2:
        lo, hi = by_procs[0], by_procs[-1]
        out["procs_most_over_fewest"] = hi["procs"] / lo["procs"]
        for key in ("save_call_s", "snapshot_s", "snapshot_worker_s", "restore_s", "restore_cpu_s"):
            if key in hi and key in lo:
                out[f"{key[:-2]}_most_over_fewest_procs"] = hi[key]["median"] / lo[key]["median"]
    return out


def _merge_procs(n: int, per: list[Mapping[str, Any]]) -> dict[str, Any]:
    """One process count: every process's medians, their median and worst, and the aggregate throughput."""
    def across(key: str) -> dict[str, float]:
        return report.summarize([p[key]["median"] for p in per])

    total = sum(p["bytes"] for p in per)
    worst = max(p["snapshot_s"]["median"] for p in per)
    out = {"procs": n, "bytes_per_proc": per[0]["bytes"], "total_bytes": total, "processes": list(per),
           "save_call_s": across("save_call_s"), "snapshot_s": across("snapshot_s"),
           "snapshot_worker_s": across("snapshot_worker_s"), "aggregate_gbps": total / worst / 1e9}
    if all("restore_s" in p for p in per):
        out.update(restore_s=across("restore_s"), restore_cpu_s=across("restore_cpu_s"),
                   restore_aggregate_gbps=total / max(p["restore_s"]["median"] for p in per) / 1e9)
    return out


# ------------------------------------------------------------------------------------------ launched processes
def _save_loop(ck: Any, state: Any, warmup: int, repeats: int, sync: Any = None) -> dict[str, Any]:
    call, total, worker = [], [], []
    step = 0
    for _ in range(max(warmup, 2)):  # both slots of the double buffer in use before timing
        step += 1
        ck.save(step, state)
        ck.wait()
    for _ in range(repeats):
        step += 1
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        h = ck.save(step, state)
        t1 = time.perf_counter()
        ck.wait()
        call.append(t1 - t0)
        total.append(time.perf_counter() - t0)
        worker.append(h.snapshot_seconds)
    s = report.summarize
    return {"save_call_s": s(call), "snapshot_s": s(total), "snapshot_worker_s": s(worker)}


def size_phase(spec: dict) -> dict:
    """The size sweep (a launched process with 8 CPU devices): every size that fits, smallest first."""
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    from jaxckpt import Checkpointer, Config
    from jaxckpt.tools.bench.state import check_equal, make_state, restore_target

    results, skipped = [], []
    for size in spec["sizes"]:
        gc.collect()
        need = size * (1 + SLOTS) + MEMORY_MARGIN
        avail = report.available_memory_bytes()
        if need > avail:
            why = f"needs about {report.fmt_size(need)} of host memory, {report.fmt_size(avail)} available"
            log.warning("bench scaling: skipping %s: %s", report.fmt_size(size), why)
            skipped.append({"size_bytes": size, "reason": why})
            continue
        state = make_state(size)
        nbytes = sum(x.nbytes for x in state.values())
        with Checkpointer(Config(job_id="bench-scaling")) as ck:
            row = _save_loop(ck, state, spec["warmup"], spec["repeats"])
            row["held_bytes"] = ck.store.held_bytes()
            if nbytes <= CHECK_LIMIT:  # above, the restored copy would need another state's worth of memory
                check_equal("jaxckpt restore", ck.restore(restore_target(state)), state)
        row["size_bytes"] = nbytes
        results.append(row)
        log.info("size %s: save() %.2f ms, snapshot %.1f ms", report.fmt_size(nbytes),
                 row["save_call_s"]["median"] * 1e3, row["snapshot_s"]["median"] * 1e3)
        del state
    return {"results": results, "skipped": skipped}


def procs_phase(spec: dict) -> dict:
    """One process of the process sweep: its share of 8 sharded arrays, saved together with every process."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxckpt import Checkpointer, Config

    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharding = NamedSharding(mesh, P("x", None))
    rows = max(1, spec["bytes_per_proc"] // (N_ARRAYS * 4 * COLS)) * n
    state = {}
    for i in range(N_ARRAYS):
        make = jax.jit(lambda off: jax.lax.broadcasted_iota(jnp.float32, (rows, COLS), 0) * 1e-3
                       + jax.lax.broadcasted_iota(jnp.float32, (rows, COLS), 1) + off, out_shardings=sharding)
        state[f"layer{i}/w"] = make(jnp.float32(i))
    jax.block_until_ready(state)
    local = sum(s.data.nbytes for x in state.values() for s in x.addressable_shards)
    with Checkpointer(Config(job_id=spec["job"])) as ck:
        row = _save_loop(ck, state, spec["warmup"], spec["repeats"],
                         sync=lambda: multihost_utils.sync_global_devices("bench-scaling"))
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}
        wall, cpu = [], []
        for i in range(max(1, spec["repeats"])):  # all processes restore at once, as a relaunched job does
            multihost_utils.sync_global_devices(f"bench-scaling-restore-{i}")
            t0, c0 = time.perf_counter(), time.process_time()
            out = jax.block_until_ready(ck.restore(target))
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)  # every thread of this process: its own work, whatever it waited
            if i == 0:
                for k, v in state.items():
                    for a, b in zip(out[k].addressable_shards, v.addressable_shards):
                        if not np.array_equal(np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8)):
                            raise AssertionError(f"{k}: restored shard {a.index} differs from the saved one")
            del out
        row["restore_s"], row["restore_cpu_s"] = report.summarize(wall), report.summarize(cpu)
        # Every process serves its snapshot to the others' restores: none closes before all have restored.
        multihost_utils.sync_global_devices("bench-scaling-restored")
    row["bytes"] = local
    row["process"] = jax.process_index()
    return row


def procs_and_commit_phase(spec: dict) -> dict:
    """One process of a process count's job: the process sweep's phase, then (``spec["commit"]`` set) the
    commit-protocol phase with a Checkpointer and job id of its own. One launch, so one JAX start-up per
    process, for both: the protocol's key-value operations and latency are its Checkpointer's alone."""
    out = {"procs": procs_phase(spec["procs"])}
    gc.collect()
    if spec["commit"] is not None:
        out["commit"] = commit_phase(spec["commit"])
    return out


def commit_phase(spec: dict) -> dict:
    """One process of the commit-protocol phase: a tiny state saved every step; what the protocol cost it."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax._src import distributed
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxckpt import Checkpointer, Config

    mesh = Mesh(np.array(jax.devices()), ("x",))
    rows = max(1, COMMIT_BYTES // (4 * COLS)) * jax.device_count()
    x = jax.device_put(jnp.ones((rows, COLS), jnp.float32), NamedSharding(mesh, P("x", None)))
    with Checkpointer(Config(job_id=spec["job"])) as ck:
        for step in range(1, 4):  # warm-up: first-save set-up and the plan are not the protocol
            ck.save(step, {"x": x})
        ck.wait()
        before = ck.engine.collective.stats()
        first = 4
        for step in range(first, first + spec["steps"]):
            ck.save(step, {"x": x})
            ck.wait()
        after = ck.engine.collective.stats()
        times = {s: t for s, t in ck.engine.commit_times().items() if s >= first}
        live = None
        if jax.process_index() == 0 and jax.process_count() > 1:  # one process coordinates in memory
            live = len(distributed.global_state.client.key_value_dir_get_bytes(f"jaxckpt/{spec['job']}/"))
    ops = {k: after.get(k, 0) - before.get(k, 0) for k in ("sets", "gets", "try_gets", "deletes", "slow", "rounds")}
    return {"process": jax.process_index(), "steps": spec["steps"], "ops": ops,
            "times": {str(s): list(t) for s, t in times.items()}, "live_keys": live}


def merge_commit(n: int, per: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Key-value operations per step at the leader and at a follower; latency from the last process's local
    done to the step decided on every process (``time.monotonic()`` is one clock for the processes of a host)."""
    steps = per[0]["steps"]

    def per_step(p: Mapping[str, Any]) -> float:
        o = p["ops"]
        return (o["sets"] + o["gets"] + o["try_gets"] + o["deletes"] + o.get("slow", 0)) / steps  # all of them

    leader = next(p for p in per if p["process"] == 0)
    followers = [per_step(p) for p in per if p["process"] != 0]
    common = set.intersection(*(set(p["times"]) for p in per))
    lat = [max(p["times"][s][1] for p in per) - max(p["times"][s][0] for p in per) for s in sorted(common)]
    return {"procs": n, "steps": steps, "leader_ops_per_step": per_step(leader),
            "follower_ops_per_step": report.summarize(followers) if followers else None,
            "leader_ops": leader["ops"], "commit_latency_s": report.summarize(lat), "live_keys": leader["live_keys"]}


def extrapolate(commit: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """On paper: ops per step at the leader grow linearly in processes (fit on the measured counts), a follower's
    stay constant; the leader's time per step is its ops times the measured cost of one operation (latency /
    leader ops at the largest measured count). An estimate, labelled as such wherever it is shown."""
    if len(commit) < 2:
        return []
    a, b = commit[0], commit[-1]
    slope = (b["leader_ops_per_step"] - a["leader_ops_per_step"]) / (b["procs"] - a["procs"])
    base = a["leader_ops_per_step"] - slope * a["procs"]
    per_op = b["commit_latency_s"]["median"] / b["leader_ops_per_step"]
    fol = b["follower_ops_per_step"]["median"] if b["follower_ops_per_step"] else 0.0
    out = []
    for n in EXTRAPOLATE:
        ops = base + slope * n
        out.append({"procs": n, "leader_ops_per_step": ops, "follower_ops_per_step": fol,
                    "leader_s_per_step": ops * per_op, "per_op_s": per_op})
    return out


# --------------------------------------------------------------------------------------------------- markdown
def render(result: Mapping[str, Any]) -> str:
    """The BENCHMARKS.md section of a ``bench scaling`` result (every number from the JSON)."""
    fm, fn, fs = report.fmt_ms, report.fmt_num, report.fmt_size
    st = result["setup"]
    parts = ["### `jaxckpt bench scaling`: save() call and snapshot time vs state size and vs processes", ""]
    if result.get("mode") == "quick":
        parts += ["> **Quick run, placeholder until the full run.** Tiny states and few repeats on a shared machine: "
                  "these numbers show the shape of the tables, not the performance. Regenerate with the full "
                  "command on a quiet machine.", ""]
    parts += [f"Command: `{result['command']}`", "", report.machine_line(result), "",
              f"By size: the state of `jaxckpt bench save` ({st['arrays']} float32 arrays on a {st['mesh']} mesh of "
              f"{st['devices']} CPU devices, one process), jaxckpt {st['jaxckpt_config']}; median (min–max) of "
              f"{st['repeats']} saves after {max(st['warmup'], 2)} warm-up saves; restore checked bit for bit up to "
              f"{fs(st.get('check_limit', CHECK_LIMIT))}. "
              f"Snapshot = from the save() call until `wait()` returns; memcpy time = bytes / memcpy rate of this "
              f"run; host memory = bytes the store holds (one committed snapshot and the slot being reused).", ""]
    rows = []
    for r in result["by_size"]:
        rows.append([fs(r["size_bytes"]), fm(r["save_call_s"]), fm(r["snapshot_s"]),
                     fn(r["size_bytes"] / result["memcpy_gbps"] / 1e6),
                     f"{fn(r['snapshot_gbps'])} ({fn(r['snapshot_vs_memcpy'] * 100)}%)",
                     f"{fs(r['held_bytes'])} ({fn(r['held_bytes'] / r['size_bytes'])}x)"])
    parts.append(report.table(["state", "save() ms", "snapshot ms", "memcpy time ms", "snapshot GB/s (% of memcpy)",
                               "host memory held (x state)"], rows))
    q = result.get("ratios", {})
    if "bytes_largest_over_smallest" in q:
        parts += ["", f"Largest / smallest state ({fn(q['bytes_largest_over_smallest'])}x the bytes): save() "
                      f"{fn(q['save_call_largest_over_smallest'])}x, snapshot "
                      f"{fn(q['snapshot_largest_over_smallest'])}x "
                      f"(medians of this run; flat = 1x, memcpy-bound = the byte ratio)."]
    for sk in result.get("skipped", []):
        parts += ["", f"Skipped {fs(sk['size_bytes'])}: {sk['reason']}."]
    if result["by_procs"]:
        parts += ["", f"By processes: each process (1 CPU device, all on one simulated node) holds "
                      f"{fs(st['bytes_per_proc'])} of {st['arrays']} float32 arrays sharded over every device; all "
                      f"save together, each step committed by every process. Per-process figures: median across "
                      f"processes of each process's median (min–max across processes). Aggregate = total bytes / "
                      f"the slowest process's median snapshot time. The machine has {result['machine']['cores']} "
                      f"cores: beyond that, processes share them.", ""]
        rows = []
        restores = all("restore_s" in r for r in result["by_procs"])
        for r in result["by_procs"]:
            rows.append([str(r["procs"]), fs(r["total_bytes"]), fm(r["save_call_s"]), fm(r["snapshot_s"]),
                         fm(r["snapshot_worker_s"]), fn(r["aggregate_gbps"])]
                        + ([fm(r["restore_s"]), fm(r["restore_cpu_s"]), fn(r["restore_aggregate_gbps"])]
                           if restores else []))
        parts.append(report.table(["processes", "total state", "save() ms per process", "snapshot ms per process",
                                   "local copy ms per process", "aggregate GB/s"]
                                  + (["restore ms per process", "restore CPU ms per process",
                                      "restore aggregate GB/s"] if restores else []), rows))
        if restores:
            parts += ["", "Restore: every process restores its share onto the saved shardings, all at once (a "
                          "barrier before each), from the store's memory; checked bit for bit once. CPU ms = the "
                          "process's CPU time in the restore, all its threads: its own work, apart from the waiting "
                          "for a core that sets the wall time once processes outnumber the cores (memory "
                          "bandwidth and caches are shared too, so it rises with the processes as well)."]
        if "procs_most_over_fewest" in q:
            parts += ["", f"Most / fewest processes ({fn(q['procs_most_over_fewest'])}x): per-process save() "
                          f"{fn(q['save_call_most_over_fewest_procs'])}x, snapshot "
                          f"{fn(q['snapshot_most_over_fewest_procs'])}x, local copy "
                          f"{fn(q['snapshot_worker_most_over_fewest_procs'])}x"
                          + (f", restore {fn(q['restore_most_over_fewest_procs'])}x (CPU time "
                             f"{fn(q['restore_cpu_most_over_fewest_procs'])}x)"
                             if "restore_most_over_fewest_procs" in q else "") + " (flat = 1x)."]
    if result.get("commit"):
        c0 = result["commit"][0]
        parts += ["", f"Commit protocol: each process (1 CPU device, one simulated node) saves a "
                      f"{fs(COMMIT_BYTES)} share every step and waits for the commit, {c0['steps']} steps after 3 "
                      f"warm-up steps. Key-value operations (sets, gets, deletes) per step counted by the collective "
                      f"wrapper; latency = from the last process's local done to the step decided on every process; "
                      f"live keys = coordination-service keys under the job's prefix after the run.", ""]
        rows = []
        for r in result["commit"]:
            f = r["follower_ops_per_step"]
            rows.append([str(r["procs"]), fn(r["leader_ops_per_step"]), fn(f["median"]) if f else "-",
                         fm(r["commit_latency_s"]), str(r["live_keys"])])
        parts.append(report.table(["processes", "kv ops per step, leader", "kv ops per step, follower",
                                   "commit latency ms", "live keys after"], rows))
        ex = extrapolate(result["commit"])
        if ex:
            parts += ["", "On paper (not measured): leader ops per step fitted linearly on the measured counts, a "
                          "follower's constant, the leader's time = ops x the cost of one operation measured at the "
                          f"largest count ({fn(ex[0]['per_op_s'] * 1e3)} ms here, one loaded machine; a dedicated "
                          "coordination service is faster):", ""]
            parts.append(report.table(["processes", "kv ops per step, leader", "kv ops per step, follower",
                                       "leader time per step (estimate)"],
                                      [[str(e["procs"]), fn(e["leader_ops_per_step"]), fn(e["follower_ops_per_step"]),
                                        f"{fn(e['leader_s_per_step'] * 1e3)} ms"] for e in ex]))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxckpt.tools.bench.scaling``: the same options as ``jaxckpt bench scaling``."""
    return runner.main("jaxckpt.tools.bench.scaling", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
