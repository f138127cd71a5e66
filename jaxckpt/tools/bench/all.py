"""``jaxckpt bench all``: every benchmark in one go, then BENCHMARKS.md sections and PNG plots from their JSON.

Each benchmark runs as its own ``python -m jaxckpt.cli bench NAME --json OUT/NAME.json`` subprocess (a fresh JAX
with the device count that benchmark sets, nothing shared between them), one after another so that none
measures while another loads the machine. Its output goes to ``OUT/NAME.log``. Afterwards every result JSON in
OUT is rendered by that benchmark's own renderer, plots are drawn from the same JSON (matplotlib, the optional
``plots`` extra; without it, tables only, with a logged note), and with ``--update-md`` each section of the
markdown file is replaced between its ``<!-- bench:NAME:begin/end -->`` markers and every JSON it rendered
(``all.json`` included) is kept beside the plots (``docs/bench/`` next to that file, or ``--plots-dir``), since
OUT is not in the repository. ``--render-only`` redoes that last part from an existing OUT without measuring;
``--render-only --out docs/bench --update-md BENCHMARKS.md`` re-renders the recorded sections.

The full run's sizes are those of the recorded sections (``FULL_ARGS``): about 45 minutes on the 2-core, 24 GiB
machine this project runs on (the suite summary records each benchmark's wall time, and warns past
``BUDGET_S``); ``--quick`` runs every benchmark's own
``--quick`` preset, about a minute and a half in all.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from jaxckpt.tools.bench import report, runner

log = logging.getLogger("jaxckpt.tools.bench")

BENCHES = ("parity", "save", "restore", "scaling", "memory", "torch", "stall", "cluster")
# Options of the full run (--quick uses each benchmark's --quick alone). Measured on the 2-core machine
# (2026-12-07, 45 min in all): parity <1 min, save ~12 (its leaf sweep: Orbax saving and restoring 4,096 leaves),
# restore ~2, scaling ~1 (sizes to 4 GiB as memory allows, 2/4/8 processes), memory <1, torch ~1.5, stall ~24
# (a GPT of 0.2 and 1 GB of state on 2 processes, about 1.7 and 6.7 s per step, 10 modes), cluster ~3.5.
FULL_ARGS: dict[str, list[str]] = {
    "parity": [],
    "save": [],
    "restore": [],
    "scaling": ["--max-size", "4G"],
    "memory": [],
    "torch": [],
    "stall": ["--sizes", "0.2G,1G", "--steps", "10", "--warmup", "2"],
    "cluster": [],  # 512 MiB on 4 simulated nodes, every policy, 2 node-loss cycles
}
BUDGET_S = {"full": 50 * 60, "quick": 3 * 60}
TIMEOUT_S = 45 * 60  # one benchmark; a hung one must not hold the suite forever


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``jaxckpt bench all``."""
    p.add_argument("--quick", action="store_true", help="every benchmark's --quick preset (CI size)")
    p.add_argument("--out", default="bench-results", help="directory for the JSON results and logs "
                                                          "(default bench-results/)")
    p.add_argument("--update-md", metavar="PATH", help="rewrite the benchmark sections of this markdown file")
    p.add_argument("--plots-dir", default=None,
                   help="where the PNG plots (and, with --update-md, the JSON of each section) go "
                        "(default: docs/bench next to --update-md, else OUT/plots)")
    p.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(BENCHES)}")
    p.add_argument("--skip", default="", help="comma-separated benchmarks to leave out")
    p.add_argument("--render-only", action="store_true",
                   help="measure nothing: render the sections and plots from the JSON already in OUT")
    p.add_argument("--timeout", type=float, default=TIMEOUT_S, help="limit for each benchmark, in seconds")
    p.add_argument("--bench-args", action="append", default=[], metavar="NAME=OPTIONS",
                   help="more options for benchmark NAME, after its preset (repeatable), e.g. "
                        "'cluster=--restore-collective --plain-dir /scratch'")
    p.set_defaults(run=run)


