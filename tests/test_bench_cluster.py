"""``jaxckpt bench cluster --quick`` end to end in a real subprocess (of the session's ``bench all --quick``):
4 simulated nodes, every protection policy, every restore path (each checked bit for bit inside the run), two
node losses, Orbax's emergency manager.

No timing thresholds: the JSON's shape, that every figure is finite and positive, what the run must have done
(rebuilt the lost node's chunks, restored the newest protected or persisted step, planned parity at 1/(R-1)), the
markdown section and plots rendered from it, and that nothing is left behind in /dev/shm.
"""
import copy
import math
import os

import pytest

from jaxckpt.tools.bench import cluster, cluster_launchers, cluster_report, plots, report
from test_bench_all import _check_numbers, _check_stats
from conftest import bench_section

PROSE = "# Benchmarks\n\nbefore\n\n<!-- bench:cluster:begin -->\nold\n<!-- bench:cluster:end -->\n\nafter\n"


@pytest.fixture(scope="module")
def run(bench_quick, tmp_path_factory):
    """The quick cluster benchmark of the session's ``bench all --quick`` run (tests/conftest.py: its own
    ``jaxckpt bench cluster --quick --json ... --restore-collective --plain-dir D`` process), and its section
    written by ``bench cluster --update-md``."""
    d = tmp_path_factory.mktemp("bench-cluster")
    md = d / "BENCHMARKS.md"
    md.write_text(PROSE)
    (d / "cluster.json").write_bytes((bench_quick["out"] / "cluster.json").read_bytes())
    stdout = bench_section("cluster", d / "cluster.json", md)
    return {"dir": bench_quick["plain"], "md": md, "result": bench_quick["results"]["cluster"], "stdout": stdout,
            "left": {n for n in bench_quick["shm_left"] if n.startswith("jaxckpt-bench-cluster")}}


def test_schema_and_every_figure(run):
    res = run["result"]
    assert res["bench"] == "cluster" and res["mode"] == "quick"
    assert res["command"].startswith("jaxckpt bench cluster --quick") and res["command"].endswith(
        " --restore-collective")  # the command repeats the run, collective included
    assert {"machine", "date", "command", "setup", "policies", "restore", "save", "recovery", "ratios"} <= set(res)
    assert res["memcpy_gbps"] > 0 and res["setup"]["replicas"] == "split"  # the memory copy floor, same run
    # the suite's sizes (tests/conftest.py) reached the run, and its command repeats them
    assert (res["setup"]["state_bytes"], res["setup"]["repeats"], res["setup"]["steps"]) == (8 << 20, 1, 1)
    assert res["setup"]["probe_bytes"] == 32 << 20 and res["loopback"]["tcp_threads"]["bytes"] >= 32 << 20
    assert " --size 8M --steps 1 --repeats 1 " in res["command"] and " --probe-size 32M " in res["command"]
    assert all(res["restore"][k]["process_bytes"] > 0 for k in ("local", "peers", "resharded", "persistent"))
    # the agents-alive restore's machine floor, measured beside it: every process copying its bytes at once
    together = res["restore"]["local"]["copy_at_once_s"]
    assert together["n"] == res["setup"]["repeats"] and together["median"] > 0, together
    # and JAX's own part: making the same arrays from host copies of their shards, every process at once
    made = res["restore"]["local"]["made_from_host_s"]
    assert made["n"] == res["setup"]["repeats"] and 0 < made["median"], made
    _check_stats(res, "cluster")
    _check_numbers(res, "cluster")
    assert not run["left"], f"left in /dev/shm: {run['left']}"
    assert not [n for n in os.listdir(run["dir"]) if n.startswith("jaxckpt-bench-cluster")]


def test_policies_memory_and_protection(run):
    res = run["result"]
    rows = {p["policy"]: p for p in res["policies"]}
    assert list(rows) == ["none", "parity", "replica", "xor-group", "hybrid"]
    assert rows["none"]["chosen"] == ["none"] and rows["none"]["extra_bytes_per_node"] == 0
    assert "protect_lag_s" not in rows["none"]
    assert rows["parity"]["chosen"] == ["parity", "replica"]  # the fully sharded half is held once
    assert rows["hybrid"]["chosen"] == ["parity", "xor-group"]
    par = rows["parity"]
    assert par["replica_nodes"] == 4
    assert abs(par["parity_extra_over_parity_data"] - 1 / 3) <= 0.1 / 3  # issue 5: 1/(R-1) within 10%
    for name in ("parity", "replica", "xor-group", "hybrid"):
        r = rows[name]
        assert r["protect_lag_s"]["n"] == res["setup"]["repeats"] and r["sent_bytes_total"] > 0
        assert abs(r["measured_over_planned_extra"] - 1) <= 0.1, (name, r["measured_over_planned_extra"])
        assert r["snapshot_bytes_per_node"] == rows["none"]["snapshot_bytes_per_node"]


