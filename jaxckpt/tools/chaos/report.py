"""The RELIABILITY section of BENCHMARKS.md, rendered from a ``jaxckpt chaos`` report (jaxckpt/tools/chaos/run.py).

``jaxckpt chaos ... --update-md BENCHMARKS.md`` writes it between ``<!-- bench:chaos:begin -->`` and
``<!-- bench:chaos:end -->`` (jaxckpt.tools.bench.report.replace_section): the machine, date and command, then per
fault kind the trials, recoveries, wrong restores, hangs, relaunches and the steps of work lost per fault
(median and max, against the snapshot interval). It also keeps the run's record (report, command, machine, date)
as ``docs/bench/chaos.json`` beside that file, from which ``jaxckpt chaos --from-json`` renders the same section.
:func:`format_table` is the same report as the fixed-width table ``jaxckpt chaos`` prints.
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any, Mapping

from jaxckpt.tools.bench.report import (machine_facts, machine_line, now_utc, record_dir, record_json,
                                        replace_section, table)

SECTION = "chaos"


def command_line(args: argparse.Namespace) -> str:
    """The ``jaxckpt chaos`` command that reproduces a run of ``args`` (without output options)."""
    parts = ["jaxckpt chaos", f"--profile {args.profile}", f"--seed {args.seed}"]
    for flag, value in (("--trials", args.trials), ("--jax-trials", args.jax_trials),
                        ("--faults", args.faults or None), ("--protection", args.protection)):
        if value is not None:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def _lost(values: list[int]) -> tuple[str, str]:
    if not values:
        return "-", "-"
    return f"{statistics.median(values):g}", str(max(values))


def _relaunches(results: list[Mapping[str, Any]]) -> str:
    """Relaunches, and in brackets those for bad bytes (a record of before that count says nothing there)."""
    n = sum(r["relaunches"] for r in results)
    if not all("relaunches_bad_bytes" in r for r in results):
        return str(n)
    return f"{n} ({sum(r['relaunches_bad_bytes'] for r in results)})"


def render(rep: Mapping[str, Any], command: str, machine: Mapping[str, Any] | None = None,
           date: str | None = None) -> str:
    """The markdown section of a finished run's report (``ChaosRun.run()``)."""
    p = rep["profile"]
    interval = p["interval"]
    by_kind: dict[str, list[Mapping[str, Any]]] = {}
    for r in rep["results"]:
        by_kind.setdefault(r["kind"] + (" (jax)" if r["mode"] == "jax" else ""), []).append(r)
    rows = []
    for kind, rs in sorted(by_kind.items()):
        med, mx = _lost([r["lost"] for r in rs])
        rows.append([f"`{kind}`", str(len(rs)), str(sum(r["recovered"] for r in rs)), str(sum(r["wrong"] for r in rs)),
                     str(sum(r["hang"] for r in rs)), _relaunches(rs),
                     str(sum(r.get("fell_back", 0) for r in rs)), med, mx,
                     str(sum(r["lost"] > interval for r in rs)), str(sum(r["unexpected_loss"] for r in rs))])
    everything = rep["results"]
    med, mx = _lost([r["lost"] for r in everything])
    over = sum(r["lost"] > interval for r in everything)
    rows.append(["**all**", str(rep["trials"]), str(rep["recoveries"]), str(rep["wrong_restores"]), str(rep["hangs"]),
                 _relaunches(everything), str(rep.get("fell_back_in_restore", 0)), med, mx, str(over),
                 str(rep["unexpected_losses"])])
    ok = not (rep["wrong_restores"] or rep["hangs"] or rep["unexpected_losses"]) and rep["recoveries"] == rep["trials"]
    result = {"machine": machine or machine_facts(), "date": date or now_utc()}
    parts = [
        f"### `jaxckpt chaos`: {rep['trials']} seeded faults over a multi-process job on simulated nodes", "",
        f"Command: `{command}`", "",
        machine_line(result), "",
        f"Job: {p['nodes']} simulated nodes x {p['procs_per_node']} numpy trainer process(es), each node with its "
        f"own agent (`store=\"shm\"`, node memory budget), protection `{p['protection']}`, a snapshot every "
        f"{interval} step(s) of {p['step_time_s'] * 1000:g} ms, peer time-out {p['peer_timeout_s']:g} s, peer "
        f"security `{p.get('peer_security', 'auto')}`, every "
        f"driver wait {p['timeout_s']:g} s; plus {rep['jax_trials']} trials of a `jaxckpt.Checkpointer` trainer "
        f"restoring onto another mesh each time. Seed {rep['seed']}; the run took {rep['seconds'] / 60:.1f} min.", "",
        f"Result: **{rep['recoveries']} of {rep['trials']} faults recovered from, {rep['wrong_restores']} wrong "
        f"restores, {rep['hangs']} hangs, {rep['unexpected_losses']} unexpected losses**; work lost per fault: "
        f"median {med} step(s), max {mx} (snapshot interval {interval}; {over} fault(s) lost more than the "
        f"interval). " + ("Every check passed." if ok else "**Not every check passed** (see the table)."), "",
        table(["fault", "trials", "recovered", "wrong restores", "hangs", "relaunches", "fell back in restore",
               "work lost median",
               "work lost max", f"lost > interval ({interval})", "unexpected loss"], rows), "",
        "Work lost = the newest step any process had trained when the job was stopped minus the step the next "
        "incarnation restored (the job is stopped at a random point, so this includes the steps trained since the "
        "last committed snapshot). Relaunches: incarnations that could not restore (a step dropped for bad bytes "
        "with nothing older to fall back to, a process killed in its restore) and were started again; in brackets "
        "those for bad bytes. Fell back in "
        "restore: newer steps a restore passed over for bad bytes inside the same call (jaxckpt.core.fallback), "
        "with no relaunch. A wrong restore is a digest that differs from the "
        "state recomputed outside the system, or processes that restored different steps; a hang is any wait "
        "that ran past its time-out; an unexpected loss is a committed step (or, after a node's memory was lost or "
        "with an agent killed within the restore, a protected step) that the restore did not get back although "
        "the fault did not destroy it.",
    ]
    lag = rep.get("protection_lag") or {}
    if lag.get("steps"):
        parts += ["", f"Protection lag (commit -> protected, {lag['steps']} committed steps): median "
                  f"{lag['median_s'] * 1e3:.0f} ms, p90 {lag['p90_s'] * 1e3:.0f} ms, max {lag['max_s'] * 1e3:.0f} ms "
                  f"from the decision that committed a step until it or a newer step was announced protected on "
                  f"every node (the times the processes recorded, not when their trainers looked); steps committed "
                  f"meanwhile: median {lag['median_steps_behind']}, max {lag['max_steps_behind']}; within one "
                  f"snapshot interval (no more than one newer snapshot committed meanwhile): "
                  f"{lag['within_one_interval']:.0%} of the steps."]
    by = rep.get("protection_lag_by_kind") or {}
    if by:
        rows = [[f"`{kind}`", str(v["steps"]), f"{v['median_s'] * 1e3:.0f}", f"{v['p90_s'] * 1e3:.0f}",
                 f"{v['max_s'] * 1e3:.0f}", f"{v['within_one_interval']:.0%}"] for kind, v in by.items()]
        parts += ["", "By the fault of the trial the steps were committed in (`end`: the last incarnation, which "
                  "only checks the last fault; a peer fault delays, drops or stalls one node's peer traffic for the "
                  "whole trial, and a pull stalled there waits the peer time-out):", "",
                  table(["trial's fault", "steps", "median ms", "p90 ms", "max ms", "within one interval"], rows)]
    return "\n".join(parts)


