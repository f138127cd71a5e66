"""What a node is: the failure domain this process runs in, as the scheduler that started it names it.

A node is what fails as one: the machine with its memory. Its agent, its shared memory and the placement of
protection all follow one name, found here once per process (:func:`node_identity`), in this order:

1. ``Config.node_name`` (or ``JAXCKPT_NODE_NAME``): set by hand, or by ``jaxckpt launch`` for its simulated nodes;
2. ``K8S_NODE_NAME``: on Kubernetes, the pod spec puts the node's name there through the downward API
   (``valueFrom: fieldRef: fieldPath: spec.nodeName``; docs/deploy.md). Two pods of a job on one machine then
   share a failure domain, whatever their agents;
3. ``SLURMD_NODENAME``: under SLURM, the node the step runs on (several ``slurmd -N`` on one host are several
   nodes, as on a cluster that runs them so);
4. the host name.

The scheduler (:func:`detect_scheduler`) is reported beside it by ``jaxckpt doctor``; under SLURM its job id
also scopes the default agent directory (:func:`agent_dir_name`), so two allocations of one user on a shared
node never meet, and the end of one frees only its own memory.

This module sits just above ``jaxckpt.config`` and ``jaxckpt.errors``: it imports nothing else of jaxckpt. The
names of the variables jaxckpt's own launcher (``jaxckpt.tools.node``) sets live in ``jaxckpt.config``, whose
environment reader must know they are not fields.
"""
from __future__ import annotations

import hashlib
import os
import re
import socket
from dataclasses import dataclass
from typing import Mapping

from jaxckpt.config import ENV_LAUNCH_DIR, ENV_NODE, ENV_PROCS_PER_NODE, Config

# The schedulers' variables jaxckpt reads (one place: nothing else names them).
ENV_K8S_NODE = "K8S_NODE_NAME"  # ours, documented: the pod spec fills it from spec.nodeName
ENV_K8S = "KUBERNETES_SERVICE_HOST"  # set in every pod by the kubelet
ENV_SLURM_NODE = "SLURMD_NODENAME"
ENV_SLURM_JOB = "SLURM_JOB_ID"
ENV_SLURM_STEP = "SLURM_STEP_ID"
ENV_SLURM_NODELIST = "SLURM_JOB_NODELIST"
ENV_SLURM_TASKS_PER_NODE = "SLURM_STEP_TASKS_PER_NODE"  # "2(x3),1": tasks of this step on each of its nodes
ENV_SLURM_NODEID = "SLURM_NODEID"
ENV_TORCHRUN = "TORCHELASTIC_RUN_ID"
ENV_TORCHRUN_LOCAL = "LOCAL_WORLD_SIZE"
ENV_OMPI_LOCAL = "OMPI_COMM_WORLD_LOCAL_SIZE"
ENV_TORCHRUN_RESTART = "TORCHELASTIC_RESTART_COUNT"
ENV_TORCHRUN_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
ENV_TORCHRUN_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"  # "True": workers share torchrun's rendezvous store
ENV_TORCH_UNSHARE_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # torch's opt-out: a fresh store per round
ENV_OMPI_RANK = "OMPI_COMM_WORLD_RANK"
ENV_OMPI_URI = "OMPI_MCA_orte_hnp_uri"
# MPICH's and Intel MPI's launcher (Hydra: mpiexec / mpirun of either) sets these for each rank.
ENV_PMI_RANK = "PMI_RANK"
ENV_PMI_SIZE = "PMI_SIZE"
ENV_HYDRA_LOCAL = "MPI_LOCALNRANKS"

_DIR_PART = 48  # at most this much of a node name goes into a directory name as it is
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class NodeIdentity:
    """This process's node: ``name`` and where it came from (``source``, for ``jaxckpt doctor`` and logs)."""

    name: str
    source: str


@dataclass(frozen=True)
class Scheduler:
    """What started this process: ``name`` (slurm, kubernetes, torchrun, mpirun, jaxckpt launch, none), the
    scheduler's ``job`` id ("" if it has none) and what else it says (``details``: step, node list, ...)."""

    name: str
    job: str = ""
    details: tuple[tuple[str, str], ...] = ()


def node_identity(config: Config | None = None, environ: Mapping[str, str] | None = None) -> NodeIdentity:
    """This process's node (see the module docstring for the order)."""
    env = os.environ if environ is None else environ
    if config is not None and config.node_name:
        return NodeIdentity(config.node_name, "Config.node_name")
    for var, what in ((ENV_K8S_NODE, "Kubernetes downward API"), (ENV_SLURM_NODE, "SLURM")):
        name = env.get(var, "").strip()
        if name:
            return NodeIdentity(name, f"{var} ({what})")
    return NodeIdentity(socket.gethostname() or "localhost", "host name")


