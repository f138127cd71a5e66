"""``python -m jaxckpt.tools.bench.recovery``: a replacement node's agent recovers its node's share alone on the
machine, every round; the report says what it rebuilt and received and sets it against the loopback's rates."""
import json
import re
import subprocess
import sys


def test_the_recovery_measurement_recovers_the_lost_share_every_round_and_moves_its_bytes_once():
    r = subprocess.run([sys.executable, "-m", "jaxckpt.tools.bench.recovery", "8", "2", "64"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rounds = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(rounds) == 2, r.stdout
    for rec in rounds:
        # node 1's share of the newest protected step (3), in 64 arrays, rebuilt and checked by the recovery
        assert rec["state"] == "done" and rec["step"] == 3, rec
        assert 0 < rec["received"] <= 1.1 * rec["bytes"] and 0 < rec["scan_seconds"] < rec["seconds"], rec
    summary = r.stdout.splitlines()[-1]
    assert re.match(r"recovery of \d+ MiB in 64 arrays \(received \d+ MiB\): median \d+ ms over 2 rounds \(\d+-\d+\), "
                    r"[\d.]+ GB/s; loopback raw TCP [\d.]+ GB/s, the peer transport [\d.]+ GB/s: the recovery takes "
                    r"[\d.]+x the raw TCP time of the bytes it received$", summary), summary


def test_the_many_leaf_restore_measurement_checks_its_restores_and_sets_them_against_jax_and_memcpy():
    """``python -m jaxckpt.tools.bench.restore_leaves``: every leaf of the mixed layout (a fully replicated one
    among them) restored bit for bit from the node agent, timed beside JAX's own part and a memory copy."""
    r = subprocess.run([sys.executable, "-m", "jaxckpt.tools.bench.restore_leaves", "12", "4", "mixed", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    lines = r.stdout.splitlines()
    assert lines[0] == ("12 leaves of 8x1024 float32 (384 KiB), mixed layout, 4 CPU devices in one process, 2 "
                        "restores from the node agent"), lines
    assert re.match(r"restore: wall median [\d.]+ ms \(p10 [\d.]+\), CPU median [\d.]+ ms", lines[1]), lines
    assert lines[2].startswith("JAX's own part (make_array_from_callback of host copies): wall median"), lines
    assert re.match(r"restore / JAX's own part [\d.]+x; restore / memory copy [\d.]+x$", lines[4]), lines
    assert "local_reads 393216 bytes" in lines[5], lines  # every byte from this node's memory
    bad = subprocess.run([sys.executable, "-m", "jaxckpt.tools.bench.restore_leaves", "8", "3"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "DEVICES an even number" in bad.stderr, bad.stderr
