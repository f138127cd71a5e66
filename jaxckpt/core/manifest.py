"""The snapshot manifest: what one process saved for one step, as plain frozen dataclasses, msgpack on the wire.

A manifest lists every array of the state (path, global shape, dtype, how it was sharded) with the chunks this
process holds (box, byte offset in its snapshot buffer, crc32c), plus the non-array leaves by value. Restore
merges the manifests of all processes into one chunk table per array. The encoded form is an envelope
``[FORMAT, VERSION, crc32c(body), body]`` so a truncated or flipped manifest is refused, never half-read.

A save encodes its manifest through its layout's :class:`Template`: the body packed once per layout with a
fixed-width slot for each chunk's crc32c, the slots filled per save in one numpy call and the step, time and
plain values packed after them. A save then makes a handful of Python objects however many chunks it has, where
the dataclasses and wire lists of every chunk set off the collector on the copy worker while the training
thread waited for the GIL. The body stays the msgpack map every reader decodes (a crc32c packed as a 4-byte
unsigned int is the same integer to msgpack).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

import msgpack

from jaxckpt.core import collector
from jaxckpt.core.box import Box
from jaxckpt.core.checksum import crc32c
from jaxckpt.core.dtypes import check_plain, dtype_from_name
from jaxckpt.core.keypath import KeyEntry
from jaxckpt.errors import ManifestError, TargetMismatchError, UnsupportedLeafError

FORMAT = "jaxckpt-manifest"
VERSION = 1
# A manifest is read from other processes and from disk: refuse absurd sizes before decoding.
MAX_MANIFEST_BYTES = 256 << 20



@dataclass(frozen=True)
class ChunkMeta:
    """One saved piece of an array: ``box`` of it lives at ``offset`` in process ``process``'s buffer."""

    box: Box
    offset: int
    nbytes: int
    crc32c: int
    process: int


@dataclass(frozen=True)
class ArrayMeta:
    """An array leaf: its global shape and dtype, how it was held, and the chunks this manifest knows of."""

    path: str
    keypath: tuple[KeyEntry, ...]
    shape: tuple[int, ...]
    dtype: str
    kind: str  # "jax" | "numpy" | "numpy_scalar" | "prng_key" | "torch"
    sharding: str = ""
    attrs: Mapping[str, Any] = field(default_factory=dict)
    chunks: tuple[ChunkMeta, ...] = ()


@dataclass(frozen=True)
class LeafMeta:
    """A non-array leaf (int, float, bool, str, bytes, None), stored by value."""

    path: str
    keypath: tuple[KeyEntry, ...]
    value: Any


@dataclass(frozen=True)
class Manifest:
    """Everything process ``process`` of ``process_count`` saved for ``step``."""

    step: int
    process: int
    process_count: int
    framework: str
    arrays: tuple[ArrayMeta, ...]
    leaves: tuple[LeafMeta, ...] = ()
    order: tuple[str, ...] = ()  # leaf paths in flatten order (arrays and non-array leaves)
    nbytes: int = 0
    layout: str = ""
    created: float = field(default_factory=time.time)

    def array(self, path: str) -> ArrayMeta:
        for a in self.arrays:
            if a.path == path:
                return a
        raise KeyError(path)


def encode(m: Manifest) -> bytes:
    """The msgpack envelope of a manifest."""
    chunks = [(i, c.box, c.offset, c.nbytes, c.process) for i, a in enumerate(m.arrays) for c in a.chunks]
    return Template(m.process, m.process_count, m.framework, m.arrays, chunks, m.order, m.nbytes,
                    m.layout).encode(m.step, [c.crc32c for a in m.arrays for c in a.chunks], m.leaves, m.created)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


_CRC = b"\xce"  # msgpack's uint32: a crc32c slot is always 4 bytes wide, whatever its value
_TAIL_KEYS = tuple(_pack(k) for k in ("step", "created", "leaves"))


