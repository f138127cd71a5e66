"""Orbax integration: ``SnapshotHandler``, an ``AsyncCheckpointHandler`` that keeps the bytes in jaxckpt memory.

Usage inside a plain ``ocp.CheckpointManager``::

    handler = SnapshotHandler(config=jaxckpt.Config(keep=3))
    registry = ocp.DefaultCheckpointHandlerRegistry()
    registry.add("state", SnapshotSave, handler)
    registry.add("state", SnapshotRestore, handler)      # the same instance: it holds the snapshots
    mngr = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(max_to_keep=3), handler_registry=registry)
    mngr.save(step, args=ocp.args.Composite(state=SnapshotSave(state)))
    state = mngr.restore(step, args=ocp.args.Composite(state=SnapshotRestore(target)))["state"]

The snapshot's bytes live in the wrapped :class:`jaxckpt.Checkpointer`'s store; the item directory Orbax hands the
handler receives only a small JSON marker (``jaxckpt_snapshot.json``: step, job id, bytes, process count), so
Orbax's own step bookkeeping (``all_steps``, ``latest_step``, ``max_to_keep`` deleting step directories) works as
usual. Restore follows the marker to the in-memory snapshot, onto the target's shardings.

The step number. Orbax does not pass the step to item handlers, only a directory such as
``<root>/<step>.orbax-checkpoint-tmp/<item>.orbax-checkpoint-tmp``. ``SnapshotSave(state, step=k)`` sets it
explicitly; without it the step is parsed from the parent (step) directory's name with Orbax's own
``step_from_checkpoint_name``, the function its standard name format uses to list steps, so with that format the
snapshot's step is the step ``CheckpointManager.all_steps()`` reports. Pass ``step=`` with a custom
``step_name_format`` or when using the handler outside a CheckpointManager (a bare ``ocp.Checkpointer`` saving
to a user's path is recognised and refused without it). The marker records the step, so restore never parses.

Retention. ``Config.keep`` bounds the snapshots held in memory (set it to at least ``max_to_keep`` to restore
every step Orbax lists). When Orbax deletes a step directory the handler frees that step's snapshot at its next
save or restore, and in any case restore only serves a step through a marker Orbax still holds; a marker whose
snapshot memory no longer holds raises :class:`jaxckpt.errors.StepNotFoundError` naming the step.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from jaxckpt.config import Config
from jaxckpt.errors import ClosedError, ManifestError, StepError, StepNotFoundError
from jaxckpt.jax.checkpointer import Checkpointer, SaveHandle

log = logging.getLogger("jaxckpt.orbax")

__all__ = ["SnapshotHandler", "SnapshotRestore", "SnapshotSave", "MARKER_NAME", "default_checkpointer"]

MARKER_NAME = "jaxckpt_snapshot.json"
MARKER_FORMAT = "jaxckpt-orbax-snapshot"
MARKER_VERSION = 1
_TMP = ocp.path.step.TMP_DIR_SUFFIX

_default: Checkpointer | None = None
_default_lock = threading.Lock()


def default_checkpointer() -> Checkpointer:
    """The process-wide Checkpointer (``Config().with_env()``) shared by every handler built without arguments.

    Sharing it means ``registry.add(item, SnapshotSave)`` and ``registry.add(item, SnapshotRestore)``, which make
    two handler instances, still restore what the other saved.
    """
    global _default
    with _default_lock:
        if _default is not None:
            try:
                _default.engine.check_open()
            except ClosedError:
                _default = None
        if _default is None:
            _default = Checkpointer(Config())
        return _default


def _final_name(name: str) -> str:
    """A directory name without Orbax's temporary suffix (``3.orbax-checkpoint-tmp`` -> ``3``)."""
    return name.split(_TMP, 1)[0]


def step_from_directory(directory: epath.PathLike) -> int | None:
    """The step of an item directory laid out by ``CheckpointManager`` (``<root>/<step dir>/<item>``), or None."""
    directory = epath.Path(directory)
    if _TMP in directory.name and _TMP not in directory.parent.name:
        return None  # a temporary item directory right under a user's directory: a bare Checkpointer, no step dir
    name = _final_name(directory.parent.name)
    try:
        return ocp.path.step.step_from_checkpoint_name(name)
    except ValueError:
        return None


