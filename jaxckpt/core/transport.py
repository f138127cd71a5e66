"""The peer transport's interface: what a process (or a node agent) serving committed snapshots and a reader of
another's offer each other, so that a transport is a part chosen by name (``Config.transport``, the registry's
group "transport"; ``jaxckpt.backends.transport.ZmqTransport`` is "zmq") and nothing above the backends imports
one. A server serves a :class:`ServedHolder` (one process's store, or a node agent's memory holding every
process of its node); a :class:`PeerClient` reads its steps, manifests and byte :class:`Span` s, and asks a node
agent holding a parity stripe to rebuild a lost range there and send only the result (``rebuild``). Every
failure is a ``jaxckpt.errors.PeerError`` (``PeerUnreachableError``, ``PeerHandshakeError``, ``StepNotFoundError``).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Sequence

from jaxckpt.core.store import SnapshotView, Store
from jaxckpt.errors import PeerError
from jaxckpt.registry import get_part

__all__ = ["PeerAddress", "PeerClient", "PeerServer", "ServedHolder", "Span", "Transport", "get_transport"]


# (address, token, CURVE public key or "") of a peer server: where a reader reaches a node's memory.
PeerAddress = tuple[str, bytes, str]


class ServedHolder(abc.ABC):
    """What a peer server serves: committed snapshots of one or more processes, opened pinned."""

    label: str  # for log lines, e.g. "process 3" or "node agent at /dev/shm/..."

    @abc.abstractmethod
    def steps(self, process: int | None) -> list[int]:
        """Committed steps of ``process`` (None: the source's default process, or every process)."""

    @abc.abstractmethod
    def open(self, process: int | None, step: int) -> SnapshotView | None:
        """Pin ``process``'s snapshot of ``step``; None if not held."""

    @abc.abstractmethod
    def held(self) -> list[list]:
        """Every snapshot held, as HeldEntry wire lists."""

    def about(self) -> dict[str, Any]:
        """What serves, for a peer that knows only the address (a node agent: its node, job and generation)."""
        return {"label": self.label}

    def rebuild(self, process: int, step: int, stripe: int, unit: int, lo: int, hi: int,
                sources: dict[int, PeerAddress], timeout_s: float) -> Any:
        """Bytes [lo, hi) of unit ``unit`` of parity stripe ``stripe``, rebuilt here, where that stripe's parity
        is held (in protection slot ``process`` of ``step``): the parity XOR the stripe's other units, read from
        ``sources`` (saving process -> where its memory is served), each within ``timeout_s``. A buffer of
        ``hi - lo`` bytes. A source that holds no parity rebuilds nothing (NotImplementedError)."""
        raise NotImplementedError(f"{self.label} rebuilds nothing")


@dataclass(frozen=True)
class Span:
    """``nbytes`` bytes at ``offset`` of a snapshot buffer; ``chunk``: (offset, nbytes) of the chunk holding them,
    when the reader wants to check them against that chunk's crc32c."""

    offset: int
    nbytes: int
    chunk: tuple[int, int] | None = None


class PeerServer(abc.ABC):
    """Serves one store's committed snapshots at ``address`` until closed."""

    address: str
    public_key: str = ""  # its CURVE public key (Z85), "" when it speaks no CURVE

    @abc.abstractmethod
    def close(self) -> None: ...


class PeerClient(abc.ABC):
    """Reads another process's committed snapshots; every call raises PeerError on refusal or time-out."""

    address: str

    @abc.abstractmethod
    def steps(self) -> list[int]:
        """The committed steps the peer holds now."""

    @abc.abstractmethod
    def manifest(self, step: int, process: int | None = None) -> bytes:
        """The peer's encoded manifest of ``step`` (of saving ``process``); StepNotFoundError if not held."""

    @abc.abstractmethod
    def read(self, step: int, offset: int, nbytes: int, process: int | None = None) -> memoryview:
        """``nbytes`` bytes at ``offset`` of the peer's snapshot buffer of ``step`` (of saving ``process``)."""

    @abc.abstractmethod
    def read_spans(self, step: int, spans: Sequence[Span], process: int | None = None, *, manifest: bool = False
                   ) -> Iterator[tuple[int, memoryview, tuple[int, int] | None]]:
        """Read ``spans`` of the peer's snapshot of ``step``, several requests in flight at once; yields
        ``(index in spans, bytes, rest)`` in the order the replies arrive, ``rest`` the crc32c of the bytes of the
        span's chunk before and after it (None for a span that names no chunk). ``manifest``: the step's manifest
        too, asked for first in the same flight (no round trip of its own), yielded as index -1."""

    @abc.abstractmethod
    def held(self) -> list[list]:
        """Every snapshot the peer holds, as HeldEntry wire lists."""

    def about(self) -> dict[str, Any]:
        """What the peer says it serves (:meth:`ServedHolder.about`); PeerError where the transport cannot ask."""
        raise PeerError(f"peer {self.address}: this transport cannot ask a peer what it serves")

    def rebuild(self, step: int, process: int, stripe: int, unit: int, lo: int, hi: int,
                sources: dict[int, PeerAddress]) -> memoryview:
        """Ask the peer to rebuild bytes [lo, hi) of unit ``unit`` of parity stripe ``stripe`` where it holds
        that stripe's parity (:meth:`ServedHolder.rebuild`) and send only the result; PeerError when it
        cannot (a transport without the request says so here)."""
        raise PeerError(f"peer {self.address}: this transport cannot ask a peer to rebuild bytes")

    @abc.abstractmethod
    def close(self) -> None: ...


class Transport(abc.ABC):
    """Makes peer servers and clients; all of them authenticate with one shared token."""

    name: ClassVar[str] = ""

    @abc.abstractmethod
    def serve(self, store: Store | ServedHolder, *, token: bytes, host: str = "127.0.0.1",
              curve: bool = False, port: int = 0, token_key: bool = False) -> PeerServer:
        """Start serving ``store`` (a Store or any ServedHolder) on ``host`` (``port``, 0: an ephemeral one); returns
        at once. ``curve``: speak CURVE only, with a key pair made here (its public half is ``server.public_key``),
        or with ``token_key`` the one derived from ``token`` (``jaxckpt.backends.curve.rendezvous_keys``)."""

    def rendezvous_key(self, token: bytes) -> str:
        """The CURVE public key of a server made with ``serve(token_key=True)`` and ``token``: what a client that
        knows only the address checks the server against."""
        raise PeerError(f"the {self.name or type(self).__name__} transport has no key derived from the token")

    @abc.abstractmethod
    def connect(self, address: str, *, token: bytes, timeout_s: float, server_key: str = "") -> PeerClient:
        """A client of the server at ``address`` (connects lazily; the first request may time out).
        ``server_key``: the CURVE public key published for that address ("": no CURVE)."""


def get_transport(name: str = "zmq", **options: Any) -> Transport:
    """The transport registered under ``name`` in ``jaxckpt.registry`` (group "transport"; ``Config.transport``
    names it), made with ``options``; BackendNotFoundError for a name nothing registered."""
    return get_part("transport", name)(**options)
