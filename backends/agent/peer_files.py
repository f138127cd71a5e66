"""Where an agent serves peers, as files in its directory: read by every restoring process, written by the agent.

Two files in the agent's directory (mode 0600, like everything there) tell restoring processes how to reach it:

  peer.token   the token its server accepts: written by the trainer that spawns the agent when
               ``Config.peer_token`` is set, else made by the agent (``JAXCKPT_PEER_TOKEN``, or random); an
               agent restarted on the directory keeps it
  peer.addr    msgpack map: address, node, job, generation, pid, directory, and ``server_key``, the CURVE
               public key of the server ("" without CURVE; its secret key never leaves the agent process, and
               a restarted agent makes a new pair and writes a new file); written once the server listens

A restoring process reads these files for its own node's agent and for ``Config.agent_dirs``, and exchanges
what it found with the other processes of its job through the coordination service (``jaxckpt.core.catalog``).
Apart from the server (``serve.py``) so that a trainer reading them imports none of the agent's own state.
"""
from __future__ import annotations

import logging
import os
import secrets
from typing import Any

import msgpack

from jaxckpt.backends.agent.protocol import read_private, remove_file, write_private
from jaxckpt.errors import AgentError

log = logging.getLogger("jaxckpt.backends.agent.daemon")

PEER_NAME, TOKEN_NAME = "peer.addr", "peer.token"
TOKEN_ENV = "JAXCKPT_PEER_TOKEN"
MAX_FILE_BYTES = 64 << 10


# ------------------------------------------------------------------------------------------------ the files
def write_token(directory: str, token: bytes) -> None:
    """Store the peer token the agent of ``directory`` will serve with (mode 0600)."""
    path = os.path.join(directory, TOKEN_NAME)
    write_private(path, bytes(token), f"{path}.{os.getpid()}.tmp")


def read_token(directory: str) -> bytes | None:
    """The peer token of the agent of ``directory``, or None."""
    return read_private(os.path.join(directory, TOKEN_NAME), MAX_FILE_BYTES) or None


def load_or_make_token(directory: str) -> bytes:
    """The agent's token: the directory's token file, else ``JAXCKPT_PEER_TOKEN``, else random (then stored)."""
    token = read_token(directory)
    if token:
        return token
    token = os.environ.get(TOKEN_ENV, "").encode() or secrets.token_hex(32).encode()
    write_token(directory, token)
    return token


def write_peer_info(directory: str, info: dict[str, Any]) -> None:
    """Publish the agent's peer address (and node, job, generation) in its directory."""
    path = os.path.join(directory, PEER_NAME)
    write_private(path, msgpack.packb(info, use_bin_type=True), f"{path}.{os.getpid()}.tmp")


def read_peer_info(directory: str) -> dict[str, Any] | None:
    """The agent's published peer info (with its token under ``"token"``), or None if it serves no peers."""
    try:
        raw = read_private(os.path.join(directory, PEER_NAME), MAX_FILE_BYTES)
        token = read_token(directory)
    except (AgentError, OSError) as e:
        log.warning("cannot read the peer info of the agent at %s: %s", directory, e)
        return None
    if raw is None or token is None:
        return None
    try:
        info = msgpack.unpackb(raw, raw=False, max_str_len=MAX_FILE_BYTES, max_bin_len=MAX_FILE_BYTES)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types on garbage
        log.warning("malformed %s in %s: %s", PEER_NAME, directory, e)
        return None
    if not isinstance(info, dict) or not all(isinstance(info.get(k), str) for k in ("address", "node", "generation")) \
            or not isinstance(info.get("server_key", ""), str):
        log.warning("malformed %s in %s", PEER_NAME, directory)
        return None
    return {**info, "token": token, "directory": directory}


def remove_peer_files(directory: str) -> None:
    """Remove the peer files (the agent shuts down: its directory goes)."""
    for name in (PEER_NAME, TOKEN_NAME):
        remove_file(os.path.join(directory, name))
