"""The saved tree's layout, kept in the Orbax item directory's marker, and Orbax's restore semantics over it.

jaxckpt's manifest names leaves by path; Orbax users also rely on what a path cannot say: the container types
(NamedTuple, tuple, dataclass nodes), ``None`` leaves and empty nodes, each array's sharding, and whether a leaf
was a numpy or a jax array. :func:`describe` records that as JSON (no pickle: a namedtuple comes back as a
namedtuple type made from its recorded name and fields, never by importing a class), and :func:`plan` turns an
Orbax-style request (an item, ``restore_args``, ``partial_restore``, ``strict``) into a jaxckpt target plus the
per-leaf work Orbax does after reading (cast, pad or truncate, PRNG key data), so that:

- a leaf saved as numpy comes back as numpy, and a target without a sharding gets the saved one (never an
  unasked-for move to device 0, never a 64-bit value narrowed by JAX);
- a restore without a target returns the saved containers, ``None`` leaves and empty nodes (an empty NamedTuple,
  such as ``optax.MaskedNode``, as ``None`` in Orbax's legacy container types);
- a leaf of the item that is ``PLACEHOLDER`` (``...``), ``None`` or an empty node (``optax.MaskedNode``) skips that
  saved leaf and comes back as given; ``partial_restore=True`` skips leaves the item omits;
- an item leaf where the saved tree had ``None`` or an empty node (an optimizer state saved masked, restored onto
  the unmasked structure) comes back as ``None``;
- ``strict=False`` pads or truncates to the target shape; a dtype in the target or restore args casts;
- saved PRNG keys come back as key arrays, whether the target gives them as keys or as their key data
  (``ocp.utils.to_shape_dtype_struct`` of a key array is a ``uint32[..., 2]`` ``ShapeDtypeStruct``);
- an array whose saved sharding names devices this job lacks, asked for without a sharding, is refused with
  Orbax's "Topology mismatch detected" (before anything is read).

:func:`standard_item` and :func:`check_standard_target` are ``StandardCheckpointHandler``'s narrower leaf types.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Callable

import jax
import numpy as np

from jaxckpt.core.dtypes import dtype_from_name, dtype_name
from jaxckpt.errors import TargetMismatchError, UnsupportedTypeError
from jaxckpt.jax.restore import SKIP
from jaxckpt.jax.tree import classify, keypath_entries

PLACEHOLDER = ...  # Orbax's type_handlers.PLACEHOLDER: "do not restore this leaf"
MISMATCH = "User-provided restore item and on-disk value metadata tree structures do not match"
TOPOLOGY = ("Topology mismatch detected. The checkpoint was saved with a different topology than the current one. "
            "Please provide a target tree with the desired topology to restore.")
_VALUE_TYPES = {t.__name__: t for t in (bool, int, float, str, bytes)}  # saved by value ("type" in the layout)
# StandardCheckpointHandler's leaf types (orbax.checkpoint.checkpoint_utils.STANDARD_ARRAY_TYPES).
STANDARD_TYPES = (int, float, np.ndarray, jax.Array)


# ------------------------------------------------------------------------------------------------ describe
def _key(entry: Any) -> list:
    kind, value = keypath_entries((entry,))[0]
    return [kind, value]


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def is_empty_node(x: Any) -> bool:
    """None or a pytree node without children (``optax.MaskedNode``, ``{}``, ``()``): no leaf to read or save."""
    if x is None:
        return True
    children, treedef = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)
    return not children and not jax.tree_util.treedef_is_leaf(treedef)


def _leaf(x: Any, path: str) -> dict:
    kind = classify(x, path)  # UnsupportedLeafError for what jaxckpt cannot hold
    if kind == "value":  # the Python type: Orbax's metadata of the leaf (ScalarMetadata, StringMetadata)
        return {"t": "leaf", "kind": "value", "type": type(x).__name__}
    if kind == "prng_key":
        return {"t": "leaf", "kind": kind, "shape": list(x.shape), "impl": str(jax.random.key_impl(x)),
                "sharding": _sharding_json(x.sharding)}
    out = {"t": "leaf", "kind": kind, "shape": list(np.shape(x)), "dtype": dtype_name(np.asarray(x).dtype
                                                                                         if kind != "jax" else x.dtype)}
    if kind == "jax":
        out["sharding"] = _sharding_json(x.sharding)
    return out


def describe(tree: Any, path: str = "") -> dict:
    """The JSON layout of ``tree``: containers, ``None``s and leaves (kind, shape, dtype, sharding)."""
    if tree is None:
        return {"t": "none"}
    children, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda y: y is not tree)
    if len(children) == 1 and children[0][0] == () and children[0][1] is tree:
        return _leaf(tree, path or "<root>")
    items = []
    for kp, child in children:
        key = _key(kp[0])
        items.append([key, describe(child, f"{path}/{key[1]}" if path else str(key[1]))])
    if isinstance(tree, dict):
        return {"t": "dict", "c": items}
    if _is_namedtuple(tree):
        return {"t": "namedtuple", "name": type(tree).__name__, "fields": list(type(tree)._fields), "c": items}
    if isinstance(tree, (list, tuple)):
        return {"t": type(tree).__name__, "c": items}
    return {"t": "node", "type": f"{type(tree).__module__}.{type(tree).__qualname__}", "c": items}


def _sharding_json(s: Any) -> dict | None:
    """A compact description (device ids, mesh shape and axes, partition spec) of a Named or SingleDevice
    sharding; None for other kinds, whose restores need a target sharding."""
    if isinstance(s, jax.sharding.NamedSharding):
        spec = [list(p) if isinstance(p, tuple) else p for p in s.spec]
        return {"mesh": list(s.mesh.devices.shape), "axes": list(s.mesh.axis_names),
                "ids": [int(d.id) for d in s.mesh.devices.flat], "spec": spec}
    if isinstance(s, jax.sharding.SingleDeviceSharding):
        return {"device": int(next(iter(s.device_set)).id)}
    return None


def saved_devices(leaf: dict) -> list[int]:
    """The ids of the devices a leaf's saved sharding names (none for numpy and value leaves)."""
    d = leaf.get("sharding") or {}
    return d["ids"] if "ids" in d else [d["device"]] if "device" in d else []


