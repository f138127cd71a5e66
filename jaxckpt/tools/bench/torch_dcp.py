"""``jaxckpt bench torch``: the torch front end against PyTorch DCP, same state dict, same run.

For each state size (a mixed-precision model + AdamW-like optimizer state dict: bfloat16 weights, float32 master
weights and moments, scalar ``step`` tensors, plain ``param_groups`` values) it measures, in one process:

- jaxckpt ``save()`` call time in the safe default mode (returns once nothing reads the live tensors) and with
  ``defer_reads=True`` (returns at once; ``wait_for_reads()`` timed separately, called right after ``save()``),
  and the time until ``wait()`` returns (committed in host memory);
- jaxckpt restore time into a preallocated target state dict, in place and as new tensors;
- ``torch.distributed.checkpoint.async_save`` call time and time until its future completes, and ``dcp.save``
  (synchronous), each to a fresh directory under /dev/shm (tmpfs), and ``dcp.load`` into the same target;
- the same three DCP calls with jaxckpt's DCP storage (``JaxckptWriter`` / ``JaxckptReader``, DCP's own planner)
  into ``store="memory"`` and into ``store="shm"`` (the node agent's shared memory, which outlives the process
  as the tmpfs files do);
- the machine's memcpy bandwidth as the limit.

torch 2.13's DCP saves and loads in a single process without a process group (it warns and runs single-process),
so none is created: DCP's best case, with no collectives. Results go to JSON; the BENCHMARKS.md section is
rendered from that JSON by :func:`render_torch`. torch is imported only inside the measurement functions, so
building the CLI parser or rendering a result never imports it.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import shlex
import shutil
import sys
import time
import warnings
from typing import Any, Mapping

from jaxckpt.tools.bench import memcpy, report, runner
from jaxckpt.tools.bench.restore import timed_saves
from jaxckpt.tools.bench.save import parse_size

log = logging.getLogger("jaxckpt.tools.bench")

LAYERS = 8
COLS = 1024
BYTES_PER_PARAM = 2 + 3 * 4  # bfloat16 weight + float32 master weight, exp_avg, exp_avg_sq
FULL = {"sizes": "64M,256M,1G", "repeats": 5, "warmup": 2, "memcpy_bytes": 512 << 20, "memcpy_repeats": 10}
QUICK = {"sizes": "1M,4M", "repeats": 3, "warmup": 1, "memcpy_bytes": 32 << 20, "memcpy_repeats": 5}
STATE = (f"{{'model': {LAYERS} bfloat16 weights [rows, {COLS}], 'optim': {{'state': per weight float32 'master', "
         f"'exp_avg', 'exp_avg_sq' of the same shape and a scalar float32 'step' tensor; 'param_groups': plain "
         f"values}}}} ({BYTES_PER_PARAM} bytes per parameter), CPU tensors")
JAXCKPT_SETUP = ("jaxckpt.torch.Checkpointer(Config()) (store=memory, keep=1); the defer_reads=True "
                 "Checkpointer shares its engine")
DCP_SETUP = ("torch.distributed.checkpoint.async_save (default stager: a synchronous CPU copy, then a writer "
             "thread) and dcp.save, FileSystemWriter to a fresh directory under /dev/shm (tmpfs) each repeat; "
             "dcp.load from the dcp.save directory into the target; no process group")
DCP_JAXCKPT_SETUP = ("storage_writer=JaxckptWriter(config=Config(store=..., keep=2)) and "
                     "storage_reader=JaxckptReader(store=writer.store), bytes in a jaxckpt store slot per save (store=memory: this process; "
                     "store=shm: a node agent spawned for the run, under /dev/shm); at least 2 warm-up rounds so "
                     "timed saves reuse the store's buffers")
DCP_STORES = ("memory", "shm")
_DCP_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``jaxckpt bench torch`` (also those of ``python -m jaxckpt.tools.bench.torch_dcp``)."""
    p.add_argument("--sizes", default=None,
                   help=f"state sizes, comma-separated, K/M/G = KiB/MiB/GiB (default {FULL['sizes']}, "
                        f"--quick {QUICK['sizes']})")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"timed repeats per size (default {FULL['repeats']}, --quick {QUICK['repeats']})")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"untimed rounds first, at least 1 (default {FULL['warmup']}, --quick {QUICK['warmup']})")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's own; on a loaded machine 1 avoids waiting on "
                        "descheduled OpenMP threads in every tensor copy, DCP's and jaxckpt's restore alike)")
    runner.output_arguments(p, "torch", "tiny sizes, few repeats: seconds, for CI")
    p.set_defaults(run=run)


