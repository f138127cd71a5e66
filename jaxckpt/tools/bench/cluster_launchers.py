"""``jaxckpt bench cluster --launcher both``: the whole cluster benchmark with jaxckpt's own launcher, then with
every process an ``srun`` step on a node of a SLURM allocation (``bench cluster``'s measure, handed in), and
their restore and recovery figures side by side, with Orbax's restore from the same runs as the yardstick.

Under ``srun`` a relaunch goes through the controller (a step per process) and the agents are steps of their own,
so recovery includes what SLURM adds; the restore itself reads the same memory either way.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from jaxckpt.tools.bench import report

RESTORES = (("local", "restore, all trainers restarted, agents alive"),
            ("resharded", "restore, resharded onto another process count and mesh"),
            ("peers", "restore after a node loss, via peers (lost chunks rebuilt)"),
            ("persistent", "restore from the persistent tier (every agent's memory gone)"),
            ("orbax_standard", "Orbax StandardRestore, directory on disk, page cache dropped"))
RECOVERIES = (("peers", "recovery after a node loss, from peers (SIGKILL to first step trained)"),
              ("persistent", "recovery after a node loss, from the persistent tier"))


def measure(opts: Mapping[str, Any], cmd: str, *, quick: bool, timeout: float,
            measure_one: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """Both runs of ``measure_one`` (``bench cluster``'s), own launcher first; the result document holds each
    whole, under ``launchers``."""
    runs = {name: measure_one({**opts, "launcher": name}, cmd, quick=quick, timeout=timeout)
            for name in ("own", "srun")}
    own = runs["own"]
    return {"bench": "cluster-launchers", "mode": own["mode"], "machine": own["machine"], "date": own["date"],
            "command": cmd, "setup": own["setup"], "slurm": runs["srun"]["setup"]["launcher"], "launchers": runs}


def _median_ms(entry: Mapping[str, Any] | None, key: str = "restore_s") -> float | None:
    stats = (entry or {}).get(key)
    return stats["median"] * 1e3 if stats else None


def render(result: Mapping[str, Any]) -> str:
    """The BENCHMARKS.md section of a ``bench cluster --launcher both`` result (every number from the JSON)."""
    fn, st, slurm = report.fmt_num, result["setup"], result["slurm"]
    runs = result["launchers"]
    parts = ["### `jaxckpt bench cluster` through `srun` beside jaxckpt's own launcher", ""]
    if result.get("mode") == "quick":
        parts += ["> **Quick run.** A small state and one repeat of each node loss on a shared machine: the "
                  "comparison of the launchers, not the performance.", ""]
    where = "an emulated SLURM cluster (jaxckpt/testing/slurm.py: slurmctld, one `slurmd -N` per node, " \
            "proctrack/cgroup)" if slurm["emulated"] else "the allocation it ran in"
    parts += [f"Command: `{result['command']}`", "", report.machine_line(result), "",
              f"Setup: as `bench cluster` ({st['nodes']} nodes x {st['procs_per_node']} JAX process(es) x "
              f"{st['devices_per_proc']} CPU device(s), {report.fmt_size(st['state_bytes'])} state, policy "
              f"{st['keep_policy']} for restores and recoveries, {st['repeats']} repeat(s), {st['recoveries']} "
              f"node-loss cycle(s)), run twice in one invocation: with jaxckpt's own launcher (simulated nodes, "
              f"agents in their own sessions), then with every process an `srun` step on a node of SLURM job "
              f"{slurm['slurm_job']} on {where} (agents spawned by the trainers as steps of their own; a node's "
              f"loss is its processes SIGKILLed, SLURM ending their steps). Figures: median (min–max) ms; recovery "
              f"in seconds from the SIGKILL to the end of the first step trained after the restore, relaunch "
              f"included.", ""]
    rows = []
    for key, what in RESTORES:
        own, srun = runs["own"]["restore"].get(key), runs["srun"]["restore"].get(key)
        a, b = _median_ms(own), _median_ms(srun)
        rows.append([what, report.fmt_ms(own["restore_s"]) if a is not None else "–",
                     report.fmt_ms(srun["restore_s"]) if b is not None else "–",
                     f"{fn(b / a)}x" if a and b else "–"])
    for key, what in RECOVERIES:
        own, srun = runs["own"]["recovery"].get(key), runs["srun"]["recovery"].get(key)
        cells = []
        for r in (own, srun):
            s = (r or {}).get("recovery_s")
            cells.append(f"{fn(s['median'])} s ({fn(s['min'])}–{fn(s['max'])})" if s else "–")
        a, b = (own or {}).get("recovery_s"), (srun or {}).get("recovery_s")
        rows.append([what, *cells, f"{fn(b['median'] / a['median'])}x" if a and b else "–"])
        for part, label in (("relaunch_s", "relaunch (SIGKILL to the new processes joined, JAX initialized)"),
                            ("restore_s", "restore")):
            x, y = (own or {}).get(part), (srun or {}).get(part)
            rows.append([f"&nbsp;&nbsp;of which {label}", f"{fn(x['median'])} s" if x else "–",
                         f"{fn(y['median'])} s" if y else "–",
                         f"{fn(y['median'] / x['median'])}x" if x and y else "–"])
    parts += [report.table(["figure", "own launcher", "srun (SLURM)", "srun / own"], rows), ""]
    ratios = []
    for name in ("own", "srun"):
        r = runs[name]["ratios"]
        ratios.append(f"{name}: " + ", ".join(f"{k.replace('orbax_standard_over_', '')} "
                                             f"{fn(r[k])}x" for k in ("orbax_standard_over_local",
                                                                     "orbax_standard_over_resharded",
                                                                     "orbax_standard_over_peers",
                                                                     "orbax_standard_over_persistent")
                                             if r.get(k) is not None))
    parts += ["Orbax StandardRestore over jaxckpt's restore, each launcher's own run: " + "; ".join(ratios) + ".",
              ""]
    return "\n".join(parts)
