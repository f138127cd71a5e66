"""The ``jaxckpt`` command. Each subcommand names the module that defines its arguments; ``main`` imports only
the module of the subcommand being run, so ``jaxckpt agent`` never loads the benchmarks, chaos or launcher."""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Sequence

import jaxckpt

# name -> (help, module, function adding its arguments)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "launch": ("run a command in N JAX processes grouped into nodes", "jaxckpt.tools.launcher", "add_arguments"),
    "agent": ("run the node agent holding a job's snapshots in shared memory", "jaxckpt.backends.agent.command",
              "add_arguments"),
    "ls": ("steps held by a node agent, per process, with bytes and age", "jaxckpt.cli.listing", "add_ls_arguments"),
    "inspect": ("arrays, shardings and chunk checksums of a step", "jaxckpt.cli.listing", "add_inspect_arguments"),
    "doctor": ("preflight of this node: node identity, agent directory, shared memory vs the budget, ports",
               "jaxckpt.cli.doctor", "add_arguments"),
    "advise": ("the snapshot interval that minimises expected lost time (Young/Daly), from measured costs",
               "jaxckpt.cli.advise", "add_arguments"),
    "chaos": ("seeded fault injection over a multi-process job on simulated nodes: every restore checked bit for "
              "bit", "jaxckpt.tools.chaos.cli", "add_arguments"),
}
BENCHES: dict[str, str] = {
    "save": "save-call and snapshot time vs state size and leaf count, vs Orbax",
    "stall": "step-time cost of a snapshot every step, vs Orbax",
    "torch": "torch front end save/restore time, vs PyTorch DCP",
    "parity": "XOR parity encode and rebuild throughput vs memcpy",
    "restore": "restore from memory and the node agent, vs Orbax",
    "scaling": "save() and snapshot time vs state size and processes; the commit protocol's cost per step",
    "memory": "host memory per node, per store and protection policy",
    "cluster": "protection, restore paths and node-loss recovery on simulated nodes, vs Orbax",
    "agent": "a fresh node agent's start-up (exec -> serving, wall and CPU), vs a bare interpreter",
    "device": "save, restore and a snapshot every step on an accelerator (the default backend), vs Orbax, in one "
              "command",
    "all": "every benchmark, then BENCHMARKS.md sections and plots",
}
BENCH_MODULES = {"torch": "torch_dcp", "agent": "agent_start"}


def _wanted(argv: Sequence[str] | None, names: Sequence[str]) -> set[str]:
    """The subcommands whose arguments must be defined to parse ``argv`` (all of them when argv is None)."""
    if argv is None:
        return set(names)
    return {a for a in argv if a in names}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The full parser, or, given ``argv``, one whose subcommand modules are imported only for what argv names."""
    p = argparse.ArgumentParser(prog="jaxckpt", description="In-memory asynchronous checkpointing for JAX/torch.")
    p.add_argument("--version", action="version", version=f"jaxckpt {jaxckpt.__version__}")
    p.add_argument("--log-level", default=os.environ.get("JAXCKPT_LOG_LEVEL", "INFO"))
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    bench = sub.add_parser("bench", help="run a benchmark")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    wanted_bench = _wanted(argv, list(BENCHES)) if (argv is None or "bench" in argv) else set()
    for name, text in BENCHES.items():
        bp = bsub.add_parser(name, help=text)
        if name in wanted_bench:
            module = importlib.import_module(f"jaxckpt.tools.bench.{BENCH_MODULES.get(name, name)}")
            module.add_arguments(bp)
    wanted = _wanted(argv, list(COMMANDS))
    for name, (text, module_name, fn) in COMMANDS.items():
        sp = sub.add_parser(name, help=text)
        if name in wanted:
            getattr(importlib.import_module(module_name), fn)(sp)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command is None or not hasattr(args, "run"):
        build_parser([]).print_help()
        return 2
    return int(args.run(args) or 0)
