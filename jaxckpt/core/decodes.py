"""Manifests decoded once for the same bytes: what the catalog's opens and the adoption hand each other.

A relaunch's adoption decodes the step it will restore, and a near open (its node's manifests first) decodes what
a wider open that follows would decode again; a 4,096-leaf state's manifests take 130-170 ms to decode here.
Decodings are keyed by the bytes' crc32c and length and handed out only for equal bytes.
"""
from __future__ import annotations

from jaxckpt.core import manifest as mf
from jaxckpt.core.checksum import crc32c

Key = tuple[int, int]
Kept = dict[Key, tuple[bytes, mf.Manifest]]


def key(data: bytes | memoryview) -> Key:
    """Where a decoding of ``data`` is kept: its crc32c and length."""
    return crc32c(data), len(data)


class Decodes:
    """The manifests one open decodes: those in ``reuse`` are taken again when the bytes are the same, and with
    ``keep`` the open keeps its own (``kept``) for the open that may follow it."""

    def __init__(self, reuse: Kept, keep: bool) -> None:
        self._reuse = reuse
        self.kept: Kept = {}
        self._keep = keep

    def decode(self, data: bytes | memoryview, source: str) -> mf.Manifest:
        """``data`` decoded (``source`` names it in a ManifestError), or the decoding kept for the same bytes."""
        k = key(data)
        got = self._reuse.get(k)
        m = got[1] if got is not None and got[0] == data else mf.decode(data, source=source)
        if self._keep:
            self.kept[k] = (bytes(data), m)  # a copy: the bytes are a view of memory the open pins
        return m
