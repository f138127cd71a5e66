"""Test-wide set-up: 8 CPU devices for in-process JAX tests (multi-process tests start their own processes), and
the one quick run of every benchmark that the benchmark tests share."""
import contextlib
import io
import os
import subprocess
import sys

import pytest

os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_sessionstart(session):
    """jaxckpt's modules (and these tests' helper modules) byte-compiled once, as installing the package does:
    with ``PYTHONDONTWRITEBYTECODE`` set, as on this project's machines, each of the hundreds of processes the
    suite launches would otherwise compile every jaxckpt module it imports (jaxckpt/tools/bytecode.py)."""
    from jaxckpt.tools.bytecode import byte_compile

    byte_compile((os.path.dirname(os.path.abspath(__file__)),))

BENCH_PROSE = "# Benchmarks\n\nprose before\n\n<!-- bench:save:begin -->\nold\n<!-- bench:save:end -->\n\nprose after\n"


BENCH_TIMEOUT_S = 900  # the quick run of every benchmark: ~1.5 minutes quiet, 5 beside four other test suites
# The suite's run: every benchmark's --quick preset (the CLI run BENCHMARKS.md records stays as it is), two of them
# smaller still, each at the smallest size that still shows what tests/test_bench*.py assert of it.
# stall: the baseline, jaxckpt's save() and Orbax (the overhead and the Orbax ratio the tests check); the fused
# and shm modes measure wrap_step and store="shm", which tests/test_fused.py and the shm tests check, and add
# a compile each.
# cluster: still 4 nodes (parity at 1/(R-1) with R = 4, xor-group), every policy, every restore path and both
# node losses (from peers, from the persistent tier), on 8 MiB instead of 32 with one repeat and one timed step
# per loop, and 32 MiB loopback and memory copy probes instead of 256.
# save: the leaf-count sweep at 8 and 16 leaves instead of 8 and 64 (the 64-leaf states, three layouts with Orbax
# beside them, cost about 15% of the benchmark's CPU time): still two leaf counts of the same total bytes, each a
# multiple of 4, so every layout's shard counts (mixed: 15 of every 4 leaves' 32) are checked.
SAVE_LEAF_COUNTS = (8, 16)
BENCH_SUITE_ARGS = {"save": f"--leaf-counts {','.join(map(str, SAVE_LEAF_COUNTS))}",
                    "stall": "--modes none,jaxckpt,orbax",
                    # split replicas: the collective restore (and the parity it protects them with) serves them
                    "cluster": "--size 8M --repeats 1 --steps 1 --probe-size 32M --replicas split --restore-collective"}


def pytest_collection_modifyitems(items):
    """A test that uses the shared benchmark run may be the one that starts it: it gets that run's time-out
    (pytest-timeout's 300 s counts the fixture's set-up too), and a little more for its own checks."""
    for item in items:
        if "bench_quick" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(BENCH_TIMEOUT_S + 120))


def _bench_dirs() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("jaxckpt-bench")} if os.path.isdir("/dev/shm") else set()


@pytest.fixture(scope="session")
def bench_quick(tmp_path_factory):
    """``jaxckpt bench all --quick --update-md``, run once in a real subprocess for every test of a benchmark's
    quick run (tests/test_bench*.py): each benchmark measured as its own ``jaxckpt bench NAME --quick --json``
    process, with the options of ``BENCH_SUITE_ARGS`` after its preset (the cluster one with a plain directory of
    its own)."""
    from jaxckpt.tools.bench import all as bench_all

    d = tmp_path_factory.mktemp("bench-all")
    md = d / "BENCHMARKS.md"
    md.write_text(BENCH_PROSE)
    plain = d / "plain"
    plain.mkdir()
    before = _bench_dirs()
    more = {**BENCH_SUITE_ARGS, "cluster": f"{BENCH_SUITE_ARGS['cluster']} --plain-dir {plain}"}
    proc = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "bench", "all", "--quick", "--out", str(d / "out"),
                           "--update-md", str(md), *[w for name, opts in more.items()
                                                     for w in ("--bench-args", f"{name}={opts}")]],
                          capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return {"dir": d, "out": d / "out", "md": md, "plain": plain, "stdout": proc.stdout, "stderr": proc.stderr,
            "results": bench_all.load_results(d / "out", list(bench_all.BENCHES)), "shm_left": _bench_dirs() - before,
            "forwarded": more}


def bench_section(name: str, result_json, md) -> str:
    """``jaxckpt bench NAME --from-json RESULT --update-md MD`` in this process (it renders, measures nothing): what
    it printed. Writes the section into ``md`` and keeps the JSON in docs/bench/ beside it, as a measuring run."""
    from jaxckpt import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["bench", name, "--from-json", str(result_json), "--update-md", str(md)]) == 0
    return out.getvalue()
