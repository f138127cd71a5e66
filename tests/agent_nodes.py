"""Simulated nodes of one host for the tests that drive node agents directly: a node is a directory under a
test's base directory, its agent started by the first store opened there."""
from __future__ import annotations

import os
import time

from jaxckpt.backends.agent import peer_files
from jaxckpt.backends.shm import ShmStore
from jaxckpt.config import Config


def node_store(base: str, job: str, node: str, process: int, process_count: int = 2) -> ShmStore:
    """The shm store of ``process`` on simulated node ``node`` (its agent in ``base/node``)."""
    return ShmStore(Config(store="shm", job_id=job, shm_dir=f"{base}/{node}", peer_timeout_s=20.0),
                    process_index=process, process_count=process_count)


def peer_of(base: str, node: str, timeout_s: float = 30.0) -> list:
    """[peer address, token] that ``node``'s agent published (AssertionError if none within ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while (info := peer_files.read_peer_info(f"{base}/{node}")) is None:
        assert time.monotonic() < deadline, f"{node}'s agent published no peer address within {timeout_s:g} s"
        time.sleep(0.05)
    return [info["address"], info["token"]]


def flip_chunk(node_dir: str, process: int, step: int, path: str) -> None:
    """One flipped bit in the first chunk of ``path`` of ``step`` of ``process``, in the memory of the agent of
    ``node_dir`` (its slot record names the segment, its manifest the chunk's offset)."""
    import msgpack

    from jaxckpt.core import manifest as mf

    with open(os.path.join(node_dir, f"rec-p{process}-s{step}"), "rb") as f:
        rec = msgpack.unpackb(f.read(), raw=False)
    chunk = mf.decode(rec["manifest"]).array(path).chunks[0]
    with open(os.path.join(node_dir, rec["seg"]), "r+b") as f:
        f.seek(chunk.offset + 3)
        byte = f.read(1)[0]
        f.seek(chunk.offset + 3)
        f.write(bytes([byte ^ 0x10]))
