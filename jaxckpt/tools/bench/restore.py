"""``jaxckpt bench restore``: restore time of one state from jaxckpt's memory, from the node agent's shared memory
in a fresh process, and from Orbax checkpoints on tmpfs and on a plain directory, all in the same run.

For each state size (the state of ``jaxckpt bench save``: 8 float32 arrays over a 2x4 mesh of 8 CPU devices):

1. a saver process builds the state and measures jaxckpt ``save()`` call and snapshot time with
   ``store="memory"`` (then restores from it in the same process: the in-process, local-memory restore) and with
   ``store="shm"`` (the node agent's shared memory); it writes the same state with Orbax ``StandardSave`` to a
   directory under /dev/shm (tmpfs) and to a plain directory (``--plain-dir``, on disk), then exits: its
   snapshots stay with the agent;
2. ``--restorers`` fresh processes each restore the newest step from the agent (``store="shm"``), and the Orbax
   checkpoints with ``StandardRestore`` onto the same shardings, round-robin, ``--repeats`` times per source.
   Before every restore from the plain directory its files are dropped from the page cache (``fsync`` +
   ``POSIX_FADV_DONTNEED``, no root needed), so it is read from the disk each time. The first restore of each
   source in a fresh process (what a restarted job pays) is reported apart from the later ones.

Every restore is checked bit for bit against the saved state once per process. The driver never imports jax;
saver and restorers are started through ``jaxckpt.testing.launch`` (fresh interpreters, always reaped), and the
agent is shut down (its memory freed) at the end, whatever happens.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import sys
import tempfile
import time
import uuid
from typing import Any, Mapping

from jaxckpt.tools.bench import memcpy, report, runner
from jaxckpt.tools.bench.save import parse_size

log = logging.getLogger("jaxckpt.tools.bench")

FULL = {"sizes": "64M,256M,1G", "repeats": 4, "restorers": 3, "save_repeats": 5, "warmup": 2,
        "memcpy_bytes": 512 << 20, "memcpy_repeats": 10}
QUICK = {"sizes": "1M,4M", "repeats": 2, "restorers": 1, "save_repeats": 3, "warmup": 1,
         "memcpy_bytes": 32 << 20, "memcpy_repeats": 5}
# Peak host memory per state byte: state + two shm slots + Orbax tmpfs copy + (restorer) expected state and
# restored state; the memory store's two slots are freed before the shm store fills its own.
MEMORY_FACTOR = 5.0
MEMORY_MARGIN = 2 << 30
FLOORS = {"shm_vs_orbax_tmpfs": 5.0, "memory_vs_orbax_plain": 10.0}  # issue 4 and issue 6, at 1 GiB
SOURCES = ("shm", "orbax_tmpfs", "orbax_plain")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``jaxckpt bench restore``."""
    p.add_argument("--sizes", default=None, help=f"state sizes, comma-separated, K/M/G binary (default "
                                                 f"{FULL['sizes']}, --quick {QUICK['sizes']})")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"restores per source in each restorer process (default {FULL['repeats']})")
    p.add_argument("--restorers", type=int, default=None,
                   help=f"fresh restorer processes per size (default {FULL['restorers']})")
    p.add_argument("--plain-dir", default=None,
                   help="where the plain-directory Orbax checkpoint goes (default: the temp directory)")
    runner.output_arguments(p, "restore", "tiny sizes, few repeats: seconds, for CI", timeout=1800.0)
    p.set_defaults(run=run)


def options(args: argparse.Namespace) -> dict[str, Any]:
    """Effective settings: explicit flags over the --quick or full defaults."""
    out = dict(QUICK if args.quick else FULL)
    for k in ("sizes", "repeats", "restorers"):
        if getattr(args, k) is not None:
            out[k] = getattr(args, k)
    out["sizes"] = [parse_size(s) for s in str(out["sizes"]).split(",") if s.strip()]
    out["plain_dir"] = args.plain_dir or tempfile.gettempdir()
    if not out["sizes"] or out["repeats"] < 1 or out["restorers"] < 1:
        raise ValueError(f"bench restore needs at least one size, --repeats >= 1 and --restorers >= 1 "
                         f"(got sizes {out['sizes']}, repeats {out['repeats']}, restorers {out['restorers']})")
    if not os.path.isdir(out["plain_dir"]):
        raise ValueError(f"bench restore: --plain-dir {out['plain_dir']} is not a directory")
    return out


