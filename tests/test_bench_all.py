"""``jaxckpt bench all``: the quick suite end to end in a real subprocess (run once per session by
tests/conftest.py and shared with the tests of each benchmark), the JSON of every benchmark, the markdown
sections and plots rendered from them, and the orchestration (subset, options, failure, render-only).

No timing thresholds: only that every figure is finite and positive (a few named fields may be zero or signed,
see ``MAY_BE_ZERO`` and ``SIGNED``) and that the reports are well formed.
"""
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxckpt import cli
from jaxckpt.tools.bench import all as bench_all
from jaxckpt.tools.bench import plots, report

STATS = {"median", "min", "max", "p10", "p90", "n"}
# Figures that are legitimately zero: a process index, an exit code, protection bytes of a policy that keeps or
# sends none, and RSS growth when the allocator reuses pages it already had.
MAY_BE_ZERO = {"process", "exit_code", "extra_bytes_per_node", "sent_bytes_per_node", "extra_over_data",
               "rss_growth_bytes", "cycle", "steps_lost",
               "transport_bytes", "collective_bytes",  # a restore may need neither (all local, one process)
               "widened",  # restores that opened every process's manifests: none when their node's suffice
               "try_gets", "live_keys",  # the commit protocol polls no key; all keys of a round may be gone
               "slow",  # a commit round that waited no longer than its grace did no slow-wait operation
               "recovery_wait_s", "cpu_s"}  # a hello that found the recovery over; a stage within a clock tick
# step-time overhead and cost vs the baseline (bench stall): within noise they can be below zero
SIGNED = ("overhead_pct_", "overhead_of_orbax_", "cost_vs_floor_")
EXPECTED = [n for n in bench_all.BENCHES if n != "torch" or importlib.util.find_spec("torch") is not None]
from conftest import BENCH_PROSE as PROSE  # the markdown file the session's run updates
# Keys each result has beyond bench/machine/date/command, and the list of rows that must not be empty.
SCHEMA = {
    "parity": ({"mode", "setup", "memcpy_gbps", "results"}, "results"),
    "save": ({"mode", "setup", "memcpy_gbps", "results"}, "results"),
    "restore": ({"mode", "setup", "memcpy_gbps", "memcpy_gbps_stats", "results", "skipped"}, "results"),
    "scaling": ({"mode", "setup", "memcpy_gbps", "memcpy_gbps_stats", "by_size", "by_procs", "commit", "skipped"},
                "by_size"),
    "memory": ({"mode", "setup", "stores", "protection", "skipped"}, "stores"),
    "torch": ({"mode", "setup", "memcpy_gbps", "results"}, "results"),
    "stall": ({"mode", "memcpy_gbps", "procs", "steps", "warmup", "results"}, "results"),
    "cluster": ({"mode", "setup", "policies", "restore", "save", "recovery", "ratios"}, "policies"),
}


@pytest.fixture(scope="module")
def suite(bench_quick):
    """The session's ``bench all --quick --update-md`` run (tests/conftest.py)."""
    return bench_quick


def _check_numbers(res, name):
    nums = report.numbers(res)
    assert len(nums) > 10, name
    for path, v in nums:
        key = path.rsplit("/", 1)[-1]
        assert math.isfinite(v), f"{name}: {path} = {v}"
        if key.startswith(SIGNED):
            continue
        if key in MAY_BE_ZERO:
            assert v >= 0, f"{name}: {path} = {v}"
        else:
            assert v > 0, f"{name}: {path} = {v} is not positive"


