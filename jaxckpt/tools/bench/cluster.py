"""``jaxckpt bench cluster``: protection, every restore path and recovery after a node loss, on simulated nodes.

One run, one state, ``--nodes`` simulated nodes of ``--procs-per-node`` JAX processes (loopback, gloo), a node
agent per node (``store="shm"``). The state (``--size``, float32 arrays, half data-parallel: split within a
process and replicated over the nodes; half fully sharded over every device) is made, trained and checked by
:mod:`jaxckpt.tools.bench.cluster_phases`. In order:

1. **save** (one job): per protection policy (none, parity, replica, xor-group when there are 3 nodes or more,
   hybrid), each with its own agents: the save() call, a loop of a jitted step without and then with a save every
   step (the step-overhead ratio), the time from a step's commit until it is protected and the bytes the nodes
   pulled from each other for it (the plan's ``sent_bytes``) over that time, the pages the node agent's segments
   take in /dev/shm next to the plan's data and extra bytes (``jaxckpt.protection.plan``). Then Orbax, same state:
   ``StandardSave`` to a directory on disk and the emergency CheckpointManager's local saves (RAM disk);
2. **resharded** (a job of 2 processes on another mesh): restore from the saving job's agents;
3. **local** (all trainers restarted, agents alive): restore; Orbax ``StandardRestore`` from disk (page cache
   dropped first); then training resumes with a save every step, a persist every ``--persist-interval`` steps;
4. **recovery**, ``--recoveries`` times: once a persisted step and a newer protected one exist, a whole node is
   SIGKILLed (trainers and agent, its memory removed) and the job with it; the relaunched job restores from the
   other nodes' agents (lost chunks rebuilt from parity or copies), trains one step and goes on; later a node is
   lost again with every agent's memory, and the relaunched job restores from the persistent tier. Recovery time
   = from the SIGKILL (driver's clock) to the end of the first step trained after the restore (the processes'
   clocks, same machine), relaunch and compilation included;
5. the last job also restores Orbax's emergency checkpoint (its local directories were left intact), or records
   the exception that stops it.

Every restore is checked bit for bit once. The driver never imports jax; every process is reaped and every agent
stopped (its memory freed) at the end, whatever happens.

``--launcher srun`` starts every process through ``srun`` instead, as a step on a node of a SLURM allocation (the
one it runs in, else an emulated cluster it starts: :class:`jaxckpt.testing.slurm.Allocation`); the agents are
then the trainers' own steps (``backends/agent/lifetime.py``) and a lost node's processes die by SLURM's step
kill. ``--launcher both`` runs the whole benchmark with each launcher in turn and reports their restore and
recovery figures side by side (:mod:`jaxckpt.tools.bench.cluster_launchers`, section ``cluster-launchers``).
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
import uuid
from typing import Any, Callable, Mapping

from jaxckpt.backends.agent import capacity
from jaxckpt.tools.bench import report, runner
from jaxckpt.tools.bytecode import byte_compile
from jaxckpt.tools.bench.cluster_report import aggregate, render
from jaxckpt.tools.bench.save import parse_size

log = logging.getLogger("jaxckpt.tools.bench")

FULL = {"size": "512M", "nodes": 4, "procs_per_node": 1, "devices_per_proc": 2, "arrays": 8, "warmup": 2,
        "steps": 8, "repeats": 3, "recoveries": 2, "persist_interval": 4, "probe_size": "256M"}
QUICK = {"size": "32M", "nodes": 4, "procs_per_node": 1, "devices_per_proc": 2, "arrays": 8, "warmup": 1,
         "steps": 3, "repeats": 2, "recoveries": 1, "persist_interval": 2, "probe_size": "256M"}
KEEP_POLICY = "hybrid"  # the policy whose agents the restore and recovery phases use
RESHARD_PROCS = 2
MAX_TRAIN_STEPS = 10_000
MEMORY_MARGIN = 2 << 30
FLOORS = {"parity_extra_tolerance": 0.10}  # issue 5: parity within 10% of 1/(R-1) extra
LAUNCHERS = ("own", "srun", "both")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``jaxckpt bench cluster``."""
    for flag, key, what in (("--size", "size", "total state size, K/M/G binary"),
                            ("--arrays", "arrays", "float32 arrays the state is cut into, half data-parallel and "
                                                   "half fully sharded (at least 8 rows each)"),
                            ("--nodes", "nodes", "simulated nodes"),
                            ("--procs-per-node", "procs_per_node", "JAX processes per node"),
                            ("--steps", "steps", "timed steps with and without saves, per policy"),
                            ("--repeats", "repeats", "repeats of every save, protection and restore figure"),
                            ("--recoveries", "recoveries", "node-loss cycles (each: from peers, then persistent)"),
                            ("--persist-interval", "persist_interval", "steps between persists while training"),
                            ("--probe-size", "probe_size", "bytes of the loopback TCP and memory copy probes, "
                                                           "K/M/G binary")):
        p.add_argument(flag, default=None, type=str if key.endswith("size") else int,
                       help=f"{what} (default {FULL[key]}, --quick {QUICK[key]})")
    p.add_argument("--late-agent", action="store_true",
                   help="relaunched trainers leave the node agent to their Checkpointer() (as before "
                        "jaxckpt.start_agent()) instead of starting it before they import JAX")
    p.add_argument("--restore-collective", action="store_true",
                   help="restores form replicated arrays with the collective (Config.restore_collective)")
    p.add_argument("--replicas", default=None, choices=("split", "whole"),
                   help="Config.replicas of every job (default: Config's): split (1/R per replica) or whole (a "
                        "whole copy of the replicated arrays on every node)")
    p.add_argument("--launcher", default=None, choices=LAUNCHERS,
                   help="own: jaxckpt's launcher (default); srun: every process an srun step on a node of a SLURM "
                        "allocation (this one, else an emulated cluster: needs root and slurm-wlm); both: each in "
                        "turn, side by side")
    p.add_argument("--plain-dir", default=None,
                   help="the disk directory for Orbax and the persistent tier (default: the temp directory)")
    p.add_argument("--shm-root", default=None,
                   help="the memory filesystem the node agents' directories are made in (Config.shm_root; default "
                        "$JAXCKPT_SHM_ROOT, else /dev/shm), e.g. a tmpfs mounted with huge=within_size")
    runner.output_arguments(p, "cluster", "a small state, one recovery cycle: about a minute, for CI", timeout=1800.0)
    p.set_defaults(run=run)