def saved_sharding(leaf: dict) -> jax.sharding.Sharding | None:
    """The sharding a leaf was saved with, on this process's devices, or None if it cannot be rebuilt here."""
    d = leaf.get("sharding")
    if not d:
        return None
    devices = {dev.id: dev for dev in jax.devices()}
    ids = saved_devices(leaf)
    if any(i not in devices for i in ids):
        return None
    if "device" in d:
        return jax.sharding.SingleDeviceSharding(devices[d["device"]])
    mesh = jax.sharding.Mesh(np.array([devices[i] for i in ids]).reshape(d["mesh"]), tuple(d["axes"]))
    spec = jax.sharding.PartitionSpec(*(tuple(p) if isinstance(p, list) else p for p in d["spec"]))
    return jax.sharding.NamedSharding(mesh, spec)


# ---------------------------------------------------------------------------------------------------- build
@functools.lru_cache(maxsize=256)
def _namedtuple(name: str, fields: tuple[str, ...]) -> type:
    return collections.namedtuple(name, fields)


def leaves(layout: dict, path: str = "") -> dict[str, dict]:
    """Path -> leaf description, for every leaf of ``layout`` (jaxckpt's path strings)."""
    out: dict[str, dict] = {}
    if layout["t"] == "leaf":
        out[path or "<root>"] = layout
    for key, child in layout.get("c", ()):
        out.update(leaves(child, f"{path}/{key[1]}" if path else str(key[1])))
    return out


def empty_nodes(layout: dict, path: str = "") -> set[str]:
    """The paths of ``layout``'s ``None`` leaves and empty nodes (a masked optimizer state's ``MaskedNode``)."""
    if layout["t"] == "none" or (layout["t"] != "leaf" and not layout["c"]):
        return {path or "<root>"}
    out: set[str] = set()
    for key, child in layout.get("c", ()):
        out |= empty_nodes(child, f"{path}/{key[1]}" if path else str(key[1]))
    return out


