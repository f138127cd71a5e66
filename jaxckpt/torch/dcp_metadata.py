"""PyTorch DCP's checkpoint ``Metadata`` as msgpack, without pickle, and the locators of the saved chunks.

DCP's own ``FileSystemWriter`` pickles its ``.metadata`` file; reading that back runs whatever the file says. Here
every dataclass DCP puts in a ``Metadata`` (``TensorStorageMetadata`` with its ``TensorProperties`` and
``ChunkStorageMetadata`` list, ``BytesStorageMetadata``, ``StorageMeta``, the planner's flattening map) is written
field by field as plain msgpack values, and decoded with every type checked. Anything else (a custom planner's
objects in ``planner_data``, a subclass with more fields, a sparse layout) is refused with a
:class:`jaxckpt.errors.ManifestError` naming the field, never pickled.

``Metadata.storage_data`` is ours: a :class:`StorageIndex` (the save's id, the store step, and one
:class:`Locator` per saved chunk: which rank's slot holds it, where, how long, its crc32c).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from jaxckpt.torch.dtypes import dtype_name, torch_dtype
from jaxckpt.core.checksum import crc32c
from jaxckpt.errors import ManifestError, UnsupportedLeafError

FORMAT = "jaxckpt-dcp-metadata"
VERSION = 2  # 2: each chunk row says how its bytes hold the item (non-tensor values as msgpack)
ENCODINGS = ("raw", "msgpack", "pickle")
SLOT_FORMAT = "jaxckpt-dcp"  # the manifest of each rank's slot
SLOT_VERSION = 1
_MEMORY_FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve": torch.preserve_format}
_MEMORY_FORMAT_NAMES = {v: k for k, v in _MEMORY_FORMATS.items()}
_KNOWN_FIELDS = {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"}


@dataclass(frozen=True)
class Locator:
    """Where one saved chunk lives: byte range ``[offset, offset + nbytes)`` of rank ``rank``'s slot."""

    rank: int
    offset: int
    nbytes: int
    crc: int
    # How the bytes hold the item: "raw" (a tensor's values), "msgpack" (a non-tensor value, ``dcp_values``) or
    # "pickle" (DCP's own torch.save bytes, written only with ``JaxckptWriter(pickle_values=True)``); None in a
    # version 1 record, whose non-tensor values were all DCP's pickled bytes.
    encoding: str | None = "raw"


@dataclass(frozen=True)
class StorageIndex:
    """``Metadata.storage_data`` of a jaxckpt DCP checkpoint (what the reader needs beyond DCP's own metadata)."""

    save_id: str  # the same on every rank's slot of one save: a slot of another save under this step is refused
    step: int
    world: int  # ranks that saved
    locators: dict[MetadataIndex, Locator]


# -------------------------------------------------------------------------------------- slot manifests
def pack_slot_manifest(body: dict) -> bytes:
    """One rank's slot manifest: an envelope ``[format, version, crc32c(body), body]``, body msgpack."""
    b = msgpack.packb(body)
    return msgpack.packb([SLOT_FORMAT, SLOT_VERSION, crc32c(b), b])


def unpack_slot_manifest(data: bytes | memoryview, where: str) -> dict:
    """The body of a slot manifest; ManifestError naming ``where`` if it is not one or is corrupted."""
    try:
        fmt, version, crc, body = msgpack.unpackb(bytes(data))
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise ManifestError(f"{where}: not a jaxckpt DCP slot manifest ({e})") from None
    if fmt != SLOT_FORMAT or version != SLOT_VERSION:
        raise ManifestError(f"{where}: manifest format {fmt!r} version {version!r}, expected {SLOT_FORMAT!r} "
                            f"{SLOT_VERSION}")
    if not isinstance(body, bytes) or crc32c(body) != crc:
        raise ManifestError(f"{where}: manifest fails its crc32c: corrupted")
    out = msgpack.unpackb(body)
    if not isinstance(out, dict):
        raise ManifestError(f"{where}: manifest body is not a map")
    return out


