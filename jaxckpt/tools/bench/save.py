"""``jaxckpt bench save``: save-call, snapshot and restore time vs state size, with Orbax and memcpy in the same run.

For each state size (a dict of float32 arrays sharded over 8 CPU devices) it measures jaxckpt ``save()`` call
time, time until ``wait()`` returns, and restore time onto the same shardings; Orbax ``AsyncCheckpointer``
(StandardSave to tmpfs) save-call, total and restore time; and the machine's memcpy bandwidth as the limit.
Then the leaf-count sweep (``jaxckpt.tools.bench.save_leaves``): save() call time of jaxckpt (plain and
``wrap_step``) and Orbax against the number of leaves at the same total bytes.
Results go to JSON; the BENCHMARKS.md section is rendered from that JSON (``jaxckpt.tools.bench.report``).

JAX must see 8 CPU devices, set before it initialises: if this process has already imported jax, the
measurement runs in a fresh ``python -m jaxckpt.tools.bench.save`` subprocess. This module imports jax only inside
the measurement functions for that reason.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from typing import Any, Mapping

from jaxckpt.tools.bench import memcpy, report, runner, save_leaves
from jaxckpt.tools.bench.state import (N_ARRAYS, SPECS, bench_devices, check_equal, devices_text, make_state,
                                       mesh_shape, restore_target, setup_jax, spec_text)

log = logging.getLogger("jaxckpt.tools.bench")

FULL = {"sizes": "16M,64M,256M,1G", "repeats": 5, "warmup": 2, "memcpy_bytes": 512 << 20, "memcpy_repeats": 10}
QUICK = {"sizes": "1M,4M", "repeats": 3, "warmup": 1, "memcpy_bytes": 32 << 20, "memcpy_repeats": 5}
JAXCKPT_PATH = "save() after the step (zero-copy views, copies on worker threads)"
ORBAX_SETUP = ("ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler()), StandardSave to a fresh directory under "
               "/dev/shm (tmpfs) each repeat, StandardRestore onto the same shardings")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``jaxckpt bench save`` (also those of ``python -m jaxckpt.tools.bench.save``)."""
    p.add_argument("--sizes", default=None,
                   help=f"state sizes, comma-separated, K/M/G = KiB/MiB/GiB (default {FULL['sizes']}, "
                        f"--quick {QUICK['sizes']})")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"timed repeats per size (default {FULL['repeats']}, --quick {QUICK['repeats']})")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"untimed rounds first, at least 1 (default {FULL['warmup']}, --quick {QUICK['warmup']})")
    lf, lq = save_leaves.FULL, save_leaves.QUICK
    p.add_argument("--leaf-counts", default=None,
                   help=f"leaf counts of the sweep, comma-separated; 'none' skips it (default {lf['leaf_counts']}, "
                        f"--quick {lq['leaf_counts']})")
    p.add_argument("--leaf-total", default=None,
                   help=f"total state size of the sweep (default {lf['leaf_total']}, --quick {lq['leaf_total']})")
    p.add_argument("--leaf-repeats", type=int, default=None,
                   help=f"timed repeats per leaf count (default {lf['leaf_repeats']}, --quick {lq['leaf_repeats']})")
    runner.output_arguments(p, "save", "tiny sizes, few repeats: seconds, for CI")
    p.set_defaults(run=run)


