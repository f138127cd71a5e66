"""``jaxckpt.start_agent()``: start this node's agent before the trainer imports its framework.

A relaunched trainer spends seconds importing JAX (or torch) and building its model before its ``Checkpointer()``
would spawn the node agent. On a replacement node (its memory gone) the agent has work to do as soon as it serves:
recover the node's share of the newest protected step from the other nodes (``Config.agent_peers`` or
``agent_dirs``; ``jaxckpt.backends.agent.recovery``). Called first thing in the training script, before
``import jax``, this starts the agent exactly as the shm store would (same directory, token, flags and, under
SLURM, a step of its own), without waiting for it, so its start and recovery overlap the trainer's imports; the
``Checkpointer()`` later finds it serving (its hello waits for a recovery still running) and spawns none.

It imports neither jax nor numpy. Where an agent already serves the node, or the store is not ``"shm"``, it does
nothing. Several processes of a node may call it: one agent wins the directory's lock, the others exit at once.
"""
from __future__ import annotations

import logging
import threading

from jaxckpt.config import Config

log = logging.getLogger("jaxckpt.early_agent")


def start_agent(config: Config | None = None) -> bool:
    """Start this node's agent for ``config`` (default: ``Config()`` with the ``JAXCKPT_*`` environment applied, as
    ``Checkpointer()`` reads it) unless one serves; True if this call started one. Returns at once."""
    from jaxckpt.backends.agent import protocol
    from jaxckpt.errors import StoreUnavailableError

    config = (config or Config()).with_env()
    if config.store != "shm":
        return False
    directory = protocol.agent_dir(config)
    try:
        protocol.AgentConnection(directory, timeout_s=5.0).close()
        return False  # one serves (a launcher's, or one that outlived the last run)
    except StoreUnavailableError:
        pass
    proc = protocol.start_agent(config, directory, recover=True)
    # Reap it should it exit while this process lives (a lost lock race, a shutdown): no zombie.
    threading.Thread(target=proc.wait, name="jaxckpt-agent-reaper", daemon=True).start()
    log.info("started the node agent of job %s in %s (pid %d) before the trainer's imports", config.job_id,
             directory, proc.pid)
    return True