def options(args: argparse.Namespace) -> dict[str, Any]:
    """Effective settings: explicit flags over the --quick or full defaults."""
    out = dict(QUICK if args.quick else FULL)
    for k in ("sizes", "repeats", "warmup"):
        if getattr(args, k) is not None:
            out[k] = getattr(args, k)
    out["sizes"] = [parse_size(s) for s in str(out["sizes"]).split(",") if s.strip()]
    # At least one warm-up round: the first DCP save imports and plans, the first jaxckpt save allocates slots.
    out["torch_threads"] = args.torch_threads
    if args.torch_threads is not None and args.torch_threads < 1:
        raise ValueError(f"bench torch needs --torch-threads >= 1 (got {args.torch_threads})")
    if not out["sizes"] or out["repeats"] < 1 or out["warmup"] < 1:
        raise ValueError(f"bench torch needs at least one size, --repeats >= 1 and --warmup >= 1 "
                         f"(got sizes {out['sizes']}, repeats {out['repeats']}, warmup {out['warmup']})")
    return out


def forwarded(args: argparse.Namespace) -> list[str]:
    """The options of ``args`` as command-line words, so a reader can repeat the run."""
    words = ["--quick"] if args.quick else []
    for flag, key in (("--sizes", "sizes"), ("--repeats", "repeats"), ("--warmup", "warmup"),
                      ("--torch-threads", "torch_threads"), ("--json", "json"), ("--update-md", "update_md"),
                      ("--from-json", "from_json")):
        if getattr(args, key) is not None:
            words += [flag, str(getattr(args, key))]
    return words


# ---------------------------------------------------------------------------------------------- entry points
def run(args: argparse.Namespace) -> int:
    """``jaxckpt bench torch``: measure (or render ``--from-json``), write JSON, print and update the section."""
    return runner.run(args, "torch", options, lambda a, _: measure(a), render_torch)


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxckpt.tools.bench.torch_dcp``: the same options as ``jaxckpt bench torch``."""
    return runner.main("jaxckpt.tools.bench.torch_dcp", __doc__, add_arguments, run, argv)


# ------------------------------------------------------------------------------------------------ measuring
def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark in this process and return the result object."""
    import torch

    opts = options(args)
    if opts["torch_threads"] is not None:
        torch.set_num_threads(opts["torch_threads"])
    machine = report.machine_facts()
    machine["versions"]["torch"] = torch.__version__
    log.info("bench torch: sizes %s, %d repeats after %d warm-up", [report.fmt_size(s) for s in opts["sizes"]],
             opts["repeats"], opts["warmup"])
    mem = report.summarize(memcpy.memcpy_gbps(opts["memcpy_bytes"], opts["memcpy_repeats"]))
    quiet = logging.getLogger("jaxckpt.torch")  # it logs every restore at INFO
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        results = [bench_size(size, opts["repeats"], opts["warmup"], mem["median"]) for size in opts["sizes"]]
    finally:
        quiet.setLevel(level)
    return {
        "bench": "torch",
        "mode": "quick" if args.quick else "full",
        "machine": machine,
        "date": report.now_utc(),
        "command": shlex.join(["jaxckpt", "bench", "torch", *forwarded(args)]),
        "setup": {"state": STATE, "layers": LAYERS, "cols": COLS, "bytes_per_param": BYTES_PER_PARAM,
                  "repeats": opts["repeats"], "warmup": opts["warmup"],
                  "jaxckpt_warmup_saves": max(opts["warmup"], 2), "jaxckpt": JAXCKPT_SETUP, "dcp": DCP_SETUP,
                  "dcp_jaxckpt": DCP_JAXCKPT_SETUP, "dcp_jaxckpt_warmup_rounds": max(opts["warmup"], 2),
                  "torch_threads": torch.get_num_threads(), "memcpy_bytes": opts["memcpy_bytes"],
                  "device": tensor_device() if tensor_device() == "cpu" else torch.cuda.get_device_name()},
        "memcpy_gbps": mem["median"],
        "memcpy_gbps_stats": mem,
        "results": results,
    }


