"""The soak section of BENCHMARKS.md and its plot, from a ``jaxckpt chaos --profile soak`` report (soak.py).

``--update-md BENCHMARKS.md`` writes the section between ``<!-- bench:soak:begin -->`` and
``<!-- bench:soak:end -->`` (appended if absent), draws ``docs/bench/soak.png`` beside that file and keeps the run's
record (report, command, machine, date) as ``docs/bench/soak.json``, from which ``jaxckpt chaos --from-json``
renders the same section again (and redraws the plot) without running anything.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Mapping

from jaxckpt.tools.bench.report import (fmt_size, machine_facts, machine_line, now_utc, record_dir, record_json,
                                        replace_section, table)
from jaxckpt.tools.chaos.soak import BYTES, ok

SECTION = "soak"
PLOT = "soak.png"
METRICS = ("rss", "rss_anon", "shm_bytes", "shm_files", "fds", "sockets", "threads", "keys")
TITLES = {"rss": "RSS (MiB)", "rss_anon": "private heap, RssAnon (MiB)", "shm_bytes": "agents' tmpfs pages (MiB)",
          "shm_files": "agents' files in shm_dir", "fds": "open fds", "sockets": "sockets", "threads": "threads",
          "keys": "live coordination keys"}
ROLES = ("trainer", "agent", "job")


def command_line(args: argparse.Namespace) -> str:
    """The ``jaxckpt chaos`` command that reproduces a soak of ``args`` (without output options)."""
    parts = ["jaxckpt chaos", f"--profile {args.profile}", f"--seed {args.seed}"]
    if getattr(args, "steps", None) is not None:
        parts.append(f"--steps {args.steps}")
    if args.faults:
        parts.append(f"--faults {args.faults}")
    return " ".join(parts)


def _fmt(metric: str, v: float) -> str:
    if metric in BYTES:
        return ("-" if v < 0 else "") + fmt_size(abs(v))
    return f"{v:.2f}".rstrip("0").rstrip(".") if v != int(v) else str(int(v))


def rows(rep: Mapping[str, Any]) -> list[list[str]]:
    """Per role and metric: series judged, the level range, the steepest slope with its band, the tolerances,
    and how many series grew."""
    out = []
    for role in ROLES:
        for metric in METRICS:
            series = [s for s in rep["series"] if s["role"] == role and s["metric"] == metric]
            fitted = [s for s in series if s.get("judged", bool(s["fit"]))]
            if not series:
                continue
            tol = rep["tolerance"][metric]
            if fitted:
                worst = max(fitted, key=lambda s: s["fit"]["slope"])
                levels = [s["fit"]["level"] for s in fitted]
                level = f"{_fmt(metric, min(levels))} .. {_fmt(metric, max(levels))}"
                slope = f"{_fmt(metric, worst['fit']['slope'])} ± {_fmt(metric, worst['fit']['band'])} " \
                        f"({worst['proc']}, segment {worst['segment']})"
            else:
                level = slope = "-"
            grew = sum(bool(s in fitted and s["fit"]["growth"]) for s in series)
            out.append([role, f"`{metric}`", f"{len(fitted)} of {len(series)}", level, slope,
                        f"{_fmt(metric, tol['per_1000_steps'])} / {_fmt(metric, tol['total'])}",
                        f"**{grew}**" if grew else "0"])
    return out


def render(rep: Mapping[str, Any], command: str, machine: Mapping[str, Any] | None = None,
           date: str | None = None, plot: str | None = PLOT) -> str:
    """The markdown section of a finished soak's report (``SoakRun.run()``)."""
    p, plan, c = rep["profile"], rep["soak"], rep["chaos"]
    kinds = ", ".join(f"`{f['kind']}`" for f in rep["faults"]) or "none"
    fitted, grew = rep.get("judged", rep["fitted"]), len(rep["growing"])
    passed = ok(rep)
    parts = [
        f"### `jaxckpt chaos --profile soak`: {rep['steps_trained']:,} steps, {len(rep['faults'])} faults, "
        f"{'nothing grows' if passed else 'NOT flat'}", "",
        f"Command: `{command}`", "",
        machine_line({"machine": machine or machine_facts(), "date": date or now_utc()}), "",
        f"Job: {p['nodes']} simulated nodes x {p['procs_per_node']} numpy trainer process(es), each node with its own "
        f"agent (`store=\"shm\"`, node memory budget), protection `{p['protection']}`, a snapshot every "
        f"{p['interval']} step(s) of {p['step_time_s'] * 1000:g} ms. {rep['steps_trained']:,} steps trained in "
        f"{len(rep['segments'])} segments (one incarnation each) at {rep['steps_per_s']:g} steps/s, a fault between "
        f"two segments ({kinds}), every restore checked bit for bit. Sampled every {plan['sample_every']} steps; "
        f"each series fitted after the first {plan['warmup_steps']} steps of its segment. Seed {rep['seed']}; the "
        f"run took {rep['seconds'] / 60:.1f} min.", "",
        f"Result: **{grew} of {fitted} judged series grow**; faults: {c['recoveries']} of {c['trials']} recovered "
        f"from, {c['wrong_restores']} wrong restores, {c['hangs']} hangs, {c['unexpected_losses']} unexpected losses"
        + (f"; incidents: {'; '.join(rep['incidents'])}" if rep["incidents"] else "") + ". "
        + ("Every check passed." if passed else "**Not every check passed**" +
           (f" (growing: {', '.join(rep['growing'][:6])}" + (f" and {grew - 6} more" if grew > 6 else "") + ")."
            if rep["growing"] else ".")), "",
        table(["process", "metric", "series judged", "level (median)", "steepest slope per 1,000 steps ± band",
               "tolerance per 1,000 steps / total", "growing"], rows(rep)), "",
    ]
    across = rep.get("across_segments", [])
    if across:
        parts += ["Agents across segments: the steady level (median) of each agent process in each segment it lived "
                  "through; the first is its warm-up, and the last may not exceed the second by more than the total "
                  "tolerance.", "",
                  table(["process", "metric", "segments", "levels", "rise", "growing"],
                        [[a["proc"], f"`{a['metric']}`", ", ".join(map(str, a["segments"])),
                          ", ".join(_fmt(a["metric"], v) for v in a["levels"]), _fmt(a["metric"], a["rise"]),
                          "**yes**" if a["growth"] else "no"] for a in sorted(across, key=lambda a: (
                              a["proc"], METRICS.index(a["metric"]), a["pid"]))]), ""]
    if plot:
        parts += [f"![soak: every sampled series over the run](docs/bench/{plot})", ""]
    parts.append(
        "A series is one metric of one process in one segment (a restarted trainer is a new process; an agent's "
        "series restart with each segment, since what lies between two segments is a fault and a restart; an agent "
        "process's first segment is its warm-up, not judged). Slope: "
        "least squares over the segment's steady part, per 1,000 steps; band: "
        f"{rep['z']:g} standard errors, widened for the residuals' lag-1 autocorrelation. A series grows when its "
        "slope exceeds its band, the tolerance per 1,000 steps, and (times the fitted span) the total tolerance "
        "(jaxckpt/tools/chaos/soak.py states the rule). RSS counts the shared-memory pages a process touched; "
        "RssAnon is its private heap; the agents' tmpfs pages are the allocated blocks of their files.")
    return "\n".join(parts)


