"""Benchmark results: machine facts, summary statistics, JSON files, and BENCHMARKS.md sections rendered from them.

Every number in BENCHMARKS.md comes from a results JSON through ``render``; a section of the file lives between
``<!-- bench:NAME:begin -->`` and ``<!-- bench:NAME:end -->`` and ``replace_section`` rewrites only that part.
A recorded run (``--update-md``) also keeps its JSON beside the plots (``record_json``, in ``docs/bench/`` next to
the markdown file), so every section can be re-rendered from the repository alone.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import logging
import math
import os
import platform
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

log = logging.getLogger("jaxckpt.tools.bench")

PACKAGES = ("jaxckpt", "jax", "jaxlib", "orbax-checkpoint", "numpy")


# ------------------------------------------------------------------------------------------------ facts
def machine_facts() -> dict[str, Any]:
    """Cores, memory, CPU model, OS and library versions of this machine, for the header of every table."""
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "unknown"
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count() or 1,
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "os": f"{platform.system()} {platform.release()}",
        # A string, not a number: a load of 0.00 is a fact, and result numbers are checked to be positive.
        "loadavg_at_start": load,
        "versions": versions,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def available_memory_bytes() -> int:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping), or physical memory if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fs_type(path: str | os.PathLike) -> str:
    """The file system type of the mount holding ``path`` (e.g. 'tmpfs', 'ext4'), from /proc/mounts."""
    target = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3:
                mnt = parts[1].replace("\\040", " ")
                inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def now_utc() -> str:
    """The date and time of a run, ISO 8601 in UTC."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median and spread (min, max, p10, p90) of timing samples, plus their count."""
    a = np.asarray(samples, dtype=np.float64)
    if a.size == 0:
        raise ValueError("summarize: no samples")
    return {"median": float(np.median(a)), "min": float(a.min()), "max": float(a.max()),
            "p10": float(np.percentile(a, 10)), "p90": float(np.percentile(a, 90)), "n": int(a.size)}


# ------------------------------------------------------------------------------------------------- JSON
def write_json(path: str | os.PathLike, result: Mapping[str, Any]) -> Path:
    """Write ``result`` as indented JSON (refusing NaN/inf, which JSON cannot carry) and return the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    tmp.replace(p)
    log.info("wrote %s", p)
    return p


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """A results file written by ``write_json``."""
    return json.loads(Path(path).read_text())


def numbers(obj: Any, prefix: str = "") -> list[tuple[str, float]]:
    """Every (path, number) in a JSON-like object, booleans excluded: what checks of "finite and positive" walk."""
    out: list[tuple[str, float]] = []
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            out += numbers(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out += numbers(v, f"{prefix}/{i}")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out.append((prefix, float(obj)))
    return out


# --------------------------------------------------------------------------------------------- markdown
def fmt_size(nbytes: float) -> str:
    """Binary units: 16 MiB, 1 GiB, 256 KiB."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            v = nbytes / (1 << shift)
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(nbytes)} B"


def fmt_num(v: float) -> str:
    """About three significant digits without exponents."""
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 0.1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def fmt_ms(stats: Mapping[str, float]) -> str:
    """'median (min-max)' of a seconds summary, in milliseconds."""
    return f"{fmt_num(stats['median'] * 1e3)} ({fmt_num(stats['min'] * 1e3)}–{fmt_num(stats['max'] * 1e3)})"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def agent_root(explicit: str = "") -> str:
    """Where a bench makes its node agents' directories: ``explicit`` (a ``--shm-root``), else what a job's
    default ``Config`` takes (``JAXCKPT_SHM_ROOT``, /dev/shm), by the agent's own rule
    (``backends/agent/protocol.shm_base``), so a bench measures the memory its users' agents get."""
    from jaxckpt.backends.agent.protocol import shm_base
    from jaxckpt.config import Config

    return shm_base(Config(shm_root=explicit) if explicit else Config().with_env())


def tmpfs_dir(prefix: str, who: str) -> str:
    """A fresh directory on tmpfs (/dev/shm) for a framework's files (``who`` writes there), so that Orbax and
    DCP are measured from memory as jaxckpt is; the temp directory, with a warning, where /dev/shm is not
    writable."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    if base is None:
        log.warning("/dev/shm is not writable; %s writes to %s instead", who, tempfile.gettempdir())
    return tempfile.mkdtemp(prefix=prefix, dir=base)


def machine_line(result: Mapping[str, Any]) -> str:
    """One line naming the machine, versions, date and the measured memcpy limit."""
    m = result["machine"]
    v = m["versions"]
    vers = ", ".join(f"{k} {v[k]}" for k in (*PACKAGES, "python") if k in v)
    line = (f"Machine: {m['cores']} cores ({m['cpu_model']}), {fmt_size(m['memory_bytes'])} memory, {m['os']}, "
            f"load at start {m['loadavg_at_start']}. ")
    if "memcpy_gbps" in result:
        line += f"memcpy {fmt_num(result['memcpy_gbps'])} GB/s (numpy copy, one thread, median). "
    return line + f"Versions: {vers}. Date: {result['date']}."


def markers(name: str) -> tuple[str, str]:
    """The begin and end markers of section ``name`` in BENCHMARKS.md."""
    return f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"


def replace_section(path: str | os.PathLike, name: str, body: str) -> Path:
    """Put ``body`` between the markers of section ``name`` in ``path``, appending the section if absent.

    Text outside the markers is kept as it is. A file with only one of the two markers is refused (ValueError)
    rather than guessed at.
    """
    p = Path(path)
    begin, end = markers(name)
    block = f"{begin}\n{body.rstrip()}\n{end}"
    text = p.read_text() if p.exists() else ""
    nb, ne = text.count(begin), text.count(end)
    if (nb, ne) == (0, 0):
        text = (text.rstrip() + "\n\n" if text.strip() else "") + block + "\n"
    elif (nb, ne) == (1, 1) and text.index(begin) < text.index(end):
        i, k = text.index(begin), text.index(end) + len(end)
        text = text[:i] + block + text[k:]
    else:
        raise ValueError(f"{p}: section {name!r} needs exactly one {begin} followed by one {end} "
                         f"(found {nb} begin, {ne} end)")
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(p)
    log.info("updated section %r of %s", name, p)
    return p


def record_dir(md_path: str | os.PathLike) -> Path:
    """Where a recorded run keeps its JSON and plots: ``docs/bench`` next to the markdown file it updates."""
    return Path(md_path).resolve().parent / "docs" / "bench"


def record_json(directory: str | os.PathLike, name: str, result: Mapping[str, Any]) -> Path:
    """Keep the result a section was rendered from as ``directory/NAME.json`` (the raw ``--out``/``--json`` files
    are not in the repository); a file that already holds ``result`` is left as it is."""
    p = Path(directory) / f"{name}.json"
    try:
        if p.exists() and read_json(p) == json.loads(json.dumps(result, allow_nan=False)):
            return p
    except ValueError:  # not JSON (a partial write): replaced below
        pass
    return write_json(p, result)
