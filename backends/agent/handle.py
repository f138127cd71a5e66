"""The node agent as the core sees it: the capabilities ``store="shm"`` offers (``jaxckpt.core.capabilities``).

One :class:`AgentHandle` per :class:`~jaxckpt.backends.shm.ShmStore` implements all three: ``NodeAgent`` (the
agent's directory, incarnation and node, and finding the job's agents from the peer files they write,
``serve.py``), ``AgentHolders`` (``readers.py``) and ``ProtectionSlots`` (slots of pseudo processes
``PROTECT_BASE + p`` in the same agent, filled by its ``pull``, ``protection_pull.py``).
"""
from __future__ import annotations

import os
from typing import Any, Hashable, Protocol, Sequence

from jaxckpt.backends.agent.readers import NodeAgentHolder, RemoteAgentHolder, expand_dirs, local_agents
from jaxckpt.backends.agent.peer_files import PEER_NAME
from jaxckpt.config import Config
from jaxckpt.core.capabilities import AgentHolders, AgentInfo, NodeAgent, ProtectionSlots
from jaxckpt.core.sources import Holder
from jaxckpt.core.store import Slot, Store
from jaxckpt.protection import PROTECT_BASE  # not .slot: a store without protection imports no protection module

class AgentStore(Protocol):
    """What the handle reads of its store (``jaxckpt.backends.shm.ShmStore``, which imports this module)."""

    config: Config
    directory: str
    agent: dict[str, Any]  # the agent's hello: its generation and node
    process_count: int

    def pull(self, slot: Slot, *, plan: bytes, tasks: list, sources: dict, rate: int, timeout: float) -> dict:
        """Have the agent build protection blocks into ``slot``."""


class AgentHandle(NodeAgent, AgentHolders, ProtectionSlots):
    """The capabilities of one ShmStore, through the node agent it is connected to."""

    def __init__(self, store: AgentStore) -> None:
        self._store = store
        self.directory = store.directory

    # ------------------------------------------------------------------------------------------ NodeAgent
    def generation(self) -> str:
        return str(self._store.agent.get("generation", ""))

    def node(self) -> str:
        return str(self._store.agent.get("node", ""))

    def directories(self) -> list[str]:
        own = os.path.realpath(self.directory)
        return [self.directory] + [d for d in expand_dirs(self._store.config.agent_dirs)
                                   if os.path.realpath(d) != own]

    def stamp(self, directory: str) -> Hashable | None:
        try:
            st = os.stat(os.path.join(directory, PEER_NAME))
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def find(self, directories: Sequence[str]) -> list[AgentInfo]:
        return local_agents(self._store.config.job_id, list(directories))

    # --------------------------------------------------------------------------------------- AgentHolders
    def node_holder(self, node: str) -> Holder:
        c = self._store.config
        return NodeAgentHolder(self.directory, c.job_id, node, c.peer_timeout_s)

    def remote_holder(self, agent: AgentInfo, node: str) -> Holder:
        c = self._store.config
        # A job that keeps replicas whole reads its own node's memory when the agents live: no clients until read
        return RemoteAgentHolder(agent, node, c.peer_timeout_s, c.restore_workers, transport=c.transport,
                                 connect_at_open=c.replicas == "split")

    # ------------------------------------------------------------------------------------ ProtectionSlots
    def slot_store(self, process: int) -> Store:
        s = self._store  # the same class: a subclass of ShmStore named by Config.store serves the slots too
        return type(s)(s.config, process_index=PROTECT_BASE + process, process_count=s.process_count)

    def pull(self, slot: Slot, *, plan: bytes, tasks: list, sources: dict, rate: int, timeout: float) -> dict:
        return self._store.pull(slot, plan=plan, tasks=tasks, sources=sources, rate=rate, timeout=timeout)
