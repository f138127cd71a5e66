"""The manifest envelope: exact roundtrip, and every defect refused as ManifestError (never another exception)."""
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jaxckpt.core import manifest as mf
from jaxckpt.core.box import Box
from jaxckpt.core.checksum import crc32c
from jaxckpt.errors import ManifestError


def sample() -> mf.Manifest:
    w = mf.ArrayMeta(
        path="params/dense/kernel", keypath=(("key", "params"), ("key", "dense"), ("key", "kernel")),
        shape=(8, 4), dtype="bfloat16", kind="jax", sharding="NamedSharding(mesh(data=8), P('data', None))",
        attrs={"note": "x", "n": [1, 2]},
        chunks=(mf.ChunkMeta(Box((0, 0), (4, 4)), 0, 32, 0xDEADBEEF, 0),
                mf.ChunkMeta(Box((4, 0), (8, 4)), 64, 32, 7, 1)))
    key = mf.ArrayMeta(path="rng", keypath=(("attr", "rng"),), shape=(2,), dtype="uint32", kind="prng_key",
                       attrs={"impl": "threefry2x32", "key_dtype": "key<fry>", "key_shape": []},
                       chunks=(mf.ChunkMeta(Box((0,), (2,)), 128, 8, 1, 0),))
    scalar = mf.ArrayMeta(path="lr", keypath=(("idx", 3),), shape=(), dtype="float32", kind="numpy_scalar",
                          chunks=(mf.ChunkMeta(Box((), ()), 192, 4, 2, 0),))
    leaves = (mf.LeafMeta("step", (("key", "step"),), 12), mf.LeafMeta("name", (("key", "name"),), "héllo"),
              mf.LeafMeta("blob", (("key", "blob"),), b"\x00\xff"), mf.LeafMeta("none", (("key", "none"),), None),
              mf.LeafMeta("f", (("key", "f"),), 1.5), mf.LeafMeta("b", (("key", "b"),), True),
              mf.LeafMeta("big", (("key", "big"),), 2**64 - 1), mf.LeafMeta("neg", (("key", "neg"),), -(2**63)))
    return mf.Manifest(step=12, process=0, process_count=2, framework="jax", arrays=(w, key, scalar), leaves=leaves,
                       order=("params/dense/kernel", "rng", "lr", "step", "name", "blob", "none", "f", "b", "big",
                              "neg"),
                       nbytes=256, layout="abcdef0123456789", created=1700000000.25)


VALID = mf.encode(sample())


def envelope(body_obj, *, fmt=mf.FORMAT, version=mf.VERSION) -> bytes:
    body = msgpack.packb(body_obj, use_bin_type=True)
    return msgpack.packb([fmt, version, crc32c(body), body], use_bin_type=True)


def wire() -> dict:
    return mf._to_wire(sample())


def test_roundtrip_is_exact():
    m = sample()
    assert mf.decode(VALID) == m
    assert mf.decode(memoryview(VALID)) == m
    assert mf.encode(mf.decode(VALID)) == VALID


def test_empty_manifest_roundtrips():
    m = mf.Manifest(step=0, process=0, process_count=1, framework="torch", arrays=())
    assert mf.decode(mf.encode(m)) == m


def _plan_order_template(m: mf.Manifest) -> tuple[mf.Template, list[tuple[int, int]]]:
    """``m``'s template with its chunks handed over in a save plan's order: interleaved across arrays."""
    keys = [(1, 0), (0, 0), (2, 0), (0, 1)]  # each array's chunks in their order, the arrays interleaved
    assert sorted(keys) == [(i, j) for i, a in enumerate(m.arrays) for j in range(len(a.chunks))]
    chunks = [(i, m.arrays[i].chunks[j].box, m.arrays[i].chunks[j].offset, m.arrays[i].chunks[j].nbytes,
               m.arrays[i].chunks[j].process) for i, j in keys]
    return mf.Template(m.process, m.process_count, m.framework, m.arrays, chunks, m.order, m.nbytes,
                       m.layout), keys