def command(args: argparse.Namespace) -> str:
    """The command line that repeats this run."""
    return runner.command_line("restore", args, (("--sizes", "sizes"), ("--repeats", "repeats"),
                                                 ("--restorers", "restorers"), ("--plain-dir", "plain_dir")))


def run(args: argparse.Namespace) -> int:
    """``jaxckpt bench restore``: measure (or render ``--from-json``), write JSON, print and update the section."""
    return runner.run(args, "restore", options,
                      lambda a, o: measure(o, command(a), quick=a.quick, timeout=a.timeout), render)


# ------------------------------------------------------------------------------------------------- the driver
def measure(opts: Mapping[str, Any], cmd: str, *, quick: bool, timeout: float) -> dict[str, Any]:
    """Every size: a saver process, then the restorer processes; returns the result document."""
    from jaxckpt.backends.agent import protocol as proto
    from jaxckpt.testing import expect_ok, launch

    machine = report.machine_facts()
    mem = report.summarize(memcpy.memcpy_gbps(opts["memcpy_bytes"], opts["memcpy_repeats"]))
    results, skipped = [], []
    for size in opts["sizes"]:
        need = int(size * MEMORY_FACTOR) + MEMORY_MARGIN
        avail = report.available_memory_bytes()
        if need > avail:
            why = (f"needs about {report.fmt_size(need)} of host memory, {report.fmt_size(avail)} available")
            log.warning("bench restore: skipping %s: %s", report.fmt_size(size), why)
            skipped.append({"size_bytes": size, "reason": why})
            continue
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        shm_dir = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                               f"jaxckpt-bench-restore-{tag}")
        tmpfs = tempfile.mkdtemp(prefix="jaxckpt-bench-orbax-", dir=os.path.dirname(shm_dir))
        plain = tempfile.mkdtemp(prefix="jaxckpt-bench-orbax-", dir=opts["plain_dir"])
        spec = {"size": size, "job": f"bench-restore-{tag}", "shm_dir": shm_dir, "tmpfs": tmpfs, "plain": plain,
                "warmup": opts["warmup"], "save_repeats": opts["save_repeats"], "repeats": opts["repeats"]}
        try:
            log.info("bench restore %s: saver", report.fmt_size(size))
            saved = expect_ok(launch(save_phase, nodes=1, procs_per_node=1, distributed=False, args=(spec,),
                                     timeout=timeout))[0]
            spec["step"] = saved["shm"]["step"]
            restorers = []
            for i in range(opts["restorers"]):
                log.info("bench restore %s: restorer %d of %d", report.fmt_size(size), i + 1, opts["restorers"])
                restorers.append(expect_ok(launch(restore_phase, nodes=1, procs_per_node=1, distributed=False,
                                                  args=(spec,), timeout=timeout))[0])
        finally:
            proto.stop_agent(shm_dir, spec["job"], timeout_s=60)
            proto.kill_agent(shm_dir, remove_memory=True)  # only if the shutdown did not happen
            shutil.rmtree(shm_dir, ignore_errors=True)
            for d in (tmpfs, plain):
                shutil.rmtree(d, ignore_errors=True)
            try:
                os.unlink(proto.default_log_path(shm_dir))
            except FileNotFoundError:
                pass
        results.append(_row(saved, restorers))
        gc.collect()
    return {"bench": "restore", "mode": "quick" if quick else "full", "machine": machine, "date": report.now_utc(),
            "command": cmd,
            "setup": {"devices": 8, "mesh": results[0]["mesh"] if results else "2x4", "arrays": 8,
                      "devices_text": results[0]["devices_text"] if results else "8 CPU devices",
                      "repeats": opts["repeats"],
                      "restorers": opts["restorers"], "save_repeats": opts["save_repeats"], "warmup": opts["warmup"],
                      "plain_dir": opts["plain_dir"], "plain_fs": report.fs_type(opts["plain_dir"]),
                      "tmpfs_fs": report.fs_type("/dev/shm") if os.path.isdir("/dev/shm") else "none",
                      "floors": dict(FLOORS)},
            "memcpy_gbps": mem["median"], "memcpy_gbps_stats": mem, "results": results, "skipped": skipped}


