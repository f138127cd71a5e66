"""Store backends by name, imported lazily on first use (fsspec's registry is the model).

Built-in names map to ``module:Class`` strings so that ``import jaxckpt`` imports no backend. Third-party
stores register with :func:`register_store` or through the ``jaxckpt.stores`` entry-point group.

Other parts the core builds without importing their package are resolved the same way, by group and name
(:func:`get_part`, :func:`register_part`): ``peers`` (a job without node agents serves each process's store to
the others: ``jaxckpt.backends.peers.Peers``) and ``transport`` (how processes and node agents read each other's
snapshots, named by ``Config.transport``: "zmq" is ``jaxckpt.backends.transport.ZmqTransport``).
"""
from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import Mapping

from jaxckpt.errors import BackendNotFoundError

log = logging.getLogger("jaxckpt.registry")

_known: dict[str, str | type] = {
    "memory": "jaxckpt.backends.memory:MemoryStore",
    "shm": "jaxckpt.backends.shm:ShmStore",
}
_loaded: dict[str, type] = {}  # classes imported from the string targets above, by name
_parts: dict[str, dict[str, str | type]] = {
    "peers": {"default": "jaxckpt.backends.peers:Peers"},
    "transport": {"zmq": "jaxckpt.backends.transport:ZmqTransport"},
}
_loaded_parts: dict[tuple[str, str], type] = {}
_entry_points_loaded = False


def register_store(name: str, cls: str | type, *, clobber: bool = False) -> None:
    """Register a Store class (or a ``"module:Class"`` string) under ``name``; refuses to overwrite unless told."""
    if name in _known and not clobber and _known[name] != cls:
        raise BackendNotFoundError(f"store {name!r} is already registered as {_known[name]!r}; pass clobber=True")
    if _known.get(name) != cls:
        _loaded.pop(name, None)
    _known[name] = cls


def registered_stores() -> Mapping[str, str | type]:
    """A read-only view of the registry."""
    _load_entry_points()
    return MappingProxyType(_known)


def get_store_class(name: str) -> type:
    """The Store class registered under ``name``, importing its module on first use."""
    if name in _loaded:
        return _loaded[name]
    if name not in _known and ":" not in name:
        # Only an unknown name needs the installed distributions' entry points: scanning them costs a relaunched
        # process 6-7 ms (every distribution's metadata read), and no entry point shadows a registered name.
        _load_entry_points()
    target = _known.get(name)
    if target is None and ":" in name:
        target = name  # "module:Class" names a class directly, as Config.store allows
    if target is None:
        raise BackendNotFoundError(f"no store named {name!r} (known: {', '.join(sorted(_known))})")
    cls = _import_target(target, f"store {name!r}", f"pip install 'jaxckpt[{name}]' or install ", detail=True)
    _loaded[name] = cls
    return cls


def _import_target(target: str | type, what: str, install: str, *, detail: bool = False) -> type:
    """The class a ``"module:Class"`` registry entry names, imported now; errors say what to install."""
    if isinstance(target, type):
        return target
    module, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise BackendNotFoundError(f"{what} needs {e.name!r}, which is not installed ({install}{e.name})") from None
    except (AttributeError, ValueError):
        where = f" (module {module!r}, attribute {attr!r})" if detail else ""
        raise BackendNotFoundError(f"{what}: {target!r} names no class{where}") from None


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group="jaxckpt.stores"):
        if ep.name not in _known:
            _known[ep.name] = ep.value


def register_part(group: str, name: str, cls: str | type, *, clobber: bool = False) -> None:
    """Register a class (or ``"module:Class"``) as part ``name`` of ``group``; refuses to overwrite unless told."""
    known = _parts.setdefault(group, {})
    if name in known and not clobber and known[name] != cls:
        raise BackendNotFoundError(f"{group} {name!r} is already registered as {known[name]!r}; pass clobber=True")
    if known.get(name) != cls:
        _loaded_parts.pop((group, name), None)
    known[name] = cls


def unregister_part(group: str, name: str) -> None:
    """Forget part ``name`` of ``group`` (a plug-in's own registration, undone); nothing if it is not registered."""
    _parts.get(group, {}).pop(name, None)
    _loaded_parts.pop((group, name), None)


def registered_parts(group: str) -> Mapping[str, str | type]:
    """A read-only view of the parts registered in ``group``."""
    return MappingProxyType(_parts.get(group, {}))


def get_part(group: str, name: str) -> type:
    """The class registered as part ``name`` of ``group`` (or named by ``name`` as ``"module:Class"``), its module
    imported on first use (then cached)."""
    if (group, name) in _loaded_parts:
        return _loaded_parts[(group, name)]
    target = _parts.get(group, {}).get(name)
    if target is None and ":" in name:
        target = name  # "module:Class" names a class directly (a node agent knows only what it imports itself)
    if target is None:
        raise BackendNotFoundError(f"no {group} named {name!r} (known: {', '.join(sorted(_parts.get(group, {})))})")
    cls = _import_target(target, f"{group} {name!r}", "install ")
    _loaded_parts[(group, name)] = cls
    return cls