def test_a_template_fills_in_each_saves_crcs_step_and_values():
    m = sample()
    template, keys = _plan_order_template(m)
    for step, crcs, leaves in ((12, [0xFFFFFFFF, 0, 5, 1 << 31], m.leaves),
                               (13, [1, 2, 3, 4], tuple(mf.LeafMeta(x.path, x.keypath, -2.5 if x.path == "f" else x.value)
                                                     for x in m.leaves))):
        got = mf.decode(template.encode(step, crcs, leaves, created=1700000001.5))
        crc_of = dict(zip(keys, crcs))
        arrays = tuple(mf.ArrayMeta(a.path, a.keypath, a.shape, a.dtype, a.kind, a.sharding, a.attrs,
                                    tuple(mf.ChunkMeta(c.box, c.offset, c.nbytes, crc_of[(i, j)], c.process)
                                          for j, c in enumerate(a.chunks)))
                       for i, a in enumerate(m.arrays))
        assert got == mf.Manifest(step=step, process=0, process_count=2, framework="jax", arrays=arrays,
                                  leaves=tuple(leaves), order=m.order, nbytes=256, layout="abcdef0123456789",
                                  created=1700000001.5)


def test_a_template_writes_the_wire_every_reader_reads():
    # The body is the same msgpack map as the field-by-field encoding (a crc32c in a 4-byte slot is the same
    # integer), and an envelope of that encoding, as earlier writers packed it, still decodes.
    m = sample()
    template, keys = _plan_order_template(m)
    crc_of = {(i, j): c.crc32c for i, a in enumerate(m.arrays) for j, c in enumerate(a.chunks)}
    data = template.encode(m.step, [crc_of[k] for k in keys], m.leaves, m.created)
    body = msgpack.unpackb(data)[3]
    assert msgpack.unpackb(body, strict_map_key=False) == wire()
    assert mf.decode(data) == mf.decode(envelope(wire())) == m


def test_array_lookup():
    m = sample()
    assert m.array("rng").kind == "prng_key"
    with pytest.raises(KeyError):
        m.array("nope")


def test_wrong_version_is_refused():
    data = envelope(wire(), version=mf.VERSION + 1)
    with pytest.raises(ManifestError, match=f"version {mf.VERSION + 1}.*not supported"):
        mf.decode(data, source="step 3 manifest of process 1")
    with pytest.raises(ManifestError, match="step 3 manifest of process 1"):
        mf.decode(data, source="step 3 manifest of process 1")


def test_wrong_format_is_refused():
    with pytest.raises(ManifestError, match="not a jaxckpt manifest envelope"):
        mf.decode(envelope(wire(), fmt="orbax-manifest"))
    with pytest.raises(ManifestError, match="not a jaxckpt manifest envelope"):
        mf.decode(msgpack.packb({"step": 1}))
    with pytest.raises(ManifestError):
        mf.decode(b"")


def test_checksum_mismatch_is_refused():
    body = msgpack.packb(wire(), use_bin_type=True)
    data = msgpack.packb([mf.FORMAT, mf.VERSION, crc32c(body) ^ 1, body], use_bin_type=True)
    with pytest.raises(ManifestError, match="checksum mismatch"):
        mf.decode(data)


def test_oversized_input_is_refused_before_decoding(monkeypatch):
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", len(VALID) - 1)
    with pytest.raises(ManifestError, match="exceeds"):
        mf.decode(VALID)


def _set(d, path, value):
    node = d
    for k in path[:-1]:
        node = node[k]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value


