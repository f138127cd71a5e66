"""jax.Array <-> planner records: placements from shardings, host views of local shards, arrays from boxes."""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import numpy as np

from jaxckpt.core import hostbuf
from jaxckpt.core.box import Box
from jaxckpt.core.dtypes import dtype_name, native_order
from jaxckpt.core.plan import HOST, ArrayLayout, Placement
from jaxckpt.jax import buffers


@functools.lru_cache(maxsize=4096)
def placements(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> tuple[Placement, ...]:
    """Where every piece of an array of ``shape`` with ``sharding`` lives, over all processes."""
    out = []
    for dev, index in sharding.devices_indices_map(shape).items():
        out.append(Placement(Box.from_index(index, shape), dev.process_index, dev.id))
    return tuple(sorted(out, key=lambda p: (p.process, p.device)))


def array_layout(path: str, x: Any, kind: str, sharding: jax.sharding.Sharding | None = None) -> ArrayLayout:
    """The planner's view of a leaf; host (numpy) leaves are owned by process 0. ``sharding``: where the copy
    that is saved lives, when it is not where ``x`` lives (the fused path's pieces, ``local_pieces``)."""
    if kind == "prng_key":
        x = jax.random.key_data(x)
    if kind in ("jax", "prng_key"):
        shape = tuple(x.shape)
        return ArrayLayout(path, shape, dtype_name(x.dtype), x.dtype.itemsize,
                           placements(shape, sharding or x.sharding))
    arr = np.asarray(x)
    shape = tuple(arr.shape)
    return ArrayLayout(path, shape, dtype_name(arr.dtype), arr.dtype.itemsize,
                       (Placement(Box.full(shape), 0, HOST),))


def describe_sharding(x: Any) -> str:
    """A short human description for manifests and ``jaxckpt inspect``."""
    s = getattr(x, "sharding", None)
    if isinstance(s, jax.sharding.NamedSharding):
        mesh = ",".join(f"{k}={v}" for k, v in s.mesh.shape.items())
        return f"NamedSharding(mesh({mesh}), {s.spec})"
    if isinstance(s, jax.sharding.SingleDeviceSharding):
        return f"SingleDevice({next(iter(s.device_set))})"
    if s is None:
        return "host"
    return type(s).__name__


def shard_reads(x: Any, kind: str, devices: frozenset[int], owned: bool = False
                  ) -> dict[int, tuple[Callable[[], np.ndarray], Callable[[], None] | None]]:
    """For each local device id in ``devices``, (fetch, start) returning the host bytes of that device's shard.

    On CPU ``np.asarray`` of a shard aliases the device buffer: taking that view here, at ``save()``, makes a
    donating next step leave these buffers alone (JAX skips donation of buffers with external references), so
    the worker copies the state as it was at the call (a state the step has not finished computing is waited
    for). On an accelerator a device-side copy is dispatched now instead (it is ordered before any later step)
    and its transfer to host is started by the dispatcher under the byte budget.
    """
    if kind == "prng_key":
        x = jax.random.key_data(x)
    if kind in ("numpy", "numpy_scalar"):
        arr = np.asarray(x)
        return {HOST: (lambda arr=arr: native_order(arr), None)}
    out = {}
    if owned:
        # jaxckpt's own copy (the fused path): nothing else can touch it, so the workers read it lazily (and
        # wait for it there, never on the training thread).
        for i, d in enumerate(x.sharding._addressable_device_assignment):
            if d.id in devices:
                out[d.id] = (lambda i=i: np.asarray(x.addressable_data(i)), None)
        return out
    # Local buffers are in ``_addressable_device_assignment`` order; only the ones the plan reads are touched
    # (one of R for replicated arrays), without building Shard objects: per-shard Python is the save() cost.
    order, cpu = _local_order(x.sharding)
    # On CPU a view of a buffer the step has not finished writing waits for the step. A device-side copy would
    # not help: XLA:CPU runs such a small program inline, so its dispatch waits too, and it costs a second memcpy.
    if cpu:
        # ``_arrays`` builds every local buffer's Python object on each access (and ``addressable_data`` reads it
        # again per call), so it is read once; a fully replicated array has one buffer worth reading.
        if x.is_fully_replicated:
            local = [x.addressable_data(0)] * len(order)
        elif buffers.private_arrays(x, order):
            local = x._arrays
        else:  # jax's private per-device arrays are not there: see jax.buffers
            local = buffers.public(x, order)
        for i, dev in enumerate(order):
            if dev in devices:
                view = np.asarray(local[i])
                out[dev] = (lambda v=view: v, None)
        return out
    copy = _device_copy(x)  # one async device-side copy of the whole array, immune to donation of ``x``
    for i, dev in enumerate(order):
        if dev in devices:
            data = copy.addressable_data(i)
            out[dev] = (lambda d=data: np.asarray(d), data.copy_to_host_async)
    return out


@functools.lru_cache(maxsize=4096)
def _local_order(sharding: jax.sharding.Sharding) -> tuple[tuple[int, ...], bool]:
    devs = sharding._addressable_device_assignment
    return tuple(d.id for d in devs), all(d.platform == "cpu" for d in devs)


def local_order(sharding: jax.sharding.Sharding) -> tuple[int, ...]:
    """The device ids of an array's local buffers, in the order of ``jax.Array._arrays``."""
    return _local_order(sharding)[0]


PINNED = "pinned_host"


@functools.lru_cache(maxsize=4096)
def pinned_sharding(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding | None:
    """``sharding`` in its accelerator's pinned host memory, where every local device has that memory; None on
    CPU (a view of the buffer there is free) and where the backend has no pinned host memory.

    On an accelerator a save's device-to-host copy goes there with one ``device_put`` for the whole state: a
    DMA into page-locked memory at the link's rate (52 GB/s on an H200, against about 2 GB/s into fresh
    pageable memory: BENCHMARKS.md, ``bench device``), ordered by the runtime before a donating next step can
    reuse the buffers, and readable by the workers as host memory."""
    devs = sharding._addressable_device_assignment
    if not devs or any(d.platform == "cpu" for d in devs):
        return None
    if not all(PINNED in {m.kind for m in d.addressable_memories()} for d in devs):
        return None
    return sharding.with_memory_kind(PINNED)


# A local replica's share smaller than this is copied whole: a piece costs the copier and the manifest a chunk each
# (a few us), about what copying this many bytes costs.
MIN_PIECE_BYTES = 64 << 10


def local_pieces(shape: tuple[int, ...], itemsize: int, sharding: jax.sharding.Sharding
                 ) -> jax.sharding.Sharding | None:
    """``sharding`` with the array's replicas inside each process cut apart: each mesh axis the spec leaves
    replicated, whose devices along it all belong to one process, added to the first dimension it divides
    evenly; None where nothing would be cut (no such axis, no dimension it divides, pieces too small).

    An accelerator's copies to pinned host memory (save()'s and the fused path's) use it: an array replicated
    over R devices of a process is copied once, in R pieces, not R times (the plan reads one copy; the others
    would cost pinned memory and link bandwidth for nothing). The pieces are the planner's placements for that
    copy, so every process cuts alike and the chunks of a replica on another node match."""
    if not isinstance(sharding, jax.sharding.NamedSharding) or not shape:
        return None
    mesh = sharding.mesh
    kinds = set(getattr(mesh, "axis_types", ()))
    if len(kinds) > 1:  # a mixed mesh: no one call places the pieces inside a program (jaxckpt.jax.fused._to_host)
        return None
    spec = list(tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec)))
    used = {a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))}
    try:
        procs = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
    except AttributeError:  # an abstract mesh: no devices to ask
        return None
    split = [int(np.prod([mesh.shape[a] for a in (e if isinstance(e, tuple) else (e,))])) if e else 1 for e in spec]
    cut = 1
    for k, axis in enumerate(mesh.axis_names):
        n = mesh.shape[axis]
        if axis in used or n == 1 or not (procs == procs.take([0], axis=k)).all():
            continue
        dim = next((i for i, size in enumerate(shape) if size % (split[i] * n) == 0), None)
        if dim is None:
            continue
        entry = spec[dim]
        spec[dim] = (*(entry if isinstance(entry, tuple) else (entry,) if entry else ()), axis)
        split[dim] *= n
        cut *= n
    if cut == 1 or int(np.prod(shape)) * itemsize // int(np.prod(split)) < MIN_PIECE_BYTES:
        return None
    spec = [e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in spec]
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec), memory_kind=sharding.memory_kind)