def _check_stats(obj, where):
    """Every timing summary in ``obj`` has the summary keys, in order."""
    if isinstance(obj, dict):
        if "median" in obj and "p10" in obj:
            assert set(obj) == STATS, where
            assert obj["min"] <= obj["p10"] <= obj["median"] <= obj["p90"] <= obj["max"], where
            assert obj["n"] >= 1, where
        for k, v in obj.items():
            _check_stats(v, f"{where}/{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _check_stats(v, f"{where}/{i}")


def test_every_benchmark_ran_and_wrote_its_json(suite):
    assert sorted(suite["results"]) == sorted(EXPECTED)
    summary = report.read_json(suite["out"] / "all.json")
    assert summary["bench"] == "all" and summary["mode"] == "quick"
    assert [r["name"] for r in summary["runs"]] == EXPECTED
    assert all(r["ok"] and r["exit_code"] == 0 for r in summary["runs"])
    for r in summary["runs"]:
        assert r["command"].startswith(f"jaxckpt bench {r['name']} --quick --json ")
        assert (suite["out"] / f"{r['name']}.log").exists()
    # each --bench-args reached its benchmark alone, after its preset
    forwarded = suite["forwarded"]
    assert sorted(forwarded) == ["cluster", "save", "stall"]
    assert forwarded["cluster"].endswith(f"--plain-dir {suite['plain']}")
    for r in summary["runs"]:
        assert [n for n, opts in forwarded.items() if r["command"].endswith(f"--json {suite['out'] / r['name']}.json "
                                                                            f"{opts}")] == \
            ([r["name"]] if r["name"] in forwarded else []), r["command"]
    assert summary["command"].endswith(" ".join(f"--bench-args '{n}={opts}'" for n, opts in forwarded.items()))
    _check_numbers(summary, "all")
    assert not suite["shm_left"], "benchmark directories left in /dev/shm"


@pytest.mark.parametrize("name", bench_all.BENCHES)
def test_result_schema_and_figures(suite, name):
    if name not in suite["results"]:
        pytest.skip(f"{name} did not run here (torch not installed)")
    res = suite["results"][name]
    keys, rows = SCHEMA[name]
    assert res["bench"] == name and res["mode"] == "quick"
    assert {"machine", "date", "command"} | keys <= set(res), set(res) ^ keys
    assert res["command"].startswith(f"jaxckpt bench {name} --quick"), res["command"]
    m = res["machine"]
    assert {"cpu_model", "cores", "memory_bytes", "versions", "os"} <= set(m)
    assert {"jax", "jaxlib", "orbax-checkpoint", "numpy", "jaxckpt", "python"} <= set(m["versions"])
    assert res[rows], f"{name}: no {rows}"
    _check_stats(res, name)
    _check_numbers(res, name)


def test_new_benchmarks_cover_what_the_issues_ask(suite):
    r = suite["results"]
    rows = r["restore"]["results"]
    assert [x["size_bytes"] for x in rows] == [1 << 20, 4 << 20] and not r["restore"]["skipped"]
    for x in rows:
        assert set(x["restore"]) == {"shm", "orbax_tmpfs", "orbax_plain"}
        assert x["restore"]["shm"]["restore_first_s"]["n"] == 1 and "connect_s" in x["restore"]["shm"]
        assert {"orbax_tmpfs_over_shm_first", "orbax_plain_over_memory_later", "shm_save_call_over_memory"} <= \
            set(x["ratios"])
        rs = x["restore"]
        assert math.isclose(x["ratios"]["orbax_tmpfs_over_shm_later"],
                            rs["orbax_tmpfs"]["restore_s"]["median"] / rs["shm"]["restore_s"]["median"])
    sc = r["scaling"]
    assert [x["procs"] for x in sc["by_procs"]] == [2, 4]
    # The commit protocol: O(processes) key-value operations per step at the leader, O(1) at a follower, and
    # live keys bounded by the process count, not the steps.
    assert [c["procs"] for c in sc["commit"]] == [2, 4]
    for c in sc["commit"]:
        assert 0 < c["leader_ops_per_step"] <= 4 * c["procs"], c
        assert 0 < c["follower_ops_per_step"]["max"] <= 3, c
        assert c["live_keys"] <= 4 * c["procs"] and c["commit_latency_s"]["n"] == c["steps"], c
    assert all(len(x["processes"]) == x["procs"] for x in sc["by_procs"])
    for x in sc["by_procs"]:  # every process restored (checked bit for bit there) and timed it
        assert x["restore_s"]["n"] == x["procs"] and x["restore_cpu_s"]["median"] > 0 and \
            x["restore_aggregate_gbps"] > 0, x
        assert all(p["restore_s"]["n"] == sc["setup"]["repeats"] for p in x["processes"]), x
    assert all(x["held_bytes"] >= x["size_bytes"] for x in sc["by_size"])
    assert {"save_call_largest_over_smallest", "snapshot_largest_over_smallest",
            "save_call_most_over_fewest_procs", "snapshot_most_over_fewest_procs",
            "restore_most_over_fewest_procs", "restore_cpu_most_over_fewest_procs"} <= set(sc["ratios"])
    if "stall" in r:  # skipped where flax/optax are missing
        st = r["stall"]
        assert st["procs"] == [2] and [x["procs"] for x in st["results"]] == [2]
        assert st["command"].startswith("jaxckpt bench stall --quick --procs 2 --modes none,jaxckpt,orbax --json")
        for x in st["results"]:
            assert all(list(p["modes"]) == ["none", "jaxckpt", "orbax"] for p in x["processes"]), x["processes"]
            leaves = {p["leaves"] for p in x["processes"]}
            assert len(leaves) == 1 and x["leaves"] in leaves and x["leaves"] > 8, x["leaves"]
            s_ = x["summary"]
            assert math.isclose(s_["overhead_of_orbax_jaxckpt"],
                                s_["overhead_pct_jaxckpt"] / s_["overhead_pct_orbax"])
    mem = r["memory"]
    assert {(p["layout"], p["policy"]) for p in mem["protection"]} == {
        (lay, pol) for lay in ("data-parallel", "fully-sharded") for pol in ("none", "replica", "parity", "xor-group",
                                                                             "hybrid")}
    parity = next(p for p in mem["protection"] if p["layout"] == "data-parallel" and p["policy"] == "parity")
    assert abs(parity["extra_over_data"] - 1 / 3) < 0.1 * (1 / 3)  # R = 4 replicas: 1/(R-1) extra, within 10%
    for s in mem["stores"]:
        assert s["memory"]["held_bytes"] <= s["memory"]["bound_bytes"]
        assert s["shm"]["held_bytes"] <= s["shm"]["bound_bytes"] and s["shm"]["tmpfs_bytes"] > 0


def test_stall_options_are_checked_before_anything_runs(capsys):
    from jaxckpt import cli
    from jaxckpt.tools.bench import stall
    assert stall.procs_list("1,2") == [1, 2] and stall.procs_list(2) == [2]
    for bad in ("3", "0", "1,5", ""):
        with pytest.raises(ValueError, match="must divide the 8 CPU devices"):
            stall.procs_list(bad)
    for argv in (["--procs", "3"], ["--sizes", "0.2G,huge"], ["--orbax-steps", "0"], ["--rounds", "0"]):
        ns = cli.build_parser().parse_args(["bench", "stall", *argv])
        assert stall.run(ns) == 2, argv
    assert stall.gpt_config("0.2G-deep", 64)["layers"] == 4 * stall.gpt_config("0.2G", 64)["layers"]
    parse = cli.build_parser().parse_args
    assert stall.command(parse(["bench", "stall", "--sizes", "4k-leaves", "--orbax-steps", "2"])).endswith(
        "--procs 2 --orbax-steps 2")
    assert stall.command(parse(["bench", "stall", "--rounds", "3"])).endswith("--procs 2 --rounds 3")
    assert stall.modes(parse(["bench", "stall"])) == [m for m in stall.MODES if m != "jaxckpt-whole"]
    assert stall.modes(parse(["bench", "stall", "--modes", "orbax, none,jaxckpt-fused"])) == \
        ["none", "jaxckpt-fused", "orbax"]  # in the benchmark's order
    assert stall.modes(parse(["bench", "stall", "--replicas", "split,whole", "--modes", "none,jaxckpt-whole"])) == \
        ["none", "jaxckpt-whole"]
    for bad, match in (("jaxckpt,orbax", "that includes none"), ("none,nope", "subset of none, copy-floor, view-floor, jaxckpt,"),
                       ("none,jaxckpt-whole", "jaxckpt-whole needs --replicas split,whole")):
        with pytest.raises(ValueError, match=match):
            stall.modes(parse(["bench", "stall", "--modes", bad]))
        assert stall.run(parse(["bench", "stall", "--modes", bad])) == 2, bad


@pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("flax", "optax")), reason="trains a Flax GPT")
def test_stall_rounds_measure_every_mode_in_turn_and_pool_its_steps(tmp_path):
    """``--rounds 2``: every mode measured twice, in turn, on fresh states (the checkpointers made again); each
    mode's step, call and snapshot times pooled over both, the idle snapshot and the floor once, the breakdown
    averaged; the command and the section say so. ``copy-floor`` moved the bytes of a save at every step, on its
    own thread, counted with the copy workers, and ``view-floor`` the same after taking a save's views (its call
    time); ``jaxckpt-wait``'s save() calls returned committed."""
    from jaxckpt.tools.bench import stall

    out = tmp_path / "stall.json"
    ns = cli.build_parser().parse_args(["bench", "stall", "--quick", "--procs", "1", "--modes",
                                        "none,jaxckpt,copy-floor,view-floor,jaxckpt-wait", "--rounds", "2", "--json",
                                        str(out)])
    assert stall.run(ns) == 0
    r = report.read_json(out)
    assert r["rounds"] == 2 and r["command"].endswith("--modes none,copy-floor,view-floor,jaxckpt,jaxckpt-wait --rounds 2 --json "
                                                    + str(out))
    (row,) = r["results"]
    (p,) = row["processes"]
    steps = r["steps"]
    assert p["modes"]["none"]["step_s"]["n"] == 2 * steps
    mine = p["modes"]["jaxckpt"]
    assert mine["step_s"]["n"] == mine["save_call_s"]["n"] == mine["snapshot_s"]["n"] == 2 * steps, mine
    assert mine["idle_snapshot_s"]["n"] == 2 and mine["bytes_this_process"] > 0  # --quick: 2 idle saves, once
    assert mine["breakdown"]["cpu_ms"]["copy workers"] > 0 and p["floor"]["copy_crc_s"] > 0
    # the training thread's span: its blocked time (its GIL waits among it) within its wall time, averaged too
    t = mine["breakdown"]["training"]
    assert 0 <= t["blocked_ms"] <= t["wall_ms"] and t["switches"] >= 0, t
    md = stall.render_stall(r)
    assert "training thread blocked ms per save" in md and "`jaxckpt`: " in md, md
    assert "; training thread blocked " in next(line for line in md.splitlines() if "`jaxckpt`: " in line), md
    waited = p["modes"]["jaxckpt-wait"]  # each call returned once its snapshot was committed
    assert waited["save_call_s"]["n"] == waited["snapshot_s"]["n"] == 2 * steps
    assert waited["save_call_s"]["median"] >= waited["snapshot_s"]["median"], waited
    floor = p["modes"]["copy-floor"]
    assert floor["step_s"]["n"] == 2 * steps and floor["floor_passes"] == 2 * (r["warmup"] + steps), floor
    assert floor["bytes_this_process"] == p["floor"]["bytes"] and floor["breakdown"]["cpu_ms"]["copy workers"] > 0
    views = p["modes"]["view-floor"]
    assert views["step_s"]["n"] == views["save_call_s"]["n"] == 2 * steps and views["save_call_s"]["median"] > 0
    assert views["floor_passes"] == floor["floor_passes"] and views["bytes_this_process"] == p["floor"]["bytes"]
    assert views["breakdown"]["cpu_ms"]["copy workers"] > 0
    s_ = row["summary"]
    assert math.isclose(s_["beyond_copy_floor_pts_jaxckpt"],
                        s_["overhead_pct_jaxckpt"] - s_["overhead_pct_copy-floor"])
    assert math.isclose(s_["beyond_view_floor_pts_jaxckpt"],
                        s_["overhead_pct_jaxckpt"] - s_["overhead_pct_view-floor"])
    # the views' share of a step; beyond the view floor only where save() returns before its copy, as its views
    assert math.isclose(s_["views_pts"], 100 * s_["save_call_s_view-floor"] / s_["step_s_none"])
    assert "beyond_view_floor_pts_jaxckpt-wait" not in s_ and "beyond_view_floor_pts_view-floor" not in s_
    text = stall.render_stall(r)
    assert "2 rounds (every mode once per round, in turn, on a fresh state), pooled" in text
    assert "| copy-floor |" in text and "points beyond the copy floor's" in text
    assert "| view-floor |" in text and "beyond the view floor's" in text


@pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("flax", "optax")), reason="trains a Flax GPT")
def test_stall_records_wrap_steps_save_time_apart_from_the_programs_dispatch(tmp_path):
    """The ``wrap_step`` modes' save() call column is the calling thread's time in the save (``save_call_seconds``
    of each step's handle), as for save(), not the wrapped call with the program's dispatch in it; the JSON says
    which (``fused_call``), so that a result recorded before renders with the meaning its numbers have."""
    from jaxckpt.tools.bench import stall

    out = tmp_path / "stall.json"
    ns = cli.build_parser().parse_args(["bench", "stall", "--quick", "--procs", "1", "--modes",
                                        "none,jaxckpt-fused,jaxckpt-fused-program", "--json", str(out)])
    assert stall.run(ns) == 0
    r = report.read_json(out)
    assert r["fused_call"] == "save"
    (row,) = r["results"]
    (p,) = row["processes"]
    for mode in ("jaxckpt-fused", "jaxckpt-fused-program"):
        calls = p["modes"][mode]["save_call_s"]
        assert calls["n"] == r["steps"] and 0 < calls["min"] <= calls["median"], (mode, calls)
    text = stall.render_stall(r)
    assert "is the calling thread's time in the save (before the step, its wait for the copy too), the " \
           "program's dispatch excluded" in text
    older = {k: v for k, v in r.items() if k != "fused_call"}
    assert "is the whole wrapped call: the save and the program's dispatch." in stall.render_stall(older)