class Template:
    """One layout's manifest, encoded once: :meth:`encode` fills in a save's chunk crc32cs, step, time and
    plain values.

    ``arrays``: the layout's arrays (their ``chunks`` are ignored); ``chunks``: this manifest's chunks as
    ``(array index, box, offset, nbytes, process)``, in the order :meth:`encode` is given their crc32cs (the
    save plan's, for the engine); each array lists its chunks in that order."""

    __slots__ = ("order", "_body", "_slots")

    def __init__(self, process: int, process_count: int, framework: str, arrays: Sequence[ArrayMeta],
                 chunks: Sequence[tuple[int, Box, int, int, int]], order: Sequence[str], nbytes: int,
                 layout: str) -> None:
        self.order = order  # the leaf order it was made for (the engine checks a save's order is the same)
        per_array: list[list[int]] = [[] for _ in arrays]
        for k, c in enumerate(chunks):
            per_array[c[0]].append(k)
        packer = msgpack.Packer(use_bin_type=True)
        parts = [packer.pack_map_header(10)]
        for key, value in (("process", process), ("process_count", process_count), ("framework", framework),
                           ("nbytes", nbytes), ("layout", layout), ("order", list(order))):
            parts += (_pack(key), _pack(value))
        parts += (_pack("arrays"), packer.pack_array_header(len(arrays)))
        slots = [0] * len(chunks)
        for a, ks in zip(arrays, per_array):
            fields = _array_head(a)
            parts.append(packer.pack_map_header(len(fields) + 1))
            for key, value in fields.items():
                parts += (_pack(key), _pack(value))
            parts += (_pack("chunks"), packer.pack_array_header(len(ks)))
            for k in ks:
                _, box, offset, nb, proc = chunks[k]
                parts.append(packer.pack_array_header(5) + _pack(box.to_wire()) + _pack(offset) + _pack(nb) + _CRC)
                slots[k] = len(parts)  # the crc32c's part: its byte position once the parts are joined
                parts += (bytes(4), _pack(proc))
        import numpy as np  # here: the node agent decodes manifests and serves before it imports numpy

        starts = np.cumsum([0] + [len(x) for x in parts])
        self._body = b"".join(parts)
        # per chunk, the 4 byte positions of its crc32c (big-endian, as msgpack writes a uint32)
        self._slots = starts[np.asarray(slots, dtype=np.int64)].reshape(-1, 1) + np.arange(4, dtype=np.int64)

    def encode(self, step: int, crcs: Sequence[int], leaves: Sequence[LeafMeta], created: float | None = None
               ) -> bytes:
        """The envelope of this layout's manifest of ``step`` with chunk crc32cs ``crcs`` (in the order of the
        template's ``chunks``), the plain values ``leaves`` and the time ``created`` (default: now)."""
        import numpy as np

        body = bytearray(self._body)
        if len(self._slots):
            np.frombuffer(body, dtype=np.uint8)[self._slots] = np.asarray(crcs, dtype=">u4").view(np.uint8
                                                                                               ).reshape(-1, 4)
        step_k, created_k, leaves_k = _TAIL_KEYS
        raw = b"".join((body, step_k, _pack(step), created_k,
                        _pack(float(time.time() if created is None else created)),
                        leaves_k, _pack([_leaf_wire(x) for x in leaves])))
        return msgpack.packb([FORMAT, VERSION, crc32c(raw), raw], use_bin_type=True)


def decode(data: bytes | memoryview, *, source: str = "manifest") -> Manifest:
    """Decode and validate an envelope; any defect raises ManifestError naming ``source``."""
    body = _body(data, source)
    # The collector paused: a manifest is a few objects per chunk, made at once and kept together (a 4,096-leaf
    # state's 32,768 chunks set off a young collection every 700 objects, 4x the unpacking itself).
    with collector.paused(), _reading(source):
        return _from_wire(msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=False))


def chunk_crcs(data: bytes | memoryview, *, source: str = "manifest") -> dict[tuple[int, int], int]:
    """(saving process, offset) -> crc32c of every chunk an envelope lists, which is all that checking bytes
    against their manifest needs: the envelope is checked as :func:`decode` checks it and every chunk's four
    integers are, but no record is built (34-80 ms against 246-358 ms for :func:`decode` of a 32,768-chunk
    manifest here, which a node agent would otherwise pay for every source at every step it protects)."""
    body = _body(data, source)
    out: dict[tuple[int, int], int] = {}
    with _reading(source):
        with collector.paused():  # as decode(): the unpacked lists are a few objects per chunk, made at once
            d = _expect(msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=False), dict, "manifest")
        for a in _expect(d["arrays"], list, "arrays"):
            for c in _expect(_expect(a, dict, "array")["chunks"], list, "chunks"):
                _, off, nb, crc, proc = _expect(c, list, "chunk")
                if not (type(off) is int and type(nb) is int and type(crc) is int and type(proc) is int
                        and off >= 0 and nb >= 0 and crc >= 0 and proc >= 0):
                    for v, what in ((off, "offset"), (nb, "nbytes"), (crc, "crc32c"), (proc, "process")):
                        _int(v, f"{a.get('path')}.{what}")
                out[(proc, off)] = crc
    return out


