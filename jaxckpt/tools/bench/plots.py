"""PNG plots of benchmark results, drawn from the result JSON only (matplotlib, the optional ``plots`` extra).

Each function takes the result documents by bench name (what ``jaxckpt bench all`` wrote) and an output
directory, draws one figure if the results it needs are there, and returns the file written (or None). Which
section of BENCHMARKS.md embeds which plot is :data:`PLOTS`'s business. matplotlib is imported only here, with
the non-interactive Agg backend, so nothing else in jaxckpt needs it.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Mapping

log = logging.getLogger("jaxckpt.tools.bench")

Results = Mapping[str, Mapping[str, Any]]


def available() -> bool:
    """True if matplotlib can be imported (``pip install 'jaxckpt[plots]'``)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def pyplot() -> Any:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _mib(nbytes: float) -> float:
    return nbytes / (1 << 20)


def _errs(stats: list[Mapping[str, float]], scale: float) -> tuple[list[float], list[list[float]]]:
    """Medians and (median - min, max - median) error bars of summaries, times ``scale``."""
    med = [s["median"] * scale for s in stats]
    return med, [[m - s["min"] * scale for s, m in zip(stats, med)], [s["max"] * scale - m for s, m in zip(stats, med)]]


def _size_axis(ax: Any, sizes: list[float]) -> None:
    """A log2 x axis of state sizes in MiB, ticked at the measured sizes and labelled in binary units."""
    from matplotlib.ticker import NullLocator

    from jaxckpt.tools.bench.report import fmt_size
    ticks = sorted(set(sizes))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [fmt_size(t * (1 << 20)) for t in ticks], fontsize=8)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("state size")


