"""A Coordinator over a private directory: the key-value store of a multi-process job without JAX.

Numpy-only trainers (``jaxckpt chaos``) run the real commit, recovery and peer protocols across processes with
it, for a fraction of the start-up cost of ``jax.distributed``. Each key is one file, written to a temporary
name and renamed, so a reader sees a value whole or not at all; ``get`` polls with a time-out. A restarted job
uses a new directory, as a restarted JAX job gets a new coordination service.
"""
from __future__ import annotations

import os
import time
import urllib.parse

POLL_S = 0.002


class FileCoordinator:
    """Process ``process_index`` of ``process_count``'s coordinator over ``directory`` (created 0700)."""

    def __init__(self, directory: str, process_index: int, process_count: int) -> None:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.directory = directory
        self.process_index, self.process_count = process_index, process_count

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, urllib.parse.quote(key, safe=""))

    def set(self, key: str, value: bytes) -> None:
        """Set ``key`` (atomically: readers never see a partial value)."""
        path = self._path(key)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, bytes(value))
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def try_get(self, key: str) -> bytes | None:
        """The value of ``key`` now, or None."""
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def delete(self, key: str) -> None:
        """Remove ``key`` (no error if it is not set)."""
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    def get(self, key: str, timeout_s: float) -> bytes:
        """Wait up to ``timeout_s`` for ``key``; TimeoutError after that."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.try_get(key)
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                raise TimeoutError(f"key {key!r} not set within {timeout_s:g}s")
            time.sleep(POLL_S)
