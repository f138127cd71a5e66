"""``jaxckpt ls`` and ``jaxckpt inspect STEP``: what a node agent holds, as human tables or ``--json``.

Both ask the node agents named by ``--dir`` (repeatable, one per node) or the job's default agent (``--job``,
``JAXCKPT_JOB_ID``/``JAXCKPT_SHM_DIR``), and never start one. ``ls`` lists every slot per process: step,
state, bytes, age, pins and ``protected``: ``yes`` once that process's protection data of the step (parity it
computed, copies or parity it holds for other nodes, the plan and manifests) is committed on this node, the
node's part of the step's redundancy (jaxckpt.protection.runtime); protection slots themselves are listed as
``P (protection)``. ``inspect`` decodes the
step's manifests: arrays, shapes, dtypes, shardings and every chunk's box, offset, size and crc32c.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from jaxckpt.backends.agent.capacity import fmt_bytes
from jaxckpt.core import manifest as mf
from jaxckpt.config import Config
from jaxckpt.errors import JaxckptError


def directories(args: argparse.Namespace) -> list[str]:
    """The agent directories ``args`` names: every ``--dir``, else the job's default (``--job``/env)."""
    from jaxckpt.backends.agent.protocol import agent_dir

    config = Config().with_env()
    if args.job:
        config = config.replace(job_id=args.job)
    return [os.path.abspath(d) for d in args.dir] if args.dir else [agent_dir(config)]


def _connect(args: argparse.Namespace, directory: str):
    from jaxckpt.backends.agent.protocol import AgentConnection

    conn = AgentConnection(directory, timeout_s=30.0)
    try:
        conn.call("hello", job=args.job or None, role="client")
    except BaseException:
        conn.close()
        raise
    return conn


def status(args: argparse.Namespace, directory: str) -> dict:
    """The status reply of the agent in ``directory``."""
    conn = _connect(args, directory)
    try:
        return conn.call("status")
    finally:
        conn.close()


def manifests(args: argparse.Namespace, directory: str, step: int) -> list[dict]:
    """The decoded manifests of ``step`` on one node (one per process holding it), as plain dicts."""
    conn = _connect(args, directory)
    try:
        st = conn.call("status")
        procs = sorted({s["process"] for s in st["slots"] if s["step"] == step and s["state"] == "committed"})
        if args.process is not None:
            procs = [p for p in procs if p == args.process]
        out = []
        for p in procs:
            r = conn.call("manifest", process=p, step=step)
            if r["found"]:
                m = mf.decode(r["manifest"], source=f"step {step} manifest of process {p}")
                out.append(_manifest_dict(m, st))
        return out
    finally:
        conn.close()


def _manifest_dict(m: mf.Manifest, st: dict) -> dict:
    return {"step": m.step, "process": m.process, "process_count": m.process_count, "framework": m.framework,
            "nbytes": m.nbytes, "layout": m.layout, "created": m.created, "node": st["node"],
            "arrays": [{"path": a.path, "shape": list(a.shape), "dtype": a.dtype, "kind": a.kind,
                        "sharding": a.sharding,
                        "chunks": [{"start": list(c.box.start), "stop": list(c.box.stop), "offset": c.offset,
                                    "nbytes": c.nbytes, "crc32c": f"{c.crc32c:08x}", "process": c.process}
                                   for c in a.chunks]} for a in m.arrays],
            "leaves": [{"path": x.path, "value": _jsonable(x.value)} for x in m.leaves]}


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes):
        return {"bytes_hex": v.hex()}
    return v


def human_age(s: float) -> str:
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{s / 60:.1f}m"
    return f"{s / 3600:.1f}h"