def selected(args: argparse.Namespace) -> list[str]:
    """The benchmarks to run, in suite order; ValueError naming any unknown one."""
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else list(BENCHES)
    skip = [n.strip() for n in args.skip.split(",") if n.strip()]
    unknown = sorted(set(only + skip) - set(BENCHES))
    if unknown:
        raise ValueError(f"bench all: unknown benchmark(s) {', '.join(unknown)} (known: {', '.join(BENCHES)})")
    names = [n for n in BENCHES if n in only and n not in skip]
    if "torch" in names and importlib.util.find_spec("torch") is None:
        log.warning("bench all: torch is not installed (pip install 'jaxckpt[torch]'): skipping bench torch")
        names.remove("torch")
    if "stall" in names and not all(importlib.util.find_spec(m) for m in ("flax", "optax")):
        log.warning("bench all: flax/optax are not installed (pip install 'jaxckpt[bench]'): skipping bench stall")
        names.remove("stall")
    return names


def bench_args(args: argparse.Namespace) -> dict[str, list[str]]:
    """``--bench-args NAME=OPTIONS`` as {name: options}; ValueError naming a malformed or unknown one."""
    out: dict[str, list[str]] = {}
    for item in getattr(args, "bench_args", None) or []:
        name, sep, options = item.partition("=")
        if not sep or name.strip() not in BENCHES:
            raise ValueError(f"bench all: --bench-args {item!r} is not NAME=OPTIONS with NAME one of "
                             f"{', '.join(BENCHES)}")
        out.setdefault(name.strip(), []).extend(shlex.split(options))
    return out


def command(args: argparse.Namespace) -> str:
    """The command line that repeats this run."""
    words = ["jaxckpt", "bench", "all"] + (["--quick"] if args.quick else []) + ["--out", args.out]
    for flag, key in (("--update-md", "update_md"), ("--plots-dir", "plots_dir"), ("--only", "only")):
        if getattr(args, key):
            words += [flag, str(getattr(args, key))]
    if args.skip:
        words += ["--skip", args.skip]
    for item in getattr(args, "bench_args", None) or []:
        words += ["--bench-args", item]
    return shlex.join(words)


def bench_command(name: str, quick: bool, out: Path, more: list[str] = ()) -> list[str]:
    """The subprocess that runs benchmark ``name`` (with ``more`` options after its preset) and writes
    ``out/name.json``."""
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    extra = ["--quick"] if quick else FULL_ARGS[name]
    return [sys.executable, "-m", "jaxckpt.cli", "--log-level", str(level), "bench", name, *extra,
            "--json", str(out / f"{name}.json"), *more]


def run(args: argparse.Namespace) -> int:
    """``jaxckpt bench all``: run the selected benchmarks, then render sections and plots from OUT."""
    try:
        names = selected(args)
        bench_args(args)
    except ValueError as e:
        log.error("%s", e)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed: list[str] = []
    if not args.render_only:
        failed = measure(names, args, out)
    summary = report.read_json(out / "all.json") if (out / "all.json").exists() else None
    render(out, names, summary, update_md=args.update_md, plots_dir=args.plots_dir)
    if failed:
        log.error("bench all: %d benchmark(s) failed: %s (logs in %s)", len(failed), ", ".join(failed), out)
        return 1
    return 0


def measure(names: list[str], args: argparse.Namespace, out: Path) -> list[str]:
    """Run each benchmark in turn; write ``out/all.json`` (what ran, how long, exit codes); the failed names."""
    mode = "quick" if args.quick else "full"
    runs, failed = [], []
    more = bench_args(args)
    t_all = time.perf_counter()
    for name in names:
        path = out / f"{name}.json"
        if path.exists():
            path.unlink()  # a failed run must not leave an older result to be rendered as this one
        cmd = bench_command(name, args.quick, out, more.get(name, []))
        log.info("bench all: %s: %s", name, shlex.join(cmd))
        t0 = time.perf_counter()
        with open(out / f"{name}.log", "wb") as logf:
            try:
                rc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                    timeout=args.timeout, check=False).returncode
            except subprocess.TimeoutExpired:
                rc = 124  # subprocess.run killed it
        seconds = time.perf_counter() - t0
        ok = rc == 0 and path.exists()
        if not ok:
            failed.append(name)
            tail = (out / f"{name}.log").read_text(errors="replace")[-3000:]
            log.error("bench all: %s failed (exit code %d) after %.0f s; end of %s:\n%s", name, rc, seconds,
                      out / f"{name}.log", tail)
        else:
            log.info("bench all: %s done in %.1f s", name, seconds)
        runs.append({"name": name, "ok": ok, "exit_code": rc, "seconds": seconds,
                     "command": shlex.join(["jaxckpt", *cmd[cmd.index("bench"):]])})
    total = time.perf_counter() - t_all
    if total > BUDGET_S[mode]:
        log.warning("bench all: the %s run took %.0f s, over its %d s budget", mode, total, BUDGET_S[mode])
    report.write_json(out / "all.json", {"bench": "all", "mode": mode, "machine": report.machine_facts(),
                                         "date": report.now_utc(), "command": command(args), "runs": runs,
                                         "total_seconds": total, "budget_seconds": BUDGET_S[mode]})
    return failed


