"""The JAX coordination service's key-value store as a jaxckpt Coordinator (no device collectives)."""
from __future__ import annotations

import jax
from jax._src import distributed


class JaxCoordinator:
    """Adapter over the client ``jax.distributed.initialize`` created in this process."""

    def __init__(self) -> None:
        client = distributed.global_state.client
        if client is None:
            raise RuntimeError("jax.distributed.initialize() has not been called in this process")
        self._client = client
        self.process_index = jax.process_index()
        self.process_count = jax.process_count()

    def set(self, key: str, value: bytes) -> None:
        self._client.key_value_set_bytes(key, bytes(value))

    def get(self, key: str, timeout_s: float) -> bytes:
        try:
            return self._client.blocking_key_value_get_bytes(key, max(1, int(timeout_s * 1000)))
        except Exception as e:  # the client raises a generic XlaRuntimeError on DEADLINE_EXCEEDED
            if "DEADLINE" in str(e).upper() or "timed out" in str(e).lower():
                raise TimeoutError(f"key {key!r} not set within {timeout_s:.1f}s") from None
            raise

    def try_get(self, key: str) -> bytes | None:
        try:
            return self._client.key_value_try_get_bytes(key)
        except Exception as e:
            if "NOT_FOUND" in str(e).upper():
                return None
            raise

    def delete(self, key: str) -> None:
        # The service deletes the key and any keys below ``key/``; our keys never have children.
        self._client.key_value_delete(key)
