"""Orbax v1 (``orbax.checkpoint.experimental.v1``): jaxckpt's in-memory snapshots as a ``CheckpointableHandler``.

A v1 user registers it once and keeps the rest of their code::

    import orbax.checkpoint.experimental.v1 as ocp
    import jaxckpt.orbax.v1

    jaxckpt.orbax.v1.configure(config=jaxckpt.Config(keep=3))         # optional: the Checkpointer to use
    with jaxckpt.orbax.v1.context():                                  # the one line
        ckptr = ocp.training.Checkpointer(directory)
        ckptr.save(step, state)                                       # unchanged
        state = ckptr.load(ckptr.latest, abstract_state)              # unchanged

The default checkpointable (``STATE``, Orbax's ``STATE_CHECKPOINTABLE_KEY``) (what ``Checkpointer.save(step, state)`` writes) then goes to jaxckpt's
memory, with a small marker in Orbax's item directory; other checkpointables keep Orbax's handlers (so a
standard pytree saved under another name beside it is written by Orbax as usual). ``context()`` is an
``ocp.Context`` whose handler registry is the global one with that name sent to
:class:`SnapshotPyTreeHandler`; pass ``checkpointable_name=`` to use another name, or build the registry with
:func:`registry`. Orbax's global registry already names it (its ``PyTreeHandler``), so ``register_handler`` cannot take that
name: use the context, or :func:`register`, which swaps that one entry of the global registry.

Semantics are those of :class:`jaxckpt.orbax.SnapshotHandler` (the v0 handler this wraps): the step is the one
Orbax writes, ``overwrite=True`` works, a load without ``abstract_state`` returns the saved tree (numpy leaves as
numpy, jax leaves on their saved shardings), ``None`` leaves of an abstract tree are skipped and come back None
(as from Orbax's own v1 pytree handler), and with ``Config.persistent_dir`` a step memory no longer holds comes
from the persistent tier. Restores without an abstract tree give the saved container types (NamedTuples, tuples),
where Orbax's v1 handler defaults to dicts and lists (its ``PyTreeMetadataOptions``).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Awaitable

from etils import epath
from orbax.checkpoint.experimental.v1._src.layout import checkpoint_layout

from jaxckpt.config import Config
from jaxckpt.errors import UnsupportedLeafError
from jaxckpt.jax.checkpointer import Checkpointer
from jaxckpt.orbax import layout as lay
from jaxckpt.orbax.handler import SnapshotHandler, SnapshotRestore, SnapshotSave

log = logging.getLogger("jaxckpt.orbax.v1")

__all__ = ["SnapshotPyTreeHandler", "configure", "context", "register", "registry"]

# v1's default checkpointable name, the one ``Checkpointer.save(step, state)`` and ``load(step)`` use.
STATE = checkpoint_layout.STATE_CHECKPOINTABLE_KEY
PYTREE_METADATA_FILE = checkpoint_layout.PYTREE_METADATA_FILE

_lock = threading.Lock()
_handler: SnapshotHandler | None = None


def configure(checkpointer: Checkpointer | None = None, *, config: Config | None = None) -> SnapshotHandler:
    """Set the jaxckpt Checkpointer every :class:`SnapshotPyTreeHandler` uses (v1 builds handlers from their
    type, without arguments). ``checkpointer``: this one (the caller closes it); ``config``: a new one; neither:
    the process-wide :func:`jaxckpt.orbax.default_checkpointer`. Returns the v0 handler that holds it."""
    global _handler
    with _lock:
        old, _handler = _handler, SnapshotHandler(checkpointer, config=config)
    if old is not None:
        old.close()
    return _handler


def _shared() -> SnapshotHandler:
    global _handler
    with _lock:
        if _handler is None or _handler.checkpointer.engine.closed:
            _handler = SnapshotHandler()  # the shared default_checkpointer (reopened if it was closed)
        return _handler


class SnapshotPyTreeHandler:
    """A v1 ``CheckpointableHandler`` for pytrees whose bytes stay in jaxckpt memory (see the module doc)."""

    def __init__(self) -> None:
        self._v0 = _shared()

    @property
    def checkpointer(self) -> Checkpointer:
        """The jaxckpt Checkpointer holding the snapshots."""
        return self._v0.checkpointer

    async def save(self, directory: Any, checkpointable: Any) -> Awaitable[None]:
        """Pin ``checkpointable`` now (a donating next step cannot change it); the returned awaitable waits for
        the commit and the item directory, then writes the marker."""
        handle, commit = self._v0.begin_save(epath.Path(directory.path), _AnyStep(checkpointable))

        async def background() -> None:
            await directory.await_creation()
            await asyncio.to_thread(handle.result)
            # v1's Checkpointer.metadata(step) only looks at an item with a pytree metadata file (AUTO layout
            # resolution), then asks the handler recorded for it (this one): the marker under that name too.
            commit(also=(PYTREE_METADATA_FILE,))
        return background()

    async def load(self, directory: Any, abstract_checkpointable: Any = None) -> Awaitable[Any]:
        """The snapshot ``directory``'s marker names, laid out like ``abstract_checkpointable`` (a tree of
        ``jax.ShapeDtypeStruct``, numpy abstract leaves, scalar types, ``None`` = as saved), or as saved."""
        async def background() -> Any:
            return await asyncio.to_thread(self._v0.restore, epath.Path(directory),
                                           SnapshotRestore(abstract_checkpointable))
        return background()

    async def metadata(self, directory: Any) -> Any:
        """The saved tree as abstract leaves: ``jax.ShapeDtypeStruct`` (saved sharding), numpy, scalar types."""
        meta = self._v0.metadata(epath.Path(directory))
        if meta is None:
            raise FileNotFoundError(f"{directory}: no jaxckpt snapshot marker")
        return meta.abstract()

    def is_handleable(self, checkpointable: Any) -> bool:
        """True for a pytree jaxckpt can snapshot (arrays, numpy, Python scalars, strings, None)."""
        try:
            lay.describe(checkpointable)
            return True
        except UnsupportedLeafError:
            return False

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool:
        """Any abstract pytree (or None): leaves it cannot fill raise a clear error on load."""
        return True


class _AnyStep(SnapshotSave):
    """v1 saves always come from a step directory (``training.Checkpointer``) or a user's path (``ocp.save``):
    without a step in the path the next free jaxckpt step is taken, as for Orbax's standard args."""