def test_markdown_sections_from_json(suite):
    text = suite["md"].read_text()
    assert text.startswith("# Benchmarks\n\nprose before\n\n<!-- bench:save:begin -->\n")
    assert "\nprose after\n" in text and "\nold\n" not in text
    render = bench_all.renderers()
    for name in [*EXPECTED, "all"]:
        begin, end = report.markers(name)
        assert text.count(begin) == 1 and text.count(end) == 1, name
        body = text[text.index(begin) + len(begin):text.index(end)]
        if name != "all":
            assert render[name](suite["results"][name]) in body, name
            assert "placeholder" in body or "Quick run" in body, name
    assert "| `restore` | ok |" in text and "| `scaling` | ok |" in text


def test_plots_are_embedded_by_relative_links(suite):
    if not plots.available():
        pytest.skip("matplotlib not installed: bench all renders tables only")
    text = suite["md"].read_text()
    links = [line[line.index("](") + 2:-1] for line in text.splitlines() if line.startswith("![")]
    assert sorted(Path(x).name for x in links) == sorted(name for name, *_ in plots.PLOTS)
    for link in links:
        assert not os.path.isabs(link) and link.startswith("docs/bench/")
        assert (suite["md"].parent / link).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plotting_code_on_the_stored_quick_json(suite, tmp_path):
    pytest.importorskip("matplotlib")
    made = plots.make_all(suite["results"], tmp_path / "p")
    files = sorted(p.name for items in made.values() for _, p in items)
    assert files == sorted(name for name, *_ in plots.PLOTS)
    for items in made.values():
        for _, p in items:
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    # With only some results, only the plots they allow; with none, none.
    some = plots.make_all({"restore": suite["results"]["restore"]}, tmp_path / "q")
    assert [p.name for items in some.values() for _, p in items] == ["restore_time.png"]
    assert plots.make_all({}, tmp_path / "r") == {}