def _row(saved: Mapping[str, Any], restorers: list[Mapping[str, Any]]) -> dict[str, Any]:
    """One size: the saver's figures and every restorer's samples pooled; ratios of medians."""
    s = report.summarize
    pooled: dict[str, Any] = {}
    for src in SOURCES:
        firsts = [r[src]["first_s"] for r in restorers]
        later = [x for r in restorers for x in r[src]["later_s"]] or firsts
        pooled[src] = {"restore_first_s": s(firsts), "restore_s": s(later)}
    pooled["shm"]["connect_s"] = s([r["shm"]["connect_s"] for r in restorers])
    mem_restore = saved["memory"]["restore_s"]["median"]
    ratios = {}
    for which in ("restore_first_s", "restore_s"):
        tag = "first" if which == "restore_first_s" else "later"
        shm = pooled["shm"][which]["median"]
        for src in ("orbax_tmpfs", "orbax_plain"):
            ratios[f"{src}_over_shm_{tag}"] = pooled[src][which]["median"] / shm
            ratios[f"{src}_over_memory_{tag}"] = pooled[src][which]["median"] / mem_restore
    ratios["shm_save_call_over_memory"] = saved["shm"]["save_call_s"]["median"] / saved["memory"]["save_call_s"][
        "median"]
    return {"size_bytes": saved["size_bytes"], "memory": saved["memory"], "shm_save": saved["shm"],
            "devices_text": saved["devices_text"], "mesh": saved["mesh"],
            "restore": pooled, "ratios": ratios}


# ------------------------------------------------------------------------------------------ launched processes
def _jax8() -> Any:
    from jaxckpt.tools.bench.state import setup_jax
    jax = setup_jax("restore")
    logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax logs every save at INFO
    logging.getLogger("jaxckpt.jax.checkpointer").setLevel(logging.WARNING)  # a line per restore
    return jax


def timed_saves(ck: Any, state: Any, warmup: int, repeats: int) -> tuple[list[float], list[float], int]:
    """``repeats`` timed saves of ``state`` after ``warmup`` (at least 2) untimed ones, from step 1: each save()
    call's seconds, each save-to-committed's, and the last step saved."""
    call, total, step = [], [], 0
    for _ in range(max(warmup, 2)):  # both slots of the double buffer in use before timing
        step += 1
        ck.save(step, state)
        ck.wait()
    for _ in range(repeats):
        step += 1
        t0 = time.perf_counter()
        ck.save(step, state)
        t1 = time.perf_counter()
        ck.wait()
        call.append(t1 - t0)
        total.append(time.perf_counter() - t0)
    return call, total, step


def save_phase(spec: dict) -> dict:
    """The saver (a launched process): save timings with both stores, restore from memory, Orbax checkpoints."""
    jax = _jax8()
    import orbax.checkpoint as ocp

    from jaxckpt import Checkpointer, Config
    from jaxckpt.tools.bench.state import check_equal, make_state, restore_target

    s = report.summarize
    state = make_state(spec["size"])
    nbytes = sum(x.nbytes for x in state.values())
    target = restore_target(state)
    with Checkpointer(Config(job_id=spec["job"] + "-mem")) as ck:
        call, total, _ = timed_saves(ck, state, spec["warmup"], spec["save_repeats"])
        check_equal("jaxckpt memory restore", ck.restore(target), state)
        restore = []
        for _ in range(spec["repeats"]):
            t0 = time.perf_counter()
            out = jax.block_until_ready(ck.restore(target))
            restore.append(time.perf_counter() - t0)
            del out
        memory = {"save_call_s": s(call), "snapshot_s": s(total), "restore_s": s(restore)}
    gc.collect()
    cfg = Config(store="shm", job_id=spec["job"], shm_dir=spec["shm_dir"])
    t0 = time.perf_counter()
    with Checkpointer(cfg) as ck:
        start = time.perf_counter() - t0  # connect (and spawn the agent)
        call, total, last = timed_saves(ck, state, spec["warmup"], spec["save_repeats"])
        shm = {"save_call_s": s(call), "snapshot_s": s(total), "start_s": start, "step": last}
    for where in (spec["tmpfs"], spec["plain"]):
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(os.path.join(where, "ckpt"), state)
            ckptr.wait_until_finished()
    sync_tree(spec["plain"])
    from jaxckpt.tools.bench.state import bench_devices, devices_text, mesh_shape
    return {"size_bytes": nbytes, "memory": memory, "shm": shm, "devices_text": devices_text(),
            "mesh": "x".join(map(str, mesh_shape(len(bench_devices()))))}