# ``jax.Array.copy`` waits for the array here; a jitted copy is dispatched asynchronously like any step.
_device_copy = jax.jit(lambda a: jax.numpy.copy(a))


@functools.lru_cache(maxsize=4096)
def _local_boxes(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> tuple[tuple[Any, Box], ...]:
    return tuple((dev, Box.from_index(index, shape))
                 for dev, index in sharding.addressable_devices_indices_map(shape).items())


def needs_private_hosts(sharding: jax.sharding.Sharding) -> bool:
    """Whether host arrays handed to ``make_array`` must be private memory (CPU devices alias what they get)."""
    return _local_order(sharding)[1]


def make_array(shape: tuple[int, ...], dtype: np.dtype, sharding: jax.sharding.Sharding,
               boxes: dict[Box, np.ndarray], private: bool = False) -> jax.Array:
    """A global jax.Array with ``sharding`` whose local shards come from host arrays keyed by box.

    ``private``: the host arrays are memory of their own (see ``needs_private_hosts``), so each may be given to
    one device as is; otherwise (or for a second device needing the same box) a copy is made on CPU.
    """
    local = _local_boxes(shape, sharding)
    hosts = [boxes[box] for _, box in local]
    targets = _put_targets(shape, sharding)
    if sharding.is_fully_replicated and len(hosts) > 1 and isinstance(targets[0], jax.Device) \
            and needs_private_hosts(sharding):
        # Every device holds the whole array: one private buffer goes to the first device and JAX copies it to
        # the others device-side, in one call, where a host copy and a transfer per device cost 2x as much
        # (BENCHMARKS.md, stop 53). The buffers stay distinct: a device given the first one's array copies it.
        one = jax.device_put(hosts[0] if private else hostbuf.copy(hosts[0]), targets[0])
        return jax.make_array_from_callback(shape, sharding, lambda _index: one, dtype=dtype)
    if needs_private_hosts(sharding):
        # The CPU client aliases aligned host memory instead of copying it (even with may_alias=False): a view
        # of a store's buffer would change when a later save reuses it, and two devices given one array would
        # share (and donate) one buffer. Every device gets memory of its own.
        used: set[int] = set()
        for i, h in enumerate(hosts):
            if not private or id(h) in used:
                hosts[i] = hostbuf.copy(h)
            used.add(id(h))
    if len(hosts) > 1 and not sharding.is_fully_replicated and isinstance(targets[0], jax.Device):
        # One call that hands every piece to its device: JAX asks for the pieces in the order of
        # addressable_devices_indices_map, the order of ``local``; 3-4x less of JAX's Python per piece than
        # a batched device_put and an assembly (bench restore). Devices in their default memory only. A fully
        # replicated sharding asks for one piece and gives it to every device (one host buffer aliased by
        # several devices), so it takes the way below.
        pieces = iter(hosts)
        return jax.make_array_from_callback(shape, sharding, lambda _index: next(pieces), dtype=dtype)
    # One batched transfer for all local devices instead of a device_put per shard.
    arrays = jax.device_put(hosts, list(targets)) if hosts else []
    # dtype: a sharding none of whose devices are this process's leaves it no shard to take it from
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays, dtype=dtype)


@functools.lru_cache(maxsize=4096)
def _put_targets(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> tuple[Any, ...]:
    """Where ``make_array`` puts each local piece (in ``_local_boxes`` order): the device, or, for a sharding in
    another memory of its devices than their default (a state kept in host memory), that memory of the device;
    the array is assembled from pieces in the sharding's own memory only."""
    kind = sharding.memory_kind
    devs = [dev for dev, _ in _local_boxes(shape, sharding)]
    if kind is None or all(d.default_memory().kind == kind for d in devs):
        return tuple(devs)
    return tuple(jax.sharding.SingleDeviceSharding(d, memory_kind=kind) for d in devs)


def needed_boxes(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> dict[Box, list[int]]:
    """The boxes this process's devices need under ``sharding``, each with the device ids that need it."""
    out: dict[Box, list[int]] = {}
    for dev, box in _local_boxes(shape, sharding):
        out.setdefault(box, []).append(dev.id)
    return out


def key_data_sharding(sharding: jax.sharding.Sharding, extra_dims: int) -> jax.sharding.Sharding | None:
    """The sharding of a typed key array's raw data (trailing key dimensions unsharded), if expressible."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * extra_dims
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    return None
