"""``jaxckpt.orbax.TieredCheckpointManager``: in memory every N steps, standard Orbax on disk every M steps.

The shape Orbax's emergency ``CheckpointManager`` users know (a fast local tier and a persistent tier), on
jaxckpt's engine::

    mngr = TieredCheckpointManager("/ckpt/run1", memory_interval=1, persistent_interval=100, max_to_keep=2)
    for step in range(start, steps):
        state = train_step(state, batch)
        mngr.save(step, state, extra={"data": loader.state(), "rng": rng.bit_generator.state})
    mngr.wait_until_finished()
    r = mngr.restore(target=abstract_state)   # r.state, r.extra, r.step, r.source ("memory", "persistent", ...)

Unlike the emergency manager it needs no second data-parallel replica (any sharding works, one process or
many), honours the target's shardings on restore (resharding from memory or from disk), and saves small
non-array state (data-iterator position, ``np.random.Generator.bit_generator.state``, step, config dict) as JSON
beside the arrays: inside the in-memory snapshot, and as Orbax's ``JsonSave`` item ``extra`` on disk. The disk
tier is exactly what ``ocp.CheckpointManager`` writes (``<dir>/<step>/default`` + ``extra``), so plain Orbax
restores it: ``ocp.CheckpointManager(dir).restore(step, args=ocp.args.StandardRestore(target))``.

Steps. ``save(step, ...)`` snapshots to memory when ``step % memory_interval == 0`` or ``step %
persistent_interval == 0`` (a persisted step goes through memory first) or ``force=True``, and returns whether
it did. Every committed multiple of ``persistent_interval`` is written to disk in the background (skipped, with a
warning, if two persists are already pending: the tier never stalls training). ``all_steps()`` lists memory
and disk steps; ``restore()`` takes the newest of either, from memory when it holds the step, else from disk.
"""
from __future__ import annotations

import logging
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from jaxckpt.config import Config
from jaxckpt.errors import ConfigError, NoCheckpointError
from jaxckpt.core.extra import encode_extra
from jaxckpt.jax.checkpointer import Checkpointer, Restored, SaveHandle

log = logging.getLogger("jaxckpt.orbax.tiered")

__all__ = ["TieredCheckpointManager", "Restored"]


class TieredCheckpointManager:
    """In-memory snapshots every ``memory_interval`` steps, standard Orbax checkpoints every ``persistent_interval``.

    ``directory``: the persistent tier's root (``Config.persistent_dir``). ``config``: everything else (store,
    protection, budgets, ...); the arguments here override its ``keep`` (``max_to_keep``: snapshots kept in
    memory), ``persistent_interval`` and ``persistent_keep`` (``persistent_max_to_keep``: steps kept on disk).
    """

    def __init__(self, directory: epath.PathLike, *, config: Config | None = None, memory_interval: int = 1,
                 persistent_interval: int | None = None, max_to_keep: int | None = None,
                 persistent_max_to_keep: int | None = None) -> None:
        config = (config or Config()).with_env()
        interval = config.persistent_interval if persistent_interval is None else persistent_interval
        for name, v in (("memory_interval", memory_interval), ("persistent_interval", interval)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"TieredCheckpointManager: {name}={v!r} must be an int of at least 1")
        changes: dict[str, Any] = {"persistent_dir": str(directory), "persistent_interval": interval}
        if max_to_keep is not None:
            changes["keep"] = max_to_keep
        if persistent_max_to_keep is not None:
            changes["persistent_keep"] = persistent_max_to_keep
        self.config = config.replace(**changes)
        self.directory = epath.Path(directory)
        self.memory_interval, self.persistent_interval = memory_interval, interval
        self.checkpointer = Checkpointer(self.config)
        self.last_handle: SaveHandle | None = None

    # ------------------------------------------------------------------------------------------------ save
    def should_save(self, step: int) -> bool:
        """True when ``save(step, ...)`` snapshots (a multiple of either interval)."""
        return step % self.memory_interval == 0 or step % self.persistent_interval == 0

    def save(self, step: int, state: Any, extra: Any = None, *, force: bool = False) -> bool:
        """Snapshot ``state`` (and JSON-able ``extra``) as ``step`` if it is due (or ``force``); returns at once.

        Returns whether a snapshot was started. Errors as ``Checkpointer.save``; a non-JSON ``extra`` raises
        UnsupportedLeafError naming its path before anything is saved.
        """
        if not (force or self.should_save(step)):
            return False
        if extra is not None:
            encode_extra(extra)  # refuse a bad extra here, on the caller's thread, with its path
        self.last_handle = self.checkpointer.save(step, state, extra=extra)
        return True

    # --------------------------------------------------------------------------------------------- listing
    def memory_steps(self) -> list[int]:
        """Committed steps held in memory, ascending."""
        return self.checkpointer.all_steps()

    def persisted_steps(self) -> list[int]:
        """Steps finalized in the persistent directory, ascending."""
        return self.checkpointer.persister.steps()

    def all_steps(self) -> list[int]:
        """Every step restore can serve (memory or disk), ascending."""
        return sorted(set(self.memory_steps()) | set(self.persisted_steps()))

    def latest_step(self) -> int | None:
        """The newest step in memory or on disk, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # --------------------------------------------------------------------------------------------- restore
    def restore(self, step: int | None = None, target: Any = None) -> Restored:
        """Step ``step`` (default: the newest of either tier) laid out like ``target``; returns a ``Restored``.

        ``target``: pytree of ``jax.ShapeDtypeStruct`` with shardings (or arrays), or an
        ``ocp.args.StandardRestore``/``PyTreeRestore`` whose item is one; arrays come back with exactly those
        shardings. ``Restored.extra`` is the extra state saved with the step, ``Restored.source`` the tier used.
        """
        if isinstance(target, (ocp.args.StandardRestore, ocp.args.PyTreeRestore)):
            target = target.item
        if step is None:
            step = self.latest_step()
            if step is None:
                raise NoCheckpointError(f"no step in memory (job {self.config.job_id!r}) nor in {self.directory}")
        out = self.checkpointer.restore_with_extra(target, step)
        log.info("tiered restore of step %d from %s", out.step, out.source)
        return out

    # -------------------------------------------------------------------------------------------- lifetime
    def wait_until_finished(self, timeout: float | None = None) -> None:
        """Block until every save is committed in memory and every persist it started is on disk."""
        self.checkpointer.wait(timeout)
        self.checkpointer.persister.wait(timeout)

    def close(self) -> None:
        """Finish pending saves and persists, then free the memory tier."""
        self.checkpointer.close()

    def __enter__(self) -> "TieredCheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
