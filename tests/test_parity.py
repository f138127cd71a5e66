"""XOR parity of byte blocks: encode/rebuild bit for bit, unequal lengths, segmented blocks, alignment, threads."""
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxckpt.protection import parity
from jaxckpt.core.checksum import crc32c
from jaxckpt.errors import ChecksumError


def _ref(blocks, length=None):
    n = max((len(b) for b in blocks), default=0) if length is None else length
    out = np.zeros(n, np.uint8)
    for b in blocks:
        a = np.frombuffer(bytes(b), np.uint8)[:n]
        out[:a.size] ^= a
    return out


blocks_st = st.lists(st.binary(min_size=0, max_size=700), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None)
@given(blocks=blocks_st, window=st.sampled_from([8, 24, 64, 4096]), data=st.data())
def test_encode_and_rebuild_every_block(blocks, window, data):
    p = parity.encode(blocks, window=window)
    np.testing.assert_array_equal(p, _ref(blocks))
    for k, missing in enumerate(blocks):
        others = blocks[:k] + blocks[k + 1:]
        got = parity.rebuild(p, others, len(missing), window=window)
        assert got.tobytes() == missing
    # A block given as segments (misaligned views into bigger buffers) is its concatenation.
    seg = []
    for b in blocks:
        cuts = sorted(data.draw(st.lists(st.integers(0, len(b)), max_size=3)))
        pad = data.draw(st.integers(0, 7))
        host = bytearray(pad) + bytearray(b)
        mv = memoryview(host)[pad:]
        bounds = [0, *cuts, len(b)]
        seg.append([mv[x:y] for x, y in zip(bounds, bounds[1:])])
    np.testing.assert_array_equal(parity.encode(seg, window=window), p)


def test_large_aligned_and_misaligned_paths_match_reference():
    rng = np.random.default_rng(0)
    raw = [rng.integers(0, 256, 300_001 + k, dtype=np.uint8) for k in range(4)]
    for shift in (0, 1, 3, 8):
        blocks = [r[shift:] for r in raw[:3]] + [raw[3][:1000]]
        want = _ref([b.tobytes() for b in blocks])
        for workers in (1, 3):
            np.testing.assert_array_equal(parity.encode(blocks, window=65536, workers=workers), want)


def test_dtypes_and_out_buffer():
    a = np.arange(10, dtype=np.float64)
    b = np.full(3, np.nan, dtype=np.float32)
    out = np.full(200, 7, np.uint8)
    got = parity.encode([a, b], out)
    assert got.base is not None and got.size == 80
    assert np.shares_memory(got, out)
    np.testing.assert_array_equal(out[:80], _ref([a.tobytes(), b.tobytes()]))
    assert (out[80:] == 7).all()
    back = parity.rebuild(out[:80], [a], b.nbytes)
    np.testing.assert_array_equal(back.view(np.float32).view(np.uint32), b.view(np.uint32))


def test_length_cuts_and_pads():
    assert parity.encode([b"\x01\x02\x03"], length=5).tobytes() == b"\x01\x02\x03\x00\x00"
    assert parity.encode([b"\x01\x02\x03", b"\x01"], length=2).tobytes() == b"\x00\x02"
    assert parity.encode([]).size == 0
    assert parity.nbytes([b"ab", memoryview(b"cde")]) == 5


def test_errors():
    with pytest.raises(ValueError, match="C-contiguous"):
        parity.encode([np.zeros((4, 4), np.uint8)[:, ::2]])
    with pytest.raises(ValueError, match="holds 2 bytes, needs 4"):
        parity.encode([b"abcd"], np.zeros(2, np.uint8))
    with pytest.raises(ValueError, match="cannot rebuild 9 bytes from a 4-byte parity"):
        parity.rebuild(b"abcd", [], 9)
    parity.check(b"hello", crc32c(b"hello"), "x")
    with pytest.raises(ChecksumError, match="params/w: crc32c .* does not match"):
        parity.check(b"hellp", crc32c(b"hello"), "params/w")


def test_encode_runs_while_other_threads_run():
    # The XOR loops release the GIL: a Python thread keeps counting while a big encode runs.
    blocks = [np.ones(32 << 20, np.uint8), np.full(32 << 20, 3, np.uint8)]
    stop, ticks = threading.Event(), [0]

    def spin():
        while not stop.is_set():
            ticks[0] += 1
    t = threading.Thread(target=spin)
    t.start()
    try:
        p = parity.encode(blocks, workers=2)
    finally:
        stop.set()
        t.join()
    assert ticks[0] > 0
    assert p[0] == 2 and p[-1] == 2


# ------------------------------------------------------------------------------------------ jaxckpt bench parity
def test_bench_parity_quick_json_and_markdown(tmp_path, capsys):
    import math
    import subprocess
    import sys

    from jaxckpt import cli
    from jaxckpt.tools.bench import parity as bench
    from jaxckpt.tools.bench import report

    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nprose\n\n<!-- bench:parity:begin -->\nold\n<!-- bench:parity:end -->\n\nafter\n")
    out = tmp_path / "parity.json"
    proc = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "bench", "parity", "--quick", "--json", str(out),
                           "--update-md", str(md)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = report.read_json(out)
    assert res["bench"] == "parity" and res["mode"] == "quick"
    assert res["command"] == f"jaxckpt bench parity --quick --json {out} --update-md {md}"
    assert {"cpu_model", "cores", "memory_bytes", "versions", "os"} <= set(res["machine"])
    assert res["setup"]["floor_vs_memcpy"] == 0.5 and res["setup"]["block_bytes"] == bench.QUICK["block_bytes"]
    cases = {(r["op"], r["fanin"], r["workers"], r["layout"]) for r in res["results"]}
    assert cases == {(op, m, 1, lay) for m in bench.QUICK["fanins"]
                     for op, lay in (("encode", "contiguous"), ("encode", "256 KiB segments"),
                                     ("rebuild", "contiguous"))}
    for r in res["results"]:
        assert set(r["seconds"]) == {"median", "min", "max", "p10", "p90", "n"} and r["seconds"]["n"] == 3
        assert math.isclose(r["xor_gbps"], r["fanin"] * res["setup"]["block_bytes"] / r["seconds"]["median"] / 1e9)
        assert math.isclose(r["vs_memcpy"], r["xor_gbps"] / res["memcpy_gbps"])
    bad = [(p, v) for p, v in report.numbers(res) if not (math.isfinite(v) and v > 0)]
    assert not bad, bad
    text = md.read_text()
    assert text.startswith("# Benchmarks\n\nprose\n\n<!-- bench:parity:begin -->\n")
    assert text.endswith("<!-- bench:parity:end -->\n\nafter\n")
    assert "Quick run, placeholder until the full run" in text and bench.render(res) in text
    rows = [line for line in bench.render(res).splitlines() if line.startswith("|")]
    assert len(rows) == 2 + len(res["results"]) and len({r.count("|") for r in rows}) == 1
    # Re-rendering from the JSON measures nothing and gives the same section; a full run has no banner.
    md2 = tmp_path / "B2.md"
    assert cli.main(["bench", "parity", "--from-json", str(out), "--update-md", str(md2)]) == 0
    assert bench.render(res) in md2.read_text() and bench.render(res) in capsys.readouterr().out
    assert "placeholder" not in bench.render(dict(res, mode="full"))
    assert cli.main(["bench", "parity", "--quick", "--repeats", "0"]) == 2