def parse_size(text: str) -> int:
    """'16M' -> 16 MiB in bytes; K, M, G are binary; a bare number is bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        n = int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise ValueError(f"bad size {text!r}: expected e.g. 16M, 1G, 4096") from None
    if n <= 0:
        raise ValueError(f"bad size {text!r}: must be positive")
    return n


def options(args: argparse.Namespace) -> dict[str, Any]:
    """Effective settings: explicit flags over the --quick or full defaults."""
    base = {**QUICK, **save_leaves.QUICK} if args.quick else {**FULL, **save_leaves.FULL}
    out = dict(base)
    for k in ("sizes", "repeats", "warmup", "leaf_counts", "leaf_total", "leaf_repeats"):
        if getattr(args, k, None) is not None:
            out[k] = getattr(args, k)
    out["sizes"] = [parse_size(s) for s in str(out["sizes"]).split(",") if s.strip()]
    counts = str(out["leaf_counts"]).strip().lower()
    try:
        out["leaf_counts"] = [] if counts == "none" else [int(c) for c in counts.split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"bad --leaf-counts {out['leaf_counts']!r}: expected e.g. 8,128,1024 or none") from None
    out["leaf_total"] = parse_size(str(out["leaf_total"]))
    if any(c < 1 for c in out["leaf_counts"]) or out["leaf_repeats"] < 1:
        raise ValueError(f"bench save needs leaf counts >= 1 and --leaf-repeats >= 1 (got {out['leaf_counts']}, "
                         f"{out['leaf_repeats']})")
    # At least one warm-up round: the first Orbax save and the first jaxckpt plan carry one-off set-up costs.
    if not out["sizes"] or out["repeats"] < 1 or out["warmup"] < 1:
        raise ValueError(f"bench save needs at least one size, --repeats >= 1 and --warmup >= 1 "
                         f"(got sizes {out['sizes']}, repeats {out['repeats']}, warmup {out['warmup']})")
    return out


def forwarded(args: argparse.Namespace) -> list[str]:
    """The options of ``args`` as command-line words, so a subprocess or a reader can repeat the run."""
    words = ["--quick"] if args.quick else []
    for flag, key in (("--sizes", "sizes"), ("--repeats", "repeats"), ("--warmup", "warmup"),
                      ("--leaf-counts", "leaf_counts"), ("--leaf-total", "leaf_total"),
                      ("--leaf-repeats", "leaf_repeats"), ("--json", "json"), ("--update-md", "update_md"),
                      ("--from-json", "from_json")):
        if getattr(args, key, None) is not None:
            words += [flag, str(getattr(args, key))]
    return words


# ---------------------------------------------------------------------------------------------- entry points
def run(args: argparse.Namespace) -> int:
    """``jaxckpt bench save``: measure (or render ``--from-json``), write JSON, print and update the table."""
    if not args.from_json and "jax" in sys.modules:
        try:
            options(args)  # refuse bad options here, before any subprocess starts
        except ValueError as e:
            log.error("%s", e)
            return 2
        return _run_subprocess(args)
    return runner.run(args, "save", options, lambda a, _: measure(a), render)


def _run_subprocess(args: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", "jaxckpt.tools.bench.save", *forwarded(args)]
    log.info("jax is already imported here; measuring in a subprocess: %s", shlex.join(cmd))
    env = dict(os.environ, JAXCKPT_LOG_LEVEL=logging.getLevelName(logging.getLogger().getEffectiveLevel()))
    return subprocess.run(cmd, env=env, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxckpt.tools.bench.save``: the same options as ``jaxckpt bench save``."""
    return runner.main("jaxckpt.tools.bench.save", __doc__, add_arguments, run, argv)


