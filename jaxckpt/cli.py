"""The ``jaxckpt`` command: subcommands register here (bench, and later agent, ls, inspect, launch, chaos)."""
from __future__ import annotations

import argparse
import logging
import os
import sys

import jaxckpt


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxckpt", description="In-memory asynchronous checkpointing for JAX/torch.")
    p.add_argument("--version", action="version", version=f"jaxckpt {jaxckpt.__version__}")
    p.add_argument("--log-level", default=os.environ.get("JAXCKPT_LOG_LEVEL", "INFO"))
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    bench = sub.add_parser("bench", help="run a benchmark")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    from jaxckpt.bench import save as bench_save
    bench_save.add_arguments(bsub.add_parser("save", help="save-call and snapshot time vs state size, vs Orbax"))
    from jaxckpt.bench import stall as bench_stall
    bench_stall.add_arguments(bsub.add_parser("stall", help="step-time cost of a snapshot every step, vs Orbax"))
    from jaxckpt.bench import torch_dcp as bench_torch
    bench_torch.add_arguments(bsub.add_parser("torch", help="torch front end save/restore time, vs PyTorch DCP"))
    from jaxckpt.bench import parity as bench_parity
    bench_parity.add_arguments(bsub.add_parser("parity", help="XOR parity encode and rebuild throughput vs memcpy"))
    from jaxckpt.bench import restore as bench_restore
    bench_restore.add_arguments(bsub.add_parser("restore", help="restore from memory and the node agent, vs Orbax"))
    from jaxckpt.bench import scaling as bench_scaling
    bench_scaling.add_arguments(bsub.add_parser("scaling", help="save() and snapshot time vs state size and processes"))
    from jaxckpt.bench import memory as bench_memory
    bench_memory.add_arguments(bsub.add_parser("memory", help="host memory per node, per store and protection policy"))
    from jaxckpt.bench import cluster as bench_cluster
    bench_cluster.add_arguments(bsub.add_parser("cluster", help="protection, restore paths and node-loss recovery "
                                                                "on simulated nodes, vs Orbax"))
    from jaxckpt.bench import all as bench_all
    bench_all.add_arguments(bsub.add_parser("all", help="every benchmark, then BENCHMARKS.md sections and plots"))
    from jaxckpt.testing import launcher
    launcher.add_arguments(sub.add_parser("launch", help="run a command in N JAX processes grouped into nodes"))
    from jaxckpt.backends import agent
    agent.add_arguments(sub.add_parser("agent", help="run the node agent holding a job's snapshots in shared memory"))
    from jaxckpt import listing
    listing.add_ls_arguments(sub.add_parser("ls", help="steps held by a node agent, per process, with bytes and age"))
    listing.add_inspect_arguments(sub.add_parser("inspect", help="arrays, shardings and chunk checksums of a step"))
    from jaxckpt import chaos
    chaos.add_arguments(sub.add_parser("chaos", help="seeded fault injection over a multi-process job on simulated "
                                                     "nodes: every restore checked bit for bit"))
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command is None:
        build_parser().print_help()
        return 2
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