def options(args: argparse.Namespace) -> dict[str, Any]:
    """Effective settings: explicit flags over the --quick or full defaults; ValueError for impossible ones."""
    out = dict(QUICK if args.quick else FULL)
    for k in ("size", "arrays", "nodes", "procs_per_node", "steps", "repeats", "recoveries", "persist_interval",
              "probe_size"):
        if getattr(args, k, None) is not None:
            out[k] = getattr(args, k)
    out["size"] = parse_size(str(out["size"]))
    out["probe_size"] = parse_size(str(out["probe_size"]))
    out["plain_dir"] = args.plain_dir or tempfile.gettempdir()
    out["shm_root"] = report.agent_root(getattr(args, "shm_root", None) or "")
    out["restore_collective"] = bool(getattr(args, "restore_collective", False))
    out["late_agent"] = bool(getattr(args, "late_agent", False))
    from jaxckpt.config import Config
    out["replicas"] = getattr(args, "replicas", None) or Config().replicas
    out["launcher"] = getattr(args, "launcher", None) or "own"
    if out["nodes"] < 2 or out["procs_per_node"] < 1:
        raise ValueError(f"bench cluster needs at least 2 nodes (got {out['nodes']}) and 1 process per node")
    for k in ("arrays", "steps", "repeats", "recoveries", "persist_interval"):
        if out[k] < 1:
            raise ValueError(f"bench cluster: --{k.replace('_', '-')} must be at least 1 (got {out[k]})")
    for k in ("plain_dir", "shm_root"):
        if not os.path.isdir(out[k]):
            raise ValueError(f"bench cluster: --{k.replace('_', '-')} {out[k]} is not a directory")
    return out


def _default_replicas() -> str:
    from jaxckpt.config import Config
    return Config().replicas


def command(args: argparse.Namespace) -> str:
    """The command line that repeats this run."""
    line = runner.command_line("cluster", args, tuple((f"--{k.replace('_', '-')}", k) for k in (
        "size", "arrays", "nodes", "procs_per_node", "steps", "repeats", "recoveries", "persist_interval",
        "probe_size", "launcher", "plain_dir", "shm_root")))
    if getattr(args, "replicas", None):
        line += f" --replicas {args.replicas}"
    if getattr(args, "late_agent", False):
        line += " --late-agent"
    return line + " --restore-collective" if getattr(args, "restore_collective", False) else line


