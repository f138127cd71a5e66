"""What a store can offer beyond the :class:`~jaxckpt.core.store.Store` interface: explicit capabilities.

The core asks, it never probes: a Store class declares what it implements in its ``capabilities`` class
attribute (a frozenset of the classes below), ``store.supports(Kind)`` says whether it does, and
``store.capability(Kind)`` returns its implementation or raises :class:`~jaxckpt.errors.CapabilityError`
naming the store and the capability. Built in, ``store="shm"`` (its node agent) offers all three and
``store="memory"`` none:

  :class:`NodeAgent`        the node agent that holds the store's snapshots beyond the process: its directory,
                            incarnation and node, and how to find the job's node agents (:class:`AgentInfo`)
  :class:`AgentHolders`     the holders a restoring process reads from (``jaxckpt.core.sources``): this node's
                            agent zero-copy, and another node's agent, from its AgentInfo, over the network
  :class:`ProtectionSlots`  a trainer's protection slots in its node agent (``jaxckpt.protection.slot``) and
                            the agent's *pull*, which builds protection blocks into a slot being written

The backends implement them (``jaxckpt.backends.agent.handle``); nothing here imports a backend.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

from jaxckpt.errors import PeerError
from jaxckpt.core.sources import Holder
from jaxckpt.core.store import Slot, Store


@dataclass(frozen=True)
class AgentInfo:
    """How to reach one node agent's memory: its peer address and token, its node, job and generation."""

    address: str
    node: str
    job: str
    generation: str
    directory: str  # the agent's own path of its directory (a path on its host)
    token: bytes = field(repr=False)
    server_key: str = ""  # the CURVE public key of its peer server ("": it speaks no CURVE)

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-able dict (exchanged between the job's processes)."""
        return {"address": self.address, "node": self.node, "job": self.job, "generation": self.generation,
                "directory": self.directory, "token": self.token, "server_key": self.server_key}

    @classmethod
    def from_wire(cls, d: Any) -> "AgentInfo":
        """The AgentInfo :meth:`to_wire` made; PeerError if ``d`` is not one."""
        if not isinstance(d, dict) or not isinstance(d.get("token"), bytes) or not d["token"] or \
                not all(isinstance(d.get(k), str) for k in ("address", "node", "job", "generation", "directory")) \
                or not isinstance(d.get("server_key", ""), str):
            raise PeerError(f"malformed agent info {sorted(d) if isinstance(d, dict) else type(d).__name__}")
        return cls(d["address"], d["node"], d["job"], d["generation"], d["directory"], d["token"],
                   d.get("server_key", ""))


class NodeAgent(abc.ABC):
    """The node agent holding a store's snapshots: they outlive the process, and it serves its node to peers."""

    directory: str  # this node's agent directory

    @abc.abstractmethod
    def generation(self) -> str:
        """The incarnation of the agent the store is connected to (a restarted agent has a new one)."""

    @abc.abstractmethod
    def node(self) -> str:
        """The node name the agent reports ("" if it reports none)."""

    @abc.abstractmethod
    def directories(self) -> list[str]:
        """Where this process can look for agents: this node's directory first, then ``Config.agent_dirs``."""

    @abc.abstractmethod
    def stamp(self, directory: str) -> Hashable | None:
        """A value that changes whenever another agent starts serving peers from ``directory``; None if none does.
        Cheap (a stat): asked at the start of every restore to follow restarted agents."""

    @abc.abstractmethod
    def find(self, directories: Sequence[str]) -> list[AgentInfo]:
        """The agents of this store's job serving peers from ``directories`` (other jobs' and none skipped)."""


class AgentHolders(abc.ABC):
    """The node agents' memory as holders a restore reads from (``jaxckpt.core.sources.Holder``)."""

    @abc.abstractmethod
    def node_holder(self, node: str) -> Holder:
        """This node's agent (kind ``node``): any process's committed snapshots, zero-copy; ``node`` labels it."""

    @abc.abstractmethod
    def remote_holder(self, agent: AgentInfo, node: str) -> Holder:
        """The agent ``agent`` (kind ``remote``), over the peer transport; a request it does not answer in time
        raises :class:`~jaxckpt.errors.PeerTimeoutError`."""


class ProtectionSlots(abc.ABC):
    """Protection slots in the node agent (``jaxckpt.protection.slot`` states their format)."""

    @abc.abstractmethod
    def slot_store(self, process: int) -> Store:
        """A new store (of the same class, for the caller to close) of process ``process``'s protection slots:
        ordinary slots of pseudo process ``PROTECT_BASE + process`` in the same node agent."""

    @abc.abstractmethod
    def pull(self, slot: Slot, *, plan: bytes, tasks: list, sources: dict, rate: int, timeout: float) -> dict:
        """Have the agent build protection blocks into ``slot``, which this store is writing: ``tasks``
        ``[[kind, id, offset], ...]`` of the encoded ``plan``, from the chunks at ``sources`` (``{process:
        [address, token] | None}``), at most ``rate`` bytes per second (0: unlimited). Returns the agent's reply
        (``crcs``: one crc32c per task; ``pulled``, ``bandwidth``). AgentError if the agent could not (a peer
        failed, a chunk was bad): the slot stays being written."""


KNOWN: tuple[type, ...] = (NodeAgent, AgentHolders, ProtectionSlots)
