"""``jaxckpt bench parity``: XOR encode and rebuild throughput of :mod:`jaxckpt.protection.parity`, against memcpy.

For each fan-in m (the number of data units XORed into one parity block: Rn-1 for REFT parity over Rn nodes,
G-1 for an xor group of G nodes) and block size S:

* encode: the parity of m blocks of S bytes (``parity.encode``), into a preallocated, pre-faulted block;
* rebuild: one missing block from the parity and the m-1 others (``parity.rebuild``);
* the same encode with every block given as a list of ``SEGMENT`` -byte segments, as protection units are.

The figure compared with memcpy is the XOR rate: bytes read and XORed per second (m*S per encode, m*S per
rebuild), which is the time it takes to protect (or read back through parity) that much data, next to the time
memcpy takes to copy it; rebuilt bytes per second are that rate divided by m. The issue's floor is 50% of the
memcpy measured in the same run. Every result is checked bit for bit. numpy only: no JAX in this process.
"""
from __future__ import annotations

import argparse
import logging
import time
from typing import Any, Mapping

import numpy as np

from jaxckpt.protection import parity
from jaxckpt.tools.bench import memcpy, report, runner
from jaxckpt.tools.bench.save import parse_size

log = logging.getLogger("jaxckpt.tools.bench")

FLOOR = 0.5
SEGMENT = 256 << 10
FULL = {"block_bytes": 64 << 20, "fanins": (1, 3, 7), "workers": (1, 2), "repeats": 7, "memcpy_bytes": 256 << 20,
        "memcpy_repeats": 10}
