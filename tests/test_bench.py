"""``jaxckpt bench save``: the quick run end to end (a real subprocess of the session's ``bench all --quick``),
its JSON schema, and the markdown it renders.

No timing thresholds: only that every figure is finite and positive and that the report is well formed.
"""
import json
import math
import os
import subprocess
import sys

import pytest

from jaxckpt import cli
from jaxckpt.tools.bench import report, save
from jaxckpt.tools.bench.save import parse_size
from conftest import SAVE_LEAF_COUNTS, bench_section

STATS = {"median", "min", "max", "p10", "p90", "n"}
JAXCKPT_KEYS = {"save_call_s", "snapshot_s", "snapshot_worker_s", "restore_s", "snapshot_gbps", "snapshot_vs_memcpy"}
ORBAX_KEYS = {"save_call_s", "total_s", "restore_s"}
RATIO_KEYS = {"save_call_orbax_over_jaxckpt", "total_orbax_over_jaxckpt", "restore_orbax_over_jaxckpt"}
SWEEP_TIMES = {"jaxckpt_save_call_s", "wrap_step_save_s", "plain_step_call_s", "wrap_step_call_s", "orbax_save_call_s",
               "jaxckpt_restore_s", "orbax_restore_s"}
SWEEP_KEYS = SWEEP_TIMES | {"leaves", "shards", "size_bytes", "view_s_per_shard", "orbax_over_jaxckpt",
                            "orbax_over_wrap_step_save", "restore_orbax_over_jaxckpt", "fresh"}
FRESH_KEYS = {"fresh_save_call_s", "saved_shards", "view_s", "direct_view_s", "expose_s", "save_s_per_saved_shard",
              "over_views", "over_views_and_expose"}


@pytest.fixture(scope="module")
def quick(bench_quick, tmp_path_factory):
    """The quick save benchmark of the session's ``bench all --quick`` run (tests/conftest.py: its own
    ``jaxckpt bench save --quick --json`` process), and its section written by ``bench save --update-md``."""
    d = tmp_path_factory.mktemp("bench")
    md = d / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nprose before\n\n<!-- bench:save:begin -->\nold\n<!-- bench:save:end -->\n\n"
                  "prose after\n")
    (d / "save.json").write_bytes((bench_quick["out"] / "save.json").read_bytes())
    stdout = bench_section("save", d / "save.json", md)
    return {"dir": d, "json": bench_quick["results"]["save"], "md": md, "stdout": stdout,
            "shm_left": {n for n in bench_quick["shm_left"] if n.startswith("jaxckpt-bench-orbax-")}}


def _check_stats(s, where):
    assert set(s) == STATS, where
    assert s["min"] <= s["p10"] <= s["median"] <= s["p90"] <= s["max"], where


def _check_schema(res, sizes, mode):
    assert res["bench"] == "save" and res["mode"] == mode
    assert {"bench", "mode", "machine", "date", "command", "setup", "memcpy_gbps", "results"} <= set(res)
    m = res["machine"]
    assert {"cpu_model", "cores", "memory_bytes", "versions", "os"} <= set(m)
    assert {"jax", "jaxlib", "orbax-checkpoint", "numpy", "jaxckpt", "python"} <= set(m["versions"])
    assert res["command"].startswith("jaxckpt bench save")
    assert res["setup"]["devices"] == 8
    assert [r["size_bytes"] for r in res["results"]] == sizes
    for r in res["results"]:
        assert set(r) == {"size_bytes", "jaxckpt", "orbax", "ratios"}
        assert set(r["jaxckpt"]) == JAXCKPT_KEYS and set(r["orbax"]) == ORBAX_KEYS and set(r["ratios"]) == RATIO_KEYS
        for side in ("jaxckpt", "orbax"):
            for k, v in r[side].items():
                if k.endswith("_s"):
                    _check_stats(v, f"{r['size_bytes']}/{side}/{k}")
        j, o = r["jaxckpt"], r["orbax"]
        assert math.isclose(r["ratios"]["save_call_orbax_over_jaxckpt"],
                            o["save_call_s"]["median"] / j["save_call_s"]["median"])
        assert math.isclose(j["snapshot_vs_memcpy"], j["snapshot_gbps"] / res["memcpy_gbps"])
    sweep = res["leaf_sweep"]  # the leaf-count sweep: same total bytes, more and more leaves
    assert [r["leaves"] for r in sweep["rows"]] == list(SAVE_LEAF_COUNTS) and sweep["total_bytes"] == 1 << 20
    for r in sweep["rows"]:
        assert set(r) == SWEEP_KEYS, set(r) ^ SWEEP_KEYS
        for k in SWEEP_TIMES:
            _check_stats(r[k], f"sweep {r['leaves']}/{k}")
        assert r["shards"] == 8 * r["leaves"]  # every leaf is split over all 8 devices
        # save() of a state a donating step just made, three layouts, against its floor measured in the same run
        assert list(r["fresh"]) == ["sharded", "mixed", "replicated"]
        sharded, mixed, replicated = r["fresh"]["sharded"], r["fresh"]["mixed"], r["fresh"]["replicated"]
        assert set(sharded) == FRESH_KEYS and set(mixed) == set(replicated) == FRESH_KEYS | {"shards"}
        assert sharded["saved_shards"] == r["shards"]
        # mixed: of every 4 leaves on the 4x2 mesh, 8 + 2 + 4 + 1 distinct shards are saved, of 32 local ones
        assert mixed["shards"] == 8 * r["leaves"] and mixed["saved_shards"] == 15 * r["leaves"] // 4
        assert replicated["shards"] == 8 * r["leaves"] and replicated["saved_shards"] == r["leaves"]
        for f in (sharded, mixed, replicated):
            _check_stats(f["fresh_save_call_s"], f"sweep {r['leaves']}/fresh")
            assert math.isclose(f["save_s_per_saved_shard"], f["fresh_save_call_s"]["median"] / f["saved_shards"])
            assert math.isclose(f["over_views"], f["fresh_save_call_s"]["median"] / f["view_s"])
            assert math.isclose(f["over_views_and_expose"],
                                f["fresh_save_call_s"]["median"] / (f["view_s"] + f["expose_s"]))
        assert abs(r["size_bytes"] - sweep["total_bytes"]) <= sweep["total_bytes"] // 8
        assert math.isclose(r["orbax_over_jaxckpt"], r["orbax_save_call_s"]["median"] / r["jaxckpt_save_call_s"]["median"])
        assert math.isclose(r["restore_orbax_over_jaxckpt"],
                            r["orbax_restore_s"]["median"] / r["jaxckpt_restore_s"]["median"])
    nums = report.numbers(res)
    assert len(nums) > 50
    bad = [(p, v) for p, v in nums if not (math.isfinite(v) and v > 0)]
    assert not bad, bad


