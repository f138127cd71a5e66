"""DCP's non-tensor values (its ``BytesIO`` items) as msgpack, so the bytes another process reads are never pickle.

DCP's save planner turns each non-tensor value of a state dict (an epoch, a learning rate, an optimizer's
``param_groups``) into ``torch.save`` bytes, and its load planner hands what it reads to a full unpickler. The
writer decodes those bytes in the process that just made them (torch's restricted loader: nothing of the user's
runs) and stores the value with :func:`encode`; the reader rebuilds it with :func:`decode`, every type checked,
and gives DCP's planner bytes it ``torch.save``'d itself from that value.

Encoded: ``None``, ``bool``, ``int`` (any size), ``float``, ``complex``, ``str``, ``bytes``, ``bytearray``,
``list``, ``tuple``, ``dict`` (keys of these types), ``OrderedDict``, ``Counter``, ``set``, ``torch.Size``,
``torch.dtype``, ``torch.device``, and dense tensors and ``nn.Parameter`` of a jaxckpt dtype (their values, shape,
device and ``requires_grad``; a view comes back as a tensor of its own). Anything else (a class of the user's, a
sparse or quantized tensor, a cycle) raises :class:`jaxckpt.errors.UnsupportedTypeError` naming the item and the
place in the value; nothing is narrowed or dropped.
"""
from __future__ import annotations

import collections
import io
import math
import re
from typing import Any, Callable

import msgpack
import numpy as np
import torch

from jaxckpt.core.dtypes import dtype_from_name
from jaxckpt.errors import ManifestError, UnsupportedLeafError, UnsupportedTypeError
from jaxckpt.torch.dtypes import DTYPE_NAMES, dtype_name, from_numpy, numpy_view, torch_dtype

__all__ = ["decode", "encode", "loadable", "stored", "stored_value"]

# msgpack extension codes; each payload is itself msgpack of the fields named.
_TUPLE, _ODICT, _COUNTER, _SET, _COMPLEX, _BYTEARRAY, _BIGINT, _SIZE, _DTYPE, _DEVICE, _TENSOR = range(1, 12)
_HINT = ("save plain values (numbers, strings, containers, tensors), or pass pickle_values=True to JaxckptWriter to "
         "store it pickled (a reader then needs trust_pickled_values=True)")
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1  # what msgpack's own ints hold
_TORCH_DTYPES = {str(d): d for d in DTYPE_NAMES} | {str(d): d for d in vars(torch).values()
                                                     if isinstance(d, torch.dtype)}


def _pack(x: Any) -> bytes:
    return msgpack.packb(x, use_bin_type=True, unicode_errors="surrogatepass")


def _kind(x: Any) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


# ------------------------------------------------------------------------------------- writer and reader
def stored(data: Any, where: str, pickle_values: bool) -> tuple[bytes | memoryview, str]:
    """The bytes a writer stores for DCP's ``torch.save`` bytes ``data`` of one value, and their encoding (see
    :func:`stored_value`); the value is read back with torch's restricted loader."""
    pickled = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(bytes(data))
    try:
        # This process's planner made these bytes from the user's value a moment ago; the restricted loader runs
        # nothing of theirs and refuses the classes only a full unpickling could rebuild.
        value = torch.load(io.BytesIO(pickled), weights_only=True)
    except Exception as e:  # noqa: BLE001 - any refusal of the restricted loader
        if pickle_values:
            return pickled, "pickle"
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        why = f"it holds a {found.group(1)}" if found else \
            f"torch's restricted loader refused DCP's bytes of it: {type(e).__name__}: {str(e)[:200]}"
        raise UnsupportedTypeError(f"{where}: its value has no encoding without pickle ({why}); {_HINT}") from None
    return stored_value(value, where, pickle_values, lambda: pickled)


def stored_value(value: Any, where: str, pickle_values: bool,
                 pickled: Callable[[], bytes | memoryview]) -> tuple[bytes | memoryview, str]:
    """The bytes a writer stores for one value and their encoding: ``value`` as msgpack, or DCP's pickled bytes
    of it (``pickled()``, "pickle") where it has no such encoding and ``pickle_values`` allows them;
    UnsupportedTypeError naming ``where`` and the place in the value otherwise."""
    try:
        return encode(value, where), "msgpack"
    except UnsupportedTypeError as e:
        if pickle_values:
            return pickled(), "pickle"
        raise UnsupportedTypeError(f"{e}; {_HINT}") from None


