"""``jaxckpt chaos``: the command line of the fault injector (jaxckpt/tools/chaos/run.py) and of its soak profiles
(jaxckpt/tools/chaos/soak.py), and ``--from-json``, which renders a kept record of either."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Mapping

from jaxckpt.tools.bench.report import read_json
from jaxckpt.tools.chaos import report as chaos_report
from jaxckpt.tools.chaos import soak, soak_report
from jaxckpt.tools.chaos.faults import FAULTS
from jaxckpt.tools.chaos.report import format_table
from jaxckpt.tools.chaos.run import PROFILES, ChaosRun, ok


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``jaxckpt chaos [--profile quick|long] [--seed N] [--trials N] [--jax-trials N] [--faults K,..] [--json]``."""
    p.add_argument("--profile", choices=sorted([*PROFILES, *soak.PROFILES]), default="quick",
                   help="quick: 50 trials + 2 JAX trials on 2 nodes (CI); long: 500 + 20 on 3 nodes; both with "
                        "protection hybrid; soak: 40,000 steps on 3 nodes with a fault every 10,000, sampling every "
                        "process for growth (jaxckpt/tools/chaos/soak.py); soak-quick: 300 steps")
    p.add_argument("--steps", type=int, default=None, help="soak profiles: steps to train (default: the profile's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trials", type=int, default=None, help="numpy-trainer trials (default: the profile's)")
    p.add_argument("--jax-trials", type=int, default=None, help="JAX-trainer trials (default: the profile's)")
    p.add_argument("--faults", default="", help=f"comma-separated fault kinds (default: all of {sorted(FAULTS)})")
    p.add_argument("--protection", default=None, choices=("none", "replica", "parity", "xor-group", "hybrid"),
                   help="Config.protection of the numpy trainers (default: the profile's, hybrid): losing a node's "
                        "memory must keep the newest protected step; with none, it may lose every step")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--update-md", default="", metavar="PATH",
                   help="write the result table into PATH's chaos section, e.g. BENCHMARKS.md "
                        "(jaxckpt/tools/chaos/report.py), and keep the run's record in docs/bench/chaos.json there")
    p.add_argument("--keep-hangs", default="", metavar="DIR",
                   help="for each hang, keep the trainers' and agents' logs (with every thread's stack), the job's "
                        "events and its coordination keys in a folder of DIR")
    p.add_argument("--from-json", default="", metavar="PATH",
                   help="run nothing: render (and --update-md) a kept record such as docs/bench/chaos.json")
    p.set_defaults(run=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    """Exit 0 when every fault was recovered from, with no wrong restore, no hang and no unexpected loss."""
    if args.from_json:
        return _render_kept(args)
    if args.profile in soak.PROFILES:
        return _run_soak(args)
    faults = [f for f in args.faults.split(",") if f] or None
    profile = PROFILES[args.profile]
    if args.protection is not None:
        profile = dataclasses.replace(profile, protection=args.protection)
    rep = ChaosRun(profile, args.seed, trials=args.trials, jax_trials=args.jax_trials, faults=faults,
                   keep_hangs=os.path.abspath(args.keep_hangs) if args.keep_hangs else "").run()
    print(json.dumps(rep, indent=1) if args.json else format_table(rep))
    if args.update_md:
        chaos_report.update_md(args.update_md, rep, chaos_report.command_line(args))
        print(f"wrote the chaos section of {args.update_md}", file=sys.stderr)
    return 0 if ok(rep) else 1


def _render_kept(args: argparse.Namespace) -> int:
    """``--from-json``: the section of a kept record, printed (and written with ``--update-md``); runs nothing."""
    try:
        record = read_json(args.from_json)
        if isinstance(record, dict) and record.get("bench") == "soak":  # jaxckpt/tools/chaos/soak.py renders it
            return _render_kept_soak(args, record)
        md = chaos_report.render_record(record)
    except (OSError, ValueError, KeyError) as e:
        print(f"jaxckpt chaos --from-json {args.from_json}: {e}", file=sys.stderr)
        return 2
    if args.update_md:
        chaos_report.update_md_from_record(args.update_md, record)
    print(md)
    return 0 if ok(record["report"]) else 1


def _run_soak(args: argparse.Namespace) -> int:
    """``jaxckpt chaos --profile soak|soak-quick``: exit 0 when nothing grew and every chaos check passed."""
    faults = [f for f in args.faults.split(",") if f] or None
    rep = soak.run_soak(args.profile, args.seed, steps=args.steps, faults=faults)
    print(json.dumps(rep, indent=1) if args.json else soak.format_summary(rep))
    if args.update_md:
        soak_report.update_md(args.update_md, rep, soak_report.command_line(args))
        print(f"wrote the soak section of {args.update_md}", file=sys.stderr)
    return 0 if soak.ok(rep) else 1


def _render_kept_soak(args: argparse.Namespace, record: Mapping[str, Any]) -> int:
    """``--from-json`` of a kept soak record: its section printed (and written with ``--update-md``, the plot
    redrawn); runs nothing. Exit 0 when the recorded soak passed, 1 when it did not, 2 for a broken record."""
    try:
        md = soak_report.render_record(record)
        if args.update_md:
            soak_report.update_md_from_record(args.update_md, record)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"jaxckpt chaos --from-json {args.from_json}: {e}", file=sys.stderr)
        return 2
    print(md)
    return 0 if soak.ok(record["report"]) else 1