def update_md(path: str, rep: Mapping[str, Any], command: str) -> None:
    """Write the run's section into ``path`` (only between its markers) and keep its record beside the plots."""
    update_md_from_record(path, {"bench": SECTION, "command": command, "machine": machine_facts(),
                                 "date": now_utc(), "report": dict(rep)})


def render_record(record: Mapping[str, Any]) -> str:
    """The section of a kept record (``docs/bench/chaos.json``); ValueError for another kind of file."""
    if not isinstance(record, Mapping) or record.get("bench") != SECTION or "report" not in record:
        raise ValueError("not a chaos record (a JSON object with bench \"chaos\" and its report)")
    return render(record["report"], record["command"], record["machine"], record["date"])


def update_md_from_record(path: str, record: Mapping[str, Any]) -> None:
    """Write the section of ``record`` into ``path`` and keep the record in ``docs/bench/chaos.json`` beside it."""
    replace_section(path, SECTION, render_record(record))
    record_json(record_dir(path), SECTION, record)


def format_table(rep: dict) -> str:
    """The report as a fixed-width table (the RELIABILITY table of BENCHMARKS.md)."""
    p = rep["profile"]
    head = (f"jaxckpt chaos: seed {rep['seed']}, {rep['trials']} trials ({rep['jax_trials']} with a JAX trainer) "
            f"on {p['nodes']} nodes x {p['procs_per_node']} trainer(s), a snapshot every {p['interval']} "
            f"step(s), protection {p['protection']}, {rep['seconds']} s")
    cols = ("fault", "trials", "recovered", "wrong", "hangs", "relaunches (bad bytes)", "fell back", "lost mean/max",
            "unexpected loss")
    total = {"trials": rep["trials"], "recovered": rep["recoveries"], "wrong": rep["wrong_restores"],
             "hangs": rep["hangs"], "relaunches": rep["relaunches"],
             "relaunches_bad_bytes": rep.get("relaunches_bad_bytes", 0), "fell_back": rep.get("fell_back_in_restore", 0),
             "lost": rep["steps_lost"],
             "max_lost": rep["max_steps_lost"], "unexpected_loss": rep["unexpected_losses"]}
    rows = [(kind, r["trials"], r.get("recovered", 0), r.get("wrong", 0), r.get("hangs", 0),
             f"{r.get('relaunches', 0)} ({r.get('relaunches_bad_bytes', 0)})",
             r.get("fell_back", 0), f"{r.get('lost', 0) / max(1, r['trials']):.1f}/{r.get('max_lost', 0)}",
             r.get("unexpected_loss", 0))
            for kind, r in [*rep["faults"].items(), ("total", total)]]
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]

    def fmt(row: tuple) -> str:
        return "  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(row, widths)))
    lines = [head, fmt(cols), *map(fmt, rows)]
    lines += [f"  (not run: {kind}: {why})" for kind, why in rep["unavailable"].items()]
    lag = rep.get("protection_lag") or {}
    if lag.get("steps"):
        lines.append(f"commit -> protected, {lag['steps']} steps: median {lag['median_s'] * 1e3:.0f} ms, p90 "
                     f"{lag['p90_s'] * 1e3:.0f} ms, max {lag['max_s'] * 1e3:.0f} ms; steps committed meanwhile: "
                     f"median {lag['median_steps_behind']}, max {lag['max_steps_behind']}; within one snapshot "
                     f"interval: {lag['within_one_interval']:.0%}")
    for kind, v in (rep.get("protection_lag_by_kind") or {}).items():
        lines.append(f"  in {kind} trials, {v['steps']} steps: median {v['median_s'] * 1e3:.0f} ms, p90 "
                     f"{v['p90_s'] * 1e3:.0f} ms; within one interval: {v['within_one_interval']:.0%}")
    return "\n".join(lines)