# ------------------------------------------------------------------------------------------------- encode
def encode(md: Metadata, index: StorageIndex) -> dict[str, Any]:
    """``md`` as plain msgpack values, its storage_data replaced by ``index``; ManifestError for what cannot be."""
    for f in dataclasses.fields(md):
        if f.name not in _KNOWN_FIELDS and getattr(md, f.name) != _default(f):
            raise ManifestError(f"DCP metadata field {f.name!r} (this torch's Metadata has it, jaxckpt does not "
                                f"know it) is set to {_kind(getattr(md, f.name))}: refusing to drop it")
    if not isinstance(md.state_dict_metadata, dict):
        raise ManifestError(f"DCP metadata state_dict_metadata is {_kind(md.state_dict_metadata)}, not a dict")
    entries = {}
    for fqn, v in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise ManifestError(f"DCP metadata: state_dict key {fqn!r} is not a string")
        entries[fqn] = _encode_entry(fqn, v)
    if md.version is not None and not isinstance(md.version, str):
        raise ManifestError(f"DCP metadata version is {_kind(md.version)}, not a string")
    return {"format": FORMAT, "version": VERSION, "state_dict_metadata": entries,
            "planner_data": _encode_planner_data(md.planner_data), "storage_meta": _encode_storage_meta(md.storage_meta),
            "dcp_version": md.version, "storage": _encode_index(index)}


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _kind(v: Any) -> str:
    return f"a {type(v).__module__}.{type(v).__qualname__}"


def _encode_entry(fqn: str, v: Any) -> dict[str, Any]:
    if type(v) is BytesStorageMetadata:
        return {"kind": "bytes"}
    if type(v) is not TensorStorageMetadata:
        raise ManifestError(f"{fqn}: DCP storage metadata {_kind(v)} cannot be stored without pickle (only "
                            f"TensorStorageMetadata and BytesStorageMetadata can)")
    p = v.properties
    if type(p) is not TensorProperties:
        raise ManifestError(f"{fqn}: tensor properties {_kind(p)} cannot be stored without pickle")
    if p.layout != torch.strided:
        raise ManifestError(f"{fqn}: tensor layout {p.layout} cannot be stored (only torch.strided)")
    if p.memory_format not in _MEMORY_FORMAT_NAMES:
        raise ManifestError(f"{fqn}: memory format {p.memory_format} cannot be stored")
    try:
        dtype = dtype_name(p.dtype, fqn)
    except UnsupportedLeafError as e:
        raise ManifestError(str(e)) from None
    chunks = []
    for c in v.chunks:
        if type(c) is not ChunkStorageMetadata:
            raise ManifestError(f"{fqn}: chunk metadata {_kind(c)} cannot be stored without pickle")
        chunks.append([_ints(c.offsets, f"{fqn} chunk offsets"), _ints(c.sizes, f"{fqn} chunk sizes")])
    return {"kind": "tensor", "dtype": dtype, "requires_grad": bool(p.requires_grad),
            "memory_format": _MEMORY_FORMAT_NAMES[p.memory_format], "pin_memory": bool(p.pin_memory),
            "size": _ints(v.size, f"{fqn} size"), "chunks": chunks}


def _ints(v: Any, what: str) -> list[int]:
    try:
        out = [int(x) for x in v]
    except (TypeError, ValueError):
        raise ManifestError(f"{what}: {v!r} is not a sequence of integers") from None
    if any(x < 0 for x in out):
        raise ManifestError(f"{what}: {out} has a negative entry")
    return out


def _encode_planner_data(pd: Any) -> Any:
    # DefaultSavePlanner stores its flattening map here: {flat fqn: (key, key or index, ...)}.
    if pd is None:
        return None
    if not isinstance(pd, dict):
        raise ManifestError(f"DCP metadata planner_data is {_kind(pd)}: only the default planner's "
                            f"{{fqn: path tuple}} map can be stored without pickle")
    out = {}
    for k, path in pd.items():
        if not isinstance(k, str) or not isinstance(path, (tuple, list)) or \
                not all(type(e) in (str, int) for e in path):
            raise ManifestError(f"DCP metadata planner_data[{k!r}] = {path!r}: only a tuple of str and int keys "
                                f"can be stored without pickle")
        out[k] = list(path)
    return out


