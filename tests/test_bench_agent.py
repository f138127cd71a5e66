"""``jaxckpt bench agent``: the quick run end to end (real subprocess, real agents), its JSON and its markdown.

No timing thresholds: only that every figure is finite and positive, that the agents started framework-free
(the bench refuses to report one that imported numpy, jax, ml_dtypes or torch before serving), and that
nothing is left running or in /dev/shm.
"""
import math
import os
import subprocess
import sys

from jaxckpt.testing import agent_processes
from jaxckpt.tools.bench import report
from jaxckpt.tools.bench.agent_start import IMPORTS

STATS = {"median", "min", "max", "p10", "p90", "n"}


def test_quick_run_json_and_markdown(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\n<!-- bench:agent:begin -->\nold\n<!-- bench:agent:end -->\n")
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "bench", "agent", "--quick", "--repeats", "2",
                           "--json", str(tmp_path / "agent.json"), "--update-md", str(md)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = report.read_json(tmp_path / "agent.json")
    assert res["bench"] == "agent" and res["mode"] == "quick" and res["setup"]["repeats"] == 2
    assert res["command"].startswith("jaxckpt bench agent --quick --repeats 2 --json ")
    assert set(res["agent"]) == {"waited_s", "serving_s", "cpu_s"} and set(res["interpreters"]) == set(IMPORTS)
    for s in [*res["agent"].values(), *(v for i in res["interpreters"].values() for v in i.values())]:
        assert set(s) == STATS and s["n"] == 2 and s["min"] <= s["median"] <= s["max"], s
    a = res["agent"]
    assert math.isclose(res["ratios"]["cpu_vs_bare_cpu"],
                        a["cpu_s"]["median"] / res["interpreters"]["bare interpreter"]["cpu_s"]["median"])
    bad = [(p, v) for p, v in report.numbers(res) if not (math.isfinite(v) and v > 0)]
    assert not bad, bad
    text = md.read_text()
    assert "\nold\n" not in text and "| agent: exec -> serving |" in text and "`python -c` import ml_dtypes" in text
    left = {n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("jaxckpt-bench-agent-")}
    assert not left, left
    assert agent_processes("jaxckpt-bench-agent-") == []  # every agent stopped and reaped
