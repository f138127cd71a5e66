"""``jaxckpt advise``: the snapshot interval that minimises expected lost time (jaxckpt.core.advise, Young/Daly)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys

from jaxckpt.core.advise import advise_interval
from jaxckpt.errors import ConfigError

_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def seconds(text: str) -> float:
    """``"0.35"``, ``"350ms"``, ``"2h"``, ``"30d"`` -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-z]*)\s*", text)
    if not m or m.group(2) not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (a number with s, ms, us, min, h or d)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``jaxckpt advise``."""
    p.add_argument("--mtbf-node", type=seconds, required=True, help="mean time between failures of one node (e.g. 30d)")
    p.add_argument("--nodes", type=int, required=True, help="nodes in the job")
    p.add_argument("--step-time", type=seconds, required=True, help="time of one training step without a snapshot")
    p.add_argument("--overhead", type=seconds, required=True,
                   help="step-time cost of one snapshot (what a snapshot adds to its step, e.g. 2ms)")
    p.add_argument("--latency", type=seconds, default=0.0, help="save() -> recoverable (committed/protected)")
    p.add_argument("--restart", type=seconds, default=0.0, help="relaunch + restore time after a failure")
    p.add_argument("--json", action="store_true", help="print the advice as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the advice; 2 with the reason on bad input."""
    try:
        a = advise_interval(mtbf_node_s=args.mtbf_node, nodes=args.nodes, step_time_s=args.step_time,
                            overhead_s=args.overhead, latency_s=args.latency, restart_s=args.restart)
    except ConfigError as e:
        sys.stderr.write(f"jaxckpt advise: {e}\n")
        return 2
    sys.stdout.write((json.dumps(dataclasses.asdict(a)) if args.json else a.describe()) + "\n")
    return 0