def test_render_only_rerenders_without_measuring(suite, tmp_path):
    md = tmp_path / "B.md"
    before = {p.name: p.stat().st_mtime_ns for p in suite["out"].iterdir()}
    assert cli.main(["bench", "all", "--render-only", "--out", str(suite["out"]), "--update-md", str(md)]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in suite["out"].iterdir()} == before  # nothing was measured
    text = md.read_text()
    for name in EXPECTED:
        assert bench_all.renderers()[name](suite["results"][name]) in text
    if plots.available():
        assert (tmp_path / "docs" / "bench" / "restore_time.png").exists()


def test_recorded_json_is_kept_beside_the_plots_and_rerenders_every_section(suite, tmp_path):
    """The --out directory is not in the repository; docs/bench/ (beside the plots) is, with every JSON the
    sections were rendered from, and re-rendering from it alone gives the same sections."""
    kept = suite["dir"] / "docs" / "bench"
    for name in EXPECTED:
        assert report.read_json(kept / f"{name}.json") == suite["results"][name], name
    assert report.read_json(kept / "all.json") == report.read_json(suite["out"] / "all.json")
    md = tmp_path / "BENCHMARKS.md"
    md.write_text(PROSE)
    assert cli.main(["bench", "all", "--render-only", "--out", str(kept), "--update-md", str(md)]) == 0
    text, want = md.read_text(), suite["md"].read_text()
    for name in [*EXPECTED, "all"]:
        begin, end = report.markers(name)
        assert text[text.index(begin):text.index(end)] == want[want.index(begin):want.index(end)], name


