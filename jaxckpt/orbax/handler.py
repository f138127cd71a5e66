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
handler receives only a small JSON marker (``jaxckpt_snapshot.json``: step, job id, bytes, process count, and the
saved tree's layout, ``jaxckpt.orbax.layout``), so Orbax's own step bookkeeping (``all_steps``, ``latest_step``,
``max_to_keep`` deleting step directories) works as usual. Restore follows the marker to the in-memory snapshot.

Orbax's args and semantics. Besides ``SnapshotSave``/``SnapshotRestore`` the handler takes the args an Orbax user
already passes (``StandardSave``/``PyTreeSave`` with ``save_args`` and ``custom_metadata``,
``StandardRestore``/``PyTreeRestore`` with ``restore_args``, ``partial_restore``, ``strict``), so registering it
for an item is the only change, and restores as Orbax's pytree handlers do: see ``jaxckpt.orbax.layout`` (masked
optimizer states, ``None`` target leaves, PRNG keys, "Topology mismatch detected"). ``metadata()`` is Orbax's
``TreeMetadata`` of the saved tree (:class:`SnapshotMetadata`). Orbax's argument errors are raised from save() as
its handlers raise them: an empty item (:class:`jaxckpt.errors.EmptyItemError`, "Found empty item."), a leaf type
the args do not take (:class:`jaxckpt.errors.UnsupportedTypeError`, "Unsupported type"; ``StandardSave`` takes
arrays and numbers only), each a ``ValueError`` with Orbax's words first.

