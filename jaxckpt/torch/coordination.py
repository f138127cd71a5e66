"""``torch.distributed``'s key-value store as a jaxckpt Coordinator (the commit protocol; no collectives).

The commit thread blocks on store keys for up to ``commit_timeout_s``. A TCPStore client serialises its
operations, so blocking waits on the process group's own client would hold up whatever else uses it; when the
store is a TCPStore we therefore open our own clients to the same server, one per thread: the commit thread and
the protection thread (``Config.protection``) each block on keys that the other process's other thread sets, and
with one shared client each process's wait would hold up its own ``set`` that the other waits for (a deadlock
until the time-out).

A store may outlive the job that used it: torchrun hands every round of its rendezvous the same store (unless
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), and a user's TCPStore or FileStore may serve several runs. The rounds of
a killed incarnation leave keys there (the results of its last rounds, which nobody read to the end), and a
restarted job counts its rounds from 0 again: a rank would take the old results for its own (measured: a
restarted rank read the earlier incarnation's abort of a step it then saved fine). So the coordinator of a
process group keys its rounds under a token rank 0 draws and broadcasts over the group itself, once per group:
the group is this incarnation's, whatever the store.
"""
from __future__ import annotations

import datetime
import hashlib
import logging
import os
import threading

import torch
import torch.distributed as dist

from jaxckpt.errors import ConfigError

log = logging.getLogger("jaxckpt.torch.coordination")


def _tcp_store(store: dist.Store) -> dist.TCPStore | None:
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, dist.TCPStore) else None


class TorchStoreCoordinator:
    """Coordinator over a ``torch.distributed`` Store (a TCPStore, FileStore, HashStore, ...).

    Made directly over a store that an earlier run of the job used, give ``prefix`` a value of this run's
    (:meth:`from_process_group` keys the rounds under a token of the process group: :func:`incarnation`).
    """

    def __init__(self, store: dist.Store, process_index: int, process_count: int, *, prefix: str = "",
                 dedicated_client: bool = True, timeout_s: float = 300.0) -> None:
        tcp = _tcp_store(store) if dedicated_client else None
        self._server = None if tcp is None else (tcp.host, tcp.port, datetime.timedelta(seconds=timeout_s))
        self._prefix = prefix
        self._shared = dist.PrefixStore(prefix, store) if prefix else store
        self._local = threading.local()
        self.process_index, self.process_count = process_index, process_count

    @property
    def _store(self) -> dist.Store:
        """This thread's client (TCPStore), or the one shared store (other store types)."""
        if self._server is None:
            return self._shared
        s = getattr(self._local, "store", None)
        if s is None:
            host, port, timeout = self._server
            s = dist.TCPStore(host, port, None, False, timeout=timeout, wait_for_workers=False)
            s = self._local.store = dist.PrefixStore(self._prefix, s) if self._prefix else s
        return s

    @classmethod
    def from_process_group(cls, group: dist.ProcessGroup | None = None) -> "TorchStoreCoordinator":
        """The coordinator of ``group`` (default: the world) over the default store of ``init_process_group``."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed.init_process_group() has not been called in this process")
        store = dist.distributed_c10d._get_default_store()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        prefix = f"run-{incarnation(group)}"
        if group is not None and group is not dist.group.WORLD:
            # Sub-groups share the default store: keep their keys apart by the group's member ranks.
            ranks = dist.get_process_group_ranks(group)
            prefix += "/pg-" + hashlib.blake2b(repr(ranks).encode(), digest_size=6).hexdigest()
        return cls(store, rank, size, prefix=prefix)

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, bytes(value))

    def get(self, key: str, timeout_s: float) -> bytes:
        try:
            self._store.wait([key], datetime.timedelta(seconds=max(0.001, timeout_s)))
        except dist.DistStoreError as e:
            if "timeout" in str(e).lower():
                raise TimeoutError(f"key {key!r} not set within {timeout_s:.1f}s") from None
            raise
        return bytes(self._store.get(key))

    def try_get(self, key: str) -> bytes | None:
        if not self._store.check([key]):
            return None
        return bytes(self._store.get(key))

    def delete(self, key: str) -> None:
        self._store.delete_key(key)  # False when it was not set: nothing to do


_tokens: dict[dist.ProcessGroup, str] = {}  # holds its groups: a new group never reuses a cached one's identity
_tokens_lock = threading.Lock()


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors the collectives of ``group`` (default: the world) carry: the CPU where the group
    has a backend for it (``"gloo"``, ``"mpi"``, ``"cpu:gloo,cuda:nccl"``), else this rank's current GPU (an
    ``"nccl"`` group). A ConfigError where it has neither (a GPU-only backend in a process that sees no GPU)."""
    pg = group if group is not None else dist.group.WORLD
    config = str(dist.get_backend_config(pg)).lower()  # "cpu:gloo,cuda:nccl": a backend per device type
    devices = {part.split(":", 1)[0].strip() for part in config.split(",") if ":" in part}
    if "cpu" in devices or (not devices and any(b in config for b in ("gloo", "mpi", "ucc"))):
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    raise ConfigError(f"process group {config!r} has no backend for CPU tensors and this process sees no GPU: "
                      f"jaxckpt's collectives on it (the run token, Config.restore_collective) need one; give it "
                      f"a CPU backend, for instance init_process_group(\"cpu:gloo,cuda:nccl\")")


def incarnation(group: dist.ProcessGroup | None = None) -> str:
    """A token every rank of ``group`` (default: the world) shares and no other process group had: drawn by its
    rank 0 and broadcast over the group, the first time a rank asks (a collective then: every rank asks at the
    same point, as every rank makes its Checkpointer), on the device the group's backend serves
    (:func:`collective_device`)."""
    pg = group if group is not None else dist.group.WORLD
    with _tokens_lock:
        token = _tokens.get(pg)
        if token is not None:
            return token
        device = collective_device(pg)
        drawn = torch.frombuffer(bytearray(os.urandom(16)), dtype=torch.int64)
        t = drawn.to(device) if dist.get_rank(pg) == 0 else torch.zeros(2, dtype=torch.int64, device=device)
        dist.broadcast(t, dist.get_global_rank(pg, 0), group=pg)
        token = t.cpu().numpy().tobytes().hex()
        _tokens[pg] = token
        log.debug("rounds of process group %s keyed under run-%s", pg, token)
        return token