def run(args: argparse.Namespace) -> int:
    """``jaxckpt bench cluster``: measure (or render ``--from-json``), write JSON, print and update the section."""
    from jaxckpt.tools.bench import cluster_launchers
    if (getattr(args, "launcher", None) or "own") == "both":
        return runner.run(args, "cluster-launchers", options,
                          lambda a, o: cluster_launchers.measure(o, command(a), quick=a.quick, timeout=a.timeout,
                                                                 measure_one=measure),
                          cluster_launchers.render)
    return runner.run(args, "cluster", options,
                      lambda a, o: measure(o, command(a), quick=a.quick, timeout=a.timeout), render)


# ------------------------------------------------------------------------------------------------- the driver
def measure(opts: Mapping[str, Any], cmd: str, *, quick: bool, timeout: float) -> dict[str, Any]:
    """All phases in order (module docstring), with the launcher ``opts["launcher"]`` (own or srun)."""
    if opts["launcher"] == "own":
        return _measure(opts, cmd, quick=quick, timeout=timeout, prefix=None)
    from jaxckpt.testing.slurm import Allocation
    root = tempfile.mkdtemp(prefix="jaxckpt-bench-slurm-")
    try:
        alloc = Allocation(max(opts["nodes"], RESHARD_PROCS), root)
        try:
            log.info("bench cluster: through srun, SLURM job %s on nodes %s", alloc.job, ",".join(alloc.nodes))
            out = _measure(opts, cmd, quick=quick, timeout=timeout, prefix=alloc.prefix)
            out["setup"]["launcher"] = {"name": "srun", "slurm_job": alloc.job, "slurm_nodes": alloc.nodes,
                                        "emulated": alloc.cluster is not None}
            return out
        finally:
            alloc.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _measure(opts: Mapping[str, Any], cmd: str, *, quick: bool, timeout: float,
             prefix: Callable[[int], list[str]] | None) -> dict[str, Any]:
    from jaxckpt.tools.bench.cluster_phases import state_bytes
    from jaxckpt.testing import expect_ok, launch

    machine = report.machine_facts()
    procs = opts["nodes"] * opts["procs_per_node"]
    devices = opts["devices_per_proc"] if opts["procs_per_node"] == 1 else 1
    policies = ["none", "parity", "replica"] + (["xor-group"] if opts["nodes"] >= 3 else []) + [KEEP_POLICY]
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    base = os.path.join(opts["shm_root"], f"jaxckpt-bench-cluster-{tag}")
    shm = capacity.shm_capacity(opts["shm_root"])
    disk = tempfile.mkdtemp(prefix="jaxckpt-bench-cluster-", dir=opts["plain_dir"])
    spec: dict[str, Any] = {
        "base": base, "job": f"bc-{tag}", "size": opts["size"], "arrays": opts["arrays"],
        "mesh": [procs, devices], "reshard_mesh": [RESHARD_PROCS, devices], "policies": policies,
        "keep_policy": KEEP_POLICY, "warmup": opts["warmup"], "steps": opts["steps"], "repeats": opts["repeats"],
        "results": os.path.join(disk, "results"), "persistent_dir": os.path.join(disk, "persistent"),
        "persist_interval": opts["persist_interval"], "orbax_std": os.path.join(disk, "orbax-standard"),
        "orbax_em_persistent": os.path.join(disk, "orbax-emergency-persistent"), "max_train_steps": MAX_TRAIN_STEPS,
        "settle_steps": 2 * opts["persist_interval"],
        "cycle": 0, "last": False, "restore_collective": opts["restore_collective"],
        "late_agent": opts.get("late_agent", False),
        "replicas": opts.get("replicas") or _default_replicas()}
    size = state_bytes(spec)
    # Measured peak about (procs + 12) x state: the replicated half on every process (and a restored copy), the
    # agents' slots and protection, Orbax's local checkpoints on RAM disk (whole state and half), persist copies.
    need = size * (procs + 12) + MEMORY_MARGIN
    avail = report.available_memory_bytes()
    if need > avail:
        raise RuntimeError(f"bench cluster: a {report.fmt_size(size)} state needs about {report.fmt_size(need)} of "
                           f"host memory, {report.fmt_size(avail)} available (use --size)")
    for d in ("results", "persistent_dir", "orbax_std", "orbax_em_persistent"):
        os.makedirs(spec[d], exist_ok=True)
    for subset in ("dp", "all"):
        os.makedirs(os.path.join(spec["orbax_em_persistent"], subset))
    os.makedirs(base, mode=0o700)
    layout = dict(nodes=opts["nodes"], procs_per_node=opts["procs_per_node"], devices_per_proc=devices)
    env = {"JAXCKPT_LOG_LEVEL": "WARNING"}
    bytecode = byte_compile()  # as installing the package does (jaxckpt/tools/bytecode.py says why)
    recoveries: list[dict[str, Any]] = []
    job = None
    t_start = time.perf_counter()
    from jaxckpt.tools.bench.loopback import probe
    loopback = probe(opts["probe_size"])  # the bandwidth the host transport could have on this machine
    from jaxckpt.tools.bench.memcpy import memcpy_gbps
    # one thread's memory copy (a median, as every bench reports it): the floor of a restore from local memory
    memcpy = report.summarize(memcpy_gbps(opts["probe_size"], 5))["median"]
    log.info("bench cluster: loopback raw TCP %.2f GB/s, peer transport %.2f GB/s", loopback["tcp"]["gbps"],
             loopback["transport"]["gbps"])
    try:
        log.info("bench cluster: %s state on %d nodes x %d processes: saves, policies %s", report.fmt_size(size),
                 opts["nodes"], opts["procs_per_node"], ", ".join(policies))
        expect_ok(launch(_phases().save_phase, **layout, args=(spec,), env=env, timeout=timeout, prefix=prefix))
        saved = _read(spec, "save", procs)
        spec["orbax_std_step"] = saved[0]["orbax"]["standard"]["step"]
        spec["orbax_em_step"] = saved[0]["orbax"]["emergency"].get("step", 0)
        spec["orbax_em_dp_step"] = saved[0]["orbax"]["emergency_dp"].get("step", 0)
        log.info("bench cluster: resharded restore on %d processes", RESHARD_PROCS)
        expect_ok(launch(_phases().reshard_phase, nodes=RESHARD_PROCS, procs_per_node=1, devices_per_proc=devices,
                         args=(spec,), env=env, timeout=timeout, prefix=prefix))
        log.info("bench cluster: local restore, then training until a node is lost")
        job = _start(_phases().local_phase, layout, spec, env, prefix)
        role = "local"
        for cycle in range(opts["recoveries"]):
            for kind in ("peers", "persistent"):
                _wait_ready(job, spec, role, procs, timeout)
                lost = 1 + (2 * cycle + (kind == "persistent")) % (opts["nodes"] - 1)
                event = _lose_node(job, spec, role, lost, opts["nodes"], wipe_all=kind == "persistent")
                job = None
                spec.update(cycle=cycle, last=cycle == opts["recoveries"] - 1 and kind == "persistent")
                log.info("bench cluster: node %d lost at step %d; relaunch, restore from %s", lost, event["step"], kind)
                phase = _phases().peer_phase if kind == "peers" else _phases().persist_phase
                job = _start(phase, layout, spec, env, prefix)
                recoveries.append({"kind": kind, "cycle": cycle, "lost_node": lost, **event})
                role = f"{kind}{cycle}"
        job.wait(timeout)
        job.close()
        final = job.results()
        job = None
        try:
            results = {"save": saved, "reshard": _read(spec, "reshard", RESHARD_PROCS),
                       "local": _read(spec, "local", procs),
                       "recovered": {f"{r['kind']}{r['cycle']}": _read(spec, f"{r['kind']}{r['cycle']}", procs)
                                     for r in recoveries},
                       "emergency": _read(spec, "emergency", procs, missing_ok=True),
                       "emergency_dp": _read(spec, "emergency_dp", procs, missing_ok=True)}
        except RuntimeError:
            expect_ok(final)  # the processes' own errors say more than a missing file
            raise
        if not any("error" in e for e in results["emergency"] + results["emergency_dp"]):
            expect_ok(final)  # Orbax's failure ends the last job; anything else is a failure of this run
    finally:
        if job is not None:
            job.close()
        _cleanup(base, disk, policies, opts["nodes"])
    out = aggregate(results, recoveries, spec)
    return {"bench": "cluster", "mode": "quick" if quick else "full", "machine": machine, "date": report.now_utc(),
            "command": cmd, "loopback": loopback, "memcpy_gbps": memcpy,
            "setup": {"nodes": opts["nodes"], "procs_per_node": opts["procs_per_node"], "devices_per_proc": devices,
                      "mesh": spec["mesh"], "reshard_mesh": spec["reshard_mesh"], "arrays": opts["arrays"],
                      "replicas": spec["replicas"], "late_agent": spec["late_agent"],
                      "state_bytes": size, "policies": policies, "keep_policy": KEEP_POLICY,
                      "warmup": opts["warmup"], "steps": opts["steps"], "repeats": opts["repeats"],
                      "recoveries": opts["recoveries"], "persist_interval": opts["persist_interval"],
                      "probe_bytes": opts["probe_size"],
                      "plain_dir": opts["plain_dir"], "plain_fs": report.fs_type(opts["plain_dir"]),
                      "shm": f"{opts['shm_root']} ({shm.fstype or 'unknown'}"
                             + (f", huge pages {shm.huge})" if shm.huge else ")"),
                      "floors": dict(FLOORS), "bytecode": bytecode, "wall_seconds": time.perf_counter() - t_start},
            **out}