class ChunkCrcs:
    """:func:`chunk_crcs` for a run of manifests of one process, each step's: the first (and the first of each new
    layout) decoded whole, the byte places of its chunks' crc32c noted; a later one whose body equals it outside
    those places up to the end of its arrays (a :class:`Template` packs the step, time and plain values after
    them) is read at the places alone. A node agent pulls from every protected process each step: decoding a
    4,096-leaf manifest whole takes 22 ms here, three of them per pull. Thread-safe."""

    def __init__(self) -> None:
        self._known: tuple | None = None  # (prefix with the crc32c bytes zeroed, their places, keys, tail keys)

    def __call__(self, data: bytes | memoryview, *, source: str = "manifest") -> dict[tuple[int, int], int]:
        body = _body(data, source)
        known = self._known
        if known is not None:
            got = _read_places(body, *known)
            if got is not None:
                return got
        out = chunk_crcs(data, source=source)  # checks every field; the places below only locate them
        try:
            self._known = _places(body)
        except Exception:  # noqa: BLE001 - not a layout the places can be read from: decoded whole each time
            self._known = None
        return out


def _places(body: bytes) -> tuple | None:
    """The prefix of ``body`` up to the end of its arrays with each chunk's crc32c zeroed, those crc32c's byte
    places, the chunks' (process, offset), and the keys after the arrays; None where a crc32c is not a 4-byte
    unsigned int (not packed by a Template)."""
    import numpy as np

    u = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(body))
    u.feed(body)
    places: list[int] = []
    keys: list[tuple[int, int]] = []
    end, tail = -1, []
    for _ in range(u.read_map_header()):
        key = u.unpack()
        if end >= 0:
            tail.append(key)
        if key != "arrays":
            u.skip()
            continue
        if end >= 0:  # arrays twice: the decode takes the last, the places would hold both
            return None
        for _ in range(u.read_array_header()):
            for _ in range(u.read_map_header()):
                if u.unpack() != "chunks":
                    u.skip()
                    continue
                for _ in range(u.read_array_header()):
                    if u.read_array_header() != 5:
                        return None
                    u.skip()  # the box
                    off = u.unpack()
                    u.skip()  # nbytes
                    at = u.tell()
                    u.skip()
                    if body[at] != _CRC[0]:
                        return None
                    places.append(at + 1)
                    keys.append((u.unpack(), off))
        end = u.tell()
    if end < 0:
        return None
    at = np.asarray(places, dtype=np.int64).reshape(-1, 1) + np.arange(4, dtype=np.int64)
    prefix = np.frombuffer(body, np.uint8, count=end).copy()
    prefix[at] = 0
    return prefix, at, keys, tail


def _read_places(body: bytes, prefix: Any, at: Any, keys: list, tail: list) -> dict[tuple[int, int], int] | None:
    """The crc32c's of ``body`` read at the places :func:`_places` noted, if its bytes equal ``prefix`` elsewhere
    and only the keys ``tail`` follow its arrays; None otherwise (another layout: decode it whole)."""
    import numpy as np

    if len(body) < prefix.size:
        return None
    head = np.frombuffer(body, np.uint8, count=prefix.size).copy()
    crcs = head[at]
    head[at] = 0
    if not np.array_equal(head, prefix):
        return None
    u = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(body))
    u.feed(body[prefix.size:])
    try:
        for key in tail:
            if u.unpack() != key:
                return None
            u.skip()
        if u.tell() != len(body) - prefix.size:
            return None
    except Exception:  # noqa: BLE001 - a malformed tail: the whole decode says what is wrong
        return None
    return dict(zip(keys, crcs.view(">u4").reshape(-1).tolist()))


def owner(data: bytes | memoryview, *, source: str = "manifest") -> tuple[int, int]:
    """(process, process_count) of the snapshot an envelope describes: the envelope checked as :func:`decode`
    checks it, those two fields only (whose a held step is, without building a record of each of its chunks)."""
    body = _body(data, source)
    with _reading(source):
        u = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(body))
        u.feed(body)
        got: dict[str, Any] = {}
        for _ in range(u.read_map_header()):  # the arrays' chunks are skipped over, never built
            key = u.unpack()
            if key in ("process", "process_count"):
                got[key] = u.unpack()
            else:
                u.skip()
        return _int(got["process"], "process"), _int(got["process_count"], "process_count")


