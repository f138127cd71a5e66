"""``jaxckpt bench torch``: the quick run end to end (a real subprocess of the session's ``bench all --quick``),
its JSON schema, and the markdown it renders.

No timing thresholds: only that every figure is finite and positive and that the report is well formed.
"""
import json
import math
import subprocess
import sys

import pytest
import torch

from jaxckpt import cli
from jaxckpt.tools.bench import all as bench_all
from jaxckpt.tools.bench import report, torch_dcp
from conftest import bench_section

STATS = {"median", "min", "max", "p10", "p90", "n"}
JAXCKPT_KEYS = {"save_call_s", "snapshot_s", "deferred_save_call_s", "deferred_wait_for_reads_s",
                "deferred_snapshot_s", "restore_in_place_s", "restore_new_s", "snapshot_gbps", "snapshot_vs_memcpy"}
DCP_KEYS = {"async_save_call_s", "async_total_s", "save_s", "load_s"}
RATIOS = {  # ratio name -> (DCP figure, jaxckpt figure)
    "save_call_dcp_over_jaxckpt": ("async_save_call_s", "save_call_s"),
    "save_call_deferred_dcp_over_jaxckpt": ("async_save_call_s", "deferred_save_call_s"),
    "total_dcp_over_jaxckpt": ("async_total_s", "snapshot_s"),
    "restore_in_place_dcp_over_jaxckpt": ("load_s", "restore_in_place_s"),
    "restore_new_dcp_over_jaxckpt": ("load_s", "restore_new_s"),
}
DCP_STORES = ("memory", "shm")
DCP_RATIOS = {f"dcp_{k}_filesystem_over_jaxckpt_{store}": (store, key) for store in DCP_STORES
              for k, key in (("save", "save_s"), ("async_call", "async_save_call_s"),
                             ("async_total", "async_total_s"), ("load", "load_s"))}


@pytest.fixture(scope="module")
def quick(bench_quick, tmp_path_factory):
    """The quick torch benchmark of the session's ``bench all --quick`` run (tests/conftest.py: its own
    ``jaxckpt bench torch --quick --json`` process), and its section written by ``bench torch --update-md``."""
    if "torch" not in bench_quick["results"]:
        pytest.skip("bench all ran no torch benchmark here (torch not installed)")
    d = tmp_path_factory.mktemp("bench_torch")
    md = d / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\n<!-- bench:save:begin -->\nsave table\n<!-- bench:save:end -->\n\nprose\n\n"
                  "<!-- bench:torch:begin -->\nold\n<!-- bench:torch:end -->\n\nprose after\n")
    (d / "torch.json").write_bytes((bench_quick["out"] / "torch.json").read_bytes())
    stdout = bench_section("torch", d / "torch.json", md)
    return {"dir": d, "json": bench_quick["results"]["torch"], "md": md, "stdout": stdout,
            "shm_left": {n for n in bench_quick["shm_left"] if n.startswith("jaxckpt-bench-dcp-")}}


def _check_stats(s, where):
    assert set(s) == STATS, where
    assert s["min"] <= s["p10"] <= s["median"] <= s["p90"] <= s["max"], where