def test_restore_paths_and_recovery(run):
    res = run["result"]
    rs = res["restore"]
    assert rs["resharded"]["processes"] == 2 and rs["local"]["processes"] == 4
    if res["setup"].get("late_agent"):  # the lost node's chunks came from parity or copies, in the restore
        assert rs["peers"]["sources"].get("rebuild", 0) > 0
    else:  # the replacement's agent, started before JAX, rebuilt them: the restore reads them in its node's memory
        assert rs["peers"]["sources"].get("rebuild", 0) == 0
        assert rs["peers"]["sources"].get("local", 0) == rs["local"]["sources"]["local"] > 0, rs["peers"]["sources"]
    assert rs["local"]["sources"].get("rebuild", 0) == 0
    # the timeline of every restore path; the data-parallel half is formed by the collective from each node's
    # share, so a local restore moves nothing over the host transport
    for key in ("local", "peers", "resharded"):  # the persistent tier restores through Orbax: no chunk reader
        t = rs[key]["timeline"]
        assert t["phases"]["discover"]["seconds"] > 0 and "device_put" in t["phases"], key
    assert rs["local"]["timeline"]["transport_bytes"] == 0 and rs["local"]["timeline"]["collective_bytes"] > 0
    assert rs["local"]["timeline"]["phases"]["collective"]["nbytes"] == rs["local"]["timeline"]["collective_bytes"]
    assert rs["peers"]["timeline"]["collective_bytes"] > 0
    # through the collective (this run's --restore-collective) every process plans from every saving process's
    # manifest: nothing first opened near, nothing widened
    n = rs["local"]["processes"]
    assert sum(rs["local"]["timeline"]["manifests"].values()) == n * n and rs["local"]["timeline"]["widened"] == 0
    assert "manifests opened by holder kind (all processes)" in run["md"].read_text()
    lb = res["loopback"]
    assert lb["tcp"]["gbps"] > 0 and lb["transport"]["gbps"] > 0
    assert math.isclose(lb["transport_over_tcp"], lb["transport"]["gbps"] / lb["tcp"]["gbps"])
    # the ceiling is the faster raw probe: between separate processes (as agents and trainers) or within one
    assert lb["tcp_processes"]["processes"] == 2 * lb["tcp_processes"]["streams"]
    assert lb["tcp"]["gbps"] == max(lb["tcp_processes"]["gbps"], lb["tcp_threads"]["gbps"])
    # the restore's transport rate is over the union of the processes' fetch spans, never a shorter one
    fetched = [k for k in ("local", "peers", "resharded")
               if rs[k]["timeline"]["phases"].get("peer_fetches", {}).get("nbytes")]
    assert fetched, "no restore path fetched over the host transport"
    for key in fetched:
        t = rs[key]["timeline"]
        assert t["transport_span_s"] >= t["phases"]["peer_fetches"]["seconds"] > 0, key
        assert math.isclose(t["transport_gbps"], t["phases"]["peer_fetches"]["nbytes"] / t["transport_span_s"] / 1e9)
    for key in ("local", "peers", "resharded", "persistent", "orbax_standard", "orbax_emergency_dp"):
        assert rs[key]["restore_s"]["n"] >= 1, key
    em = rs["orbax_emergency"]
    assert (em["restore_s"] is None and em["error"]) or em["restore_s"]["n"] >= 1
    q = res["ratios"]
    assert math.isclose(q["orbax_standard_over_peers"],
                        rs["orbax_standard"]["restore_s"]["median"] / rs["peers"]["restore_s"]["median"])
    events = res["recovery"]["events"]
    assert [e["kind"] for e in events] == ["peers", "persistent"]
    peers, persistent = events
    assert peers["lost_node"] != persistent["lost_node"]
    # The restarted job restores the newest step it can still obtain: at least the newest protected step (from
    # peers) or the newest persisted one (every agent's memory gone), never newer than the step trained.
    assert peers["newest_protected_at_kill"] <= peers["restored_step"] <= peers["killed_at_step"]
    assert persistent["newest_persisted_at_kill"] <= persistent["restored_step"] <= persistent["killed_at_step"]
    for e in events:
        parts = e["relaunch_s"] + e["target_s"] + e["create_s"] + e["latest_s"] + e["restore_s"] + e["first_step_s"]
        assert math.isclose(parts, e["recovery_s"])
        # Checkpointer() of the process that finished it last, stage by stage: the stages and the rest add up to it
        slow = e["create_slowest"]
        assert slow["create_s"] >= e["create_s"] - 1e-6  # its own, from its target built (the event's: the last's)
        assert {"import", "protection import", "store", "protection", "own steps", "discover agents",
                "agent clients", "agent listings", "registered listings", "restorable round", "agree held",
                "apply adoption", "persistent", "rest"} <= set(slow["stages"]), slow
        assert list(slow["stages"])[:2] == ["import", "protection import"], slow  # in the order they ran
        assert math.isclose(sum(v["seconds"] for v in slow["stages"].values()), slow["create_s"], rel_tol=1e-6)
        assert {"create", "latest", "restore", "first_step"} <= set(slow["cpu_s"])
        assert [b["process"] for b in e["create_replacement"]] == [e["lost_node"]]  # 1 process per node
    # the machine's bound beside the after-node-loss floor: every relaunched process's CPU summed, and the slowest's
    bound = res["recovery"]["peers"]
    assert bound["cpu_sum_s"]["median"] >= bound["cpu_max_s"]["median"] > 0, bound
    if not res["setup"].get("late_agent"):  # the replacement's agent recovered the node's share; its hello joined it
        rep = peers["create_replacement"][0]
        assert rep["agent_recovery"]["state"] == "done" and rep["recovery_wait_s"] >= 0, rep
    assert res["setup"]["bytecode"]["written"]  # jaxckpt's modules byte-compiled, as an installed package is