def loadable(raw: bytes, encoding: str | None, where: str, trust_pickled_values: bool) -> io.BytesIO:
    """What a reader hands DCP's load planner (which unpickles it in full) for the stored bytes ``raw``: for a
    msgpack value, ``torch.save`` bytes made here from the value :func:`decode` rebuilt, never bytes another
    process wrote; pickled bytes only with ``trust_pickled_values`` (UnsupportedTypeError naming ``where``)."""
    if encoding == "msgpack":
        out = io.BytesIO()
        torch.save(decode(raw, where), out)
        out.seek(0)
        return out
    if not trust_pickled_values:
        saved = "with pickle_values=True" if encoding == "pickle" else "by a jaxckpt before DCP metadata version 2"
        raise UnsupportedTypeError(f"{where}: its non-tensor value was stored pickled ({saved}) by another process, "
                                   f"and DCP's planner would unpickle it in full, so it is not loaded: pass "
                                   f"trust_pickled_values=True to JaxckptReader for a store you trust")
    return io.BytesIO(raw)


# ------------------------------------------------------------------------------------------------- encode
def encode(value: Any, where: str) -> bytes:
    """``value`` as msgpack; UnsupportedTypeError naming ``where`` and the place in the value for what cannot be."""
    return _pack(_walk(value, where, "", set()))


def _walk(x: Any, where: str, path: str, active: set[int]) -> Any:
    t = type(x)
    if x is None or t in (bool, float, str, bytes):
        return x
    if t is int:
        return x if _INT_MIN <= x <= _INT_MAX else msgpack.ExtType(_BIGINT, _pack(str(x)))
    if t is complex:
        return msgpack.ExtType(_COMPLEX, _pack([x.real, x.imag]))
    if t is bytearray:
        return msgpack.ExtType(_BYTEARRAY, bytes(x))
    if t is torch.dtype:
        return msgpack.ExtType(_DTYPE, _pack(str(x)))
    if t is torch.device:
        return msgpack.ExtType(_DEVICE, _pack(str(x)))
    if t is torch.Size:
        return msgpack.ExtType(_SIZE, _pack(list(x)))
    if isinstance(x, torch.Tensor):
        return msgpack.ExtType(_TENSOR, _pack(_tensor(x, where, path)))
    if t not in (list, tuple, dict, set, collections.OrderedDict, collections.Counter):
        raise UnsupportedTypeError(f"{where}{_at(path)}: a {_kind(x)} has no encoding without pickle (values may "
                                   f"hold None, bool, int, float, complex, str, bytes, lists, tuples, dicts, sets, "
                                   f"torch.Size, dtypes, devices and dense tensors)")
    if id(x) in active:
        raise UnsupportedTypeError(f"{where}{_at(path)}: the value contains itself (a cycle), which has no encoding "
                                   f"without pickle")
    active.add(id(x))
    try:
        if t in (list, tuple, set):
            items = [_walk(v, where, f"{path}[{i}]", active) for i, v in enumerate(x)]
            return items if t is list else msgpack.ExtType(_TUPLE if t is tuple else _SET, _pack(items))
        pairs = [[_walk(k, where, f"{path}[{k!r}] (key)", active), _walk(v, where, f"{path}[{k!r}]", active)]
                 for k, v in x.items()]
        if t is dict:
            return dict(map(tuple, pairs))  # type: ignore[arg-type]  # keys walked to hashable msgpack values
        return msgpack.ExtType(_ODICT if t is collections.OrderedDict else _COUNTER, _pack(pairs))
    finally:
        active.discard(id(x))


def _at(path: str) -> str:
    return f", at value{path}" if path else ""


def _tensor(t: torch.Tensor, where: str, path: str) -> list:
    """[dtype name, shape, device, requires_grad, is a Parameter, the values' bytes] of a dense tensor."""
    what = f"{where}{_at(path)}"
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise UnsupportedTypeError(f"{what}: a tensor of class {_kind(t)} has no encoding without pickle")
    odd = [k for k, is_ in (("quantized", t.is_quantized), ("nested", t.is_nested), ("meta", t.is_meta),
                            (str(t.layout), t.layout != torch.strided)) if is_]
    if odd:
        raise UnsupportedTypeError(f"{what}: a {' '.join(odd)} tensor has no encoding without pickle (dense tensors "
                                   f"with values only)")
    if vars(t):
        raise UnsupportedTypeError(f"{what}: a tensor with attributes of its own has no encoding "
                                   f"without pickle")
    try:
        name = dtype_name(t.dtype, what)
    except UnsupportedLeafError as e:
        raise UnsupportedTypeError(str(e)) from None
    data = numpy_view(t.detach().cpu().contiguous()).tobytes()
    return [name, list(t.shape), str(t.device), t.requires_grad, type(t) is torch.nn.Parameter, data]


