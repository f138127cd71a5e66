"""ZeroMQ CURVE for the peer transport: encrypted peer connections, both ends authenticated by key.

Used when ``Config.peer_security`` asks for it (``jaxckpt.config.peer_uses_curve``: by default whenever
``Config.peer_bind`` leaves loopback). Who holds which key:

* every peer *server* (a trainer process's, a node agent's) makes its own key pair when it starts; the secret
  key goes into its socket and nowhere else (never a file, never a message). Its public key is published next
  to its address through what already publishes the address: the ``peer addresses`` round of the job's
  collective (``jaxckpt.backends.peers``), an agent's ``peer.addr`` file (``jaxckpt.backends.agent.peer_files``),
  and from there the catalog's exchange of agent infos and the protection pulls' sources. A client sets that
  key as ``CURVE_SERVERKEY``: a server at the address that does not hold the matching secret key cannot
  complete the handshake, so nothing is sent to it and nothing it says is read. Node agents reached by address
  alone (``Config.agent_peers``: a replacement node's agent has no published key to read) serve instead with the
  pair derived from the job's token (:func:`rendezvous_keys`): a server is then proven to hold the token;
* a *client* proves that it belongs to the job with the job's client key pair, derived from the job's peer
  token (:func:`client_keys`): whoever holds the token (the processes of the job, through the coordination
  service; the node agents, through their 0600 ``peer.token`` file) holds the key, so membership is what it
  was, but the token itself never crosses the network. A server's ZAP handler (:class:`_Zap`, one per process)
  accepts exactly the client key of its own token and refuses every other key during the handshake: such a
  client gets no connection at all, and the server counts the refusal (``ZmqServer.refused_keys``).

Requests still carry the token (now inside the encrypted stream), so one server code path serves both modes.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from typing import Callable

import zmq
from zmq.utils import z85

from jaxckpt.errors import ConfigError

log = logging.getLogger("jaxckpt.backends.curve")

_DERIVE = b"jaxckpt peer client key v1\0"
_DERIVE_SERVER = b"jaxckpt agent rendezvous server key v1\0"


def require_curve(what: str) -> None:
    """ConfigError naming ``what`` unless this libzmq has CURVE."""
    if not zmq.has("curve"):
        raise ConfigError(f"{what} needs ZeroMQ CURVE, which this libzmq ({zmq.zmq_version()}) lacks; set "
                          f"Config.peer_bind to loopback or opt out with Config.peer_security='insecure-token' "
                          f"(the peer token then crosses the network in clear text)")


def client_keys(token: bytes) -> tuple[bytes, bytes]:
    """(public, secret) Z85 CURVE key pair of the clients of the job whose peer token is ``token``.

    Curve25519 takes any 32 bytes as a secret key, so a domain-separated hash of the token is one."""
    if not token:
        raise ValueError("a CURVE client key needs a non-empty token")
    secret = z85.encode(hashlib.sha256(_DERIVE + bytes(token)).digest())
    return zmq.curve_public(secret), secret


def rendezvous_keys(token: bytes) -> tuple[bytes, bytes]:
    """(public, secret) Z85 CURVE key pair the job's node agents serve with when they are reached by address alone
    (``Config.agent_peers``: a replacement node's agent knows its peers' host and port, and the job's token, but
    no key they published). Derived from the token like :func:`client_keys`, under another label: whoever holds
    the token can prove the server, whoever lacks it can neither serve as one nor connect."""
    if not token:
        raise ValueError("a CURVE server key needs a non-empty token")
    secret = z85.encode(hashlib.sha256(_DERIVE_SERVER + bytes(token)).digest())
    return zmq.curve_public(secret), secret


def valid_public_key(key: str | bytes) -> bool:
    """Whether ``key`` is a Z85 CURVE public key (40 characters decoding to 32 bytes)."""
    try:
        raw = key.encode() if isinstance(key, str) else bytes(key)
        return len(raw) == 40 and len(z85.decode(raw)) == 32
    except Exception:  # noqa: BLE001 - z85 raises several types on garbage
        return False


class _Zap:
    """The process's ZAP handler (one per ZeroMQ context, as ZeroMQ requires): each CURVE server registers a
    ZAP domain of its own with the one client key it accepts and a function that counts refusals."""

    _lock = threading.Lock()
    _auth = None
    _domains: dict[str, tuple[bytes, Callable[[bytes], None]]] = {}
    _closed: dict[str, float] = {}  # domain -> when its server closed
    _ids = itertools.count(1)
    # ZeroMQ closes a socket in the background: a handshake begun just before may still ask. Answering it
    # "unknown domain" would tell that client its key was refused, so a closed server's domain stays this long.
    GRACE_S = 30.0

    @classmethod
    def register(cls, allowed: bytes, on_refuse: Callable[[bytes], None]) -> str:
        """A new ZAP domain admitting the client key ``allowed`` (Z85); ``on_refuse(key)`` on every other key.
        The handler is running when this returns, so a server bound afterwards is never unguarded."""
        with cls._lock:
            if cls._auth is None:
                from zmq.auth.thread import ThreadAuthenticator

                auth = ThreadAuthenticator(zmq.Context.instance(), log=logging.getLogger("jaxckpt.backends.zap"))
                auth.start()
                cls._auth = auth
            cls._purge()
            domain = f"jaxckpt-{next(cls._ids)}"
            cls._domains[domain] = (bytes(allowed), on_refuse)
            cls._auth.configure_curve_callback(domain, credentials_provider=cls)
            return domain

    @classmethod
    def unregister(cls, domain: str) -> None:
        """Forget ``domain`` (its server closed) once ``GRACE_S`` have passed."""
        with cls._lock:
            if domain in cls._domains:
                cls._closed[domain] = time.monotonic()
            cls._purge()

    @classmethod
    def _purge(cls) -> None:
        old = [d for d, t in cls._closed.items() if time.monotonic() - t > cls.GRACE_S]
        for d in old:
            del cls._closed[d]
            cls._domains.pop(d, None)
            if cls._auth is not None:
                cls._auth.credentials_providers.pop(d, None)

    @classmethod
    def callback(cls, domain: str, key: bytes) -> bool:
        """ZAP's question (on the handler's thread): may the client with Z85 public ``key`` connect?"""
        with cls._lock:
            entry = cls._domains.get(domain)
        if entry is not None and entry[0] == key:
            return True
        if entry is not None:
            entry[1](key)
        return False


register_domain = _Zap.register
unregister_domain = _Zap.unregister