@contextlib.contextmanager
def _reading(source: str) -> Iterator[None]:
    """Any defect met while reading a checked envelope's body as a ManifestError that names ``source`` (msgpack,
    index and type errors alike: a body that is not what this build writes)."""
    try:
        yield
    except ManifestError as e:
        raise ManifestError(f"{source}: {e}") from None
    except Exception as e:
        raise ManifestError(f"{source}: malformed manifest body ({type(e).__name__}: {e})") from None


def _body(data: bytes | memoryview, source: str) -> bytes:
    """The body of an envelope whose size, format, version and crc32c are right (ManifestError otherwise)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{source}: {len(data)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")
    try:
        env = msgpack.unpackb(bytes(data), raw=False, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types for truncated/garbage input
        raise ManifestError(f"{source}: not a jaxckpt manifest (truncated or corrupt: {e})") from None
    if not (isinstance(env, list) and len(env) == 4 and env[0] == FORMAT):
        raise ManifestError(f"{source}: not a jaxckpt manifest envelope")
    fmt, version, crc, body = env
    if version != VERSION:
        raise ManifestError(f"{source}: manifest version {version!r} is not supported (this build reads {VERSION})")
    if not isinstance(body, bytes) or not isinstance(crc, int):
        raise ManifestError(f"{source}: malformed manifest envelope")
    if crc32c(body) != crc:
        raise ManifestError(f"{source}: manifest checksum mismatch (corrupt)")
    return body


def _keypath_to_wire(kp: Iterable[KeyEntry]) -> list:
    return [[k, v] for k, v in kp]


# What each keypath entry kind may carry (front ends write dict keys as str or int, attributes by name).
_KEY_TYPES = {"key": (str, int), "idx": int, "attr": str}
_KEY_EXACT = {"key": (str, int), "idx": (int,), "attr": (str,)}


def _keypath_from_wire(v: Any) -> tuple[KeyEntry, ...]:
    if type(v) is list:  # the usual keypath, read at once; any other is checked entry by entry below
        out = [(e[0], e[1]) for e in v if type(e) is list and len(e) == 2 and type(e[0]) is str
               and type(e[1]) in _KEY_EXACT.get(e[0], ())]
        if len(out) == len(v):
            return tuple(out)
    out = []
    for entry in _expect(v, list, "keypath"):
        if len(_expect(entry, list, "keypath entry")) != 2:
            raise ManifestError(f"keypath entry {entry!r} is not a [kind, key] pair")
        kind, key = entry
        if kind not in _KEY_TYPES:
            raise ManifestError(f"unknown keypath entry kind {kind!r}")
        _expect(key, _KEY_TYPES[kind], f"keypath {kind}")
        out.append((kind, key))
    return tuple(out)


def _array_head(a: ArrayMeta) -> dict:
    """An array's wire fields but its chunks."""
    return {"path": a.path, "keypath": _keypath_to_wire(a.keypath), "shape": list(a.shape), "dtype": a.dtype,
            "kind": a.kind, "sharding": a.sharding, "attrs": dict(a.attrs)}


def _leaf_wire(x: LeafMeta) -> dict:
    return {"path": x.path, "keypath": _keypath_to_wire(x.keypath), "value": x.value}


def _to_wire(m: Manifest) -> dict:
    """The manifest as the map its body packs (what :class:`Template` writes, field by field)."""
    return {
        "step": m.step, "process": m.process, "process_count": m.process_count, "framework": m.framework,
        "nbytes": m.nbytes, "layout": m.layout, "created": m.created, "order": list(m.order),
        "arrays": [{**_array_head(a),
                    "chunks": [[c.box.to_wire(), c.offset, c.nbytes, c.crc32c, c.process] for c in a.chunks]}
                   for a in m.arrays],
        "leaves": [_leaf_wire(x) for x in m.leaves],
    }


def _expect(v: Any, typ: type | tuple, what: str, suffix: str = "") -> Any:
    """``v`` if it is a ``typ`` (a bool only where ``typ`` names bool); the field is named ``what + suffix``,
    joined only for the error (a decode checks a few fields per chunk and array)."""
    if type(v) is typ:
        return v
    types = typ if isinstance(typ, tuple) else (typ,)
    if not isinstance(v, typ) or (isinstance(v, bool) and bool not in types):
        raise ManifestError(f"manifest field {what + suffix!r} has type {type(v).__name__}")
    return v


def _int(v: Any, what: str, suffix: str = "") -> int:
    if type(v) is not int:
        v = _expect(v, int, what, suffix)
    if v < 0:
        raise ManifestError(f"manifest field {what + suffix!r} is negative ({v})")
    return v