def _phases() -> Any:
    from jaxckpt.tools.bench import cluster_phases
    return cluster_phases


def _start(fn: Any, layout: Mapping[str, int], spec: Mapping[str, Any], env: dict[str, str],
           prefix: Callable[[int], list[str]] | None) -> Any:
    from jaxckpt.testing import start
    before = None if spec.get("late_agent") else _phases().start_agent
    return start(fn, **layout, args=(dict(spec),), env=env, fail_fast_grace=5.0, prefix=prefix, before=before)


def _read(spec: Mapping[str, Any], phase: str, procs: int, missing_ok: bool = False) -> list[dict[str, Any]]:
    out = []
    for p in range(procs):
        path = os.path.join(spec["results"], f"{phase}-p{p}.json")
        if not os.path.exists(path):
            if missing_ok:
                continue
            raise RuntimeError(f"bench cluster: process {p} wrote no {phase} result ({path})")
        out.append(report.read_json(path))
    return out


def _wait_ready(job: Any, spec: Mapping[str, Any], role: str, procs: int, timeout: float) -> None:
    """Until every process of the training job ``role`` says a persisted and a newer protected step exist."""
    from jaxckpt.errors import LaunchError
    from jaxckpt.testing import expect_ok
    deadline = time.monotonic() + timeout
    names = [os.path.join(spec["results"], f"ready-{role}-p{p}") for p in range(procs)]
    while not all(os.path.exists(n) for n in names):
        if any(c is not None for c in job.poll()) or time.monotonic() > deadline:
            job.close()
            expect_ok(job.results())
            raise LaunchError(f"bench cluster: the {role} job never had a persisted and a protected step")
        time.sleep(0.01)