QUICK = {"block_bytes": 4 << 20, "fanins": (1, 3), "workers": (1,), "repeats": 3, "memcpy_bytes": 32 << 20,
         "memcpy_repeats": 5}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``jaxckpt bench parity``."""
    p.add_argument("--block-size", default=None,
                   help=f"bytes per block, K/M/G binary (default {report.fmt_size(FULL['block_bytes'])}, "
                        f"--quick {report.fmt_size(QUICK['block_bytes'])})")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per case, after one warm-up")
    runner.output_arguments(p, "parity", "small blocks, few repeats: seconds, for CI")
    p.set_defaults(run=run)


def options(args: argparse.Namespace) -> dict[str, Any]:
    """Effective settings: explicit flags over the --quick or full defaults."""
    out = dict(QUICK if args.quick else FULL, quick=args.quick)
    if args.block_size is not None:
        out["block_bytes"] = parse_size(args.block_size)
    if args.repeats is not None:
        out["repeats"] = args.repeats
    if out["repeats"] < 1:
        raise ValueError(f"bench parity needs --repeats >= 1 (got {out['repeats']})")
    return out


def command(args: argparse.Namespace) -> str:
    """The command line that repeats this run."""
    return runner.command_line("parity", args, (("--block-size", "block_size"), ("--repeats", "repeats")))


def _timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up: thread pool start, first touches
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _row(op: str, fanin: int, workers: int, layout: str, seconds: list[float], read: int, written: int,
         memcpy_gbps: float) -> dict[str, Any]:
    s = report.summarize(seconds)
    rate = read / s["median"] / 1e9
    return {"op": op, "fanin": fanin, "workers": workers, "layout": layout, "seconds": s, "xor_gbps": rate,
            "output_gbps": written / s["median"] / 1e9, "vs_memcpy": rate / memcpy_gbps}


def measure(opts: Mapping[str, Any], cmd: str) -> dict[str, Any]:
    """Run every case of ``opts`` and return the result document."""
    size, repeats = opts["block_bytes"], opts["repeats"]
    machine = report.machine_facts()
    mc = memcpy.memcpy_gbps(opts["memcpy_bytes"], opts["memcpy_repeats"])
    mc_med = float(np.median(mc))
    rng = np.random.default_rng(0)
    results = []
    for m in opts["fanins"]:
        blocks = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(m)]
        out = np.zeros(size, np.uint8)  # pre-faulted: page faults are not bandwidth
        want = np.bitwise_xor.reduce(np.stack(blocks), axis=0) if m > 1 else blocks[0]
        segmented = [[b[i:i + SEGMENT] for i in range(0, size, SEGMENT)] for b in blocks]
        for w in opts["workers"]:
            secs = _timed(lambda: parity.encode(blocks, out, workers=w), repeats)
            np.testing.assert_array_equal(out, want)
            results.append(_row("encode", m, w, "contiguous", secs, m * size, size, mc_med))
            secs = _timed(lambda: parity.encode(segmented, out, workers=w), repeats)
            np.testing.assert_array_equal(out, want)
            results.append(_row("encode", m, w, f"{report.fmt_size(SEGMENT)} segments", secs, m * size, size, mc_med))
            pbuf = want.copy()
            secs = _timed(lambda: parity.rebuild(pbuf, blocks[1:], size, out, workers=w), repeats)
            np.testing.assert_array_equal(out, blocks[0])
            results.append(_row("rebuild", m, w, "contiguous", secs, m * size, size, mc_med))
            log.info("parity: fan-in %d, %d thread(s): encode %.2f GB/s", m, w, results[-3]["xor_gbps"])
    return {"bench": "parity", "mode": "quick" if opts.get("quick") else "full",
            "machine": machine, "date": report.now_utc(), "command": cmd,
            "setup": {"block_bytes": size, "fanins": list(opts["fanins"]), "workers": list(opts["workers"]),
                      "repeats": repeats, "window_bytes": parity.WINDOW, "segment_bytes": SEGMENT,
                      "floor_vs_memcpy": FLOOR},
            "memcpy_gbps": mc_med, "memcpy": report.summarize(mc), "results": results}


def render(result: Mapping[str, Any]) -> str:
    """The BENCHMARKS.md section of a ``bench parity`` result."""
    s = result["setup"]
    parts = ["### `jaxckpt bench parity`: XOR encode and rebuild throughput vs memcpy", ""]
    if result.get("mode") == "quick":
        parts += ["> **Quick run, placeholder until the full run.** Small blocks and few repeats on a shared "
                  "machine: these numbers show the shape of the table, not the performance. Regenerate with the "
                  "full command on a quiet machine.", ""]
    parts += [
        f"Command: `{result['command']}`", "",
        report.machine_line(result), "",
        f"Blocks of {report.fmt_size(s['block_bytes'])} of random bytes; fan-in = data blocks XORed into one parity "
        f"(Rn-1 for REFT parity over Rn nodes, G-1 for an xor group). XOR rate = bytes read and XORed per second "
        f"(fan-in x block per operation), compared with memcpy's bytes copied per second in the same run; the "
        f"issue's floor is {FLOOR:.0%}. Rebuilt bytes per second = XOR rate / fan-in. Windows of "
        f"{report.fmt_size(s['window_bytes'])}; median (min–max) of {s['repeats']} repeats after one warm-up; every "
        f"result checked bit for bit.", "",
    ]
    rows = []
    for r in result["results"]:
        rows.append([r["op"], str(r["fanin"]), str(r["workers"]), r["layout"],
                     report.fmt_ms(r["seconds"]), report.fmt_num(r["xor_gbps"]),
                     f"{report.fmt_num(r['vs_memcpy'] * 100)}%", report.fmt_num(r["output_gbps"]),
                     "yes" if r["vs_memcpy"] >= s["floor_vs_memcpy"] else "**no**"])
    parts.append(report.table(["operation", "fan-in", "threads", "blocks", "ms", "XOR rate GB/s", "% of memcpy",
                               "output GB/s", f"≥ {s['floor_vs_memcpy']:.0%} floor"], rows))
    return "\n".join(parts)


def run(args: argparse.Namespace) -> int:
    """``jaxckpt bench parity``: measure (or render ``--from-json``), write JSON, print and update the section."""
    return runner.run(args, "parity", options, lambda a, o: measure(o, command(a)), render)