# ------------------------------------------------------------------------------------------------ measuring
def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark in this process (jax must not be initialised yet) and return the result object."""
    opts = options(args)
    setup_jax("save")
    logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax logs every save at INFO
    machine = report.machine_facts()
    log.info("bench save: sizes %s, %d repeats after %d warm-up", [report.fmt_size(s) for s in opts["sizes"]],
             opts["repeats"], opts["warmup"])
    mem = report.summarize(memcpy.memcpy_gbps(opts["memcpy_bytes"], opts["memcpy_repeats"]))
    results = []
    for size in opts["sizes"]:
        state = make_state(size)
        nbytes = sum(x.nbytes for x in state.values())
        log.info("state %s: %d arrays, %d bytes", report.fmt_size(size), len(state), nbytes)
        j = bench_jaxckpt(state, opts["repeats"], opts["warmup"])
        gc.collect()
        o = bench_orbax(state, opts["repeats"], opts["warmup"])
        del state
        gc.collect()
        gbps = nbytes / j["snapshot_s"]["median"] / 1e9
        j["snapshot_gbps"] = gbps
        j["snapshot_vs_memcpy"] = gbps / mem["median"]
        ratios = {k + "_orbax_over_jaxckpt": o[a]["median"] / j[b]["median"]
                  for k, a, b in (("save_call", "save_call_s", "save_call_s"), ("total", "total_s", "snapshot_s"),
                                  ("restore", "restore_s", "restore_s"))}
        results.append({"size_bytes": nbytes, "jaxckpt": j, "orbax": o, "ratios": ratios})
        log.info("%s: jaxckpt save() %.2f ms, snapshot %.1f ms (%.2f GB/s), restore %.1f ms; Orbax save() %.1f ms, "
                 "total %.1f ms, restore %.1f ms", report.fmt_size(nbytes), j["save_call_s"]["median"] * 1e3,
                 j["snapshot_s"]["median"] * 1e3, gbps, j["restore_s"]["median"] * 1e3,
                 o["save_call_s"]["median"] * 1e3, o["total_s"]["median"] * 1e3, o["restore_s"]["median"] * 1e3)
    sweep = None
    if opts["leaf_counts"]:
        log.info("bench save: leaf-count sweep %s at %s in total", opts["leaf_counts"],
                 report.fmt_size(opts["leaf_total"]))
        sweep = save_leaves.measure(opts, opts["warmup"])
    out = {
        "bench": "save",
        "mode": "quick" if args.quick else "full",
        "machine": machine,
        "date": report.now_utc(),
        "command": shlex.join(["jaxckpt", "bench", "save", *forwarded(args)]),
        "setup": {"devices": len(bench_devices()), "devices_text": devices_text(),
                  "mesh": "x".join(map(str, mesh_shape(len(bench_devices())))), "arrays": N_ARRAYS,
                  "specs": [spec_text(s) for s in SPECS], "repeats": opts["repeats"], "warmup": opts["warmup"],
                  "jaxckpt_warmup_saves": max(opts["warmup"], 2),
                  "jaxckpt_config": "Config() defaults (store=memory, keep=1)", "jaxckpt_path": JAXCKPT_PATH,
                  "orbax": ORBAX_SETUP, "memcpy_bytes": opts["memcpy_bytes"]},
        "memcpy_gbps": mem["median"],
        "memcpy_gbps_stats": mem,
        "results": results,
    }
    if sweep is not None:
        out["leaf_sweep"] = sweep
    return out


def bench_jaxckpt(state: dict[str, Any], repeats: int, warmup: int) -> dict[str, Any]:
    """save() call, save-to-committed and restore seconds of jaxckpt's default Checkpointer."""
    import jax
    from jaxckpt import Checkpointer, Config

    target = restore_target(state)
    call, total, worker, restore = [], [], [], []
    step = 0
    with Checkpointer(Config()) as ck:
        # Warm-up fills both slots of the double buffer, so timed saves reuse slots, as in training.
        for _ in range(max(warmup, 2)):  # keep in step with setup['jaxckpt_warmup_saves']
            step += 1
            ck.save(step, state)
            ck.wait()
        for _ in range(repeats):
            step += 1
            t0 = time.perf_counter()
            h = ck.save(step, state)
            t1 = time.perf_counter()
            ck.wait()
            t2 = time.perf_counter()
            call.append(t1 - t0)
            total.append(t2 - t0)
            worker.append(h.snapshot_seconds)
        check_equal("jaxckpt restore", ck.restore(target), state)
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = jax.block_until_ready(ck.restore(target))
            restore.append(time.perf_counter() - t0)
            del out
    return {"save_call_s": report.summarize(call), "snapshot_s": report.summarize(total),
            "snapshot_worker_s": report.summarize(worker), "restore_s": report.summarize(restore)}