def _from_wire(d: Any) -> Manifest:
    d = _expect(d, dict, "manifest")
    step, process_count = _int(d["step"], "step"), _int(d["process_count"], "process_count")
    process = _int(d["process"], "process")
    if process >= process_count:
        raise ManifestError(f"manifest of process {process} in a job of {process_count} processes")
    # A state's chunks repeat a few boxes (arrays of one shape cut alike): each (shape, box) is checked once and
    # its Box made once, the bulk of decoding a many-leaf manifest otherwise (8 us a chunk, 2 with this).
    boxes: dict[tuple, tuple[Box, int]] = {}
    ranges: list[tuple[int, int, int, str]] = []  # (process, start, end, path) of every non-empty chunk
    arrays = []
    for a in _expect(d["arrays"], list, "arrays"):
        a = _expect(a, dict, "array")
        path = _expect(a["path"], str, "path")
        shape = tuple(_int(s, path, ".shape") for s in _expect(a["shape"], list, path, ".shape"))
        dtype = _expect(a["dtype"], str, path, ".dtype")
        itemsize = dtype_from_name(dtype).itemsize
        chunks = []
        for c in _expect(a["chunks"], list, path, ".chunks"):
            box_w, off, nb, crc, proc = c if type(c) is list else _expect(c, list, path, ".chunk")
            try:
                box, size = boxes[(shape, tuple(box_w[0]), tuple(box_w[1]))]
            except (KeyError, TypeError, IndexError):  # a box not met yet (or not a box: _box says so)
                box = _box(box_w, shape, path)
                size = box.size
                boxes[(shape, box.start, box.stop)] = box, size
            # exactly int (not bool) and not negative, checked at once; the field named only when one is not
            if not (type(off) is int and type(nb) is int and type(crc) is int and type(proc) is int
                    and off >= 0 and nb >= 0 and crc >= 0 and proc >= 0):
                for v, what in ((off, "offset"), (nb, "nbytes"), (crc, "crc32c"), (proc, "process")):
                    _int(v, path, f".{what}")
            if proc >= process_count:
                raise ManifestError(f"{path}: chunk of process {proc} in a job of {process_count}")
            if nb != size * itemsize:
                raise ManifestError(f"{path}: chunk {box} of {dtype} has {nb} bytes, expected {size * itemsize}")
            if nb:
                ranges.append((proc, off, off + nb, path))
            chunks.append(ChunkMeta(box, off, nb, crc, proc))
        arrays.append(ArrayMeta(path=path, keypath=_keypath_from_wire(a["keypath"]), shape=shape, dtype=dtype,
                                kind=_expect(a["kind"], str, path, ".kind"),
                                sharding=_expect(a["sharding"], str, path, ".sharding"),
                                attrs=_expect(a["attrs"], dict, path, ".attrs"), chunks=tuple(chunks)))
    leaves = tuple(LeafMeta(_expect(x["path"], str, "leaf.path"), _keypath_from_wire(x["keypath"]),
                            _expect(x["value"], VALUE_TYPES, f"{x['path']}.value"))
                   for x in (_expect(x, dict, "leaf") for x in _expect(d["leaves"], list, "leaves")))
    m = Manifest(step=step, process=process, process_count=process_count,
                 framework=_expect(d["framework"], str, "framework"), arrays=tuple(arrays), leaves=leaves,
                 order=tuple(_expect(p, str, "order") for p in _expect(d["order"], list, "order")),
                 nbytes=_int(d["nbytes"], "nbytes"), layout=_expect(d["layout"], str, "layout"),
                 created=_expect(d["created"], (int, float), "created"))
    _check_consistent(m, ranges)
    return m


def _box(box_w: Any, shape: tuple[int, ...], path: str) -> Box:
    """The Box of a chunk's wire ``[start, stop]`` inside an array of ``shape`` (ManifestError otherwise)."""
    start, stop = _expect(box_w, list, path, ".box")
    start, stop = _expect(start, list, path, ".box"), _expect(stop, list, path, ".box")
    if not (len(start) == len(stop) == len(shape)
            and all(type(lo) is int and type(hi) is int and 0 <= lo <= hi <= s
                    for lo, hi, s in zip(start, stop, shape))):
        raise ManifestError(f"{path}: chunk box {start}..{stop} out of bounds of shape {shape}")
    return Box(tuple(start), tuple(stop))


VALUE_TYPES = (bool, int, float, str, bytes, type(None))  # what a manifest holds by value (LeafMeta.value)