def test_quick_run_json_schema(quick):
    _check_schema(quick["json"], [1 << 20, 4 << 20], "quick")
    counts = ",".join(map(str, SAVE_LEAF_COUNTS))
    assert quick["json"]["command"].startswith(f"jaxckpt bench save --quick --leaf-counts {counts} --json ")
    assert not quick["shm_left"], "Orbax tmpfs directories left behind"


def test_quick_run_updates_only_its_section(quick):
    text = quick["md"].read_text()
    assert text.startswith("# Benchmarks\n\nprose before\n\n<!-- bench:save:begin -->\n")
    assert text.endswith("<!-- bench:save:end -->\n\nprose after\n")
    assert "\nold\n" not in text
    assert "Quick run, placeholder until the full run" in text
    assert save.render(quick["json"]) in text
    assert "| 1 MiB |" in quick["stdout"] and "| 4 MiB |" in quick["stdout"]


def test_markdown_table_from_json(quick):
    md = save.render(quick["json"])
    sizes_md, sweep_md = md.split("#### save() against the number of leaves")
    rows = [line for line in sizes_md.splitlines() if line.startswith("|")]
    assert len(rows) == 2 + 2  # header, rule, one row per size
    ncols = rows[0].count("|")
    assert all(r.count("|") == ncols for r in rows)
    assert rows[2].startswith("| 1 MiB |") and rows[3].startswith("| 4 MiB |")
    sweep_md, fresh_md = sweep_md.split("#### save() of the state a donating step just made")
    fresh_rows = [line for line in fresh_md.splitlines() if line.startswith("|")]
    assert len(fresh_rows) == 2 + 2 * 3  # header, rule, per leaf count the sharded, mixed and replicated layout
    assert [r.split("|")[1:3] for r in fresh_rows[2:]] == [[f" {n} ", f" {name} "] for n in SAVE_LEAF_COUNTS
                                                          for name in ("sharded", "mixed", "replicated")]
    sweep_rows = [line for line in sweep_md.splitlines() if line.startswith("|")]
    assert len(sweep_rows) == 2 + 2 and sweep_rows[0].startswith("| leaves | local shards | jaxckpt save() ms |")
    assert [r.split("|")[1:3] for r in sweep_rows[2:]] == [[f" {n} ", f" {8 * n} "] for n in SAVE_LEAF_COUNTS]
    assert all(r.count("|") == sweep_rows[0].count("|") for r in sweep_rows)
    assert f"Command: `{quick['json']['command']}`" in md
    assert f"orbax-checkpoint {quick['json']['machine']['versions']['orbax-checkpoint']}" in md
    # A full run's result renders without the placeholder banner.
    full = json.loads(json.dumps(quick["json"]))
    full["mode"] = "full"
    assert "placeholder" not in save.render(full)


