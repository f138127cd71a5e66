"""This process's peers: a server of its snapshots for the others, clients of theirs, found through the coordinator.

Set-up, when a job has more than one process (two rounds of the engine's ``main`` channel,
``jaxckpt.core.collective``, through the coordination service, which is trusted):
  0) (process 0)     generates the job's peer token, unless ``Config.peer_token`` is set, and broadcasts it
                     (round ``peer token``; a process with ``Config.peer_token`` set uses its own);
  1) (every process) starts a transport server over its store; an ``all_gather`` round ``peer addresses``
                     gives every process every server's address and CURVE public key ("" without CURVE:
                     ``Config.peer_security``, ``jaxckpt.backends.curve``);
  2) (on restore)    connects to a peer on first use, then fetches its manifest and chunk ranges.
"""
from __future__ import annotations

import logging
import secrets
import threading

from jaxckpt.core import manifest as mf
from jaxckpt.config import Config, peer_uses_curve
from jaxckpt.core.collective import Channel, Collective
from jaxckpt.core.coordination import Coordinator
from jaxckpt.errors import ConfigError, ManifestError, PeerError
from jaxckpt.core.fetch import ByteReader
from jaxckpt.core.store import Store

log = logging.getLogger("jaxckpt.backends.peers")


def _same_security(keys: list[str], addresses: list[str]) -> None:
    """ConfigError (the same on every process: they all see the same list) unless every server speaks CURVE or
    none does: a client without CURVE gets no connection from a CURVE server, only a time-out."""
    plain = [q for q, k in enumerate(keys) if not k]
    if plain and len(plain) < len(keys):
        curve = [q for q, k in enumerate(keys) if k]
        raise ConfigError(f"peer servers disagree on CURVE: process(es) {curve} speak it, {plain} do not (e.g. "
                          f"process {plain[0]} at {addresses[plain[0]]}); set Config.peer_bind and "
                          f"Config.peer_security alike on every process")


class Peers:
    """Serves ``store`` to the job's other processes and reads theirs."""

    def __init__(self, config: Config, coordinator: Coordinator, store: Store, *,
                 channel: Channel | None = None) -> None:
        """``channel``: the rounds to run set-up on (every process calls this together); default: a channel of
        a new collective instance of ``config.job_id``."""
        from jaxckpt.core.transport import get_transport  # the transport's module is imported only here

        self._config, self._coord = config, coordinator
        if channel is None:
            channel = Collective.for_job(coordinator, config.job_id, config.commit_timeout_s).channel("main")
        self._transport = get_transport(config.transport)
        self._token = self._exchange_token(channel)
        self.server = self._transport.serve(store, token=self._token, host=config.peer_bind,
                                            curve=peer_uses_curve(config.peer_bind, config.peer_security))
        try:
            published = channel.all_gather("peer addresses", [self.server.address, self.server.public_key])
            self._addresses = [str(a) for a, _ in published]
            self._keys = [str(k) for _, k in published]
            _same_security(self._keys, self._addresses)
        except BaseException:
            self.server.close()
            raise
        self._clients: dict = {}
        self._lock = threading.Lock()

    def _exchange_token(self, channel: Channel) -> bytes:
        own = self._config.peer_token.encode() if self._config.peer_token else None
        if channel.process_index == 0 and own is None:
            own = secrets.token_hex(32).encode()
        shared = channel.broadcast("peer token", None if self._config.peer_token else own)
        if own is not None:  # process 0's, or a configured one (processes with other tokens refuse each other)
            return own
        if shared is None:
            raise PeerError("the peer token: Config.peer_token is set on process 0 but not on process "
                            f"{channel.process_index}; set it on every process or on none")
        return bytes(shared)

    def client(self, process: int):
        """The (cached) client of ``process``'s snapshot server."""
        with self._lock:
            c = self._clients.get(process)
            if c is None:
                if not 0 <= process < len(self._addresses):
                    raise PeerError(f"process {process}: no such process in a job of {len(self._addresses)}")
                address = self._addresses[process]
                c = self._clients[process] = self._transport.connect(address, token=self._token,
                                                                     timeout_s=self._config.peer_timeout_s,
                                                                     server_key=self._keys[process])
            return c

    def manifests(self, step: int, own: mf.Manifest, sources: dict[int, ByteReader]) -> list[mf.Manifest]:
        """The other processes' manifests of ``step``; adds a ByteReader per process to ``sources``."""
        out = []
        for q in range(own.process_count):
            if q == own.process:
                continue
            c = self.client(q)
            source = f"step {step} manifest of process {q} ({c.address})"
            m = mf.decode(c.manifest(step), source=source)
            if m.step != step or m.process != q or m.process_count != own.process_count:
                raise ManifestError(f"{source}: describes step {m.step} of process {m.process}/{m.process_count}")
            out.append(m)
            sources[q] = (lambda offset, nbytes, c=c: c.read(step, offset, nbytes))
        return out

    def close(self) -> None:
        """Stop serving and drop the clients."""
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()
        self.server.close()