def test_quick_run_json_schema(quick):
    res = quick["json"]
    assert res["bench"] == "torch" and res["mode"] == "quick"
    assert {"bench", "mode", "machine", "date", "command", "setup", "memcpy_gbps", "memcpy_gbps_stats",
            "results"} <= set(res)
    assert res["command"].startswith("jaxckpt bench torch --quick --json ")
    assert {"torch", "numpy", "jaxckpt", "python"} <= set(res["machine"]["versions"])
    assert res["machine"]["versions"]["torch"] == torch.__version__
    s = res["setup"]
    assert s["repeats"] == 3 and s["warmup"] == 1 and s["jaxckpt_warmup_saves"] == 2
    assert "/dev/shm" in s["dcp"] and "async_save" in s["dcp"]
    assert "JaxckptWriter" in s["dcp_jaxckpt"] and s["dcp_jaxckpt_warmup_rounds"] == 2
    _check_stats(res["memcpy_gbps_stats"], "memcpy")
    assert [r["requested_bytes"] for r in res["results"]] == [1 << 20, 4 << 20]
    for r in res["results"]:
        where = report.fmt_size(r["requested_bytes"])
        assert set(r) == {"requested_bytes", "size_bytes", "tensors", "jaxckpt", "dcp", "dcp_jaxckpt_memory",
                          "dcp_jaxckpt_shm", "ratios"}
        assert set(r["jaxckpt"]) == JAXCKPT_KEYS and set(r["dcp"]) == DCP_KEYS
        assert set(r["ratios"]) == set(RATIOS) | set(DCP_RATIOS)
        for store in DCP_STORES:
            assert set(r[f"dcp_jaxckpt_{store}"]) == DCP_KEYS, store
            assert r[f"dcp_jaxckpt_{store}"]["load_s"]["n"] == 3
            for k in DCP_KEYS:
                _check_stats(r[f"dcp_jaxckpt_{store}"][k], f"{where}/dcp_jaxckpt_{store}/{k}")
        for name, (store, key) in DCP_RATIOS.items():
            assert math.isclose(r["ratios"][name], r["dcp"][key]["median"] / r[f"dcp_jaxckpt_{store}"][key]["median"])
        # 8 layers: a bfloat16 weight and three float32 tensors of the same shape, plus a scalar step, per layer.
        assert r["tensors"] == 8 * 5
        assert 0.9 * r["requested_bytes"] <= r["size_bytes"] <= 1.1 * r["requested_bytes"], where
        assert r["jaxckpt"]["save_call_s"]["n"] == r["dcp"]["load_s"]["n"] == 3
        for side, keys in (("jaxckpt", JAXCKPT_KEYS), ("dcp", DCP_KEYS)):
            for k in keys:
                if k.endswith("_s"):
                    _check_stats(r[side][k], f"{where}/{side}/{k}")
        for name, (a, b) in RATIOS.items():
            assert math.isclose(r["ratios"][name], r["dcp"][a]["median"] / r["jaxckpt"][b]["median"]), name
        j = r["jaxckpt"]
        assert math.isclose(j["snapshot_gbps"], r["size_bytes"] / j["snapshot_s"]["median"] / 1e9)
        assert math.isclose(j["snapshot_vs_memcpy"], j["snapshot_gbps"] / res["memcpy_gbps"])
    nums = report.numbers(res)
    assert len(nums) > 100
    bad = [(p, v) for p, v in nums if not (math.isfinite(v) and v > 0)]
    assert not bad, bad


def test_quick_run_cleans_up_tmpfs(quick):
    assert not quick["shm_left"], f"DCP tmpfs directories left behind: {quick['shm_left']}"


def test_quick_run_updates_only_its_section(quick):
    text = quick["md"].read_text()
    assert text.startswith("# Benchmarks\n\n<!-- bench:save:begin -->\nsave table\n<!-- bench:save:end -->\n\n"
                           "prose\n\n<!-- bench:torch:begin -->\n")
    assert text.endswith("<!-- bench:torch:end -->\n\nprose after\n")
    assert "\nold\n" not in text
    assert "Quick run, placeholder until the full run" in text
    assert torch_dcp.render_torch(quick["json"]) in text
    assert "| 1 MiB |" in quick["stdout"] and "| 4 MiB |" in quick["stdout"]


