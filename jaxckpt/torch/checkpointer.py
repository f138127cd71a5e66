"""``jaxckpt.torch.Checkpointer``: asynchronous in-memory snapshots of torch state dicts.

The shared face (``jaxckpt.frontend.Checkpointer``) with the torch front end (``jaxckpt.torch.frontend``): save
path, three hops as in the JAX front end: the front end (flatten the state dict, host reads per tensor) -> the
core engine (plan, copy + checksum on worker threads) -> the store (slot commit). Planning, snapshots,
manifests, commit, retention and the restore driver are the core's; nothing here duplicates them.

On restore each process assembles the boxes its target needs; bytes held by another process of the job come
through the core's peer transport (``jaxckpt.backends.peers``), so a 2-rank job can restore onto other
placements and a sub-mesh can restore what a larger mesh saved.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch.distributed as dist

from jaxckpt.config import Config
from jaxckpt.core.coordination import Coordinator
from jaxckpt.core.engine import CheckpointEngine, SaveHandle
from jaxckpt.frontend.checkpointer import Checkpointer as Face
from jaxckpt.node_identity import torchrun_store_hazard
from jaxckpt.torch.frontend import TorchFrontend

log = logging.getLogger("jaxckpt.torch")
_told_store_hazard = False  # once per process: every Checkpointer of a worker would say the same

__all__ = ["Checkpointer", "SaveHandle"]


class Checkpointer(Face):
    """In-memory asynchronous checkpointing of torch state dicts (docs/design.md states the guarantees).

    ``defer_reads=False`` (default): ``save()`` returns once the snapshot no longer reads live tensors, so the
    caller may update them in place right away. On CPU that means it waits for the host copy (done by the
    worker threads in parallel); on CUDA it only queues the copies and orders the current stream after them.
    ``defer_reads=True``: ``save()`` returns at once and the copy overlaps the caller's next forward/backward;
    the caller MUST call :meth:`wait_for_reads` before anything writes the saved tensors in place
    (``optimizer.step()``, a training-mode forward that updates BatchNorm statistics, ``load_state_dict``).

    ``engine``: attach to an existing core engine (e.g. ``jaxckpt.Checkpointer().engine``) so a JAX and a torch
    front end share one store, one commit protocol and one retention policy; ``close()`` then leaves it open.
    ``Config.persistent_dir`` is refused (ConfigError): this front end writes no persistent tier.
    """

    def __init__(self, config: Config | None = None, process_group: dist.ProcessGroup | None = None, *,
                 coordinator: Coordinator | None = None, engine: CheckpointEngine | None = None,
                 defer_reads: bool = False) -> None:
        global _told_store_hazard
        hazard = None if _told_store_hazard else torchrun_store_hazard()
        if hazard:
            # Said in the first attempt, where a user reads it before the restart that would hang.
            log.warning("%s", hazard)
            _told_store_hazard = True
        super().__init__(TorchFrontend(process_group), config, coordinator=coordinator, engine=engine)
        self.frontend.bind(self.engine)
        self.process_group = process_group
        self.defer_reads = defer_reads

    def save(self, step: int, state: Any, *, extra: Any = None) -> SaveHandle:
        """Start a snapshot of ``state`` (nested dicts/lists of tensors, DTensors, generators, values) as ``step``.

        The snapshot equals ``state`` at this call bit for bit (with ``defer_reads=True``, provided
        :meth:`wait_for_reads` is called before the state is written in place). Raises StepError if ``step`` is
        not newer than the last saved step, UnsupportedLeafError for a leaf it cannot hold, BudgetExceededError
        when the store's memory budget is full. Every process of the group must call it with a state of the
        same structure, shapes, dtypes and placements.
        """
        t0 = time.perf_counter()
        self.frontend.last_reads = None
        try:
            handle = super().save(step, state, extra=extra)
        except BaseException:
            self.frontend.drop_reads()
            raise
        if self.frontend.last_reads is not None:
            self.frontend.last_reads.handle = handle
        if not self.defer_reads:
            self.frontend.host.wait_for_reads()
            handle.save_call_seconds = time.perf_counter() - t0
        return handle

    def wait_for_reads(self, timeout: float | None = None) -> None:
        """Return once no pending snapshot reads the live tensors any more; call it before updating them in place.

        CPU: blocks until the worker threads have copied the tensors into host memory. CUDA: makes the current
        stream wait for the device-to-host copies (kernels queued afterwards run after them; the CPU does not
        wait). A no-op when nothing is pending; with ``defer_reads=False`` ``save()`` has already done it.
        """
        self.frontend.host.wait_for_reads(timeout)

    def restore(self, target: Any = None, step: int | None = None, *, in_place: bool = False) -> Any:
        """The state saved at ``step`` (default: the newest committed), shaped like ``target``.

        ``target`` is a state dict like the one saved (e.g. ``{"model": model.state_dict(), "optim":
        opt.state_dict()}``): tensors come back with the target's dtype, shape and device, DTensors with the
        target's mesh and placements (resharded by the core planner), ``torch.Generator`` targets get
        ``set_state()`` (always in place), ``PerRank(t)`` targets come back as this process's tensor. Meta-device
        tensors ask for new CPU tensors. ``in_place=True`` copies into the target's tensors and returns them.
        A mismatch in structure, shape or dtype raises TargetMismatchError naming the path. Without a target,
        nested dicts/lists of CPU tensors come back (optimizer ``state`` keys stay ints). A restore of the newest
        step falls back to an older one in the same call when it cannot be read bit for bit.
        """
        return self.restore_with_extra(target, step, in_place=in_place).state

    def close(self) -> None:
        """Finish in-flight saves, stop the threads and free the store (unless the engine was passed in)."""
        super().close()
        self.frontend.host.close()