def registry(checkpointable_name: str = STATE) -> Any:
    """A v1 handler registry: the global one with ``checkpointable_name`` sent to :class:`SnapshotPyTreeHandler`."""
    from orbax.checkpoint.experimental.v1._src.handlers import registration
    out = registration.local_registry(include_global_registry=False)
    out.add(SnapshotPyTreeHandler, checkpointable_name=checkpointable_name)
    for handler, name in registration.global_registry().get_all_entries():
        if name == checkpointable_name:
            continue
        try:
            out.add(handler, checkpointable_name=name,
                    secondary_typestrs=registration.global_registry().get_secondary_typestrs(handler))
        except registration.AlreadyExistsError:
            pass
    return out


def context(checkpointable_name: str = STATE, base: Any = None) -> Any:
    """An ``ocp.Context`` (copied from ``base`` or the active one) whose registry is :func:`registry`."""
    import orbax.checkpoint.experimental.v1 as ocp1
    ctx = ocp1.Context(base)
    ctx.checkpointables.registry = registry(checkpointable_name)
    return ctx


def register(checkpointable_name: str = STATE) -> Any:
    """Send ``checkpointable_name`` to :class:`SnapshotPyTreeHandler` in Orbax's global registry, so every context
    (and every ``ocp.handlers.local_registry()``, which copies the global one) uses it; returns a function that
    puts Orbax's entry back. Orbax has no public way to replace a named global entry, so this edits its
    registry's entry list in place (the one place jaxckpt reaches into Orbax's v1 internals; :func:`context`
    does not)."""
    from orbax.checkpoint.experimental.v1._src.handlers import registration
    entries = registration.global_registry()._registry  # list of (handler type, name)
    old = [(i, e) for i, e in enumerate(entries) if e[1] == checkpointable_name]
    for i, _ in reversed(old):
        del entries[i]
    entries.append((SnapshotPyTreeHandler, checkpointable_name))

    def unregister() -> None:
        entries[:] = [e for e in entries if e != (SnapshotPyTreeHandler, checkpointable_name)]
        for i, e in old:
            entries.insert(i, e)
    return unregister