def restore_phase(spec: dict) -> dict:
    """A restorer (a fresh launched process): restore from the agent and from both Orbax directories, in turn."""
    jax = _jax8()
    import orbax.checkpoint as ocp

    from jaxckpt import Checkpointer, Config
    from jaxckpt.tools.bench.state import check_equal, make_state, restore_target

    want = make_state(spec["size"])  # the saved state, rebuilt: the target's shapes and the bitwise reference
    target = restore_target(want)
    orbax = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    times: dict[str, list[float]] = {src: [] for src in SOURCES}
    t0 = time.perf_counter()
    ck = Checkpointer(Config(store="shm", job_id=spec["job"], shm_dir=spec["shm_dir"]))
    connect = time.perf_counter() - t0
    try:
        for r in range(spec["repeats"]):
            for src in SOURCES:
                if src == "orbax_plain":
                    drop_cache(spec["plain"])
                t0 = time.perf_counter()
                if src == "shm":
                    out = jax.block_until_ready(ck.restore(target))
                else:
                    path = os.path.join(spec["tmpfs" if src == "orbax_tmpfs" else "plain"], "ckpt")
                    out = jax.block_until_ready(orbax.restore(path, args=ocp.args.StandardRestore(target)))
                times[src].append(time.perf_counter() - t0)
                if r == 0:
                    check_equal(f"{src} restore", out, want)
                del out
        step = ck.latest_step()
    finally:
        ck.close()
        orbax.close()
    if step != spec["step"]:
        raise AssertionError(f"restorer found step {step}, the saver committed {spec['step']}")
    out = {src: {"first_s": v[0], "later_s": v[1:]} for src, v in times.items()}
    out["shm"]["connect_s"] = connect
    return out


def _files(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, names in os.walk(root) for f in names]