def build(layout: dict, leaf: Callable[[str, dict], Any], path: str = "", *, rich: bool = True) -> Any:
    """The tree ``layout`` describes, each leaf ``leaf(path, description)``; dataclass-like nodes become dicts.

    ``rich=False``: Orbax's legacy metadata mode (its default), namedtuples as dicts (an empty one as None) and
    tuples as lists."""
    t = layout["t"]
    if t == "none" or (t == "namedtuple" and not layout["c"] and not rich):
        return None
    if t == "leaf":
        return leaf(path or "<root>", layout)
    kids = [(key[1], build(child, leaf, f"{path}/{key[1]}" if path else str(key[1]), rich=rich))
            for key, child in layout["c"]]
    if t == "list" or (t == "tuple" and not rich):
        return [v for _, v in kids]
    if t == "tuple":
        return tuple(v for _, v in kids)
    if t == "namedtuple" and rich:
        return _namedtuple(layout["name"], tuple(layout["fields"]))(*(v for _, v in kids))
    return dict(kids)


# ----------------------------------------------------------------------------------------------------- plan
@dataclasses.dataclass
class Want:
    """What the caller asked of one saved leaf."""

    kind: str  # "jax" | "numpy" | "value" | "skip"
    shape: tuple[int, ...] | None = None
    dtype: Any = None
    sharding: Any = None
    strict: bool = True


def _numpy_abstract(t: Any) -> bool:
    return type(t).__name__ == "NumpyShapeDtype" and hasattr(t, "shape") and hasattr(t, "dtype")


def _want(path: str, saved: dict, t: Any, ra: Any, strict: bool) -> Want:
    """Resolve the target leaf ``t`` and its restore args ``ra`` against the saved leaf (Orbax's precedence:
    restore args, then the target, then what was saved)."""
    import orbax.checkpoint as ocp
    if t is PLACEHOLDER:
        return Want("skip")
    kind, shape, dtype, sharding = None, None, None, None
    if isinstance(t, (jax.ShapeDtypeStruct, jax.Array)):
        kind, shape, dtype, sharding = "jax", tuple(t.shape), t.dtype, getattr(t, "sharding", None)
        if sharding is None and saved["kind"] in ("numpy", "numpy_scalar"):
            kind = "numpy"  # Orbax: a leaf saved as numpy, asked for without a sharding, comes back as numpy
    elif isinstance(t, np.ndarray) or _numpy_abstract(t):
        kind, shape, dtype = "numpy", tuple(t.shape), np.dtype(t.dtype)
    elif isinstance(t, (bool, int, float, str, bytes, np.generic)) or (
            isinstance(t, type) and issubclass(t, (int, float, str, bytes, np.generic))):
        kind = "value"
    if isinstance(ra, ocp.ArrayRestoreArgs):
        if ra.sharding is not None:
            sharding = ra.sharding
        elif ra.mesh is not None and ra.mesh_axes is not None:
            sharding = jax.sharding.NamedSharding(ra.mesh, ra.mesh_axes)
        shape = tuple(ra.global_shape) if ra.global_shape is not None else shape
        strict = ra.strict if ra.strict is not None else strict
    if isinstance(ra, ocp.RestoreArgs):
        dtype = ra.dtype if ra.dtype is not None else dtype
        if ra.restore_type is np.ndarray:
            kind = "numpy"
        elif ra.restore_type is jax.Array or sharding is not None:
            kind = "jax" if kind in (None, "value") or sharding is not None else kind
    skind = saved["kind"]
    if skind == "value" or (skind == "numpy_scalar" and kind in (None, "value")):
        return Want("value")
    if kind is None or kind == "value":
        kind = "jax" if skind in ("jax", "prng_key") or sharding is not None else "numpy"
    if skind == "prng_key":  # a key array whatever the target's form (Orbax rewraps the key data it reads)
        if kind == "jax" and dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            sharding = _key_sharding(path, saved, shape, sharding)  # given for the key data
        return Want("jax", None, None, sharding if sharding is not None else saved_sharding(saved))
    if kind == "jax" and sharding is None:
        sharding = saved_sharding(saved)  # None when the saved devices are not all here: Plan raises TOPOLOGY
    return Want(kind, shape, None if dtype is None else np.dtype(dtype), sharding, strict)