# Bodies that carry a valid checksum but a defect that only the schema checks can catch.
BAD_BODIES = {
    "step negative": (("step",), -1),
    "step bool": (("step",), True),
    "step missing": (("step",), KeyError),
    "arrays not a list": (("arrays",), {"a": 1}),
    "path not str": (("arrays", 0, "path"), 3),
    "shape negative": (("arrays", 0, "shape"), [8, -4]),
    "shape of str": (("arrays", 0, "shape"), "8x4"),
    "chunk out of bounds": (("arrays", 0, "chunks", 1, 0), [[4, 0], [9, 4]]),
    "chunk box rank": (("arrays", 0, "chunks", 0, 0), [[0], [4]]),
    "chunk box negative extent": (("arrays", 0, "chunks", 0, 0), [[3, 0], [1, 4]]),
    "chunk box negative start": (("arrays", 0, "chunks", 0, 0), [[-4, 0], [4, 4]]),
    "chunk too short": (("arrays", 0, "chunks", 0), [[[0, 0], [4, 4]], 0, 32]),
    "chunk box float": (("arrays", 0, "chunks", 0, 0), [[0.5, 0], [4, 4]]),
    "chunk box bool": (("arrays", 0, "chunks", 0, 0), [[0, False], [4, 4]]),
    "chunk box not a pair": (("arrays", 0, "chunks", 0, 0), [[0, 0]]),
    "chunk box of str": (("arrays", 0, "chunks", 0, 0), "0:4"),
    "keypath key bool": (("arrays", 0, "keypath", 0, 1), True),
    "chunk offset negative": (("arrays", 0, "chunks", 0, 1), -64),
    "crc not int": (("arrays", 0, "chunks", 0, 3), "deadbeef"),
    "keypath entry kind": (("arrays", 0, "keypath", 0, 0), "weird"),
    "keypath not list": (("arrays", 0, "keypath"), "params/dense"),
    "dtype not str": (("arrays", 0, "dtype"), 5),
    "attrs not dict": (("arrays", 0, "attrs"), [1]),
    "leaf missing path": (("leaves", 0, "path"), KeyError),
    "order not str": (("order",), [1, 2]),
    "created str": (("created",), "yesterday"),
    "framework missing": (("framework",), KeyError),
}


def test_chunk_crcs_are_decodes_crcs_and_their_integers_are_checked():
    m = sample()
    assert mf.chunk_crcs(VALID) == {(c.process, c.offset): c.crc32c for a in m.arrays for c in a.chunks}
    assert mf.chunk_crcs(memoryview(VALID)) == {(0, 0): 0xDEADBEEF, (1, 64): 7, (0, 128): 1, (0, 192): 2}
    for name in ("chunk too short", "chunk offset negative", "crc not int", "arrays not a list"):
        path, value = BAD_BODIES[name]
        d = wire()
        _set(d, path, value)
        with pytest.raises(ManifestError, match="step 4 manifest of process 1: "):
            mf.chunk_crcs(envelope(d), source="step 4 manifest of process 1")
    d = wire()
    _set(d, ("arrays", 0, "chunks", 1, 4), True)  # a bool is not a process index
    with pytest.raises(ManifestError, match=r"params/dense/kernel.process' has type bool"):
        mf.chunk_crcs(envelope(d))
    body = msgpack.packb(wire(), use_bin_type=True)
    with pytest.raises(ManifestError, match="peer 3: manifest checksum mismatch"):
        mf.chunk_crcs(msgpack.packb([mf.FORMAT, mf.VERSION, crc32c(body) ^ 1, body], use_bin_type=True),
                      source="peer 3")