def bench_orbax(state: dict[str, Any], repeats: int, warmup: int) -> dict[str, Any]:
    """Orbax AsyncCheckpointer save() call, total and restore seconds, StandardSave to tmpfs."""
    import jax
    import orbax.checkpoint as ocp

    target = restore_target(state)
    call, total, restore = [], [], []
    root = report.tmpfs_dir("jaxckpt-bench-orbax-", "Orbax")
    ckptr = ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())
    try:
        for i in range(warmup + repeats):
            path = os.path.join(root, f"r{i}")
            t0 = time.perf_counter()
            ckptr.save(path, args=ocp.args.StandardSave(state))
            t1 = time.perf_counter()
            ckptr.wait_until_finished()
            t2 = time.perf_counter()
            out = jax.block_until_ready(ckptr.restore(path, args=ocp.args.StandardRestore(target)))
            t3 = time.perf_counter()
            if i == 0:
                check_equal("Orbax restore", out, state)
            del out
            shutil.rmtree(path)
            if i >= warmup:
                call.append(t1 - t0)
                total.append(t2 - t0)
                restore.append(t3 - t2)
    finally:
        ckptr.close()
        shutil.rmtree(root, ignore_errors=True)
    return {"save_call_s": report.summarize(call), "total_s": report.summarize(total),
            "restore_s": report.summarize(restore)}


def render(result: Mapping[str, Any]) -> str:
    """The BENCHMARKS.md section of a ``bench save`` result."""
    fmt_size, fmt_ms, fmt_num, table = report.fmt_size, report.fmt_ms, report.fmt_num, report.table
    s = result["setup"]
    parts = ["### `jaxckpt bench save`: save() call, snapshot and restore time vs state size, against Orbax", ""]
    if result.get("mode") == "quick":
        parts += ["> **Quick run, placeholder until the full run.** Tiny states and few repeats on a shared machine: "
                  "these numbers show the shape of the table, not the performance. Regenerate with the full "
                  "command on a quiet machine.", ""]
    parts += [
        f"Command: `{result['command']}`", "",
        report.machine_line(result), "",
        f"State: {s['arrays']} float32 arrays on a {s['mesh']} mesh of {s.get('devices_text', str(s['devices']) + ' CPU devices')} "
        f"(shardings {', '.join(s['specs'])}). jaxckpt: {s['jaxckpt_config']}; level-1 path: {s['jaxckpt_path']}. "
        f"Orbax: {s['orbax']}. Each figure: median (min–max) of {s['repeats']} repeats after {s['warmup']} "
        f"warm-up round(s) (jaxckpt: {s['jaxckpt_warmup_saves']} warm-up saves, so both slots of its double buffer "
        f"are reused); restores are checked bit for bit against the saved state.", "",
    ]
    rows = []
    for r in result["results"]:
        j, o, q = r["jaxckpt"], r["orbax"], r["ratios"]
        rows.append([
            fmt_size(r["size_bytes"]), fmt_ms(j["save_call_s"]), fmt_ms(j["snapshot_s"]),
            f"{fmt_num(j['snapshot_gbps'])} ({fmt_num(j['snapshot_vs_memcpy'] * 100)}%)",
            fmt_ms(j["restore_s"]), fmt_ms(o["save_call_s"]), fmt_ms(o["total_s"]), fmt_ms(o["restore_s"]),
            f"{fmt_num(q['save_call_orbax_over_jaxckpt'])}x", f"{fmt_num(q['restore_orbax_over_jaxckpt'])}x",
        ])
    parts.append(table(["state", "jaxckpt save() ms", "jaxckpt snapshot ms", "snapshot GB/s (% of memcpy)",
                        "jaxckpt restore ms", "Orbax save() ms", "Orbax total ms", "Orbax restore ms",
                        "save() Orbax/jaxckpt", "restore Orbax/jaxckpt"], rows))
    parts += ["", "save(): time the call blocks the caller. snapshot: from the save() call until `wait()` returns "
              "(the step is committed in host memory); Orbax total: until `wait_until_finished()` returns. "
              "GB/s = 1e9 bytes per second of snapshot time; ratios are of medians within this run."]
    if result.get("leaf_sweep"):
        parts += ["", save_leaves.render(result["leaf_sweep"])]
    return "\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
