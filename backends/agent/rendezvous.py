"""A node agent finds the job's other agents by address: the rendezvous of a replacement node across machines.

Agents on one host (or on a shared directory) find each other through the peer files they publish
(``Config.agent_dirs``). Across machines a replacement node's agent has nothing to read: ``Config.agent_peers``
(``jaxckpt agent --peers``) names where the job's agents listen, ``host[:port]`` entries separated by commas
(the scheduler's node list: every node of the job, this one and the lost one included), each agent serving on the
known port ``Config.agent_port`` (``--peer-port``) of its ``peer_bind`` address. A host name resolving to several
addresses (a Kubernetes headless service) stands for all of them.

The agent asks each address what serves there (the peer transport's ``about``: node, job, generation, directory)
with the job's shared token (``Config.peer_token``, ``JAXCKPT_PEER_TOKEN``: the same on every node, so a token
made at random by one agent cannot serve) and, where the job speaks CURVE, the server key every agent of the job
derives from that token (the transport's ``rendezvous_key``): no key has to be published first, and
whoever lacks the token can neither answer nor ask. Addresses that do not answer within the time-out (the lost
node, a spare without an agent) are skipped, in parallel; its own address answers with its own generation and is
skipped too.
"""
from __future__ import annotations

import logging
import socket
from concurrent.futures import ThreadPoolExecutor

from jaxckpt.core.capabilities import AgentInfo
from jaxckpt.config import agent_peer_entries
from jaxckpt.errors import JaxckptError

log = logging.getLogger("jaxckpt.backends.agent.daemon")


def addresses(spec: str, port: int) -> list[str]:
    """The peer transport addresses of ``spec``'s entries, each host resolved (every address it has)."""
    out: list[str] = []
    for host, n in agent_peer_entries(spec, port):
        try:
            infos = socket.getaddrinfo(host, n, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            log.warning("agent rendezvous: %s does not resolve (%s): skipped", host, e)
            continue
        for family, _, _, _, sockaddr in infos:
            ip = sockaddr[0] if family == socket.AF_INET else f"[{sockaddr[0]}]"
            a = f"tcp://{ip}:{n}"
            if a not in out:
                out.append(a)
    return out


def discover(job: str, spec: str, port: int, *, token: bytes, curve: bool, generation: str, transport: str,
             timeout_s: float) -> list[AgentInfo]:
    """The job's other agents answering at ``spec``'s addresses (see the module docstring)."""
    from jaxckpt.core.transport import get_transport

    t = get_transport(transport)
    key = t.rendezvous_key(token) if curve else ""

    def ask(address: str) -> AgentInfo | None:
        client = t.connect(address, token=token, timeout_s=timeout_s, server_key=key)
        try:
            about = client.about()
        except JaxckptError as e:
            log.info("agent rendezvous: nothing answers at %s (%s)", address, e)
            return None
        finally:
            client.close()
        if about.get("job") != job or not all(isinstance(about.get(k), str) for k in ("node", "generation")):
            log.warning("agent rendezvous: %s serves %r, not an agent of job %r: not used", address, about, job)
            return None
        if about["generation"] == generation:
            return None  # this agent
        return AgentInfo(address, about["node"], job, about["generation"], str(about.get("directory", "")), token,
                         key)

    found = addresses(spec, port)
    with ThreadPoolExecutor(max(1, min(16, len(found)))) as pool:
        out = [i for i in pool.map(ask, found) if i is not None]
    log.info("agent rendezvous: %d of %d addresses are agents of job %s: %s", len(out), len(found), job,
             ", ".join(f"{i.node} at {i.address}" for i in out))
    return out