def test_chunk_crcs_of_a_run_of_steps_read_one_layout_at_its_places_and_are_each_steps(monkeypatch):
    """ChunkCrcs (a node agent's reader of each step's manifest of a process): every step's answer is the whole
    decode's, whatever changes (crc32c's, step, plain values, another layout, a manifest no Template packed,
    a damaged one); a later step of the layout is read at its crc32c's places alone."""
    m = sample()
    template, keys = _plan_order_template(m)
    read = mf.ChunkCrcs()
    decoded = []  # the sources of the manifests decoded whole
    real = mf.chunk_crcs
    monkeypatch.setattr(mf, "chunk_crcs", lambda data, source="manifest": decoded.append(source) or
                        real(data, source=source))
    for step, crcs in enumerate(([1, 2, 3, 4], [0xFFFFFFFF, 0, 1 << 31, 9], [5, 5, 5, 5])):
        data = template.encode(10 + step, crcs, m.leaves[:step])  # the plain values after the arrays change too
        assert read(data, source=f"step {10 + step}") == real(data) == dict(
            zip([(m.arrays[i].chunks[j].process, m.arrays[i].chunks[j].offset) for i, j in keys], crcs))
    assert decoded == ["step 10"]  # the later steps of the layout were read at the places
    other = mf.encode(mf.Manifest(step=13, process=0, process_count=2, framework="jax", arrays=m.arrays[1:]))
    assert read(other, source="other") == real(other)  # another layout: decoded whole
    assert read(VALID, source="back") == real(VALID) and decoded[-2:] == ["other", "back"]
    plain = envelope(wire())  # packed field by field, not by a Template: decoded whole every time
    assert read(plain, source="p1") == read(plain, source="p2") == real(VALID)
    assert decoded[-2:] == ["p1", "p2"]
    d = wire()
    _set(d, ("arrays", 0, "chunks", 1, 4), True)
    with pytest.raises(ManifestError, match=r"process' has type bool"):
        read(envelope(d))
    with pytest.raises(ManifestError, match="manifest checksum mismatch"):
        read(VALID[:-5] + bytes([VALID[-5] ^ 1]) + VALID[-4:])


def test_owner_reads_whose_a_manifest_is_and_checks_the_envelope():
    assert mf.owner(VALID) == (0, 2) and mf.owner(memoryview(VALID)) == (0, 2)
    for field, value, says in (("process", -1, "negative"), ("process_count", True, "type bool"),
                               ("process", KeyError, "KeyError")):
        d = wire()
        _set(d, (field,), value)
        with pytest.raises(ManifestError, match=f"step 9 manifest of process 0: .*{says}"):
            mf.owner(envelope(d), source="step 9 manifest of process 0")
    for damaged in (VALID[:-1], VALID[:10], bytes([VALID[0] ^ 4]) + VALID[1:], envelope(wire(), version=2)):
        with pytest.raises(ManifestError):
            mf.owner(damaged)


@pytest.mark.parametrize("name", sorted(BAD_BODIES))
def test_schema_defects_with_a_valid_checksum_are_refused(name):
    path, value = BAD_BODIES[name]
    d = wire()
    _set(d, path, value)
    with pytest.raises(ManifestError, match="^step 5 manifest of process 1: "):  # every defect names its source
        mf.decode(envelope(d), source="step 5 manifest of process 1")


def test_a_box_checked_for_one_array_is_checked_again_in_another_of_a_smaller_shape():
    """The decode checks each (shape, box) once for many chunks: a box inside one array's bounds is still refused
    in an array it runs out of, and its size checked against that array's dtype."""
    def arr(path: str, shape: tuple, dtype: str, offset: int, nbytes: int) -> mf.ArrayMeta:
        return mf.ArrayMeta(path=path, keypath=(("key", path),), shape=shape, dtype=dtype, kind="numpy",
                            chunks=(mf.ChunkMeta(Box((0,), (8,)), offset, nbytes, 1, 0),))
    ok = mf.Manifest(step=2, process=0, process_count=1, framework="jax",
                     arrays=(arr("a", (8,), "float32", 0, 32), arr("b", (8,), "float16", 32, 16)))
    assert mf.decode(mf.encode(ok)) == ok
    d = mf._to_wire(ok)
    d["arrays"][1]["shape"] = [4]
    with pytest.raises(ManifestError, match=r"step 2: b: chunk box \[0\]\.\.\[8\] out of bounds of shape \(4,\)"):
        mf.decode(envelope(d), source="step 2")
    d = mf._to_wire(ok)
    d["arrays"][1]["chunks"][0][2] = 32  # float16 of 8 elements is 16 bytes
    with pytest.raises(ManifestError, match=r"b: chunk .* of float16 has 32 bytes, expected 16"):
        mf.decode(envelope(d))