def detect_scheduler(environ: Mapping[str, str] | None = None) -> Scheduler:
    """The scheduler or launcher that started this process, from its variables."""
    env = os.environ if environ is None else environ
    if env.get(ENV_NODE) is not None and env.get(ENV_LAUNCH_DIR):
        return Scheduler("jaxckpt launch", "", (("simulated node", env[ENV_NODE]),))
    if env.get(ENV_SLURM_JOB):
        details = [("step", env.get(ENV_SLURM_STEP, "")), ("nodes", env.get(ENV_SLURM_NODELIST, "")),
                   ("node", env.get(ENV_SLURM_NODE, ""))]
        return Scheduler("slurm", env[ENV_SLURM_JOB], tuple((k, v) for k, v in details if v))
    if env.get(ENV_TORCHRUN):
        return Scheduler("torchrun", env[ENV_TORCHRUN], (("restart", env.get(ENV_TORCHRUN_RESTART, "0")),))
    if env.get(ENV_OMPI_RANK) is not None:
        return Scheduler("mpirun", "", (("rank", env[ENV_OMPI_RANK]),))
    if env.get(ENV_PMI_RANK) is not None and env.get(ENV_PMI_SIZE):  # after SLURM: srun --mpi=pmi2 sets them too
        return Scheduler("mpirun", "", (("rank", env[ENV_PMI_RANK]), ("launcher", "Hydra (MPICH, Intel MPI)")))
    if env.get(ENV_K8S):
        return Scheduler("kubernetes", "", ())
    return Scheduler("none")


def torchrun_store_hazard(environ: Mapping[str, str] | None = None) -> str | None:
    """Why a restart under this torchrun may hang the workers' ``init_process_group``, or None.

    torchrun (torch 2.13) hands every round of its rendezvous the same store, which still holds the last round's
    process-group keys; a restarted worker may read a dead peer's gloo address before its peer rewrites it. The
    attempt counter does not tell the rounds apart either: a node whose worker failed counts a restart, the
    others restart theirs for the new round at their old count. Measured on the emulated SLURM cluster
    (2 nodes, a worker SIGKILLed): with a store prefix per TORCHELASTIC_RESTART_COUNT, 1 of 5 runs hung in
    ``init_process_group`` (the two ranks under different prefixes); with torch's own opt-out, which gives every
    round a fresh store, 12 of 12 restarted (docs/deploy.md, torchrun).
    """
    env = os.environ if environ is None else environ
    try:
        restarts = int(env.get(ENV_TORCHRUN_MAX_RESTARTS, "0"))
    except ValueError:
        restarts = 0
    if not env.get(ENV_TORCHRUN) or env.get(ENV_TORCHRUN_AGENT_STORE) != "True" or restarts <= 0:
        return None
    return (f"torchrun shares one rendezvous store across restarts ({ENV_TORCHRUN_AGENT_STORE}=True, "
            f"--max-restarts={restarts}): the restarted workers' init_process_group may read the last round's "
            f"addresses and fail or hang (30 minutes with gloo) before any restore; set "
            f"{ENV_TORCH_UNSHARE_STORE}=1 in torchrun's environment for a fresh store per round (docs/deploy.md, "
            f"torchrun)")


def local_process_count(environ: Mapping[str, str] | None = None) -> int | None:
    """How many processes of the job run on this node, as the launcher says (None if it does not)."""
    env = os.environ if environ is None else environ
    for var in (ENV_PROCS_PER_NODE, ENV_TORCHRUN_LOCAL, ENV_OMPI_LOCAL, ENV_HYDRA_LOCAL):
        if env.get(var, "").isdigit():
            return int(env[var])
    per_node = env.get(ENV_SLURM_TASKS_PER_NODE, "")
    if per_node:
        counts: list[int] = []
        for part in per_node.split(","):
            m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
            if m is None:
                return None
            counts += [int(m[1])] * int(m[2] or 1)
        node = int(env.get(ENV_SLURM_NODEID, "0") or 0)
        return counts[node] if 0 <= node < len(counts) else None
    return None


def allocation(environ: Mapping[str, str] | None = None) -> str:
    """The scheduler's allocation this process belongs to, as it scopes node memory ("slurm<id>"), or ""."""
    env = os.environ if environ is None else environ
    job = env.get(ENV_SLURM_JOB, "").strip()
    return f"slurm{job}" if job.isdigit() else ""


def agent_dir_name(job_id: str, node: str, environ: Mapping[str, str] | None = None) -> str:
    """The default agent directory's name for ``job_id`` on ``node``: ``jaxckpt-<uid>-<job>[@<allocation>]@<node>``.

    '@' is in neither a job id nor a node's part, so no two (job, allocation, node) share a name. The node's name
    is made safe for a file name and kept short: a digest stands for a long or unusual one."""
    safe = _UNSAFE.sub("_", node)
    if safe != node or len(safe) > _DIR_PART:
        safe = f"{safe[:_DIR_PART - 9]}-{hashlib.blake2b(node.encode(), digest_size=4).hexdigest()}"
    scope = allocation(environ)
    return f"jaxckpt-{os.geteuid()}-{job_id}" + (f"@{scope}" if scope else "") + f"@{safe}"


def parse_agent_dir_name(name: str) -> tuple[int, str, str, str] | None:
    """(uid, job, allocation, node part) of a default agent directory's ``name``, or None if it is not one."""
    m = _DIR_RE.match(name)
    return None if m is None else (int(m["uid"]), m["job"], m["scope"] or "", m["node"])


_DIR_RE = re.compile(r"jaxckpt-(?P<uid>\d+)-(?P<job>[A-Za-z0-9._-]+)(?:@(?P<scope>slurm\d+))?"
                     r"@(?P<node>[A-Za-z0-9._-]+)\Z")
