"""This process's peers: a server of its snapshots for the others, clients of theirs, found through the coordinator.

Set-up, when a job has more than one process (all through the coordination service, which is trusted):
  0) (process 0)     generates the job's peer token, unless ``Config.peer_token`` is set, and publishes it
                     under ``jaxckpt/<job>/peer/token``; (others) read it, waiting up to ``commit_timeout_s``;
  1) (every process) starts a transport server over its store and publishes the address under
                     ``jaxckpt/<job>/peer/addr/<process>``;
  2) (on restore)    reads a peer's address on first use, then fetches its manifest and chunk ranges.
"""
from __future__ import annotations

import logging
import secrets
import threading

from jaxckpt.core import manifest as mf
from jaxckpt.config import Config
from jaxckpt.core.coordination import Coordinator
from jaxckpt.errors import ManifestError, PeerError
from jaxckpt.core.fetch import ByteSource
from jaxckpt.core.store import Store

log = logging.getLogger("jaxckpt.backends.peers")


class Peers:
    """Serves ``store`` to the job's other processes and reads theirs."""

    def __init__(self, config: Config, coordinator: Coordinator, store: Store, prefix: str = "jaxckpt") -> None:
        from jaxckpt.backends.transport import get_transport  # pyzmq is needed only by multi-process jobs

        self._config, self._coord = config, coordinator
        self._prefix = f"{prefix}/{config.job_id}/peer"
        self._transport = get_transport()
        self._token = self._exchange_token()
        self.server = self._transport.serve(store, token=self._token, host=config.peer_bind)
        coordinator.set(f"{self._prefix}/addr/{coordinator.process_index}", self.server.address.encode())
        self._clients: dict = {}
        self._lock = threading.Lock()

    def _exchange_token(self) -> bytes:
        if self._config.peer_token:
            return self._config.peer_token.encode()
        key = f"{self._prefix}/token"
        if self._coord.process_index == 0:
            token = secrets.token_hex(32).encode()
            self._coord.set(key, token)
            return token
        try:
            return self._coord.get(key, self._config.commit_timeout_s)
        except TimeoutError:
            raise PeerError(f"process 0 did not publish the peer token ({key}) within "
                            f"{self._config.commit_timeout_s:g}s") from None

    def client(self, process: int):
        """The (cached) client of ``process``'s snapshot server."""
        with self._lock:
            c = self._clients.get(process)
            if c is None:
                key = f"{self._prefix}/addr/{process}"
                try:
                    address = self._coord.get(key, self._config.peer_timeout_s).decode()
                except TimeoutError:
                    raise PeerError(f"process {process} has not published its snapshot server address ({key}) "
                                    f"within {self._config.peer_timeout_s:g}s") from None
                c = self._clients[process] = self._transport.connect(address, token=self._token,
                                                                     timeout_s=self._config.peer_timeout_s)
            return c

    def manifests(self, step: int, own: mf.Manifest, sources: dict[int, ByteSource]) -> list[mf.Manifest]:
        """The other processes' manifests of ``step``; adds a ByteSource per process to ``sources``."""
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
