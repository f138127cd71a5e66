"""What a launched process knows about itself: its place in the job and its simulated node, from the environment.

The launcher (``jaxckpt.testing.launch`` or ``jaxckpt launch``) sets these variables in every process it starts;
:func:`node_info` reads them and :func:`init_from_env` turns them into a JAX distributed runtime on loopback.
Nothing here imports jax until :func:`init_from_env` is called.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass

from jaxckpt.errors import LaunchError
# The variables' names live with Config, whose environment reader skips them.
from jaxckpt.config import (ENV_COORDINATOR, ENV_DEVICES_PER_PROC, ENV_LAUNCH_DIR, ENV_LOCAL_RANK, ENV_NODE,
                            ENV_NODE_COUNT, ENV_PROCESS_COUNT, ENV_PROCESS_ID, ENV_PROCS_PER_NODE, LAUNCH_ENV)

log = logging.getLogger("jaxckpt.testing")

ENV_NODE_NAME = "JAXCKPT_NODE_NAME"  # Config.node_name

PIDS_FILE = "pids.json"  # process id -> [pid, node], written by the launcher into the launch dir
WORKER_PID_FILE = "worker-{}.pid"  # a worker's own pid, by process id (it may be another launcher's child)


@dataclass(frozen=True)
class NodeInfo:
    """A launched process's place: process ``process_id`` of ``process_count``, ``local_rank`` on ``node``."""

    process_id: int
    process_count: int
    node: int
    node_count: int
    local_rank: int
    procs_per_node: int
    devices_per_proc: int
    coordinator: str
    launch_dir: str

    @property
    def node_dir(self) -> str:
        """A scratch folder private to this simulated node (created on first use)."""
        path = os.path.join(self.launch_dir, f"node{self.node}")
        os.makedirs(path, exist_ok=True)
        return path


def launch_env(*, process_id: int, nodes: int, procs_per_node: int, devices_per_proc: int, coordinator: str,
               launch_dir: str) -> dict[str, str]:
    """The variables the launcher sets for process ``process_id`` (processes fill node 0 first)."""
    return {
        ENV_COORDINATOR: coordinator,
        ENV_PROCESS_ID: str(process_id),
        ENV_PROCESS_COUNT: str(nodes * procs_per_node),
        ENV_DEVICES_PER_PROC: str(devices_per_proc),
        ENV_NODE: str(process_id // procs_per_node),
        ENV_NODE_COUNT: str(nodes),
        ENV_LOCAL_RANK: str(process_id % procs_per_node),
        ENV_PROCS_PER_NODE: str(procs_per_node),
        ENV_LAUNCH_DIR: launch_dir,
        # Each simulated node is a node of its own (jaxckpt.node_identity): its own default agent directory, and
        # protection keeps its redundancy on the others.
        ENV_NODE_NAME: sim_node_name(process_id // procs_per_node),
    }


def sim_node_name(node: int) -> str:
    """The node name (Config.node_name) of simulated node ``node``."""
    return f"node{node}"


def node_info() -> NodeInfo:
    """This process's NodeInfo; raises LaunchError if it was not started by the jaxckpt launcher."""
    missing = [k for k in LAUNCH_ENV if k not in os.environ]
    if missing:
        raise LaunchError(f"not started by jaxckpt.testing.launch or `jaxckpt launch` "
                          f"(missing {', '.join(missing)})")
    try:
        ints = {k: int(os.environ[k]) for k in LAUNCH_ENV if k not in (ENV_COORDINATOR, ENV_LAUNCH_DIR)}
    except ValueError as e:
        raise LaunchError(f"malformed launcher environment: {e}") from None
    return NodeInfo(process_id=ints[ENV_PROCESS_ID], process_count=ints[ENV_PROCESS_COUNT], node=ints[ENV_NODE],
                    node_count=ints[ENV_NODE_COUNT], local_rank=ints[ENV_LOCAL_RANK],
                    procs_per_node=ints[ENV_PROCS_PER_NODE], devices_per_proc=ints[ENV_DEVICES_PER_PROC],
                    coordinator=os.environ[ENV_COORDINATOR], launch_dir=os.environ[ENV_LAUNCH_DIR])


def init_from_env(*, initialization_timeout: int = 120) -> NodeInfo:
    """Start this process's JAX runtime as the launcher described it; call before any JAX computation.

    Sets ``jax_num_cpu_devices``; with more than one process, gloo CPU collectives and
    ``jax.distributed.initialize`` with the coordination service bound to loopback. A job of one process
    runs as a plain process does: under ``jax.distributed`` XLA's CPU client runs even one process's
    collectives through gloo, which makes a training step up to several times slower than the user's own
    single-process run that a launched benchmark stands for.
    """
    info = node_info()
    import jax

    jax.config.update("jax_num_cpu_devices", info.devices_per_proc)
    if info.process_count == 1:
        log.info("single process (node %d) with %d devices: no distributed runtime", info.node,
                 jax.local_device_count())
        return info
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    port = info.coordinator.rsplit(":", 1)[1]
    jax.distributed.initialize(info.coordinator, info.process_count, info.process_id,
                               coordinator_bind_address=f"127.0.0.1:{port}",
                               initialization_timeout=initialization_timeout)
    log.info("process %d/%d (node %d, local rank %d) joined %s with %d devices", info.process_id,
             info.process_count, info.node, info.local_rank, info.coordinator, jax.local_device_count())
    return info


def kill_node(node: int, sig: int = signal.SIGKILL) -> list[int]:
    """From inside a launched job: send ``sig`` to every process of simulated ``node`` (and their children).

    The launcher is told these deaths were intended (a marker file per pid), so it does not treat them as a
    failure of the job. Returns the pids signalled.
    """
    info = node_info()
    path = os.path.join(info.launch_dir, PIDS_FILE)
    deadline = time.monotonic() + 30
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)  # the launcher writes it right after starting the last process
    with open(path) as f:
        pids = {int(k): v for k, v in json.load(f).items()}
    targets = [pid for _, (pid, n) in sorted(pids.items()) if n == node]
    for pid in targets:
        open(os.path.join(info.launch_dir, f"killed-{pid}"), "w").close()
    for pid in targets:
        try:
            os.killpg(pid, sig)  # every process is its own group leader: this reaches its children too
        except ProcessLookupError:
            pass
    return targets