def _finish(fig: Any, ax: Any, path: Path, title: str, subtitle: str) -> Path:
    ax.set_title(title + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    log.info("wrote %s", path)
    return path


def _subtitle(result: Mapping[str, Any]) -> str:
    m = result["machine"]
    quick = " (quick run)" if result.get("mode") == "quick" else ""
    return f"{m['cores']} cores, {result['date'][:10]}{quick}"


def save_call_vs_size(results: Results, out: Path) -> Path | None:
    """save() call time vs state size: jaxckpt (bench save and bench scaling) and Orbax (bench save)."""
    save, scaling = results.get("save"), results.get("scaling")
    if not save and not (scaling and scaling["by_size"]):
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    sizes: list[float] = []
    if save:
        rows = save["results"]
        x = [_mib(r["size_bytes"]) for r in rows]
        sizes += x
        for who, label, fmt in (("jaxckpt", "jaxckpt save() (bench save)", "o-"),
                                ("orbax", "Orbax AsyncCheckpointer save() (bench save)", "s-")):
            y, e = _errs([r[who]["save_call_s"] for r in rows], 1e3)
            ax.errorbar(x, y, yerr=e, fmt=fmt, capsize=3, label=label)
    if scaling and scaling["by_size"]:
        rows = scaling["by_size"]
        x = [_mib(r["size_bytes"]) for r in rows]
        sizes += x
        y, e = _errs([r["save_call_s"] for r in rows], 1e3)
        ax.errorbar(x, y, yerr=e, fmt="^--", capsize=3, label="jaxckpt save() (bench scaling)")
    _size_axis(ax, sizes)
    ax.set_yscale("log")
    ax.set_ylabel("save() call time (ms), median, min–max")
    return _finish(fig, ax, out / "save_call_vs_size.png", "save() call time vs state size",
                   _subtitle(save or scaling))


def snapshot_throughput(results: Results, out: Path) -> Path | None:
    """Snapshot throughput vs state size, with the machine's memcpy bandwidth of the same run."""
    scaling, save = results.get("scaling"), results.get("save")
    src = scaling if scaling and scaling["by_size"] else save
    if not src:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    sizes: list[float] = []
    for res, fmt in ((scaling, "o-"), (save, "s--")):
        if not res:
            continue
        rows = res["by_size"] if res is scaling else res["results"]
        x = [_mib(r["size_bytes"]) for r in rows]
        sizes += x
        gbps = [r["snapshot_gbps"] if res is scaling else r["jaxckpt"]["snapshot_gbps"] for r in rows]
        ax.plot(x, gbps, fmt, label=f"jaxckpt snapshot (save() until wait()), bench {res['bench']}")
    mc = src["memcpy_gbps_stats"]
    ax.axhline(mc["median"], color="gray", linestyle="--", label=f"memcpy, one thread (bench {src['bench']})")
    ax.axhspan(mc["min"], mc["max"], color="gray", alpha=0.15)
    ax.axhline(0.6 * mc["median"], color="red", linestyle=":", label="60% of memcpy (issue 3 floor)")
    _size_axis(ax, sizes)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("GB/s (1e9 bytes per second)")
    return _finish(fig, ax, out / "snapshot_throughput.png", "Snapshot throughput vs memcpy", _subtitle(src))


def restore_time(results: Results, out: Path) -> Path | None:
    """Restore time per source and state size (grouped bars, log scale)."""
    res = results.get("restore")
    if not res or not res["results"]:
        return None
    plt = pyplot()
    rows = res["results"]
    series = (("memory (same process)", lambda r: r["memory"]["restore_s"]),
              ("shm, fresh process (first)", lambda r: r["restore"]["shm"]["restore_first_s"]),
              ("shm, fresh process (later)", lambda r: r["restore"]["shm"]["restore_s"]),
              ("Orbax tmpfs (first)", lambda r: r["restore"]["orbax_tmpfs"]["restore_first_s"]),
              ("Orbax plain dir, cold (first)", lambda r: r["restore"]["orbax_plain"]["restore_first_s"]))
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    width = 0.8 / len(series)
    for k, (label, get) in enumerate(series):
        y, e = _errs([get(r) for r in rows], 1e3)
        ax.bar([i + (k - (len(series) - 1) / 2) * width for i in range(len(rows))], y, width, yerr=e, capsize=2,
               label=label)
    from jaxckpt.tools.bench.report import fmt_size
    ax.set_xticks(range(len(rows)), [fmt_size(r["size_bytes"]) for r in rows])
    ax.set_yscale("log")
    ax.set_xlabel("state size")
    ax.set_ylabel("restore time (ms), median, min–max")
    return _finish(fig, ax, out / "restore_time.png", "Restore time: jaxckpt memory / node agent vs Orbax",
                   _subtitle(res))


def scaling_procs(results: Results, out: Path) -> Path | None:
    """Per-process save() and snapshot time, and aggregate throughput, vs number of processes."""
    sc = results.get("scaling")
    if not sc or not sc["by_procs"]:
        return None
    plt = pyplot()
    rows = sc["by_procs"]
    x = [r["procs"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, label, fmt in (("save_call_s", "save() per process", "o-"),
                            ("snapshot_s", "snapshot per process", "s-"),
                            ("snapshot_worker_s", "local copy per process", "^-")):
        y, e = _errs([r[key] for r in rows], 1e3)
        ax.errorbar(x, y, yerr=e, fmt=fmt, capsize=3, label=label + " (ms)")
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xlabel(f"processes ({_mib(sc['setup']['bytes_per_proc']):g} MiB each, 1 CPU device each)")
    ax.set_ylabel("ms: median across processes, min–max")
    ax2 = ax.twinx()
    ax2.plot(x, [r["aggregate_gbps"] for r in rows], "k--", label="aggregate GB/s (right)")
    ax2.set_ylabel("aggregate GB/s")
    ax2.set_ylim(bottom=0)
    ax2.legend(fontsize=8, loc="lower right")
    return _finish(fig, ax, out / "scaling_procs.png", "Per-process cost vs number of processes", _subtitle(sc))


# (file name, section of BENCHMARKS.md that embeds it, caption, function)
def cluster_restore(results: Results, out: Path) -> Path | None:
    """Restore time per path on simulated nodes (bench cluster), jaxckpt vs Orbax, log scale; failures marked."""
    res = results.get("cluster")
    if not res:
        return None
    from jaxckpt.tools.bench.report import fmt_size
    short = {"local": "local", "peers": "peers\n(node lost)", "resharded": "resharded\n(other mesh)",
             "persistent": "persistent\ntier", "orbax_standard": "Orbax Standard\n(disk, cold)",
             "orbax_emergency": "Orbax\nemergency", "orbax_emergency_dp": "Orbax emergency\n(dp half only)"}
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    keys, labelled = list(short), set()
    for i, key in enumerate(keys):
        r = res["restore"][key]
        if r.get("restore_s") is None:
            ax.text(i, 0.03, "failed", ha="center", va="bottom", rotation=90, fontsize=9, color="red",
                    transform=ax.get_xaxis_transform())
            continue
        y, e = _errs([r["restore_s"]], 1e3)
        who = "Orbax" if key.startswith("orbax") else "jaxckpt"
        ax.bar([i], y, 0.6, yerr=e, capsize=3, color="C1" if who == "Orbax" else "C0",
               label=None if who in labelled else who)
        labelled.add(who)
    ax.set_xticks(range(len(keys)), [short[k] for k in keys], fontsize=7.5)
    ax.set_yscale("log")
    ax.set_ylabel("restore time (ms), median, min–max")
    title = f"Restore on {res['setup']['nodes']} simulated nodes, {fmt_size(res['setup']['state_bytes'])} state"
    return _finish(fig, ax, out / "cluster_restore.png", title, _subtitle(res))


def cluster_recovery(results: Results, out: Path) -> Path | None:
    """Kill-to-first-step time after a node loss, split into its stages: from peers vs the persistent tier."""
    res = results.get("cluster")
    if not res:
        return None
    plt = pyplot()
    rec = res["recovery"]
    kinds = [("peers", "jaxckpt:\nrestore from peers"), ("persistent", "restart from the\npersistent tier")]
    stages = [("relaunch_s", "relaunch (start, JAX init)"), ("target_s", "the script's target"),
              ("create_s", "Checkpointer()"), ("latest_s", "latest_step()"),
              ("restore_s", "restore"), ("first_step_s", "first step (compile)")]
    stages = [(k, label) for k, label in stages if all(k in rec[kind] for kind, _ in kinds)]  # older results
    fig, ax = plt.subplots(figsize=(7, 4.2))
    bottom = [0.0] * len(kinds)
    for k, (key, label) in enumerate(stages):
        y = [rec[kind][key]["median"] for kind, _ in kinds]
        ax.bar(range(len(kinds)), y, 0.5, bottom=bottom, label=label, color=f"C{k}")
        bottom = [b + v for b, v in zip(bottom, y)]
    _, err = _errs([rec[kind]["recovery_s"] for kind, _ in kinds], 1.0)
    ax.errorbar(range(len(kinds)), [rec[kind]["recovery_s"]["median"] for kind, _ in kinds], yerr=err, fmt="k.",
                capsize=4, label="kill → first step (median, min–max)")
    ax.set_xticks(range(len(kinds)), [label for _, label in kinds])
    ax.set_xlim(-0.5, len(kinds) + 0.7)  # room on the right for the legend
    ax.set_ylabel("seconds after the SIGKILL of a node")
    return _finish(fig, ax, out / "cluster_recovery.png", "Recovery after a node loss: kill to first step trained",
                   _subtitle(res))


PLOTS: tuple[tuple[str, str, str, Callable[[Results, Path], Path | None]], ...] = (
    ("save_call_vs_size.png", "save", "save() call time vs state size, jaxckpt vs Orbax", save_call_vs_size),
    ("snapshot_throughput.png", "scaling", "snapshot throughput vs memcpy", snapshot_throughput),
    ("restore_time.png", "restore", "restore time by source", restore_time),
    ("scaling_procs.png", "scaling", "per-process cost vs processes", scaling_procs),
    ("cluster_restore.png", "cluster", "restore time per path on simulated nodes, vs Orbax", cluster_restore),
    ("cluster_recovery.png", "cluster", "recovery time after a node loss, by stage", cluster_recovery),
)


def make_all(results: Results, out: str | Path) -> dict[str, list[tuple[str, Path]]]:
    """Draw every plot the results allow into ``out``; {section: [(caption, path), ...]}."""
    out = Path(out)
    made: dict[str, list[tuple[str, Path]]] = {}
    for _, section, caption, fn in PLOTS:
        path = fn(results, out)
        if path is not None:
            made.setdefault(section, []).append((caption, path))
    return made