def key_data_shape(saved: dict) -> tuple[int, ...]:
    """The shape of saved PRNG keys' key data (the keys' shape, then the impl's trailing dimensions)."""
    keys = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=saved["impl"])))
    return tuple(saved["shape"]) + tuple(keys.shape)


def _key_sharding(path: str, saved: dict, shape: tuple[int, ...] | None, data: Any) -> Any:
    """The keys' sharding from ``data``, a sharding given for their key data (trailing key dimensions)."""
    want = key_data_shape(saved)
    if shape is not None and tuple(shape) != want:
        raise TargetMismatchError(f"{path}: saved PRNG keys whose key data is {list(want)}, target shape "
                                  f"{list(shape)}")
    ndim = len(saved["shape"])
    if data is None or isinstance(data, jax.sharding.SingleDeviceSharding):
        return data
    if isinstance(data, jax.sharding.NamedSharding):
        spec = tuple(data.spec)[:ndim]
        return jax.sharding.NamedSharding(data.mesh, jax.sharding.PartitionSpec(*spec))
    raise TargetMismatchError(f"{path}: a {type(data).__name__} given for saved PRNG keys' key data; give the keys' "
                              f"own sharding (a ShapeDtypeStruct of the key dtype) or a NamedSharding")


@dataclasses.dataclass
class Plan:
    """A jaxckpt restore target for the whole saved tree, and how to turn what comes back into Orbax's answer."""

    target: Any
    wants: dict[str, Want]
    saved: dict[str, dict]
    finish: Callable[[dict[str, Any]], Any]


def _target_leaf(path: str, saved: dict, want: Want) -> Any:
    """The jaxckpt target leaf that reads ``saved`` as stored (same shape and dtype); ``finish`` adapts it."""
    if want.kind == "skip":
        return SKIP
    kind = saved["kind"]
    if kind in ("value", "numpy_scalar"):
        return 0  # a value target: the saved value (or numpy scalar) comes back as it was
    shape = tuple(saved["shape"])
    if kind == "prng_key":
        keys = jax.eval_shape(lambda: jax.random.key(0, impl=saved["impl"]))
        exact = want.kind == "jax" and want.sharding is not None
        return jax.ShapeDtypeStruct(shape, keys.dtype, sharding=want.sharding if exact else None)
    dtype = dtype_from_name(saved["dtype"])
    same_shape = want.shape is None or tuple(want.shape) == shape
    if want.kind == "jax" and same_shape:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=want.sharding)
    return np.broadcast_to(np.zeros((), dtype), shape)  # host bytes (no memory of its own): numpy target


def _fit(path: str, host: np.ndarray, shape: tuple[int, ...], strict: bool) -> np.ndarray:
    """Orbax's strict=False: truncate or zero-pad each axis to ``shape``."""
    if host.shape == shape:
        return host
    if strict or host.ndim != len(shape):
        raise TargetMismatchError(f"{path}: saved shape {host.shape}, target shape {shape} (pass strict=False to "
                                  f"pad or truncate)")
    out = np.zeros(shape, host.dtype)
    common = tuple(slice(0, min(a, b)) for a, b in zip(host.shape, shape))
    out[common] = host[common]
    return out


def _check_x64(path: str, dtype: Any) -> None:
    if dtype is not None and np.dtype(dtype).itemsize == 8 and np.dtype(dtype).kind in "iuf" \
            and not jax.config.jax_enable_x64:
        raise TargetMismatchError(f"{path}: a jax.Array of dtype {np.dtype(dtype).name} needs jax_enable_x64 "
                                  f"(JAX would narrow it); restore it as numpy or enable x64")