def host_kind(value: Any, path: str) -> str | None:
    """The kind of a leaf every front end holds alike: "numpy", "numpy_scalar" or "value" (saved by value), None
    for any other leaf (the front end's own kinds); UnsupportedLeafError naming ``path`` for a numpy leaf of
    objects or of a dtype with no plain bytes, and an integer wider than 64 bits."""
    import numpy as np  # here: the node agent decodes manifests and serves before it imports numpy

    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise UnsupportedLeafError(f"{path}: numpy arrays of dtype object cannot be snapshotted")
        check_plain(value.dtype, path)
        return "numpy"
    if isinstance(value, np.generic):
        check_plain(value.dtype, path)
        return "numpy_scalar"
    if isinstance(value, VALUE_TYPES):
        if isinstance(value, int) and not isinstance(value, bool) and not -(1 << 63) <= value < (1 << 64):
            raise UnsupportedLeafError(f"{path}: integer {value} does not fit 64 bits")
        return "value"
    return None


def _check_consistent(m: Manifest, ranges: list[tuple[int, int, int, str]]) -> None:
    """Cross-field rules a checksum cannot vouch for (a buggy or hostile writer): restore relies on them. Each
    chunk's own (its process, its size against its box and dtype) the decode checks as it reads it; ``ranges``:
    (process, start, end, path) of every non-empty chunk, checked here for bytes two chunks share."""
    paths: set[str] = set()
    keys: set[tuple] = set()
    for x in (*m.arrays, *m.leaves):
        if x.path in paths:
            raise ManifestError(f"{x.path}: listed twice in the manifest of step {m.step}")
        paths.add(x.path)
        k = tuple(key for _, key in x.keypath)
        if k in keys:
            raise ManifestError(f"{x.path}: keypath {list(k)} is used twice in the manifest of step {m.step}")
        keys.add(k)
    for k in keys:  # a leaf cannot sit inside another leaf
        for n in range(len(k)):
            if k[:n] in keys:
                raise ManifestError(f"keypath {list(k[:n])} is both a leaf and a container in step {m.step}")
    if len(set(m.order)) != len(m.order) or not paths.issuperset(m.order):
        raise ManifestError(f"manifest of step {m.step}: leaf order names unknown or repeated paths")
    for a in m.arrays:
        if a.kind == "prng_key":
            shape, kdtype, impl = a.attrs.get("key_shape"), a.attrs.get("key_dtype"), a.attrs.get("impl")
            if not (isinstance(shape, list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                    for s in shape)
                    and isinstance(kdtype, str) and isinstance(impl, str)):
                raise ManifestError(f"{a.path}: PRNG key array without a valid key_shape/key_dtype/impl")
    ranges.sort()
    for (p0, _, end, path0), (p1, start, _, path1) in zip(ranges, ranges[1:]):
        if p0 == p1 and start < end:  # two chunks sharing bytes: one of them would be read unverified
            raise ManifestError(f"{path1}: chunk at offset {start} of process {p1} overlaps a chunk of {path0} "
                                f"in step {m.step}")


def merge_chunks(manifests: Iterable[Manifest]) -> dict[str, ArrayMeta]:
    """One ArrayMeta per path holding the chunks of every given manifest (which must agree on shapes)."""
    out: dict[str, ArrayMeta] = {}
    for m in manifests:
        for a in m.arrays:
            prev = out.get(a.path)
            if prev is None:
                out[a.path] = a
                continue
            if prev.shape != a.shape or prev.dtype != a.dtype:
                raise ManifestError(f"{a.path}: processes disagree on shape/dtype at step {m.step}: "
                                    f"{prev.shape}/{prev.dtype} vs {a.shape}/{a.dtype}")
            out[a.path] = ArrayMeta(prev.path, prev.keypath, prev.shape, prev.dtype, prev.kind, prev.sharding,
                                    prev.attrs, prev.chunks + a.chunks)
    return out


def check_target_paths(paths: Iterable[str], m: Manifest, step: int) -> None:
    """Raise TargetMismatchError unless a restore target's leaves (by path) are exactly the ones ``m`` saved."""
    wanted = list(paths)
    saved = set(m.order)
    for path in wanted:
        if path not in saved:
            raise TargetMismatchError(f"{path}: in the target but not in step {step} (structure differs)")
    wanted_set = set(wanted)
    for path in m.order:
        if path not in wanted_set:
            raise TargetMismatchError(f"{path}: saved in step {step} but missing from the target (structure differs)")