def _encode_storage_meta(sm: StorageMeta | None) -> Any:
    if sm is None:
        return None
    if type(sm) is not StorageMeta:
        raise ManifestError(f"DCP storage_meta {_kind(sm)} cannot be stored without pickle")
    cid = os.fspath(sm.checkpoint_id) if sm.checkpoint_id is not None else None
    for name, v in (("checkpoint_id", cid), ("save_id", sm.save_id), ("load_id", sm.load_id)):
        if v is not None and not isinstance(v, str):
            raise ManifestError(f"DCP storage_meta.{name} is {_kind(v)}, not a string")
    if not all(isinstance(m, str) for m in sm.modules):
        raise ManifestError(f"DCP storage_meta.modules {sm.modules!r} is not a list of strings")
    return {"checkpoint_id": cid, "save_id": sm.save_id, "load_id": sm.load_id, "modules": list(sm.modules)}


def _encode_index(index: StorageIndex) -> dict[str, Any]:
    rows = []
    for mi, loc in index.locators.items():
        offset = None if mi.offset is None else _ints(mi.offset, f"{mi.fqn} offset")
        if loc.encoding not in ENCODINGS:
            raise ManifestError(f"{mi.fqn}: chunk encoding {loc.encoding!r} is not one of {ENCODINGS}")
        rows.append([mi.fqn, offset, mi.index, loc.rank, loc.offset, loc.nbytes, loc.crc, loc.encoding])
    return {"save_id": index.save_id, "step": index.step, "world": index.world, "chunks": rows}


# ------------------------------------------------------------------------------------------------- decode
def decode(d: Any, where: str) -> Metadata:
    """The ``Metadata`` encoded by :func:`encode`; ManifestError naming ``where`` if it is not well formed."""
    d = _expect(d, dict, where)
    if d.get("format") != FORMAT or d.get("version") not in (1, VERSION):
        raise ManifestError(f"{where}: not a jaxckpt DCP metadata record of version 1 or {VERSION} "
                            f"(format {d.get('format')!r}, version {d.get('version')!r})")
    try:
        entries = {_expect(fqn, str, f"{where}: key"): _decode_entry(fqn, v, where)
                   for fqn, v in _expect(d["state_dict_metadata"], dict, f"{where}: state_dict_metadata").items()}
        pd = d["planner_data"]
        if pd is not None:
            pd = {_expect(k, str, f"{where}: planner_data key"): tuple(_path(v, f"{where}: planner_data[{k!r}]"))
                  for k, v in _expect(pd, dict, f"{where}: planner_data").items()}
        version = d["dcp_version"]
        if version is not None:
            _expect(version, str, f"{where}: dcp_version")
        index = _decode_index(d["storage"], where, d["version"])
        for mi, loc in index.locators.items():
            # A value's bytes read as a tensor's, or a tensor's handed to DCP's planner as a value: refused here.
            is_tensor = isinstance(entries.get(mi.fqn), TensorStorageMetadata)
            if loc.encoding is not None and (loc.encoding == "raw") != is_tensor:
                raise ManifestError(f"{where}: chunk of {mi.fqn!r}: encoding {loc.encoding!r} for "
                                    f"{'a tensor' if is_tensor else 'a non-tensor value'}")
        return Metadata(state_dict_metadata=entries, planner_data=pd, storage_data=index,
                        storage_meta=_decode_storage_meta(d["storage_meta"], where), version=version)
    except KeyError as e:
        raise ManifestError(f"{where}: field {e.args[0]!r} is missing") from None


def _expect(v: Any, typ: type | tuple, what: str) -> Any:
    if not isinstance(v, typ) or isinstance(v, bool) and typ is int:
        raise ManifestError(f"{what}: expected {getattr(typ, '__name__', typ)}, got {type(v).__name__}")
    return v