def test_a_failed_benchmark_is_reported_and_leaves_no_stale_result(suite, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "parity.json").write_text((suite["out"] / "parity.json").read_text())
    # A real failure: the benchmark's process is killed by the suite's time-out.
    proc = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "bench", "all", "--quick", "--only", "parity",
                           "--out", str(out), "--timeout", "0.01"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "parity failed (exit code 124)" in proc.stderr and "1 benchmark(s) failed: parity" in proc.stderr
    assert not (out / "parity.json").exists()
    summary = report.read_json(out / "all.json")
    assert [(r["name"], r["ok"], r["exit_code"]) for r in summary["runs"]] == [("parity", False, 124)]


def test_selection(capsys):
    ns = cli.build_parser().parse_args(["bench", "all", "--only", "save,parity", "--skip", "parity"])
    assert bench_all.selected(ns) == ["save"]
    ns = cli.build_parser().parse_args(["bench", "all", "--skip", "stall,torch"])
    assert bench_all.selected(ns) == ["parity", "save", "restore", "scaling", "memory", "cluster"]
    ns = cli.build_parser().parse_args(["bench", "all", "--only", "save,nope"])
    with pytest.raises(ValueError, match=r"unknown benchmark\(s\) nope \(known: parity,"):
        bench_all.selected(ns)
    assert cli.main(["bench", "all", "--only", "nope", "--render-only"]) == 2
    ns = cli.build_parser().parse_args(["bench", "all", "--bench-args", "cluster=--steps 2", "--bench-args",
                                        "save=--sizes '1M'", "--bench-args", "cluster=--repeats 1"])
    assert bench_all.bench_args(ns) == {"cluster": ["--steps", "2", "--repeats", "1"], "save": ["--sizes", "1M"]}
    for bad in ("cluster", "nope=--x"):
        ns = cli.build_parser().parse_args(["bench", "all", "--bench-args", bad])
        with pytest.raises(ValueError, match=r"--bench-args .* is not NAME=OPTIONS with NAME one of parity,"):
            bench_all.bench_args(ns)
        assert cli.main(["bench", "all", "--bench-args", bad, "--render-only"]) == 2