def _adapt(path: str, value: Any, saved: dict, want: Want) -> Any:
    """What the caller asked for, from the leaf as stored."""
    if want.kind == "value":
        return value
    if saved["kind"] == "prng_key":
        return value if want.sharding is None else jax.device_put(value, want.sharding)
    shape = tuple(want.shape) if want.shape is not None else tuple(saved["shape"])
    if want.kind == "numpy" or isinstance(value, np.ndarray):
        host = _fit(path, np.asarray(value), shape, want.strict)
        if want.dtype is not None and host.dtype != want.dtype:
            host = host.astype(want.dtype)
        if want.kind == "numpy":
            return host
        _check_x64(path, host.dtype)
        return jax.device_put(host, want.sharding)
    if want.dtype is not None and value.dtype != want.dtype:
        _check_x64(path, want.dtype)
        value = value.astype(want.dtype)  # jnp astype keeps the sharding
    return value


def flat_with_paths(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[tuple[str, Any]], Any]:
    """``tree``'s leaves with their "/"-joined key paths ("<root>" for a bare leaf), and its treedef."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    out = []
    for kp, v in pairs:
        out.append(("/".join(str(e[1]) for e in keypath_entries(kp)) or "<root>", v))
    return out, treedef


def _given(t: Any) -> bool:
    """An item leaf that is the caller's own answer, never read: PLACEHOLDER, None, an empty node."""
    return t is PLACEHOLDER or is_empty_node(t)


def plan(layout: dict, item: Any = None, restore_args: Any = None, *, partial: bool = False,
         strict: bool = True, rich: bool = True) -> Plan:
    """The restore of ``layout`` that Orbax would do for (``item``, ``restore_args``, ``partial``, ``strict``)."""
    import orbax.checkpoint as ocp
    saved = leaves(layout)
    is_ra = lambda x: isinstance(x, ocp.RestoreArgs)  # noqa: E731
    ras = dict(flat_with_paths(restore_args, is_ra)[0]) if restore_args is not None else {}
    wants: dict[str, Want] = {}
    answers: dict[str, Any] = {}  # item leaves answered without a read
    if item is None:
        for path, leaf in saved.items():
            wants[path] = _want(path, leaf, None, ras.get(path), strict)
    else:
        empty = empty_nodes(layout)
        for path, t in flat_with_paths(item, _given)[0]:
            if path in saved and not _given(t):
                wants[path] = _want(path, saved[path], t, ras.get(path), strict)
            elif path in saved or path in empty:
                # The item's own None / MaskedNode / PLACEHOLDER; an array asked where the saved tree had none
                # (a masked optimizer state restored onto the unmasked one) is None, as in Orbax.
                answers[path] = t if _given(t) else None
            else:
                known = f"{sorted(saved)[:8]}..." if len(saved) > 8 else f"{sorted(saved)}"
                raise TargetMismatchError(f"{MISMATCH}: {path!r} is in the restore item but not saved (saved "
                                          f"leaves: {known})")
        missing = [p for p in saved if p not in wants and p not in answers]
        if missing and not partial:
            raise TargetMismatchError(f"{MISMATCH}: saved leaves {missing} are missing from the restore item (pass "
                                      f"partial_restore=True to restore only the item's leaves)")
        for p in saved:
            wants.setdefault(p, Want("skip"))
    _check_topology(saved, wants)
    target = build(layout, lambda p, leaf: _target_leaf(p, leaf, wants[p]))

    def finish(values: dict[str, Any]) -> Any:
        adapted = {p: _adapt(p, values[p], saved[p], w) for p, w in wants.items() if w.kind != "skip"}
        if item is None:
            return build(layout, lambda p, leaf: adapted[p], rich=rich)
        flat, treedef = flat_with_paths(item, _given)
        return jax.tree_util.tree_unflatten(treedef, [answers[p] if p in answers else adapted[p] for p, _ in flat])
    return Plan(target, wants, saved, finish)