def test_markdown_and_plots(run, tmp_path):
    res = run["result"]
    text = run["md"].read_text()
    assert "`Checkpointer()` of each relaunch, stage by stage" in text and "last to finish `Checkpointer()`" in text
    body = cluster.render(res)
    assert body == cluster_report.render(res)
    assert text.startswith("# Benchmarks\n\nbefore\n\n<!-- bench:cluster:begin -->\n") and "\nafter\n" in text
    assert body in text and "\nold\n" not in text and "Quick run" in body
    assert "None" not in body and "nan" not in body
    for words in ("jaxckpt, via peers", "Orbax StandardRestore", "Orbax emergency", "Parity floor",
                  "Restore timeline", "raw TCP", "between 8 processes", "The floor of each restore path",
                  "memory copy floor ms", "Floors (issue 26; `Config.replicas='split'`)", "- agents alive: restore ",
                  "  - where this machine stops it: every process copying the bytes it restores at once (",
                  "  - JAX's own part: making the restored arrays again from host copies of their shards (",
                  "- after a node loss: `Checkpointer()` + restore", "  - where this machine stops it: ", "- kill → first step: jaxckpt's own share",
                  "kill → first step", res["machine"]["loadavg_at_start"]):
        assert words in body, words
    if plots.available():
        made = plots.make_all({"cluster": res}, tmp_path)
        files = [p for _, p in made["cluster"]]
        assert sorted(p.name for p in files) == ["cluster_recovery.png", "cluster_restore.png"]
        assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in files)


def test_a_result_without_the_measured_copies_states_the_computed_floor(run):
    """A result recorded before the local phase measured every process's copy at once renders the computed
    machine floor (the restored bytes at one thread's memcpy rate over the cores) instead."""
    res = copy.deepcopy(run["result"])
    del res["restore"]["local"]["copy_at_once_s"]
    body = cluster_report.render(res)
    assert "  - where this machine stops it: every process's restored bytes (" in body
    assert "copying the bytes it restores at once" not in body
    assert "copying the bytes it restores at once" in cluster_report.render(run["result"])


def test_options_are_checked():
    from jaxckpt import cli
    ns = cli.build_parser().parse_args(["bench", "cluster", "--quick", "--nodes", "1"])
    with pytest.raises(ValueError, match="at least 2 nodes"):
        cluster.options(ns)
    ns = cli.build_parser().parse_args(["bench", "cluster", "--repeats", "0"])
    with pytest.raises(ValueError, match="--repeats must be at least 1"):
        cluster.options(ns)
    assert cluster.options(cli.build_parser().parse_args(["bench", "cluster", "--quick"]))["probe_size"] == 256 << 20
    ns = cli.build_parser().parse_args(["bench", "cluster", "--probe-size", "lots"])
    with pytest.raises(ValueError, match="bad size 'lots'"):
        cluster.options(ns)
    assert cli.main(["bench", "cluster", "--quick", "--nodes", "1"]) == 2
    ns = cli.build_parser().parse_args(["bench", "cluster", "--quick", "--arrays", "0"])
    with pytest.raises(ValueError, match="--arrays must be at least 1"):
        cluster.options(ns)
    ns = cli.build_parser().parse_args(["bench", "cluster", "--quick", "--arrays", "1024"])
    assert cluster.options(ns)["arrays"] == 1024 and "--arrays 1024" in cluster.command(ns)


def test_the_srun_section_is_rendered_from_its_recorded_run():
    """BENCHMARKS.md's `bench cluster --launcher both` section is what its recorded JSON renders (no figure typed
    by hand), and that JSON holds both launchers' whole runs, the srun one on the emulated SLURM cluster."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    doc = report.read_json(os.path.join(root, "docs", "bench", "cluster-launchers.json"))
    assert set(doc["launchers"]) == {"own", "srun"} and doc["slurm"]["emulated"], doc.get("slurm")
    assert doc["launchers"]["srun"]["setup"]["launcher"]["name"] == "srun"
    with open(os.path.join(root, "BENCHMARKS.md")) as f:
        md = f.read()
    begin, end = report.markers("cluster-launchers")
    assert md[md.index(begin) + len(begin):md.index(end)].strip() == cluster_launchers.render(doc).strip()
