"""``jaxckpt bench agent``: how long a fresh node agent takes to serve, the wait of a replacement node's first
``Checkpointer()`` (its store spawns the agent and connects once it listens), against a bare interpreter.

Each repeat, in turn (so that the machine's load falls alike on every case):

* agent: ``spawn_agent`` exactly as the shm store calls it, on a new directory; the spawner's wait until the agent
  answers a hello (wall), and the agent's own account of exec -> serving, wall and CPU (its status reply,
  ``daemon.startup_cost``); then it is stopped;
* bare interpreter: ``python -c pass`` with the same interpreter and site, exec -> exit, wall and CPU (the floor
  no Python agent goes under);
* the imports a framework-free agent leaves out, each in its own interpreter, wall and CPU: ``import numpy`` (the
  agent imports it once serving, on a thread of its own: manifests need it) and ``import ml_dtypes`` (only for a dtype name numpy lacks).

CPU is user + system time of the process (getrusage of the reaped child; the agent's from its status), the
figure to trust on a loaded machine. The target is an agent serving within ``TARGET_S`` of its exec.
"""
from __future__ import annotations

import argparse
import logging
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Mapping

from jaxckpt.tools.bench import report, runner

log = logging.getLogger("jaxckpt.tools.bench")

TARGET_S = 0.3
FULL = {"repeats": 15}
QUICK = {"repeats": 3}
IMPORTS = {"bare interpreter": "pass", "import numpy": "import numpy", "import ml_dtypes": "import ml_dtypes"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``jaxckpt bench agent``."""
    p.add_argument("--repeats", type=int, default=None, help=f"agents started (default {FULL['repeats']}, "
                                                             f"--quick {QUICK['repeats']})")
    runner.output_arguments(p, "agent", "few repeats: seconds, for CI")
    p.set_defaults(run=run)


def options(args: argparse.Namespace) -> dict[str, Any]:
    """Effective settings: explicit flags over the --quick or full defaults."""
    out = dict(QUICK if args.quick else FULL, quick=args.quick)
    if args.repeats is not None:
        out["repeats"] = args.repeats
    if out["repeats"] < 1:
        raise ValueError(f"bench agent needs --repeats >= 1 (got {out['repeats']})")
    return out


def command(args: argparse.Namespace) -> str:
    """The command line that repeats this run."""
    return runner.command_line("agent", args, (("--repeats", "repeats"),))


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _interpreter(code: str) -> tuple[float, float]:
    """(wall, CPU) seconds of ``python -c code``, exec to exit."""
    cpu0, t0 = _children_cpu(), time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, stdin=subprocess.DEVNULL)
    return time.perf_counter() - t0, _children_cpu() - cpu0


def _agent(base: str, i: int) -> dict[str, float]:
    """Spawn an agent as the shm store does; the spawner's wait for a hello and the agent's own start-up."""
    from jaxckpt.backends.agent.protocol import AgentConnection, spawn_agent, stop_agent
    from jaxckpt.config import Config
    from jaxckpt.errors import StoreUnavailableError

    job, d = "bench-agent", os.path.join(base, f"node{i}")
    t0 = time.perf_counter()
    p = spawn_agent(Config(job_id=job, shm_dir=d), d, log_path=os.path.join(base, f"agent{i}.log"))
    try:
        deadline = t0 + 60
        while True:
            try:
                conn = AgentConnection(d, timeout_s=30)
                break
            except StoreUnavailableError:
                if p.poll() is not None or time.perf_counter() > deadline:
                    raise RuntimeError(f"the agent in {d} did not serve (exit {p.poll()}); "
                                       f"see {base}/agent{i}.log") from None
                time.sleep(0.001)
        try:
            conn.call("hello", job=job, role="client")
            waited = time.perf_counter() - t0
            st = conn.call("status")
        finally:
            conn.close()
        frameworks = [m for m in ("numpy", "jax", "ml_dtypes", "torch") if m in st["modules_at_serving"]]
        if frameworks:
            raise RuntimeError(f"the agent imported {frameworks} before serving")
    finally:
        stop_agent(d, job)
        rc = p.wait(timeout=60)
    if rc != 0:
        raise RuntimeError(f"the agent in {d} exited with {rc}; see {base}/agent{i}.log")
    return {"waited_s": waited, "serving_s": st["startup"]["serving_s"], "cpu_s": st["startup"]["cpu_s"]}


def measure(opts: Mapping[str, Any], cmd: str) -> dict[str, Any]:
    """Start ``repeats`` agents, interleaved with the interpreters they are compared with."""
    machine = report.machine_facts()
    base = tempfile.mkdtemp(prefix="jaxckpt-bench-agent-", dir=report.agent_root())
    agent: dict[str, list[float]] = {"waited_s": [], "serving_s": [], "cpu_s": []}
    others: dict[str, dict[str, list[float]]] = {k: {"wall_s": [], "cpu_s": []} for k in IMPORTS}
    try:
        for i in range(opts["repeats"]):
            for k, v in _agent(base, i).items():
                agent[k].append(v)
            for name, code in IMPORTS.items():
                wall, cpu = _interpreter(code)
                others[name]["wall_s"].append(wall)
                others[name]["cpu_s"].append(cpu)
            log.info("agent %d: serving %.0f ms after exec (%.0f ms CPU)", i, 1e3 * agent["serving_s"][-1],
                     1e3 * agent["cpu_s"][-1])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    bare = others["bare interpreter"]
    summary = {k: report.summarize(v) for k, v in agent.items()}
    return {"bench": "agent", "mode": "quick" if opts.get("quick") else "full", "machine": machine,
            "date": report.now_utc(), "command": cmd, "setup": {"repeats": opts["repeats"], "target_s": TARGET_S},
            "agent": summary, "interpreters": {k: {m: report.summarize(s) for m, s in v.items()}
                                               for k, v in others.items()},
            "ratios": {"serving_vs_bare_wall": summary["serving_s"]["median"] /
                       report.summarize(bare["wall_s"])["median"],
                       "cpu_vs_bare_cpu": summary["cpu_s"]["median"] / report.summarize(bare["cpu_s"])["median"]}}


def render(result: Mapping[str, Any]) -> str:
    """The BENCHMARKS.md section of a ``bench agent`` result."""
    s, a = result["setup"], result["agent"]
    parts = ["### `jaxckpt bench agent`: a fresh node agent's start-up, against a bare interpreter", ""]
    if result.get("mode") == "quick":
        parts += ["> **Quick run, placeholder until the full run.** Few repeats on a shared machine.", ""]
    parts += [f"Command: `{result['command']}`", "", report.machine_line(result), "",
              f"{s['repeats']} agents spawned as the shm store spawns them (a replacement node's first "
              f"`Checkpointer()` waits for this), each followed by the interpreters below; median (min–max). "
              f"Agent: exec -> serving as the agent measured it (its status reply), and the spawner's wait for "
              f"its hello reply. Interpreters: exec -> exit. CPU = user + system time, the figure to read on a "
              f"loaded machine. Target: serving within {s['target_s'] * 1e3:.0f} ms of exec.", ""]
    rows = [["agent: exec -> serving", report.fmt_ms(a["serving_s"]), report.fmt_ms(a["cpu_s"])],
            ["agent: spawner's wait for a hello", report.fmt_ms(a["waited_s"]), "–"]]
    for name, v in result["interpreters"].items():
        rows.append([f"`python -c` {name}", report.fmt_ms(v["wall_s"]), report.fmt_ms(v["cpu_s"])])
    parts.append(report.table(["what", "wall ms", "CPU ms"], rows))
    r = result["ratios"]
    met = "yes" if a["serving_s"]["median"] <= s["target_s"] else "**no**"
    parts += ["", f"Agent / bare interpreter: {report.fmt_num(r['serving_vs_bare_wall'])}x wall, "
                  f"{report.fmt_num(r['cpu_vs_bare_cpu'])}x CPU. Serving within {s['target_s'] * 1e3:.0f} ms "
                  f"(median): {met}."]
    return "\n".join(parts)


def run(args: argparse.Namespace) -> int:
    """``jaxckpt bench agent``: measure (or render ``--from-json``), write JSON, print and update the section."""
    return runner.run(args, "agent", options, lambda a, o: measure(o, command(a)), render)


if __name__ == "__main__":
    sys.exit(runner.main(__name__, __doc__, add_arguments, run))