def table(rows: list[list[str]], header: list[str]) -> str:
    """Left-aligned text columns."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*map(str, r)).rstrip() for r in [header, *rows])


def _trainers(st: dict) -> str:
    return ", ".join(f"{p} (pid {pid})" for p, pid in sorted(st["trainers"].items(), key=lambda kv: int(kv[0]))) \
        or "none"


def mark_protected(st: dict) -> dict:
    """Set ``protected`` on every slot of an agent status: yes/no for snapshots, ``-`` for protection slots."""
    from jaxckpt.protection.slot import PROTECT_BASE

    have = {(s["process"] - PROTECT_BASE, s["step"]) for s in st["slots"]
            if s["process"] >= PROTECT_BASE and s["state"] == "committed"}
    for s in st["slots"]:
        s["protected"] = "-" if s["process"] >= PROTECT_BASE else \
            ("yes" if (s["process"], s["step"]) in have else "no")
    return st


def _process_label(p: int) -> str:
    from jaxckpt.protection.slot import PROTECT_BASE
    return f"{p - PROTECT_BASE} (protection)" if p >= PROTECT_BASE else str(p)


def format_status(st: dict) -> str:
    head = (f"job {st['job']}  node {st['node']}  agent pid {st['pid']} (up {human_age(st['now'] - st['started'])})"
            f"  {st['dir']}\nheld {fmt_bytes(st['held_bytes'])} (+ {fmt_bytes(st['metadata_bytes'])} "
            f"metadata), node budget {fmt_bytes(st['node_budget']) if st['node_budget'] else 'none'}, "
            f"trainers connected: {_trainers(st)}, protection bytes pulled from other nodes: "
            f"{fmt_bytes(st.get('pulled_bytes', 0))}")
    g = st.get("memory_cgroup")
    if g:  # the limit a save past which the agent refuses (its snapshots' pages are charged there)
        head += (f"\nmemory cgroup {g['path']}: limit {fmt_bytes(g['limit'])}, {fmt_bytes(g['used'])} in use, "
                 f"{fmt_bytes(g['free'])} more for snapshots")
    mark_protected(st)
    rows = [[_process_label(s["process"]), s["step"], s["state"], fmt_bytes(s["nbytes"]), human_age(s["age_s"]),
             s["pins"], s["protected"]] for s in st["slots"]]
    pooled = "".join(f"\npooled segments of process {p}: {fmt_bytes(n)}" for p, n in sorted(st["pooled"].items()))
    body = table(rows, ["process", "step", "state", "bytes", "age", "pins", "protected"]) if rows else "no snapshots"
    return f"{head}\n{body}{pooled}"


def format_manifest(m: dict) -> str:
    out = [f"step {m['step']} of process {m['process']}/{m['process_count']} on node {m['node']}: framework "
           f"{m['framework']}, {fmt_bytes(m['nbytes'])}, layout {m['layout']}, saved "
           f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(m['created']))}"]
    rows = [[a["path"], tuple(a["shape"]), a["dtype"], a["kind"], a["sharding"] or "-", len(a["chunks"])]
            for a in m["arrays"]]
    out.append(table(rows, ["array", "shape", "dtype", "kind", "sharding", "chunks"]))
    crows = [[a["path"], " ".join(f"{lo}:{hi}" for lo, hi in zip(c["start"], c["stop"])) or "()", c["offset"],
              c["nbytes"], c["crc32c"]] for a in m["arrays"] for c in a["chunks"]]
    if crows:
        out.append(table(crows, ["chunk of", "box", "offset", "bytes", "crc32c"]))
    if m["leaves"]:
        out.append(table([[x["path"], repr(x["value"])] for x in m["leaves"]], ["leaf", "value"]))
    return "\n\n".join(out)


# --------------------------------------------------------------------------------------------------------- CLI
def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", default="", help="job id (default: JAXCKPT_JOB_ID or 'default'); checked by the agent")
    p.add_argument("--dir", action="append", default=[],
                   help="an agent directory, one per node (repeatable; default: JAXCKPT_SHM_DIR or the job's)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def add_ls_arguments(p: argparse.ArgumentParser) -> None:
    """``jaxckpt ls [--job ID] [--dir DIR] [--json]``."""
    _common(p)
    p.set_defaults(run=run_ls)


def add_inspect_arguments(p: argparse.ArgumentParser) -> None:
    """``jaxckpt inspect STEP [--process P] [--job ID] [--dir DIR] [--json]``."""
    p.add_argument("step", type=int)
    p.add_argument("--process", type=int, default=None, help="only this process's manifest")
    _common(p)
    p.set_defaults(run=run_inspect)


def run_ls(args: argparse.Namespace) -> int:
    out, rc = [], 0
    for d in directories(args):
        try:
            out.append(status(args, d))
        except JaxckptError as e:
            print(f"jaxckpt ls: {d}: {e}", file=sys.stderr)
            rc = 1
    if args.json:
        print(json.dumps([mark_protected(st) for st in out], indent=2, sort_keys=True))
    elif out:
        print("\n\n".join(format_status(st) for st in out))
    return rc


def run_inspect(args: argparse.Namespace) -> int:
    ms, rc = [], 0
    for d in directories(args):
        try:
            ms += manifests(args, d, args.step)
        except JaxckptError as e:
            print(f"jaxckpt inspect: {d}: {e}", file=sys.stderr)
            rc = 1
    if not ms:
        print(f"jaxckpt inspect: step {args.step} is not committed on "
              f"{'these nodes' if len(args.dir) > 1 else 'this node'}"
              + (f" for process {args.process}" if args.process is not None else ""), file=sys.stderr)
        return 1
    print(json.dumps(ms, indent=2) if args.json else "\n\n".join(format_manifest(m) for m in ms))
    return rc