def _check_topology(saved: dict[str, dict], wants: dict[str, Want]) -> None:
    """Orbax's "Topology mismatch detected" for arrays asked for without a sharding whose saved one cannot be
    rebuilt here (its devices are not all in this job), naming each; before anything is read."""
    lost = [p for p, w in wants.items() if w.kind == "jax" and w.sharding is None]
    give = "give the target a sharding (a jax.ShapeDtypeStruct with sharding=, or ArrayRestoreArgs)"
    unknown = [p for p in lost if not saved_devices(saved[p])]
    if unknown:  # saved as numpy, or with a kind of sharding the layout does not record
        raise TargetMismatchError(f"{unknown[0]}: asked for as a jax.Array without a sharding, and saved without "
                                  f"one this job can rebuild; {give}")
    if lost:
        where = "; ".join(f"{p}: saved on devices {saved_devices(saved[p])}" for p in lost)
        raise TargetMismatchError(f"{TOPOLOGY} {where}; this job has devices {sorted(d.id for d in jax.devices())}: "
                                  f"{give}")


def standard_item(item: Any) -> Any:
    """``item`` as ``StandardCheckpointHandler`` saves it: array-likes as numpy arrays; UnsupportedTypeError
    (Orbax's "Unsupported type") for a leaf that is not an array or a number (a ``str``)."""
    def check(kp: Any, x: Any) -> Any:
        if not isinstance(x, (np.ndarray, jax.Array)) and hasattr(x, "__array__"):
            x = np.asarray(x)
        if not isinstance(x, STANDARD_TYPES):
            raise _unsupported(kp, x, "StandardSave takes arrays and numbers (PyTreeSave also takes strings)")
        return x
    return jax.tree_util.tree_map_with_path(check, item)


def check_standard_target(item: Any) -> None:
    """UnsupportedTypeError (Orbax's "Unsupported type") for a ``StandardRestore`` item leaf that is not an array,
    a number or a ``jax.ShapeDtypeStruct`` (``PLACEHOLDER`` and metadata leaves are ``PyTreeRestore``'s)."""
    def check(kp: Any, x: Any) -> None:
        if not isinstance(x, (*STANDARD_TYPES, jax.ShapeDtypeStruct)):
            raise _unsupported(kp, x, "a StandardRestore target takes arrays, numbers and jax.ShapeDtypeStruct")
    jax.tree_util.tree_map_with_path(check, item)


def _unsupported(kp: Any, x: Any, why: str) -> UnsupportedTypeError:
    entries = keypath_entries(kp)
    path = "/".join(str(v) for _, v in entries) or "<root>"
    return UnsupportedTypeError(f"Unsupported type: {type(x)} for key: {tuple(v for _, v in entries)}. {path}: {why}")


def flat_values(tree: Any) -> dict[str, Any]:
    """Path -> value of a restored tree (the SKIP sentinel counts as a leaf)."""
    return dict(flat_with_paths(tree)[0])


def abstract(layout: dict) -> Any:
    """The saved tree as restore targets: ``jax.ShapeDtypeStruct`` on the saved sharding (None where it cannot
    be rebuilt here), ``np.ndarray``-like numpy leaves (zero-copy views), the types of numpy scalars, and a value
    of the saved type for a Python value (as Orbax v1's metadata: ``0``, ``""``; a None leaf would skip it)."""
    def leaf(path: str, d: dict) -> Any:
        if d["kind"] == "value":
            return _VALUE_TYPES.get(d.get("type"), int)()
        if d["kind"] == "prng_key":
            keys = jax.eval_shape(lambda: jax.random.key(0, impl=d["impl"]))
            return jax.ShapeDtypeStruct(tuple(d["shape"]), keys.dtype, sharding=saved_sharding(d))
        dtype = dtype_from_name(d["dtype"])
        if d["kind"] == "jax":
            return jax.ShapeDtypeStruct(tuple(d["shape"]), dtype, sharding=saved_sharding(d))
        if d["kind"] == "numpy_scalar":
            return dtype.type
        return np.broadcast_to(np.zeros((), dtype), tuple(d["shape"]))
    return build(layout, leaf)