def bench_size(size: int, repeats: int, warmup: int, memcpy_gbps: float) -> dict[str, Any]:
    """Every figure for one state size: jaxckpt, then DCP, on the same state and target; ratios of medians."""
    state, target = make_state(size), make_state(size, zeros=True)
    nbytes, count = state_bytes(state)
    log.info("state %s: %d tensors, %d bytes", report.fmt_size(size), count, nbytes)
    j = bench_jaxckpt(state, target, repeats, warmup)
    gc.collect()
    d = bench_dcp(state, target, repeats, warmup)
    gc.collect()
    dj = {store: bench_dcp_jaxckpt(state, target, repeats, warmup, store) for store in DCP_STORES}
    del state, target
    gc.collect()
    j["snapshot_gbps"] = nbytes / j["snapshot_s"]["median"] / 1e9
    j["snapshot_vs_memcpy"] = j["snapshot_gbps"] / memcpy_gbps
    pairs = (("save_call", "async_save_call_s", "save_call_s"),
             ("save_call_deferred", "async_save_call_s", "deferred_save_call_s"),
             ("total", "async_total_s", "snapshot_s"),
             ("restore_in_place", "load_s", "restore_in_place_s"),
             ("restore_new", "load_s", "restore_new_s"))
    ratios = {f"{k}_dcp_over_jaxckpt": d[a]["median"] / j[b]["median"] for k, a, b in pairs}
    for store in DCP_STORES:  # FileSystemWriter over JaxckptWriter, the same DCP call
        for k, key in DCP_PAIRS:
            ratios[f"dcp_{k}_filesystem_over_jaxckpt_{store}"] = d[key]["median"] / dj[store][key]["median"]
    log.info("%s: jaxckpt save() %.2f ms (deferred %.2f ms), snapshot %.1f ms, restore %.1f ms in place; "
             "DCP async_save() %.1f ms, total %.1f ms, load %.1f ms", report.fmt_size(nbytes),
             j["save_call_s"]["median"] * 1e3, j["deferred_save_call_s"]["median"] * 1e3,
             j["snapshot_s"]["median"] * 1e3, j["restore_in_place_s"]["median"] * 1e3,
             d["async_save_call_s"]["median"] * 1e3, d["async_total_s"]["median"] * 1e3, d["load_s"]["median"] * 1e3)
    log.info("%s: DCP with JaxckptWriter: %s", report.fmt_size(nbytes), "; ".join(
        f"{store} save {dj[store]['save_s']['median'] * 1e3:.1f} ms, async_save() "
        f"{dj[store]['async_save_call_s']['median'] * 1e3:.1f} ms, load {dj[store]['load_s']['median'] * 1e3:.1f} ms"
        for store in DCP_STORES))
    return {"requested_bytes": size, "size_bytes": nbytes, "tensors": count, "jaxckpt": j, "dcp": d,
            **{f"dcp_jaxckpt_{store}": dj[store] for store in DCP_STORES}, "ratios": ratios}


DCP_PAIRS = (("save", "save_s"), ("async_call", "async_save_call_s"), ("async_total", "async_total_s"),
             ("load", "load_s"))


def tensor_device() -> str:
    """Where the state's tensors live: the CPU, or with ``JAXCKPT_BENCH_DEVICES=default`` (``bench device``) the
    GPU where torch sees one."""
    import torch

    from jaxckpt.tools.bench.state import on_default_backend
    return "cuda" if on_default_backend() and torch.cuda.is_available() else "cpu"


