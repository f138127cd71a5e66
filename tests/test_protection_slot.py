"""The protection slot's format (``jaxckpt.protection.slot``): a slot's header and meta decode back to what was
built, and garbage is a ManifestError naming its source."""
import numpy as np
import pytest


def test_slot_format_roundtrip_and_malformed():
    """Protection slot headers and metas decode back; garbage is a ManifestError naming the source."""
    from jaxckpt.protection.slot import build_slot, decode_header, decode_meta, encode_meta
    from jaxckpt.errors import ManifestError

    meta = encode_meta(b"plan-bytes", {3: b"m3", 5: b"m5"})
    header, size, writes = build_slot(9, 2, meta, [("stripe", 4, np.arange(100, dtype=np.uint8)),
                                                   ("copy", 1, np.ones(3, np.float32))])
    h = decode_header(header, source="slot")
    assert (h.step, h.process, h.meta[1]) == (9, 2, len(meta))
    assert [(b.kind, b.id, b.nbytes) for b in h.blocks] == [("stripe", 4, 100), ("copy", 1, 12)]
    assert all(b.offset % 64 == 0 for b in h.blocks) and size >= h.blocks[-1].offset + 12
    assert decode_meta(meta, source="meta") == (b"plan-bytes", {3: b"m3", 5: b"m5"})
    for bad in (b"", b"\x93\x01\x02", header[:-3]):
        with pytest.raises(ManifestError, match="slot X"):
            decode_header(bad, source="slot X")
    with pytest.raises(ManifestError, match="meta Y"):
        decode_meta(b"\xc1", source="meta Y")