The step number. Orbax does not pass the step to item handlers, only a directory such as
``<root>/<step>.orbax-checkpoint-tmp/<item>.orbax-checkpoint-tmp``. ``SnapshotSave(state, step=k)`` sets it
explicitly; without it the step is parsed from the parent (step) directory's name with Orbax's own
``step_from_checkpoint_name``, the function its standard name format uses to list steps, so with that format the
snapshot's step is the step ``CheckpointManager.all_steps()`` reports. Pass ``step=`` with a custom
``step_name_format`` or when using the handler outside a CheckpointManager (a bare ``ocp.Checkpointer`` saving
to a user's path is recognised and refused without it; with Orbax's standard args the next free step is taken,
as Orbax's handlers need no step). The marker records the step, so restore never parses. A step Orbax writes
again (``overwrite``, ``delete(s)`` then ``save(s)``, a second manager on the same Checkpointer) is snapshotted
as the next free jaxckpt step, which its marker names.

Retention. ``Config.keep`` bounds the snapshots held in memory (set it to at least ``max_to_keep`` to restore
every step Orbax lists). When Orbax deletes a step directory the handler frees that step's snapshot at its next
save or restore, and in any case restore only serves a step through a marker Orbax still holds; a marker whose
snapshot memory no longer holds raises :class:`jaxckpt.errors.StepNotFoundError` naming the step, unless
``Config.persistent_dir`` holds it (then it is read from there). After a restart that lost memory
(``store="memory"``), ``SnapshotHandler(directory=root)`` renames away the steps that cannot be restored, so
``latest_step()`` names one that can (or None: start fresh). Built without it, the handler learns the manager's
directory only at its first call, after the manager listed its steps: the restore of a gone step then renames
the gone steps away and raises StepNotFoundError, and ``CheckpointManager.reload()`` lists only what can be
restored.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import logging
import threading
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
# Orbax's own TreeMetadata (what its pytree handlers' metadata() returns) and ShardingMetadata: not exported.
from orbax.checkpoint._src.metadata import sharding as sharding_metadata
from orbax.checkpoint._src.metadata import tree as tree_metadata

from jaxckpt.config import Config
from jaxckpt.errors import (ClosedError, EmptyItemError, ManifestError, StepError, StepNotFoundError,
                            UnsupportedLeafError, UnsupportedTypeError)
from jaxckpt.jax.checkpointer import Checkpointer, SaveHandle
from jaxckpt.jax.shards import key_data_sharding
from jaxckpt.orbax import layout as lay

log = logging.getLogger("jaxckpt.orbax")

__all__ = ["SnapshotHandler", "SnapshotMetadata", "SnapshotRestore", "SnapshotSave", "MARKER_NAME",
           "default_checkpointer"]

MARKER_NAME = "jaxckpt_snapshot.json"
MARKER_FORMAT = "jaxckpt-orbax-snapshot"
MARKER_VERSION = 1
MAX_JOB_PREFIX = 64  # of the default job id, in a per-root one (Config bounds job ids' length)
# Orbax's own args an Orbax user already passes: SnapshotHandler takes them as they are.
_STANDARD_SAVE = (ocp.args.StandardSave, ocp.args.PyTreeSave)
_STANDARD_RESTORE = (ocp.args.StandardRestore, ocp.args.PyTreeRestore)
_TMP = ocp.path.step.TMP_DIR_SUFFIX

_default: Checkpointer | None = None
_per_root: dict[str, Checkpointer] = {}
_default_lock = threading.Lock()


def _is_open(ck: Checkpointer | None) -> bool:
    if ck is None:
        return False
    try:
        ck.engine.check_open()
        return True
    except ClosedError:
        return False


def default_checkpointer(root: epath.PathLike | None = None) -> Checkpointer:
    """The Checkpointer (``Config().with_env()``) shared by handlers built without arguments.

    Without ``root``: one per process. With ``root`` (a CheckpointManager's directory): one per root, whose job
    id is the process default's with a digest of the root appended, so two managers in one process keep their
    own steps and retention (``Config.keep``) while ``registry.add(item, SnapshotSave)`` and
    ``registry.add(item, SnapshotRestore)``, which make two handler instances of one manager, still share one.
    """
    global _default
    with _default_lock:
        if root is None:
            if not _is_open(_default):
                _default = Checkpointer(Config())
            return _default
        key = os.path.abspath(os.fspath(root))
        ck = _per_root.get(key)
        if not _is_open(ck):
            base = Config().with_env()
            digest = hashlib.sha1(key.encode()).hexdigest()[:10]
            ck = _per_root[key] = Checkpointer(base.replace(job_id=f"{base.job_id[:MAX_JOB_PREFIX]}-{digest}"))
        return ck


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
    :class:`SnapshotSave` and :class:`SnapshotRestore` (or for Orbax's ``StandardSave``/``StandardRestore``,
    ``PyTreeSave``/``PyTreeRestore``, which it takes as they are). ``rich_types``: see :meth:`restore`.
    """

    def __init__(self, checkpointer: Checkpointer | None = None, *, config: Config | None = None,
                 primary_host: int = 0, rich_types: bool = True, directory: epath.PathLike | None = None) -> None:
        if checkpointer is not None and config is not None:
            raise TypeError("SnapshotHandler: pass a checkpointer or a config, not both")
        self._owned = checkpointer is None and config is not None
        # Built without arguments: the Checkpointer is the one of the manager directory of the first item
        # directory seen (default_checkpointer(root)); until then, the process-wide one.
        self._unbound = checkpointer is None and config is None
        if checkpointer is None:
            checkpointer = Checkpointer(config) if config is not None else default_checkpointer()
        self.checkpointer = checkpointer
        self._primary_host = primary_host
        # Restores without a target: the saved container types (NamedTuple, tuple); False gives Orbax's legacy
        # answer (PyTreeMetadataOptions(support_rich_types=False), its default): dicts and lists.
        self.rich_types = rich_types
        self._lock = threading.Lock()
        # step -> (item directory while Orbax writes it, item directory once finalized): how to tell a step
        # Orbax deleted (max_to_keep) from one it has not yet renamed into place.
        self._dirs: dict[int, tuple[epath.Path, epath.Path, SaveHandle]] = {}
        self._marked: set[int] = set()  # steps whose commit future ran: their directory existed
        if directory is not None:
            self.forget_lost_steps(directory)

    # ------------------------------------------------------------------------------------------------ save
    async def async_save(self, directory: epath.Path, args: "SnapshotSave") -> list[ocp.future.Future]:
        """Start the snapshot (returns once it is pinned) and a commit future that writes the marker."""
        return self._start_save(epath.Path(directory), args)

    def save(self, directory: epath.Path, args: "SnapshotSave") -> None:
        """Save synchronously: snapshot, wait for its commit, write the marker."""
        for f in self._start_save(epath.Path(directory), args):
            f.result()

    def _start_save(self, directory: epath.Path, args: Any) -> list[ocp.future.Future]:
        try:
            handle, commit = self.begin_save(directory, args)
        except (EmptyItemError, UnsupportedTypeError):
            # Refusals of the item itself, before anything started: raised from save() as Orbax's own handlers
            # raise them (tests/test_orbax_contract.py; the process still exits at once, test_orbax_semantics).
            raise
        except Exception as e:
            # Orbax started creating the directory and waits, on a thread of its own, for this save's commit
            # futures: raising here would leave that thread waiting (the process would not exit for minutes,
            # even with a second future taking the signal). A future that takes the signal and then fails ends
            # the save the way any asynchronous failure does: wait_until_finished() (or the next save) raises
            # this error, and the step is never listed.
            error = e

            async def failed() -> None:
                raise error
            log.error("save into %s refused: %s", directory, e)
            return [ocp.future.CommitFutureAwaitingContractedSignals(failed(), name="jaxckpt_commit_refused")]

        async def committed() -> None:
            # The item directory exists by now: the future awaited Orbax's creation signal.
            handle.result()
            commit()
        return [ocp.future.CommitFutureAwaitingContractedSignals(committed(), name=f"jaxckpt_commit_{handle.step}")]

    def _bind(self, directory: epath.Path, root: epath.Path | None = None) -> None:
        if not self._unbound:
            return
        if root is None and step_from_directory(directory) is not None:
            root = directory.parent.parent
        if root is not None:
            self.checkpointer = default_checkpointer(root)
            self._unbound = False

    def begin_save(self, directory: epath.Path, args: Any) -> tuple[SaveHandle, Any]:
        """Start the snapshot of ``args``' state for the item ``directory`` (returns once the state is pinned):
        its handle, and the function that records it (the marker) once the handle is done and the directory
        exists. Front ends (v0 here, ``jaxckpt.orbax.v1``) wrap the two in their own kind of future."""
        self._bind(directory)
        if isinstance(args, SnapshotSave):
            state, save_args, custom, explicit = args.state, args.save_args, args.custom_metadata, args.step
        elif isinstance(args, _STANDARD_SAVE):
            state, save_args, custom, explicit = args.item, args.save_args, args.custom_metadata, None
        else:
            raise TypeError(f"SnapshotHandler.save expects args=SnapshotSave(...), StandardSave(...) or "
                            f"PyTreeSave(...), got {type(args).__name__}")
        parsed = step_from_directory(directory)
        step = explicit if explicit is not None else parsed
        if step is None and type(args) is SnapshotSave:  # subclasses (jaxckpt.orbax.v1) take the next step
            raise StepError(f"{directory}: cannot tell the step from the directory name (not a CheckpointManager "
                            f"step layout); pass SnapshotSave(state, step=...)")
        if explicit is not None and parsed is not None and parsed != explicit:
            log.warning("SnapshotSave(step=%d) differs from the step %d in %s; the marker records %d",
                        explicit, parsed, directory, explicit)
        if isinstance(args, ocp.args.StandardSave):
            if state is None:
                raise EmptyItemError("Must provide item to save. StandardSave(None): there is no state to snapshot")
            state = lay.standard_item(state)
        if not jax.tree_util.tree_leaves(state) and not state:  # Orbax's test: a tuple of Nones is an item
            raise EmptyItemError(f"Found empty item. The state to save has no leaves ({type(state).__name__}: "
                                 f"{state!r:.80}): there is nothing to snapshot")
        state = _cast(state, save_args)
        try:
            tree_layout = lay.describe(state)
        except UnsupportedLeafError as e:  # Orbax's words, still a jaxckpt error naming the path
            raise UnsupportedTypeError(f"Unsupported type: {e}") from None
        self.prune()
        snap = self._snapshot_step(step)
        # Returns once the state is pinned: a donating next step cannot change the snapshot.
        handle = self.checkpointer.save(snap, state)
        final = directory.parent.parent / _final_name(directory.parent.name) / _final_name(directory.name)
        with self._lock:
            self._dirs[snap] = (directory, final, handle)
        marker = {"format": MARKER_FORMAT, "version": MARKER_VERSION, "step": snap, "orbax_step": step,
                  "job_id": self.checkpointer.config.job_id, "store": self.checkpointer.config.store,
                  "process_count": jax.process_count(), "nbytes": handle.nbytes, "layout": tree_layout,
                  "custom_metadata": custom}
        write = ocp.multihost.is_primary_host(self._primary_host)

        def commit(also: tuple[str, ...] = ()) -> None:
            if write:
                text = json.dumps(marker, separators=(",", ":"))
                for name in (MARKER_NAME, *also):
                    (directory / name).write_text(text)
            with self._lock:
                self._marked.add(snap)
        return handle, commit

    def _snapshot_step(self, step: int | None) -> int:
        """The jaxckpt step for a save Orbax calls ``step``: the same number while it is newer than every step
        saved so far; else (``overwrite``, ``delete(s)`` then ``save(s)``, a second manager sharing this
        Checkpointer, a bare Checkpointer without steps) the next free one. The marker records both."""
        last = self.checkpointer.engine.newest_begun()  # the engine refuses any step not newer than this
        if step is not None and (last is None or step > last):
            return step
        return 0 if last is None else last + 1

    # --------------------------------------------------------------------------------------------- restore
    def restore(self, directory: epath.Path, args: Any = None) -> Any:
        """The snapshot the marker in ``directory`` names, with Orbax's semantics for ``args``.

        ``args``: ``SnapshotRestore``, ``StandardRestore`` or ``PyTreeRestore`` (item, ``restore_args``,
        ``partial_restore``, ``strict``), or None (the saved tree: its containers, shardings, numpy leaves).
        From memory; with ``Config.persistent_dir``, a step memory no longer holds comes from that tier.
        """
        directory = epath.Path(directory)
        self._bind(directory)
        marker = self.read_marker(directory)
        step, job = marker["step"], marker["job_id"]
        if job != self.checkpointer.config.job_id:
            raise StepNotFoundError(f"step {step}: {directory} was saved by jaxckpt job {job!r}, this handler "
                                    f"serves job {self.checkpointer.config.job_id!r}")
        self.prune()
        held = self.checkpointer.store.steps()
        persister = self.checkpointer.persister
        if step not in held and (persister is None or step not in persister.steps()):
            where = f" nor is it persisted in {persister.directory}" if persister is not None else ""
            # A manager's step layout: the manager listed its steps when it was built, so they stay listed; but
            # renamed away now, the gone ones leave its listing at reload() (a resume can then start fresh).
            root = directory.parent.parent if step_from_directory(directory) is not None else None
            lost = self.forget_lost_steps(root) if root is not None else []
            renamed = (f"; the step directories of gone snapshots ({sorted(lost)}) are renamed to "
                       f"<step>.jaxckpt-lost, so CheckpointManager.reload() lists only steps that can be restored"
                       if lost else "")
            raise StepNotFoundError(
                f"step {step}: Orbax lists {directory} but jaxckpt memory (store "
                f"{self.checkpointer.config.store!r}) no longer holds its snapshot (held steps: {held or 'none'}; "
                f"Config.keep={self.checkpointer.config.keep}){where}{renamed}; a restarted job has Orbax forget "
                f"such steps with SnapshotHandler(directory=<the manager's directory>) built before the manager, "
                f"or keeps them with Config.persistent_dir")
        item, restore_args, partial, strict = _restore_request(args)
        if isinstance(args, ocp.args.StandardRestore) and item is not None:
            lay.check_standard_target(item)
        if "layout" not in marker:  # a marker written before layouts: jaxckpt's own target semantics
            return self.checkpointer.restore(item, step=step)
        p = lay.plan(marker["layout"], item, restore_args, partial=partial, strict=strict, rich=self.rich_types)
        out = self.checkpointer.restore(p.target, step=step)  # memory, else the persistent tier
        return p.finish(lay.flat_values(out))

    def metadata(self, directory: epath.Path) -> "SnapshotMetadata | None":
        """The saved tree's metadata, Orbax's ``TreeMetadata`` (see :class:`SnapshotMetadata`: the tree of shapes,
        dtypes and shardings, ``.custom_metadata``, and ``.marker``); None without a marker, or for a marker
        written before layouts were recorded."""
        directory = epath.Path(directory)
        try:
            marker = self.read_marker(directory)
        except StepNotFoundError:
            return None
        if "layout" not in marker:
            return None
        tree = lay.build(marker["layout"], lambda path, leaf: _leaf_metadata(path, leaf, directory),
                         rich=self.rich_types)
        return SnapshotMetadata(tree=tree, custom_metadata=marker.get("custom_metadata"), marker=marker)

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
    def forget_lost_steps(self, root: epath.PathLike) -> list[int]:
        """Rename away (``<step dir>.jaxckpt-lost``) the step directories under ``root`` whose snapshot is gone:
        saved by this job, not held in memory (a restarted job with ``store="memory"``) and not persisted.
        Orbax then no longer lists them, so a resume (``latest_step()`` then ``restore()``) starts from the
        newest step that can be restored, or fresh. ``SnapshotHandler(directory=root)`` does this when built;
        build it before the CheckpointManager, which lists steps when it is built. Returns the steps."""
        root = epath.Path(root)
        self._bind(root, root)
        if not root.exists() or not ocp.multihost.is_primary_host(self._primary_host):
            return []
        held = set(self.checkpointer.store.steps())
        persister = self.checkpointer.persister
        persisted = set(persister.steps()) if persister is not None else set()
        lost = []
        for step_dir in sorted(p for p in root.iterdir() if p.is_dir() and _TMP not in p.name):
            for item in (p for p in step_dir.iterdir() if (p / MARKER_NAME).exists()):
                try:
                    marker = self.read_marker(item)
                except ManifestError:
                    continue
                if marker["job_id"] == self.checkpointer.config.job_id and marker["step"] not in held | persisted:
                    step_dir.rename(step_dir.parent / f"{step_dir.name}.jaxckpt-lost")
                    log.warning("%s: the snapshot of step %s is gone (not in memory, not persisted); renamed to "
                                "%s.jaxckpt-lost so Orbax no longer lists it", step_dir, marker["step"],
                                step_dir.name)
                    lost.append(marker.get("orbax_step", marker["step"]))
                    break
        return lost

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


@dataclasses.dataclass
class SnapshotSave(ocp.args.CheckpointArgs):
    """Save ``state`` (any pytree jaxckpt supports) as an in-memory snapshot; ``step`` overrides the parsed step.

    ``save_args``: a tree of ``ocp.SaveArgs`` as Orbax takes it (its ``dtype`` casts the leaf before saving)."""

    state: Any
    step: int | None = None
    save_args: Any = None
    custom_metadata: Any = None


ocp.args.register_with_handler(SnapshotHandler, for_save=True)(SnapshotSave)


@ocp.args.register_with_handler(SnapshotHandler, for_restore=True)
@dataclasses.dataclass
class SnapshotRestore(ocp.args.CheckpointArgs):
    """Restore laid out like ``target`` (pytree of ``jax.ShapeDtypeStruct``, arrays, or ``PLACEHOLDER`` to skip
    a leaf); None: the saved tree as saved. ``restore_args``, ``partial_restore``, ``strict`` as Orbax's."""

    target: Any = None
    restore_args: Any = None
    partial_restore: bool = False
    strict: bool = True
    item: Any = None  # the legacy positional form ``ckptr.restore(path, item=...)``


@jax.tree_util.register_pytree_with_keys_class
class SnapshotMetadata(tree_metadata._TreeMetadataImpl):
    """``SnapshotHandler.metadata``: Orbax's ``TreeMetadata`` of the saved tree, as its pytree handlers give it,
    plus jaxckpt's marker.

    It is the saved tree itself: a pytree over its leaves (``jax.tree.map(lambda m: m.dtype, metadata)``,
    ``metadata["w"].shape``), with ``.tree`` (the containers, an ``ocp.metadata.ArrayMetadata`` per array with
    its shape, dtype and ``ShardingMetadata``, a ``ScalarMetadata`` per number, a ``StringMetadata`` per string,
    None where the saved tree had None or an empty node) and ``.custom_metadata`` beside it. ``.marker`` is the
    marker (step, job id, bytes, process count, layout); :meth:`abstract` the saved tree as restore targets.
    """

    def __init__(self, *, tree: Any, custom_metadata: Any = None, use_zarr3: bool = False,
                 marker: dict | None = None) -> None:
        super().__init__(tree=tree, custom_metadata=custom_metadata, use_zarr3=use_zarr3)
        self._marker = marker or {}

    @property
    def marker(self) -> dict:
        return self._marker

    def __repr__(self) -> str:
        return (f"SnapshotMetadata(step={self._marker.get('step')}, custom_metadata={self.custom_metadata!r}, "
                f"tree={self.tree!r})")

    def abstract(self) -> Any:
        """The saved tree as restore targets: ``jax.ShapeDtypeStruct`` (saved sharding) or numpy per leaf."""
        return lay.abstract(self._marker["layout"])


# Python values saved by value, as Orbax's pytree handlers describe them.
_SCALAR_DTYPES = {"int": np.dtype(np.int64), "float": np.dtype(np.float64), "bool": np.dtype(np.bool_)}


def _leaf_metadata(path: str, leaf: dict, directory: epath.Path) -> Any:
    kind = leaf["kind"]
    if kind == "value":  # a marker older than the recorded type, or bytes: no metadata (Orbax has none)
        if leaf.get("type") == "str":
            return ocp.metadata.StringMetadata(name=path, directory=directory)
        dtype = _SCALAR_DTYPES.get(leaf.get("type"))
        return None if dtype is None else ocp.metadata.ScalarMetadata(name=path, directory=directory, dtype=dtype)
    if kind == "numpy_scalar":
        return ocp.metadata.ScalarMetadata(name=path, directory=directory, shape=(), dtype=np.dtype(leaf["dtype"]))
    s = lay.saved_sharding(leaf)
    if kind == "prng_key":  # as Orbax stores keys: their key data, trailing key dimensions unsharded
        shape = lay.key_data_shape(leaf)
        s = key_data_sharding(s, len(shape) - len(leaf["shape"])) if s is not None else None
        dtype = np.dtype("uint32")
    else:
        shape, dtype = tuple(leaf["shape"]), lay.dtype_from_name(leaf["dtype"])
    sharding = sharding_metadata.from_jax_sharding(s) if s is not None else None
    return ocp.metadata.ArrayMetadata(name=path, directory=directory, shape=shape, sharding=sharding, dtype=dtype)


def _restore_request(args: Any) -> tuple[Any, Any, bool, bool]:
    """(item, restore_args, partial_restore, strict) from any restore args an Orbax user passes."""
    if args is None:
        return None, None, False, True
    if isinstance(args, SnapshotRestore):
        item = args.target if args.target is not None else args.item
        request = item, args.restore_args, args.partial_restore, args.strict
    elif isinstance(args, ocp.args.PyTreeRestore):
        request = args.item, args.restore_args, args.partial_restore, True
    elif isinstance(args, ocp.args.StandardRestore):
        request = args.item, None, False, args.strict
    else:
        raise TypeError(f"SnapshotHandler.restore expects args=SnapshotRestore(...), StandardRestore(...) or "
                        f"PyTreeRestore(...), got {type(args).__name__}")
    if isinstance(request[0], tree_metadata.TreeMetadata):  # restored onto its metadata: the tree it holds
        request = (request[0].tree, *request[1:])
    return request


def _cast(state: Any, save_args: Any) -> Any:
    """Orbax's ``SaveArgs(dtype=...)``: each leaf cast before it is saved."""
    if save_args is None:
        return state
    is_sa = lambda x: isinstance(x, ocp.SaveArgs)  # noqa: E731
    casts = dict(lay.flat_with_paths(save_args, is_sa)[0])
    flat, treedef = lay.flat_with_paths(state)
    out = []
    for path, x in flat:
        sa = casts.get(path)
        if sa is not None and sa.dtype is not None and hasattr(x, "astype") and x.dtype != sa.dtype:
            x = x.astype(sa.dtype)
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)