# --------------------------------------------------------------------------------------------------- rendering
def renderers() -> dict[str, Callable[[Mapping[str, Any]], str]]:
    """Each benchmark's markdown renderer (imported lazily: none of them imports jax or torch to render)."""
    from jaxckpt.tools.bench import cluster, memory, parity, restore, save, scaling, stall, torch_dcp
    return {"parity": parity.render, "save": save.render, "restore": restore.render,
            "scaling": scaling.render, "memory": memory.render, "torch": torch_dcp.render_torch,
            "stall": stall.render_stall, "cluster": cluster.render}


def render_result(result: Mapping[str, Any]) -> str:
    """The markdown section of any benchmark's result, chosen by its ``bench`` field."""
    try:
        renderer = renderers()[result["bench"]]
    except KeyError:
        raise ValueError(f"no markdown renderer for bench {result.get('bench')!r} "
                         f"(known: {', '.join(BENCHES)})") from None
    return renderer(result)


def load_results(out: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """The result JSON of each of ``names`` present in ``out``."""
    return {n: report.read_json(out / f"{n}.json") for n in names if (out / f"{n}.json").exists()}


def render(out: Path, names: list[str], summary: Mapping[str, Any] | None, *, update_md: str | None,
           plots_dir: str | None) -> dict[str, str]:
    """Every section (plus the suite summary) from the JSON in ``out``; returns {section: markdown}."""
    results = load_results(out, names)
    md_dir = Path(update_md).resolve().parent if update_md else out.resolve()
    pdir = Path(plots_dir) if plots_dir else (report.record_dir(update_md) if update_md else out / "plots")
    made: dict[str, list[tuple[str, Path]]] = {}
    from jaxckpt.tools.bench import plots
    if not results:
        log.warning("bench all: no results in %s to render", out)
    elif plots.available():
        made = plots.make_all(results, pdir)
    else:
        log.warning("bench all: matplotlib is not installed (pip install 'jaxckpt[plots]'): tables only, no plots")
    sections: dict[str, str] = {}
    render_fn = renderers()
    for name in names:
        if name in results:
            sections[name] = render_fn[name](results[name]).rstrip()
    leftover = []
    for section, items in made.items():
        links = "\n\n".join(f"![{cap}]({os.path.relpath(path.resolve(), md_dir)})" for cap, path in items)
        if section in sections:
            sections[section] += "\n\n" + links
        else:
            leftover.append(links)
    if summary is not None:
        sections["all"] = render_summary(summary, extra="\n\n".join(leftover))
    for name, body in sections.items():
        print(body + "\n")
        if update_md:
            report.replace_section(update_md, name, body)
            report.record_json(pdir, name, summary if name == "all" else results[name])
    return sections


def render_summary(summary: Mapping[str, Any], extra: str = "") -> str:
    """The suite's own section: what ran, how long each benchmark took, and the command."""
    parts = ["### `jaxckpt bench all`: the suite run that produced the sections below", ""]
    if summary.get("mode") == "quick":
        parts += ["> **Quick run.** Every benchmark's `--quick` preset: the shape of each table, not the "
                  "performance.", ""]
    parts += [f"Command: `{summary['command']}`", "", report.machine_line(summary), ""]
    rows = [[f"`{r['name']}`", "ok" if r["ok"] else f"**failed** (exit code {r['exit_code']})",
             report.fmt_num(r["seconds"]), f"`{r['command']}`"] for r in summary["runs"]]
    parts.append(report.table(["benchmark", "result", "wall time s", "command"], rows))
    parts += ["", f"Total: {report.fmt_num(summary['total_seconds'])} s (budget {summary['budget_seconds']} s). "
                  f"Raw results: one JSON per benchmark in the `--out` directory; those of the sections on this "
                  f"page are kept in `docs/bench/` (`jaxckpt bench all --render-only --out docs/bench "
                  f"--update-md BENCHMARKS.md` re-renders them)."]
    if extra:
        parts += ["", extra]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxckpt.tools.bench.all``: the same options as ``jaxckpt bench all``."""
    return runner.main("jaxckpt.tools.bench.all", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