def test_merge_chunks_joins_processes_and_checks_agreement():
    m0 = sample()
    other = mf.ArrayMeta(path="params/dense/kernel", keypath=m0.arrays[0].keypath, shape=(8, 4), dtype="bfloat16",
                         kind="jax", chunks=(mf.ChunkMeta(Box((0, 0), (8, 4)), 0, 64, 3, 1),))
    m1 = mf.Manifest(step=12, process=1, process_count=2, framework="jax", arrays=(other,))
    merged = mf.merge_chunks([m0, m1])
    assert len(merged["params/dense/kernel"].chunks) == 3
    assert merged["rng"] == m0.arrays[1]
    bad = mf.Manifest(step=12, process=1, process_count=2, framework="jax",
                      arrays=(mf.ArrayMeta(path="rng", keypath=(), shape=(3,), dtype="uint32", kind="jax"),))
    with pytest.raises(ManifestError, match="rng: processes disagree.*step 12"):
        mf.merge_chunks([m0, bad])


# ------------------------------------------------------------------------------------------------ fuzzing
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_refused(data: bytes, crcs_too: bool = True) -> None:
    """Damage ``decode`` refuses; with ``crcs_too`` (damage to the envelope or its bytes) ``chunk_crcs`` and ``owner``
    too."""
    for f in (mf.decode, mf.chunk_crcs, mf.owner) if crcs_too else (mf.decode,):
        try:
            f(data)
        except ManifestError:
            continue
        raise AssertionError(f"{f.__name__} accepted a damaged manifest: {data[:64]!r}")


@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes_raise_manifest_error(data):
    _decode_refused(data)


@FUZZ
@given(st.integers(0, len(VALID) - 1))
def test_every_truncation_raises_manifest_error(n):
    _decode_refused(VALID[:n])


def test_every_single_truncation_exhaustively():
    for n in range(len(VALID)):
        _decode_refused(VALID[:n])


@FUZZ
@given(st.integers(0, len(VALID) * 8 - 1))
def test_single_bit_flips_raise_manifest_error(bit):
    data = bytearray(VALID)
    data[bit // 8] ^= 1 << (bit % 8)
    _decode_refused(bytes(data))


@FUZZ
@given(st.lists(st.integers(0, len(VALID) * 8 - 1), min_size=2, max_size=8, unique=True))
def test_multi_bit_flips_raise_manifest_error(bits):
    data = bytearray(VALID)
    for bit in bits:
        data[bit // 8] ^= 1 << (bit % 8)
    _decode_refused(bytes(data))


@FUZZ
@given(st.binary(min_size=1, max_size=64))
def test_trailing_garbage_raises_manifest_error(tail):
    _decode_refused(VALID + tail)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20)


@FUZZ
@given(msgpack_values)
def test_random_bodies_with_a_valid_checksum_raise_manifest_error(body):
    _decode_refused(envelope(body), crcs_too=False)
    try:  # it checks the chunks' integers only: anything else it reads must be refused, never another exception
        mf.chunk_crcs(envelope(body))
    except ManifestError:
        pass


@FUZZ
@given(st.sampled_from(["step", "process", "process_count", "framework", "arrays", "leaves", "order", "nbytes",
                        "layout", "created"]), msgpack_values)
def test_random_field_values_raise_manifest_error_or_decode(field, value):
    d = wire()
    d[field] = value
    try:
        m = mf.decode(envelope(d))
    except ManifestError:
        return
    assert isinstance(m, mf.Manifest)  # a value of the right type is fine; anything else must be refused