def make_state(size_bytes: int, zeros: bool = False) -> dict[str, Any]:
    """About ``size_bytes`` of model + optimizer state dict (see ``STATE``) on ``tensor_device()``; ``zeros``: a
    target of the same shape."""
    import torch

    rows = max(1, size_bytes // (BYTES_PER_PARAM * COLS * LAYERS))
    gen = torch.Generator().manual_seed(0)
    device = tensor_device()
    model, opt = {}, {}
    for i in range(LAYERS):
        name = f"layers.{i}.weight"
        w = (torch.zeros(rows, COLS) if zeros else torch.randn(rows, COLS, generator=gen)).to(device)
        model[name] = w.to(torch.bfloat16)
        opt[name] = {"step": torch.tensor(0.0 if zeros else 10.0 + i), "master": w,
                     "exp_avg": w * 0.1, "exp_avg_sq": w * w}
    groups = [{"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "params": list(model)}]
    return {"model": model, "optim": {"state": opt, "param_groups": groups}}


def _tensors(state: Any) -> list:
    import torch
    if isinstance(state, Mapping):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return [state] if isinstance(state, torch.Tensor) else []


def state_bytes(state: Any) -> tuple[int, int]:
    """(bytes, number) of the tensors in ``state``."""
    ts = _tensors(state)
    return sum(t.numel() * t.element_size() for t in ts), len(ts)


def _zero(state: Any) -> None:
    import torch
    with torch.no_grad():
        for t in _tensors(state):
            t.zero_()


def check_equal(what: str, out: Any, state: Any) -> None:
    """AssertionError unless every tensor of ``out`` has the bytes, dtype and shape of ``state``'s, and every
    other value is equal."""
    import torch
    if isinstance(state, Mapping):
        for k, v in state.items():
            check_equal(f"{what}/{k}", out[k], v)
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            check_equal(f"{what}/{i}", out[i], v)
    elif isinstance(state, torch.Tensor):
        if out.dtype != state.dtype or out.shape != state.shape or not torch.equal(
                out.reshape(-1).view(torch.uint8), state.reshape(-1).view(torch.uint8)):
            raise AssertionError(f"{what}: restored tensor differs from the saved one")
    elif out != state:
        raise AssertionError(f"{what}: restored {out!r}, saved {state!r}")


def bench_jaxckpt(state: dict, target: dict, repeats: int, warmup: int) -> dict[str, Any]:
    """save() call (safe and deferred), wait_for_reads(), save-to-committed and restore seconds."""
    from jaxckpt import Config
    from jaxckpt.torch import Checkpointer

    dcall, dreads, dtotal, rin, rnew = [], [], [], [], []
    with Checkpointer(Config(job_id="bench-torch")) as safe:
        deferred = Checkpointer(engine=safe.engine, defer_reads=True)
        try:
            # Warm-up fills both slots of the double buffer, so timed saves reuse slots, as in training.
            call, total, step = timed_saves(safe, state, warmup, repeats)  # keep setup['jaxckpt_warmup_saves']
            for i in range(warmup + repeats):
                step += 1
                t0 = time.perf_counter()
                deferred.save(step, state)
                t1 = time.perf_counter()
                deferred.wait_for_reads()
                t2 = time.perf_counter()
                deferred.wait()
                t3 = time.perf_counter()
                if i >= warmup:
                    dcall.append(t1 - t0)
                    dreads.append(t2 - t1)
                    dtotal.append(t3 - t0)
            _zero(target)
            check_equal("jaxckpt restore in place", safe.restore(target, in_place=True), state)
            check_equal("jaxckpt restore", safe.restore(target), state)
            for _ in range(repeats):
                t0 = time.perf_counter()
                safe.restore(target, in_place=True)
                rin.append(time.perf_counter() - t0)
            for _ in range(repeats):
                t0 = time.perf_counter()
                out = safe.restore(target)
                rnew.append(time.perf_counter() - t0)
                del out
        finally:
            deferred.close()
    s = report.summarize
    return {"save_call_s": s(call), "snapshot_s": s(total), "deferred_save_call_s": s(dcall),
            "deferred_wait_for_reads_s": s(dreads), "deferred_snapshot_s": s(dtotal),
            "restore_in_place_s": s(rin), "restore_new_s": s(rnew)}


def bench_dcp(state: dict, target: dict, repeats: int, warmup: int) -> dict[str, Any]:
    """DCP async_save call and total, dcp.save and dcp.load seconds, to and from tmpfs."""
    import torch.distributed.checkpoint as dcp

    call, total, sync, load = [], [], [], []
    root = report.tmpfs_dir("jaxckpt-bench-dcp-", "DCP")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_DCP_WARNING)
            for i in range(warmup + repeats):
                a, b = os.path.join(root, f"async{i}"), os.path.join(root, f"sync{i}")
                t0 = time.perf_counter()
                future = dcp.async_save(state, checkpoint_id=a)
                t1 = time.perf_counter()
                future.result()
                t2 = time.perf_counter()
                dcp.save(state, checkpoint_id=b)
                t3 = time.perf_counter()
                if i == 0:
                    _zero(target)
                t4 = time.perf_counter()
                dcp.load(target, checkpoint_id=b)
                t5 = time.perf_counter()
                if i == 0:
                    check_equal("dcp.load", target, state)
                shutil.rmtree(a)
                shutil.rmtree(b)
                if i >= warmup:
                    call.append(t1 - t0)
                    total.append(t2 - t0)
                    sync.append(t3 - t2)
                    load.append(t5 - t4)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    s = report.summarize
    return {"async_save_call_s": s(call), "async_total_s": s(total), "save_s": s(sync), "load_s": s(load)}


def bench_dcp_jaxckpt(state: dict, target: dict, repeats: int, warmup: int, store: str) -> dict[str, Any]:
    """bench_dcp's figures with JaxckptWriter / JaxckptReader into ``store`` instead of the tmpfs files."""
    import torch.distributed.checkpoint as dcp

    from jaxckpt import Config
    from jaxckpt.backends.agent import protocol as proto
    from jaxckpt.torch import JaxckptReader, JaxckptWriter

    call, total, sync, load = [], [], [], []
    root = report.tmpfs_dir("jaxckpt-bench-dcp-", "DCP") if store == "shm" else None
    config = Config(store=store, job_id=f"bench-dcp-{store}", keep=2,
                    **({"shm_dir": os.path.join(root, "agent")} if root else {}))
    try:
        with warnings.catch_warnings(), JaxckptWriter(config=config) as writer:
            warnings.filterwarnings("ignore", message=_DCP_WARNING)
            reader = JaxckptReader(store=writer.store)
            rounds = max(warmup, 2)  # keep in step with setup['dcp_jaxckpt_warmup_rounds']
            for i in range(rounds + repeats):
                t0 = time.perf_counter()
                future = dcp.async_save(state, storage_writer=writer, checkpoint_id=2 * i)
                t1 = time.perf_counter()
                future.result()
                t2 = time.perf_counter()
                dcp.save(state, storage_writer=writer, checkpoint_id=2 * i + 1)
                t3 = time.perf_counter()
                if i == 0:
                    _zero(target)
                t4 = time.perf_counter()
                dcp.load(target, storage_reader=reader, checkpoint_id=2 * i + 1)
                t5 = time.perf_counter()
                if i == 0:
                    check_equal(f"dcp.load from JaxckptReader ({store})", target, state)
                if i >= rounds:
                    call.append(t1 - t0)
                    total.append(t2 - t0)
                    sync.append(t3 - t2)
                    load.append(t5 - t4)
    finally:
        if root:
            proto.stop_agent(config.shm_dir, config.job_id, timeout_s=30)
            shutil.rmtree(root, ignore_errors=True)
    s = report.summarize
    return {"async_save_call_s": s(call), "async_total_s": s(total), "save_s": s(sync), "load_s": s(load)}


# --------------------------------------------------------------------------------------------- markdown
def render_torch(result: Mapping[str, Any]) -> str:
    """The BENCHMARKS.md section of a ``bench torch`` result (every number from the JSON)."""
    from jaxckpt.tools.bench.report import fmt_ms, fmt_num, fmt_size, machine_line, table

    s = result["setup"]
    parts = ["### `jaxckpt bench torch`: torch front end save() call, snapshot and restore time, against "
             "PyTorch DCP", ""]
    if result.get("mode") == "quick":
        parts += ["> **Quick run, placeholder until the full run.** Tiny states and few repeats on a shared machine: "
                  "these numbers show the shape of the tables, not the performance. Regenerate with the full "
                  "command on a quiet machine.", ""]
    parts += [
        f"Command: `{result['command']}`", "",
        machine_line(result) + f" torch {result['machine']['versions'].get('torch', '?')} "
        f"({s['torch_threads']} intra-op threads).", "",
        f"State: {s['state']}" + ("" if s.get("device", "cpu") == "cpu" else f", its tensors on {s['device']} "
                                   f"(the scalar `step` tensors on the CPU, as optimizers keep them)")
        + f"; its rows are chosen so that the tensors hold about the nominal size (the JSON "
        f"has the exact bytes, which the GB/s use). jaxckpt: {s['jaxckpt']}. DCP: {s['dcp']}. Each figure: "
        f"median (min–max) of {s['repeats']} repeats after {s['warmup']} warm-up round(s) (jaxckpt: "
        f"{s['jaxckpt_warmup_saves']} warm-up saves, so both slots of its double buffer are reused); restores "
        f"and `dcp.load` are checked bit for bit against the saved state.", "",
    ]
    save_rows, restore_rows = [], []
    for r in result["results"]:
        j, d, q = r["jaxckpt"], r["dcp"], r["ratios"]
        size = fmt_size(r["requested_bytes"])
        save_rows.append([
            size, fmt_ms(j["save_call_s"]), fmt_ms(j["deferred_save_call_s"]), fmt_ms(j["deferred_wait_for_reads_s"]),
            fmt_ms(j["snapshot_s"]), f"{fmt_num(j['snapshot_gbps'])} ({fmt_num(j['snapshot_vs_memcpy'] * 100)}%)",
            fmt_ms(d["async_save_call_s"]), fmt_ms(d["async_total_s"]), fmt_ms(d["save_s"]),
            f"{fmt_num(q['save_call_dcp_over_jaxckpt'])}x", f"{fmt_num(q['save_call_deferred_dcp_over_jaxckpt'])}x",
        ])
        restore_rows.append([
            size, fmt_ms(j["restore_in_place_s"]), fmt_ms(j["restore_new_s"]), fmt_ms(d["load_s"]),
            f"{fmt_num(q['restore_in_place_dcp_over_jaxckpt'])}x", f"{fmt_num(q['restore_new_dcp_over_jaxckpt'])}x",
        ])
    parts += ["Save:", "", table(
        ["state", "jaxckpt save() ms", "deferred save() ms", "wait_for_reads() ms", "jaxckpt snapshot ms",
         "snapshot GB/s (% of memcpy)", "DCP async_save() ms", "DCP async total ms", "dcp.save ms",
         "save() DCP/jaxckpt", "save() DCP/jaxckpt deferred"], save_rows), ""]
    parts += ["Restore:", "", table(
        ["state", "jaxckpt restore in place ms", "jaxckpt restore new tensors ms", "dcp.load ms",
         "restore DCP/jaxckpt in place", "restore DCP/jaxckpt new"], restore_rows), ""]
    if "dcp_jaxckpt" in s:  # results recorded before the DCP storage rows have only two tables
        parts += _dcp_storage_table(result)
    parts.append(
        "jaxckpt save(): time the call blocks the caller in the default mode, which returns once the snapshot no "
        "longer reads the live tensors (on CPU: after the worker threads' host copy). deferred save(): "
        "`defer_reads=True`, which returns at once; the caller must call `wait_for_reads()` before writing the "
        "tensors in place (here called right after save(), with no work to overlap: the worst case). jaxckpt "
        "snapshot: from the default save() call until `wait()` returns (committed in host memory). DCP async "
        "total: from the `async_save()` call until its future completes. GB/s = 1e9 bytes per second of snapshot "
        "time; ratios are of medians within this run.")
    return "\n".join(parts)


def _dcp_storage_table(result: Mapping[str, Any]) -> list[str]:
    """The third table: the same DCP calls into FileSystemWriter on tmpfs and into jaxckpt's stores."""
    from jaxckpt.tools.bench.report import fmt_ms, fmt_num, fmt_size, table

    rows = []
    for r in result["results"]:
        size = fmt_size(r["requested_bytes"])
        for name, key in (("FileSystemWriter, /dev/shm", "dcp"),
                          *((f"JaxckptWriter, store={s}", f"dcp_jaxckpt_{s}") for s in DCP_STORES)):
            d = r[key]
            if key == "dcp":
                save_ratio = load_ratio = "1x"
            else:
                store = key.rsplit("_", 1)[1]
                save_ratio = f"{fmt_num(r['ratios'][f'dcp_save_filesystem_over_jaxckpt_{store}'])}x"
                load_ratio = f"{fmt_num(r['ratios'][f'dcp_load_filesystem_over_jaxckpt_{store}'])}x"
            rows.append([size, name, fmt_ms(d["save_s"]), fmt_ms(d["async_save_call_s"]), fmt_ms(d["async_total_s"]),
                         fmt_ms(d["load_s"]), save_ratio, load_ratio])
    return ["DCP storage: the same `dcp.save`, `dcp.async_save` and `dcp.load` calls on the same state, DCP's "
            f"own planner, into FileSystemWriter as above or into jaxckpt's DCP storage ("
            f"{result['setup']['dcp_jaxckpt']}):", "", table(
                ["state", "storage", "dcp.save ms", "async_save() ms", "async total ms", "dcp.load ms",
                 "dcp.save FileSystemWriter/this", "dcp.load FileSystemWriter/this"], rows), ""]


if __name__ == "__main__":
    sys.exit(main())