def test_markdown_tables_from_json(quick):
    res = quick["json"]
    md = bench_all.render_result(res)  # dispatches to the torch renderer by the "bench" field
    assert md == torch_dcp.render_torch(res)
    rows = [line for line in md.splitlines() if line.startswith("|")]
    # two tables with a row per size, then the DCP storage table with a row per size and storage
    assert len(rows) == 2 * (2 + 2) + 2 + 2 * 3
    save_rows, restore_rows, storage_rows = rows[:4], rows[4:8], rows[8:]
    for t in (save_rows, restore_rows, storage_rows):
        assert all(r.count("|") == t[0].count("|") for r in t)
    for t in (save_rows, restore_rows):
        assert t[2].startswith("| 1 MiB |") and t[3].startswith("| 4 MiB |")
    assert [r.split(" | ")[1] for r in storage_rows[2:]] == \
        ["FileSystemWriter, /dev/shm", "JaxckptWriter, store=memory", "JaxckptWriter, store=shm"] * 2
    assert storage_rows[2].startswith("| 1 MiB |") and storage_rows[5].startswith("| 4 MiB |")
    assert "dcp.load ms" in storage_rows[0]
    load_ratio = report.fmt_num(res["results"][1]["ratios"]["dcp_load_filesystem_over_jaxckpt_shm"])
    assert storage_rows[7].endswith(f"| {load_ratio}x |")
    assert "DCP async_save() ms" in save_rows[0] and "dcp.load ms" in restore_rows[0]
    ratio = report.fmt_num(res["results"][0]["ratios"]["save_call_deferred_dcp_over_jaxckpt"])
    assert save_rows[2].endswith(f"| {ratio}x |")
    assert f"Command: `{res['command']}`" in md
    assert f"torch {res['machine']['versions']['torch']}" in md
    full = json.loads(json.dumps(res))
    full["mode"] = "full"
    assert "placeholder" not in torch_dcp.render_torch(full)


def test_from_json_rerenders_without_measuring(quick, tmp_path, capsys):
    md = tmp_path / "B.md"
    assert cli.main(["bench", "torch", "--from-json", str(quick["dir"] / "torch.json"), "--update-md", str(md)]) == 0
    begin, end = report.markers("torch")
    assert md.read_text() == f"{begin}\n{torch_dcp.render_torch(quick['json'])}\n{end}\n"
    assert torch_dcp.render_torch(quick["json"]) in capsys.readouterr().out


def test_bad_options_are_refused_before_measuring():
    proc = subprocess.run([sys.executable, "-m", "jaxckpt.tools.bench.torch_dcp", "--quick", "--repeats", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--repeats >= 1" in proc.stderr and "repeats 0" in proc.stderr


def test_state_and_bitwise_check():
    state, target = torch_dcp.make_state(1 << 20), torch_dcp.make_state(1 << 20, zeros=True)
    nbytes, count = torch_dcp.state_bytes(state)
    assert count == 40 and torch_dcp.state_bytes(target) == (nbytes, count)
    w = state["model"]["layers.0.weight"]
    assert w.dtype == torch.bfloat16 and state["optim"]["state"]["layers.0.weight"]["master"].dtype == torch.float32
    torch_dcp.check_equal("same", torch_dcp.make_state(1 << 20), state)
    with pytest.raises(AssertionError, match="x/model/layers.0.weight: restored tensor differs"):
        torch_dcp.check_equal("x", target, state)
    # Bitwise, not numeric: -0.0 == 0.0 numerically, but a restore must keep the sign bit.
    a, b = {"t": torch.zeros(3)}, {"t": torch.tensor([0.0, -0.0, 0.0])}
    with pytest.raises(AssertionError, match="x/t: restored tensor differs"):
        torch_dcp.check_equal("x", a, b)
    with pytest.raises(AssertionError, match=r"x/optim/param_groups/0/lr: restored 0.5, saved 0.001"):
        changed = torch_dcp.make_state(1 << 20)
        changed["optim"]["param_groups"][0]["lr"] = 0.5
        torch_dcp.check_equal("x", changed, state)


def test_options_and_forwarded_command():
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "torch", "--sizes", "2M,8M", "--torch-threads", "1", "--repeats", "2"])
    opts = torch_dcp.options(args)
    assert opts["sizes"] == [2 << 20, 8 << 20] and opts["repeats"] == 2 and opts["torch_threads"] == 1
    assert opts["warmup"] == torch_dcp.FULL["warmup"]
    assert torch_dcp.forwarded(args) == ["--sizes", "2M,8M", "--repeats", "2", "--torch-threads", "1"]
    with pytest.raises(ValueError, match=r"--torch-threads >= 1 \(got 0\)"):
        torch_dcp.options(parser.parse_args(["bench", "torch", "--torch-threads", "0"]))
    with pytest.raises(ValueError, match="bad size 'big'"):
        torch_dcp.options(parser.parse_args(["bench", "torch", "--sizes", "big"]))