def sync_tree(root: str) -> None:
    for path in _files(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_cache(root: str) -> None:
    """Evict ``root``'s (synced, clean) file pages from the page cache, so the next read comes from the disk."""
    for path in _files(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------------------------------- markdown
def render(result: Mapping[str, Any]) -> str:
    """The BENCHMARKS.md section of a ``bench restore`` result (every number from the JSON)."""
    fm, fn, fs = report.fmt_ms, report.fmt_num, report.fmt_size
    st = result["setup"]
    parts = ["### `jaxckpt bench restore`: restore from memory, from the node agent and from Orbax checkpoints", ""]
    if result.get("mode") == "quick":
        parts += ["> **Quick run, placeholder until the full run.** Tiny states and few repeats on a shared machine: "
                  "these numbers show the shape of the tables, not the performance. Regenerate with the full "
                  "command on a quiet machine.", ""]
    parts += [
        f"Command: `{result['command']}`", "",
        report.machine_line(result), "",
        f"State: the state of `jaxckpt bench save` ({st['arrays']} float32 arrays on a {st['mesh']} mesh of "
        f"{st.get('devices_text', str(st['devices']) + ' CPU devices')}), restored onto the same shardings. memory: `store=\"memory\"`, restored in "
        f"the process that saved it. shm: `store=\"shm\"`, saved by a process that then exits; each of "
        f"{st['restorers']} fresh processes restores the newest step from the node agent's shared memory. Orbax: "
        f"`StandardSave` once, `StandardRestore` in the same fresh processes, from a directory on tmpfs "
        f"({st['tmpfs_fs']}) and from a plain directory ({st['plain_dir']}, {st['plain_fs']}) whose files are "
        f"dropped from the page cache before every restore (fsync + POSIX_FADV_DONTNEED). Sources take turns, "
        f"{st['repeats']} restores each per process; *first* = the first restore of that source in a fresh process "
        f"(what a restarted job pays), *later* = the others. Each figure: median (min–max); every source checked "
        f"bit for bit once per process.", "",
    ]
    rows = []
    for r in result["results"]:
        rs, q = r["restore"], r["ratios"]
        rows.append([fs(r["size_bytes"]), fm(r["memory"]["restore_s"]), fm(rs["shm"]["restore_first_s"]),
                     fm(rs["shm"]["restore_s"]), fm(rs["orbax_tmpfs"]["restore_first_s"]),
                     fm(rs["orbax_tmpfs"]["restore_s"]), fm(rs["orbax_plain"]["restore_first_s"]),
                     fm(rs["orbax_plain"]["restore_s"]),
                     f"{fn(q['orbax_tmpfs_over_shm_first'])}x / {fn(q['orbax_tmpfs_over_shm_later'])}x",
                     f"{fn(q['orbax_plain_over_shm_first'])}x / {fn(q['orbax_plain_over_shm_later'])}x",
                     f"{fn(q['orbax_plain_over_memory_later'])}x"])
    parts.append(report.table(["state", "memory restore ms", "shm first ms", "shm later ms", "Orbax tmpfs first ms",
                               "Orbax tmpfs later ms", "Orbax plain first ms", "Orbax plain later ms",
                               "Orbax tmpfs / shm (first / later)", "Orbax plain / shm (first / later)",
                               "Orbax plain / memory"], rows))
    parts += ["", "Save with `store=\"shm\"` (the same saver process, same state):", ""]
    rows = []
    for r in result["results"]:
        m, sh = r["memory"], r["shm_save"]
        rows.append([fs(r["size_bytes"]), fm(m["save_call_s"]), fm(m["snapshot_s"]), fm(sh["save_call_s"]),
                     fm(sh["snapshot_s"]), fm(r["restore"]["shm"]["connect_s"]),
                     f"{fn(r['ratios']['shm_save_call_over_memory'])}x"])
    parts.append(report.table(["state", "memory save() ms", "memory snapshot ms", "shm save() ms",
                               "shm snapshot ms", "shm connect in a fresh process ms", "save() shm / memory"],
                              rows))
    floors = st["floors"]
    big = [r for r in result["results"] if r["size_bytes"] >= 1 << 30]
    if big:
        r = big[-1]
        a, b = r["ratios"]["orbax_tmpfs_over_shm_first"], r["ratios"]["orbax_plain_over_memory_later"]
        parts += ["", f"Floors at {fs(r['size_bytes'])}: shm restore ≥ {fn(floors['shm_vs_orbax_tmpfs'])}x faster "
                      f"than Orbax from tmpfs (first restore in a fresh process): {fn(a)}x, "
                      f"{'met' if a >= floors['shm_vs_orbax_tmpfs'] else '**not met**'}; memory restore ≥ "
                      f"{fn(floors['memory_vs_orbax_plain'])}x faster than Orbax from a plain directory: {fn(b)}x, "
                      f"{'met' if b >= floors['memory_vs_orbax_plain'] else '**not met**'}."]
    for sk in result.get("skipped", []):
        parts += ["", f"Skipped {fs(sk['size_bytes'])}: {sk['reason']}."]
    parts += ["", "save(): time the call blocks the caller; snapshot: until `wait()` returns. Ratios are of "
                  "medians within this run."]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxckpt.tools.bench.restore``: the same options as ``jaxckpt bench restore``."""
    return runner.main("jaxckpt.tools.bench.restore", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