def plot(rep: Mapping[str, Any], out: str | Path) -> Path | None:
    """Every sampled series against the step, a panel per metric (``out``/soak.png); None without matplotlib."""
    from jaxckpt.tools.bench import plots

    if not plots.available():
        return None
    plt = plots.pyplot()
    fig, axes = plt.subplots(2, 4, figsize=(16, 7), sharex=True)
    procs = sorted({s["proc"] for s in rep["series"]})
    colours = {name: plt.cm.tab10(i % 10) for i, name in enumerate(procs)}
    for ax, metric in zip(axes.flat, METRICS):
        labelled = set()
        scale = 1 / (1 << 20) if metric in ("rss", "rss_anon", "shm_bytes") else 1
        for s in rep["series"]:
            if s["metric"] != metric:
                continue
            ax.plot(s["steps"], [v * scale for v in s["values"]], color=colours[s["proc"]], lw=0.9,
                    label=None if s["proc"] in labelled else s["proc"])
            labelled.add(s["proc"])
        ax.set_title(TITLES[metric], fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    keys = axes.flat[-1].get_legend_handles_labels()
    fig.legend(handles + keys[0], labels + keys[1], loc="lower center", ncol=len(procs), fontsize=8)
    fig.suptitle(f"jaxckpt chaos --profile soak: {rep['steps_trained']:,} steps, {len(rep['faults'])} faults "
                 f"(a line per process and segment)", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path = Path(out) / PLOT
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def render_record(record: Mapping[str, Any], with_plot: bool = True) -> str:
    """The section of a kept record (``docs/bench/soak.json``); ValueError for another kind of file."""
    if not isinstance(record, Mapping) or record.get("bench") != SECTION or "report" not in record:
        raise ValueError("not a soak record (a JSON object with bench \"soak\" and its report)")
    return render(record["report"], record["command"], record["machine"], record["date"],
                  PLOT if with_plot else None)


def update_md(path: str, rep: Mapping[str, Any], command: str) -> None:
    """Write the soak's section into ``path`` (between its markers), its plot and its record beside it."""
    update_md_from_record(path, {"bench": SECTION, "command": command, "machine": machine_facts(),
                                 "date": now_utc(), "report": dict(rep)})


def update_md_from_record(path: str, record: Mapping[str, Any]) -> None:
    """Write the section of ``record`` into ``path``; draw docs/bench/soak.png and keep docs/bench/soak.json."""
    render_record(record)  # refuses another kind of record before anything is written
    drawn = plot(record["report"], record_dir(path))
    replace_section(path, SECTION, render_record(record, with_plot=drawn is not None))
    record_json(record_dir(path), SECTION, record)