def test_from_json_rerenders_without_measuring(quick, tmp_path, capsys):
    md = tmp_path / "B.md"
    assert cli.main(["bench", "save", "--from-json", str(quick["dir"] / "save.json"), "--update-md", str(md)]) == 0
    begin, end = report.markers("save")
    assert md.read_text() == f"{begin}\n{save.render(quick['json'])}\n{end}\n"
    assert save.render(quick["json"]) in capsys.readouterr().out


def _section(text: str, name: str) -> str:
    begin, end = report.markers(name)
    return text[text.index(begin):text.index(end) + len(end)]


def test_a_recorded_run_keeps_its_json_beside_the_plots_and_rerenders_from_it(quick, tmp_path):
    """``--update-md`` keeps the result in docs/bench/ next to the markdown file (the --json path and the
    bench-results/ directory are not in the repository); the section re-renders from that copy alone."""
    kept = quick["dir"] / "docs" / "bench" / "save.json"
    assert kept.is_file(), f"no {kept}"
    assert report.read_json(kept) == quick["json"]
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("<!-- bench:save:begin -->\nold\n<!-- bench:save:end -->\n")
    assert cli.main(["bench", "save", "--from-json", str(kept), "--update-md", str(md)]) == 0
    assert _section(md.read_text(), "save") == _section(quick["md"].read_text(), "save")
    assert report.read_json(tmp_path / "docs" / "bench" / "save.json") == quick["json"]  # recorded there too


def test_record_json_leaves_an_identical_file_alone(tmp_path):
    first = report.record_json(tmp_path, "save", {"bench": "save", "x": [1, 2.5]})
    mtime = first.stat().st_mtime_ns
    assert report.record_json(tmp_path, "save", {"bench": "save", "x": [1, 2.5]}).stat().st_mtime_ns == mtime
    report.record_json(tmp_path, "save", {"bench": "save", "x": [3]})
    assert report.read_json(first) == {"bench": "save", "x": [3]}


def test_cli_in_a_process_that_imported_jax_measures_in_a_subprocess(tmp_path):
    # This pytest process has jax imported (conftest), so the CLI must hand over to `python -m jaxckpt.tools.bench.save`.
    assert "jax" in sys.modules
    out = tmp_path / "one.json"
    counts = ",".join(map(str, SAVE_LEAF_COUNTS))  # the suite's leaf sweep (conftest.py), not the preset's 64 leaves
    assert cli.main(["bench", "save", "--quick", "--sizes", "256K", "--repeats", "1", "--leaf-counts", counts,
                     "--json", str(out)]) == 0
    res = report.read_json(out)
    _check_schema(res, [256 << 10], "quick")
    assert res["command"] == f"jaxckpt bench save --quick --sizes 256K --repeats 1 --leaf-counts {counts} --json {out}"


def test_replace_section(tmp_path):
    p = tmp_path / "B.md"
    report.replace_section(p, "save", "one")
    assert p.read_text() == "<!-- bench:save:begin -->\none\n<!-- bench:save:end -->\n"
    p.write_text("# T\n\nintro\n")
    report.replace_section(p, "save", "two")
    report.replace_section(p, "other", "x")
    report.replace_section(p, "save", "three\n")
    assert p.read_text() == ("# T\n\nintro\n\n<!-- bench:save:begin -->\nthree\n<!-- bench:save:end -->\n\n"
                             "<!-- bench:other:begin -->\nx\n<!-- bench:other:end -->\n")
    p.write_text("<!-- bench:save:end -->\n<!-- bench:save:begin -->\n")
    with pytest.raises(ValueError, match="section 'save' needs exactly one"):
        report.replace_section(p, "save", "y")
    p.write_text("<!-- bench:save:begin -->\n")
    with pytest.raises(ValueError, match=r"found 1 begin, 0 end"):
        report.replace_section(p, "save", "y")


def test_render_rejects_unknown_bench():
    from jaxckpt.tools.bench import all as bench_all
    with pytest.raises(ValueError, match="no markdown renderer for bench 'nope'"):
        bench_all.render_result({"bench": "nope"})


def test_bad_options_are_refused_before_measuring(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jaxckpt.tools.bench.save", "--quick", "--warmup", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--warmup >= 1" in proc.stderr and "warmup 0" in proc.stderr


def test_parse_size():
    assert parse_size("16M") == 16 << 20
    assert parse_size("1G") == 1 << 30
    assert parse_size("256k") == 256 << 10
    assert parse_size("64MiB") == 64 << 20
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError, match="bad size 'lots'"):
        parse_size("lots")
    with pytest.raises(ValueError, match="must be positive"):
        parse_size("0M")


def test_bad_leaf_counts_are_refused_before_measuring():
    proc = subprocess.run([sys.executable, "-m", "jaxckpt.tools.bench.save", "--quick", "--leaf-counts", "8,lots"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "bad --leaf-counts '8,lots'" in proc.stderr