class SnapshotHandler(ocp.AsyncCheckpointHandler):
    """An Orbax item handler whose bytes stay in a :class:`jaxckpt.Checkpointer`'s in-memory store.

    ``checkpointer``: use this one (the caller closes it). Else ``config``: a Checkpointer of its own, closed by
    :meth:`close`. Neither: the shared :func:`default_checkpointer`. Register the same instance for
    :class:`SnapshotSave` and :class:`SnapshotRestore`.
    """

    def __init__(self, checkpointer: Checkpointer | None = None, *, config: Config | None = None,
                 primary_host: int = 0) -> None:
        if checkpointer is not None and config is not None:
            raise TypeError("SnapshotHandler: pass a checkpointer or a config, not both")
        self._owned = checkpointer is None and config is not None
        if checkpointer is None:
            checkpointer = Checkpointer(config) if config is not None else default_checkpointer()
        self.checkpointer = checkpointer
        self._primary_host = primary_host
        self._lock = threading.Lock()
        # step -> (item directory while Orbax writes it, item directory once finalized): how to tell a step
        # Orbax deleted (max_to_keep) from one it has not yet renamed into place.
        self._dirs: dict[int, tuple[epath.Path, epath.Path, SaveHandle]] = {}
        self._marked: set[int] = set()  # steps whose commit future ran: their directory existed

    # ------------------------------------------------------------------------------------------------ save
    async def async_save(self, directory: epath.Path, args: "SnapshotSave") -> list[ocp.future.Future]:
        """Start the snapshot (returns once it is pinned) and a commit future that writes the marker."""
        return self._start_save(epath.Path(directory), args)

    def save(self, directory: epath.Path, args: "SnapshotSave") -> None:
        """Save synchronously: snapshot, wait for its commit, write the marker."""
        for f in self._start_save(epath.Path(directory), args):
            f.result()

    def _start_save(self, directory: epath.Path, args: "SnapshotSave") -> list[ocp.future.Future]:
        if not isinstance(args, SnapshotSave):
            raise TypeError(f"SnapshotHandler.save expects args=SnapshotSave(...), got {type(args).__name__}")
        parsed = step_from_directory(directory)
        step = args.step if args.step is not None else parsed
        if step is None:
            raise StepError(f"{directory}: cannot tell the step from the directory name (not a CheckpointManager "
                            f"step layout); pass SnapshotSave(state, step=...)")
        if args.step is not None and parsed is not None and parsed != args.step:
            log.warning("SnapshotSave(step=%d) differs from the step %d in %s; the marker records %d",
                        args.step, parsed, directory, args.step)
        self.prune()
        # Returns once the state is pinned: a donating next step cannot change the snapshot.
        handle = self.checkpointer.save(step, args.state)
        final = directory.parent.parent / _final_name(directory.parent.name) / _final_name(directory.name)
        with self._lock:
            self._dirs[step] = (directory, final, handle)
        marker = {"format": MARKER_FORMAT, "version": MARKER_VERSION, "step": step,
                  "job_id": self.checkpointer.config.job_id, "store": self.checkpointer.config.store,
                  "process_count": jax.process_count(), "nbytes": handle.nbytes}
        write = ocp.multihost.is_primary_host(self._primary_host)

        async def commit() -> None:
            handle.result()
            if write:  # the item directory exists by now: the future awaited Orbax's creation signal
                (directory / MARKER_NAME).write_text(json.dumps(marker))
            with self._lock:
                self._marked.add(step)

        return [ocp.future.CommitFutureAwaitingContractedSignals(commit(), name=f"jaxckpt_commit_{step}")]

    # --------------------------------------------------------------------------------------------- restore
    def restore(self, directory: epath.Path, args: "SnapshotRestore | None" = None) -> Any:
        """The snapshot the marker in ``directory`` names, from memory, on ``args.target``'s shardings."""
        directory = epath.Path(directory)
        marker = self.read_marker(directory)
        step, job = marker["step"], marker["job_id"]
        if job != self.checkpointer.config.job_id:
            raise StepNotFoundError(f"step {step}: {directory} was saved by jaxckpt job {job!r}, this handler "
                                    f"serves job {self.checkpointer.config.job_id!r}")
        self.prune()
        held = self.checkpointer.store.steps()
        if step not in held:
            raise StepNotFoundError(
                f"step {step}: Orbax lists {directory} but jaxckpt memory (store "
                f"{self.checkpointer.config.store!r}) no longer holds its snapshot (held steps: {held or 'none'}; "
                f"Config.keep={self.checkpointer.config.keep})")
        target = args.target if args is not None else None
        return self.checkpointer.restore(target, step=step)

    def metadata(self, directory: epath.Path) -> dict[str, Any] | None:
        """The marker of ``directory`` (step, job id, bytes, process count), or None without one."""
        try:
            return self.read_marker(epath.Path(directory))
        except StepNotFoundError:
            return None

    @staticmethod
    def read_marker(directory: epath.Path) -> dict[str, Any]:
        """The validated marker in ``directory``; StepNotFoundError if there is none, ManifestError if malformed."""
        path = epath.Path(directory) / MARKER_NAME
        if not path.exists():
            step = step_from_directory(directory)
            what = f"step {step}" if step is not None else "this item"
            raise StepNotFoundError(f"{what}: no jaxckpt snapshot marker at {path} (Orbax deleted the step, or it "
                                    f"was not saved with SnapshotSave)")
        try:
            marker = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError(f"{path}: marker is not valid JSON ({e})") from None
        if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT:
            raise ManifestError(f"{path}: not a jaxckpt snapshot marker")
        if marker.get("version") != MARKER_VERSION:
            raise ManifestError(f"{path}: marker version {marker.get('version')!r} is not supported "
                                f"(expected {MARKER_VERSION})")
        if not isinstance(marker.get("step"), int) or not isinstance(marker.get("job_id"), str):
            raise ManifestError(f"{path}: marker lacks an int step or a job id")
        return marker

    # ------------------------------------------------------------------------------------------- retention
    def prune(self) -> list[int]:
        """Free the snapshots of steps whose Orbax item directory is gone (``max_to_keep``); returns them."""
        dropped = []
        with self._lock:
            decided = {s for s, (_, _, h) in self._dirs.items() if h.done()}
            held = set(self.checkpointer.store.steps())  # read after `decided`: a decided step is in it if kept
            for step, (tmp, final, _) in list(self._dirs.items()):
                if step in decided and step not in held:
                    del self._dirs[step]  # Config.keep already let it go
                    self._marked.discard(step)
                # Only steps whose directory existed (the commit future ran) can have been deleted; tmp first:
                # Orbax renames tmp -> final, so one of the two exists unless it deleted the step.
                elif step in self._marked and not tmp.exists() and not final.exists():
                    del self._dirs[step]
                    self._marked.discard(step)
                    dropped.append(step)
        for step in dropped:
            log.info("step %d: Orbax deleted its directory; freeing the in-memory snapshot", step)
            self.checkpointer.store.delete(step)
        return dropped

    def close(self) -> None:
        """Close the Checkpointer if this handler created it."""
        if self._owned:
            self.checkpointer.close()


@ocp.args.register_with_handler(SnapshotHandler, for_save=True)
@dataclasses.dataclass
class SnapshotSave(ocp.args.CheckpointArgs):
    """Save ``state`` (any pytree jaxckpt supports) as an in-memory snapshot; ``step`` overrides the parsed step."""

    state: Any
    step: int | None = None


@ocp.args.register_with_handler(SnapshotHandler, for_restore=True)
@dataclasses.dataclass
class SnapshotRestore(ocp.args.CheckpointArgs):
    """Restore laid out like ``target`` (pytree of ``jax.ShapeDtypeStruct`` with shardings); None: numpy dicts."""

    target: Any = None