# ------------------------------------------------------------------------------------------------- decode
def decode(data: bytes, where: str) -> Any:
    """The value :func:`encode` wrote; ManifestError naming ``where`` if ``data`` is not such a value."""
    try:
        return _unpack(data, where)
    except RecursionError:
        raise ManifestError(f"{where}: the value is nested too deeply to decode") from None


def _unpack(data: bytes, where: str) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, unicode_errors="surrogatepass",
                               ext_hook=lambda code, payload: _ext(code, payload, where))
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        if isinstance(e, ManifestError):
            raise
        raise ManifestError(f"{where}: not a jaxckpt DCP value ({type(e).__name__}: {e})") from None


def _expect(x: Any, typ: type | tuple, what: str, where: str) -> Any:
    if not isinstance(x, typ) or isinstance(x, bool) and typ is int:
        raise ManifestError(f"{where}: {what} is a {type(x).__name__}, expected {getattr(typ, '__name__', typ)}")
    return x


def _ext(code: int, payload: bytes, where: str) -> Any:
    if code == _BYTEARRAY:
        return bytearray(payload)
    x = _unpack(payload, where)
    if code == _TUPLE:
        return tuple(_expect(x, list, "a tuple", where))
    if code == _SET:
        return set(_expect(x, list, "a set", where))
    if code in (_ODICT, _COUNTER):
        pairs = _expect(x, list, "a dict's pairs", where)
        for p in pairs:
            if not isinstance(p, list) or len(p) != 2:
                raise ManifestError(f"{where}: a dict's entry is not a [key, value] pair")
        d = collections.OrderedDict(map(tuple, pairs))
        return d if code == _ODICT else collections.Counter(d)  # Counter(pairs) would count the pairs
    if code == _COMPLEX:
        re, im = _expect(x, list, "a complex", where)
        return complex(_expect(re, float, "a complex's real part", where), _expect(im, float, "its imaginary part",
                                                                                   where))
    if code == _BIGINT:
        return int(_expect(x, str, "a big int", where))
    if code == _SIZE:
        return torch.Size([_expect(n, int, "a torch.Size entry", where) for n in _expect(x, list, "a Size", where)])
    if code == _DTYPE:
        name = _expect(x, str, "a dtype", where)
        if name not in _TORCH_DTYPES:
            raise ManifestError(f"{where}: unknown torch dtype {name!r}")
        return _TORCH_DTYPES[name]
    if code == _DEVICE:
        try:
            return torch.device(_expect(x, str, "a device", where))
        except RuntimeError as e:
            raise ManifestError(f"{where}: not a torch device: {x!r} ({e})") from None
    if code == _TENSOR:
        return _rebuild(x, where)
    raise ManifestError(f"{where}: unknown value type code {code}")


def _rebuild(x: Any, where: str) -> torch.Tensor:
    fields = _expect(x, list, "a tensor", where)
    if len(fields) != 6:
        raise ManifestError(f"{where}: a tensor record has {len(fields)} fields, expected 6")
    name, shape, device, grad, param, data = fields
    dtype = torch_dtype(_expect(name, str, "a tensor's dtype", where), where)
    shape = [_expect(n, int, "a tensor's dimension", where) for n in _expect(shape, list, "a shape", where)]
    np_dtype = dtype_from_name(name)
    if any(n < 0 for n in shape) or len(_expect(data, bytes, "a tensor's values", where)) != \
            math.prod(shape) * np_dtype.itemsize:
        raise ManifestError(f"{where}: a {name}{shape} tensor with {len(data)} bytes of values")
    t = from_numpy(np.frombuffer(bytearray(data), np_dtype).reshape(shape), dtype)
    try:
        t = t.to(torch.device(_expect(device, str, "a tensor's device", where)))
    except RuntimeError as e:
        raise ManifestError(f"{where}: the value holds a tensor saved on {device}, which this process cannot "
                            f"place ({e})") from None
    if _expect(grad, bool, "requires_grad", where) and not (t.is_floating_point() or t.is_complex()):
        raise ManifestError(f"{where}: a {name} tensor that requires grad (only floating point ones can)")
    if _expect(param, bool, "a tensor's kind", where):
        return torch.nn.Parameter(t, requires_grad=grad)
    return t.requires_grad_(grad)