def _node_dir(spec: Mapping[str, Any], node: int) -> str:
    return f"{spec['base']}/{KEEP_POLICY}-node{node}"


def _lose_node(job: Any, spec: Mapping[str, Any], role: str, node: int, nodes: int, *, wipe_all: bool
               ) -> dict[str, Any]:
    """SIGKILL ``node`` (trainers and agent, its memory removed), then the rest of the job, as a restart would;
    with ``wipe_all`` every node's memory goes (the restart finds only the persistent tier)."""
    from jaxckpt.backends.agent import protocol as proto
    from jaxckpt.tools.bench.restore import drop_cache, sync_tree
    t_kill = time.time()
    job.kill_node(node)
    for n in [node] + ([m for m in range(nodes) if m != node] if wipe_all else []):
        proto.kill_agent(_node_dir(spec, n), remove_memory=True)
        shutil.rmtree(_node_dir(spec, n), ignore_errors=True)
    for n in range(nodes):
        if n != node:
            job.kill_node(n)
    job.close()
    progress = report.read_json(os.path.join(spec["results"], f"progress-{role}"))
    if wipe_all:  # the next job reads the persistent tier from the disk, not from the page cache
        sync_tree(spec["persistent_dir"])
        drop_cache(spec["persistent_dir"])
    return {"t_kill": t_kill, "step": progress["step"], "newest_protected": progress["protected"],
            "newest_persisted": progress["persisted"]}


def _cleanup(base: str, disk: str, policies: list[str], nodes: int) -> None:
    from jaxckpt.testing import remove_agents
    try:
        remove_agents(base, also=[f"{base}/{p}-node{n}" for p in policies for n in range(nodes)])
    except RuntimeError as e:  # agents that would not stop: say so, the run's results stand
        log.warning("bench cluster: %s", e)
    shutil.rmtree(disk, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxckpt.tools.bench.cluster``: the same options as ``jaxckpt bench cluster``."""
    return runner.main("jaxckpt.tools.bench.cluster", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
