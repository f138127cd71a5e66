"""``jaxckpt doctor``: preflight of a node before a job, as the job's processes would see it.

It reports the scheduler detected, this node's identity and where it came from (``jaxckpt.node_identity``), the
job's agent directory and whether an agent serves it, the shared-memory filesystem's size and free bytes against
the memory budget of the node's processes, the ports the job uses, and memory left by ended SLURM allocations.
Problems (a budget the filesystem cannot hold) make it exit 1; warnings (a setting that works but loses what a
user expects, such as Kubernetes without ``K8S_NODE_NAME``) do not. ``--sweep`` removes the memory of ended
allocations; ``--json`` prints the report as one JSON document.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from jaxckpt.config import Config, peer_uses_curve
from jaxckpt.errors import ConfigError, JaxckptError

SMALL_SHM = 1 << 30  # without a budget, a shared-memory filesystem smaller than this is worth a warning


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``jaxckpt doctor [--config FILE] [--job ID] [--sweep] [--json]``."""
    p.add_argument("--config", default="", help="a TOML config (Config.from_file); default Config() with JAXCKPT_*")
    p.add_argument("--job", default="", help="job id (Config.job_id) to check, over the config's")
    p.add_argument("--sweep", action="store_true",
                   help="remove this user's agent directories left by ended SLURM allocations (no agent serving)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run)


def report(config: Config, *, sweep: bool = False) -> dict[str, Any]:
    """The preflight report of this process's node for ``config`` (see the module docstring)."""
    from jaxckpt.backends.agent import capacity, lifetime
    from jaxckpt.backends.agent.protocol import SOCKET_NAME, agent_dir, pid_alive, read_pid_file, shm_base
    from jaxckpt.node_identity import (ENV_K8S, ENV_K8S_NODE, allocation, detect_scheduler, local_process_count,
                                       node_identity, parse_agent_dir_name, torchrun_store_hazard)

    problems: list[str] = []
    warnings: list[str] = []
    sched = detect_scheduler()
    ident = node_identity(config)
    procs = local_process_count()
    directory = agent_dir(config)
    out: dict[str, Any] = {
        "scheduler": {"name": sched.name, "job": sched.job, **dict(sched.details)},
        "node": {"name": ident.name, "source": ident.source},
        "processes_on_node": procs, "job_id": config.job_id, "store": config.store,
        "agent": {"directory": directory, "default": not config.shm_dir, "socket": os.path.join(directory,
                                                                                              SOCKET_NAME)}}
    pid = read_pid_file(directory) if os.path.isdir(directory) else None
    out["agent"]["running"] = bool(pid and pid_alive(pid[0]))
    if pid and out["agent"]["running"]:
        out["agent"].update(pid=pid[0], generation=pid[1])
    # The agent's answer, where one serves: a DaemonSet's agent is in another pod (its pid means nothing here).
    status = _agent_status(directory, config.job_id) if os.path.exists(out["agent"]["socket"]) else None
    if status is not None and not out["agent"]["running"]:
        out["agent"].update(running=True, pid=status.get("pid"), generation=status.get("generation"))
    if os.environ.get(ENV_K8S) and not os.environ.get(ENV_K8S_NODE) and not config.node_name:
        warnings.append(f"Kubernetes without {ENV_K8S_NODE}: the node is the pod's host name, so two pods on one "
                        f"machine count as two nodes and protection may keep a node's redundancy on that machine; "
                        f"set {ENV_K8S_NODE} from spec.nodeName through the downward API (docs/deploy.md)")
    hazard = torchrun_store_hazard()
    if hazard:
        warnings.append(hazard)
    if sched.name == "slurm" and not out["agent"]["running"]:
        # With srun at hand a trainer spawns the agent as a step of its own, which usually outlives the trainers'
        # step and hears of the allocation's end (backends/agent/lifetime.py); not always: SLURM SIGKILLs it where
        # the srun that started it dies with the trainers' step on a node that finished first.
        own = lifetime.step_launch() is not None
        out["agent"]["spawn"] = "own step" if own else "trainers' step"
        how = ("the trainers will spawn one as a step of its own, which SLURM sometimes kills with their step (the "
               "srun that started it dies there)" if own else "srun is not on PATH or this is no allocation: the "
               "trainers will spawn one inside their step, which dies with it")
        warnings.append(f"no agent runs for this job on this node: {how}; the memory then stays for the next step's "
                        f"agent, and after the allocation's end until the next agent of the user on the node, "
                        f"jaxckpt doctor --sweep or the Epilog removes it; for memory freed at the allocation's end "
                        f"every time, run the agent as its own step: srun --overlap --ntasks-per-node=1 jaxckpt "
                        f"agent --job {config.job_id} --wait & (docs/deploy.md)")
    if config.store.startswith("shm"):
        unusable = _unusable_dir(directory)
        if unusable:
            problems.append(unusable)
    # Shared memory against the budget of this node's processes (what Checkpointer() checks).
    try:
        cap = capacity.shm_capacity(directory)
        out["shm"] = {"mount": cap.mount, "fstype": cap.fstype, "size": cap.size, "free": cap.free,
                      "held_by_job": capacity.held_bytes(directory), "huge": cap.huge}
        budget = config.memory_budget_bytes
        out["budget"] = {"per_process": budget, "processes": procs or 1, "node": budget * (procs or 1)}
        try:
            capacity.check_budget(directory, budget, procs or 1, ident.name)
        except ConfigError as e:
            problems.append(str(e))
        if not budget and cap.size < SMALL_SHM:
            warnings.append(f"no memory budget (Config.memory_budget_bytes=0): snapshots may take up to the "
                            f"{capacity.fmt_bytes(cap.size)} of {cap.mount or directory}; a larger one fails at its "
                            f"save (set memory_budget_bytes to be told at Checkpointer())")
        if cap.fstype and cap.fstype not in ("tmpfs", "shm", "ramfs"):
            warnings.append(f"{cap.mount} is {cap.fstype}, not a memory filesystem: snapshots go to its disk")
        if config.store.startswith("shm") and cap.fstype == "tmpfs" and cap.huge not in ("always", "within_size"):
            warnings.append(f"{cap.mount} keeps the agent's segments in 4 KiB pages (tmpfs huge={cap.huge}): a "
                            f"relaunched trainer maps its snapshot page by page, 262,144 per GiB; on a tmpfs "
                            f"mounted with huge=within_size, Config.shm_root (JAXCKPT_SHM_ROOT) pointed at it, 512x "
                            f"fewer (docs/deploy.md, \"Huge pages\")")
    except OSError as e:
        problems.append(f"cannot look at the filesystem of {directory}: {e}")
    if config.store.startswith("shm"):
        _memory_cgroup(config, procs or 1, status, out, problems)
    out["ports"] = _ports(config)
    if config.agent_peers and not config.peer_token:
        problems.append("Config.agent_peers is set but no shared peer token (JAXCKPT_PEER_TOKEN): a node agent "
                        "refuses to start with a rendezvous and a token of its own (docs/deploy.md)")
    # Memory of ended SLURM allocations (this user's default directories).
    stale = []
    base = shm_base(config)
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        parsed = parse_agent_dir_name(name)
        if parsed and parsed[0] == os.geteuid() and parsed[2] and parsed[2] != allocation():
            stale.append(name)
    if sweep:
        out["swept"] = lifetime.sweep_ended(base)
    out["other_allocations"] = [n for n in stale if os.path.join(base, n) not in out.get("swept", [])]
    out["problems"], out["warnings"] = problems, warnings
    return out


def _agent_status(directory: str, job: str) -> dict | None:
    """The status reply of the agent serving ``directory`` (``jaxckpt ls``'s), or None where none answers."""
    from jaxckpt.backends.agent.protocol import agent_status
    from jaxckpt.errors import JaxckptError

    try:
        return agent_status(directory, job, timeout_s=5.0)
    except (JaxckptError, OSError):
        return None


def _memory_cgroup(config: Config, procs: int, status: dict | None, out: dict[str, Any],
                   problems: list[str]) -> None:
    """The memory cgroup a node agent's snapshots are charged to, and the node's budget against it (the agent
    refuses saves past its limit). A serving agent says its own in its ``status`` reply: a DaemonSet's agent runs in
    another pod, whose cgroup this process cannot see. Without one, this process's: an agent the trainers spawn
    is charged there (under SLURM in the job's cgroup above their step, which the agent's step shares)."""
    from jaxckpt.backends.agent import cgroup
    from jaxckpt.backends.agent.capacity import fmt_bytes

    agent, held = out["agent"], 0
    if agent["running"]:
        if status is None:
            problems.append(f"the node agent (pid {agent.get('pid')}) at {agent['directory']} does not answer")
            return
        got = status.get("memory_cgroup")
        if got is None:
            return
        path, limit, used, free = got["path"], int(got["limit"]), int(got["used"]), int(got["free"])
        held = int(status.get("held_bytes", 0))  # charged already, and reused by the next saves
        whose, charged = f"the node agent's memory cgroup (pid {agent.get('pid')})", "the agent"
    else:
        limited = cgroup.room()
        if limited is None:
            return
        path, limit, used, free = limited.path, limited.limit, limited.used, limited.free
        whose, charged = "this process's memory cgroup", "an agent it spawns is charged there and"
    out["memory_cgroup"] = {"path": path, "limit": limit, "used": used, "free": free,
                            "of": "agent" if agent["running"] else "this process", "held": held}
    node = config.memory_budget_bytes * procs
    if node > free + held:
        problems.append(f"the node's memory budget, {fmt_bytes(node)} ({procs} process(es) x "
                        f"Config.memory_budget_bytes), does not fit {whose}: limit {fmt_bytes(limit)} at {path}, "
                        f"{fmt_bytes(used)} in use; {charged} refuses saves past the limit: raise the limit (a "
                        f"SLURM job's --mem, the container's) or lower the budget")


def _unusable_dir(directory: str) -> str | None:
    """Why this user's trainers and agent could not use the agent directory ``directory`` (None: they can). One
    that exists must be a directory of this user, mode 0700; one to be made needs a directory above it this user
    may write (a host directory a Kubernetes hostPath made is root's, mode 0755)."""
    from jaxckpt.backends.agent.capacity import nearest_existing
    from jaxckpt.backends.agent.protocol import cannot_make, ensure_private_dir

    if os.path.lexists(directory):
        try:
            ensure_private_dir(directory, create=False)
        except JaxckptError as e:
            return str(e)
        return None
    if os.access(nearest_existing(directory), os.W_OK | os.X_OK):
        return None
    return cannot_make(directory, "permission denied")


def _ports(config: Config) -> dict[str, Any]:
    """The addresses and ports the job uses: peer servers, the JAX coordinator the launcher implies."""
    lo, hi = _ephemeral()
    peers = {"bind": config.peer_bind, "port": f"ephemeral ({lo}-{hi})",
             "security": "CURVE" if peer_uses_curve(config.peer_bind, config.peer_security) else "token"}
    if config.agent_port:  # the node agent's, for the rendezvous (Config.agent_peers)
        peers["port"] = f"{config.agent_port} (node agent), ephemeral ({lo}-{hi}) (trainers)"
    if config.agent_peers:
        peers["rendezvous"] = config.agent_peers
    env = os.environ
    coord: dict[str, Any] = {}
    if env.get("JAXCKPT_COORDINATOR"):
        coord = {"address": env["JAXCKPT_COORDINATOR"], "from": "jaxckpt launch"}
    elif env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        coord = {"address": f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}", "from": "torchrun (torch.distributed)"}
    else:
        try:  # what jax.distributed.initialize() would pick without arguments (JAX's own cluster detection)
            from jax._src import clusters

            for c in clusters.ClusterEnv._cluster_types:
                if not c.opt_in_only_method and c.is_env_present():
                    coord = {"address": c.get_coordinator_address(None, env.get("JAX_COORDINATOR_PORT")),
                             "from": f"JAX's {c.name} detection"}
                    break
        except Exception as e:  # noqa: BLE001 - jax absent or its internals moved: say so, nothing else depends on it
            coord = {"address": "", "from": f"unknown ({type(e).__name__})"}
    return {"peers": peers, "coordinator": coord}


def _ephemeral() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 0, 0


def render(r: dict[str, Any]) -> str:
    """The report as text lines."""
    from jaxckpt.backends.agent.capacity import fmt_bytes

    s = r["scheduler"]
    extra = "; ".join(f"{k} {v}" for k, v in s.items() if k not in ("name", "job") and v)
    lines = [f"scheduler      {s['name']}" + (f" (job {s['job']}" + (f"; {extra}" if extra else "") + ")"
                                               if s["job"] else (f" ({extra})" if extra else "")),
             f"node           {r['node']['name']}  (from {r['node']['source']})",
             f"processes      {r['processes_on_node'] or 'unknown (1 assumed)'} on this node",
             f"job id         {r['job_id']}  (store {r['store']})"]
    a = r["agent"]
    state = f"agent running: pid {a['pid']}, generation {a['generation']}" if a["running"] else "no agent running"
    if a.get("spawn") == "own step":
        state += "; the trainers spawn it as a step of its own (srun --overlap)"
    lines.append(f"agent dir      {a['directory']}  ({'default' if a['default'] else 'Config.shm_dir'}; {state})")
    if "shm" in r:
        m, b = r["shm"], r["budget"]
        kind = m["fstype"] + (f", huge pages {m['huge']}" if m.get("huge") else "")
        lines.append(f"shared memory  {m['mount']} ({kind}): {fmt_bytes(m['size'])}, {fmt_bytes(m['free'])} "
                     f"free, {fmt_bytes(m['held_by_job'])} held by this job's agent")
        lines.append("budget         " + (f"{fmt_bytes(b['per_process'])} x {b['processes']} process(es) = "
                                          f"{fmt_bytes(b['node'])}" if b["per_process"] else
                                          "none (Config.memory_budget_bytes=0)"))
    if "memory_cgroup" in r:
        g = r["memory_cgroup"]
        whose = " (the node agent's)" if g["of"] == "agent" else ""
        held = f" ({fmt_bytes(g['held'])} of it snapshots held)" if g["held"] else ""
        lines.append(f"memory cgroup  {g['path']}{whose}: limit {fmt_bytes(g['limit'])}, {fmt_bytes(g['used'])} in "
                     f"use{held} (file cache not counted), {fmt_bytes(g['free'])} more for snapshots")
    p = r["ports"]
    lines.append(f"peers          bind {p['peers']['bind']}, port {p['peers']['port']}, {p['peers']['security']}")
    if p["peers"].get("rendezvous"):
        lines.append(f"rendezvous     {p['peers']['rendezvous']}")
    c = p["coordinator"]
    lines.append(f"coordinator    {c.get('address') or 'none'}" + (f"  ({c['from']})" if c.get("from") else ""))
    if r.get("swept"):
        lines.append(f"swept          {', '.join(r['swept'])}")
    if r["other_allocations"]:
        lines.append(f"other memory   {', '.join(r['other_allocations'])} (other SLURM allocations of this user; "
                     f"--sweep removes those that ended)")
    for w in r["warnings"]:
        lines.append(f"WARNING        {w}")
    for e in r["problems"]:
        lines.append(f"PROBLEM        {e}")
    lines.append("ok" if not r["problems"] else f"{len(r['problems'])} problem(s)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """``jaxckpt doctor``: print the report; 1 if it found a problem, 2 if the config itself is bad."""
    try:
        config = Config.from_file(args.config) if args.config else Config().with_env()
        if args.job:
            config = config.replace(job_id=args.job)
    except JaxckptError as e:
        print(f"jaxckpt doctor: {e}", file=sys.stderr)
        return 2
    try:
        r = report(config, sweep=args.sweep)
    except ConfigError as e:  # e.g. a Config.shm_root that is not there
        print(f"jaxckpt doctor: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r, indent=1, sort_keys=True) if args.json else render(r))
    return 1 if r["problems"] else 0