def _int_list(v: Any, what: str) -> list[int]:
    v = _expect(v, list, what)
    for x in v:
        if _expect(x, int, what) < 0:
            raise ManifestError(f"{what}: negative entry {x}")
    return v


def _path(v: Any, what: str) -> list:
    for e in _expect(v, list, what):
        if type(e) not in (str, int):
            raise ManifestError(f"{what}: path entry {e!r} is neither str nor int")
    return v


def _decode_entry(fqn: str, v: Any, where: str) -> TensorStorageMetadata | BytesStorageMetadata:
    v = _expect(v, dict, f"{where}: {fqn}")
    if v.get("kind") == "bytes":
        return BytesStorageMetadata()
    if v.get("kind") != "tensor":
        raise ManifestError(f"{where}: {fqn}: unknown entry kind {v.get('kind')!r}")
    fmt = v["memory_format"]
    if fmt not in _MEMORY_FORMATS:
        raise ManifestError(f"{where}: {fqn}: unknown memory format {fmt!r}")
    props = TensorProperties(dtype=torch_dtype(_expect(v["dtype"], str, f"{where}: {fqn} dtype"), fqn),
                             layout=torch.strided, requires_grad=_expect(v["requires_grad"], bool, f"{fqn} grad"),
                             memory_format=_MEMORY_FORMATS[fmt],
                             pin_memory=_expect(v["pin_memory"], bool, f"{where}: {fqn} pin_memory"))
    chunks = []
    for c in _expect(v["chunks"], list, f"{where}: {fqn} chunks"):
        off, sizes = _expect(c, list, f"{where}: {fqn} chunk")
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(_int_list(off, f"{where}: {fqn} chunk offsets")),
                                           sizes=torch.Size(_int_list(sizes, f"{where}: {fqn} chunk sizes"))))
    return TensorStorageMetadata(properties=props, size=torch.Size(_int_list(v["size"], f"{where}: {fqn} size")),
                                 chunks=chunks)


def _decode_storage_meta(v: Any, where: str) -> StorageMeta:
    if v is None:
        return StorageMeta()
    v = _expect(v, dict, f"{where}: storage_meta")
    for name in ("checkpoint_id", "save_id", "load_id"):
        if v[name] is not None:
            _expect(v[name], str, f"{where}: storage_meta.{name}")
    modules = [_expect(m, str, f"{where}: storage_meta.modules") for m in _expect(v["modules"], list, where)]
    return StorageMeta(checkpoint_id=v["checkpoint_id"], save_id=v["save_id"], load_id=v["load_id"], modules=modules)


def _decode_index(v: Any, where: str, version: int) -> StorageIndex:
    v = _expect(v, dict, f"{where}: storage")
    world = _expect(v["world"], int, f"{where}: world")
    locators: dict[MetadataIndex, Locator] = {}
    for row in _expect(v["chunks"], list, f"{where}: chunks"):
        row = _expect(row, list, f"{where}: chunk")
        if len(row) != (7 if version == 1 else 8):
            raise ManifestError(f"{where}: a chunk row of {len(row)} fields in a version {version} record")
        fqn, offset, hint, rank, off, nbytes, crc = row[:7]
        encoding = None if version == 1 else row[7]
        what = f"{where}: chunk of {fqn!r}"
        if version > 1 and encoding not in ENCODINGS:
            raise ManifestError(f"{what}: unknown encoding {encoding!r}")
        mi = MetadataIndex(_expect(fqn, str, what), None if offset is None else _int_list(offset, what),
                           None if hint is None else _expect(hint, int, what))
        for name, x in (("rank", rank), ("offset", off), ("nbytes", nbytes), ("crc", crc)):
            if _expect(x, int, f"{what} {name}") < 0:
                raise ManifestError(f"{what}: negative {name} {x}")
        if rank >= world:
            raise ManifestError(f"{what}: rank {rank} is outside the {world} ranks that saved")
        locators[mi] = Locator(rank, off, nbytes, crc, encoding)
    return StorageIndex(_expect(v["save_id"], str, f"{where}: save_id"), _expect(v["step"], int, f"{where}: step"),
                        world, locators)
