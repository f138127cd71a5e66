"""``jaxckpt bench stall``: what a snapshot every step costs a real training loop, jaxckpt vs Orbax.

A Flax GPT (AdamW, donated state, data x model mesh) trains in ``--procs`` JAX processes started by the
project's launcher (one process runs as a plain one, without ``jax.distributed``: ``tools.node.init_from_env``).
In one run, for each state size, every process measures these modes one after another on
a fresh state with the same compiled step:

- ``none``:          no checkpointing (the baseline step time);
- ``copy-floor``:    no checkpointing; where the others save, one thread copies the bytes a jaxckpt save moves,
  in its pieces, each with its crc32c, into a buffer of its own (``breakdown.FloorCopy``): what moving the
  bytes once costs the step on this machine (the bytes' own share of a snapshot's cost);
- ``view-floor``:    ``copy-floor``, and before each pass the training thread takes zero-copy views of every
  buffer a jaxckpt save views (``breakdown.take_views``: JAX exposing each array's local buffers, then a view of
  each one read), held until the pass ends: what the part of a snapshot JAX decides costs the step beside the
  bytes' (with no view the next donating step is free to reuse the buffers: a save cannot skip them);
- ``jaxckpt``:       ``ckpt.save(step, state)`` after every step (views + background copy; the default);
- ``jaxckpt-wait``:  ``ckpt.save(step, state).result()``: the same save, waited for before the next step (no
  copy beside the step, the next step's donation never held back: on a few shared cores it can cost less);
- ``jaxckpt-fused``: ``ckpt.wrap_step`` as a user gets it (``copy="auto"``: on CPU devices a save() waited for
  before the plain program, on an accelerator the program's own copy to pinned host);
- ``jaxckpt-fused-program``: ``wrap_step(copy="in_program")``: the step program itself copies its incoming state
  to pinned host, on CPU devices too;
- ``jaxckpt-shm``, ``jaxckpt-fused-shm``, ``jaxckpt-fused-program-shm``: the same with ``store="shm"`` (the slots
  are the node agent's shared memory, issue 4);
- ``jaxckpt-whole`` (with ``--replicas split,whole``): ``jaxckpt`` with ``Config.replicas="whole"``, each
  process named a node of its own (``Config.node_name``), so every process saves a whole copy of the
  replicated arrays it holds: the save cost of whole replicas on one process per node;
- ``orbax``:         ``ocp.AsyncCheckpointer(StandardCheckpointHandler)`` saving every step to tmpfs.

``--modes`` measures a subset (``none`` always among them: the baseline). ``--orbax-steps`` times Orbax over
fewer steps than the others (the ``4k-leaves`` state: Orbax's save of 4,083 leaves per step makes its mode
alone outlast a sitting); the result records it and the table says so.

and then the idle snapshot throughput (save + wait with no training), compared with the machine's memcpy
bandwidth measured in the same run. Step time is measured to the completion of each step's loss.
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from jaxckpt.tools.bench.report import machine_facts, now_utc, summarize

log = logging.getLogger("jaxckpt.tools.bench")

MODES = ("none", "copy-floor", "view-floor", "jaxckpt", "jaxckpt-wait", "jaxckpt-fused", "jaxckpt-fused-program",
         "jaxckpt-shm", "jaxckpt-fused-shm", "jaxckpt-fused-program-shm", "jaxckpt-whole", "orbax")
# save() returning before its copy: the views held while the next step runs, as view-floor's are
OVERLAPPED = ("jaxckpt", "jaxckpt-shm", "jaxckpt-whole")
OPTIONAL = {"jaxckpt-whole": "whole"}  # modes run only when --replicas names them
# Presets: (d_model, layers). State bytes ~ 12 bytes/param (param + 2 AdamW moments, float32). "0.2G-deep" has
# the bytes of "0.2G" in 4x the layers: 879 leaves instead of 231 (the leaf count of an LLM-like state, issue 13).
# "4k-leaves": 4,083 leaves of 68 MB (issue 28's state of ~4,096 leaves: per-leaf costs, not bytes, dominate).
SIZES = {"tiny": (64, 2), "0.2G": (512, 6), "0.2G-deep": (256, 24), "1G": (1024, 7), "4k-leaves": (64, 113)}


def gpt_config(size: str, seq_len: int) -> dict:
    d, layers = SIZES[size]
    return {"d_model": d, "layers": layers, "heads": 8 if d >= 256 else 4, "seq_len": seq_len, "vocab": 256}


def job_id(spec: dict, mode: str) -> str:
    """The job id of one mode's checkpointer (each mode its own job, and its own agent with ``-shm``)."""
    return f"stall-{spec['size']}-{mode}"


def agent_dir(spec: dict, mode: str) -> str:
    """The node agent's directory of a ``-shm`` mode, inside the run's private temporary directory."""
    return os.path.join(spec["orbax_dir"], f"agent-{mode}")


def run_process(spec: dict) -> dict:
    """One launched process: every mode for one model size, ``spec["rounds"]`` times over. Returns JSON-ready
    measurements (each mode's step, call and snapshot times pooled over the rounds)."""
    import jax

    from jaxckpt.tools.bench import gpt

    cfg = gpt.GPTConfig(**spec["gpt"])
    mesh = gpt.make_mesh()
    step_fn = gpt.make_train_step(cfg, mesh)
    orbax_steps = spec.get("orbax_steps") or spec["steps"]
    n = spec["warmup"] + max(spec["steps"], orbax_steps)
    data = [b for _, b in gpt.batches(cfg, mesh, spec["batch"], seed=0, stop=n)]
    proc = jax.process_index()
    out: dict[str, Any] = {"process": proc, "state_bytes": None, "leaves": None, "modes": {}}

    rounds = spec.get("rounds", 1)
    took: dict[str, dict[str, Any]] = {}
    # Each round measures every mode once, in order, on a fresh state: over several rounds a drift of the
    # machine's speed (other work, thermal, memory) falls on every mode alike instead of on the mode that ran then.
    for r in range(rounds):
        for mode in spec["modes"]:
            got = _measure_mode(spec, mode, r, cfg, mesh, step_fn, data, orbax_steps, idle=r == rounds - 1)
            out["state_bytes"], out["leaves"] = got.pop("state_bytes"), got.pop("leaves")
            if "floor" in got:
                out.setdefault("floor", got.pop("floor"))
            acc = took.setdefault(mode, {})
            for key, value in got.items():
                acc.setdefault(key, []).append(value)
    for mode, acc in took.items():
        entry: dict[str, Any] = {}
        for key in ("step_s", "save_call_s", "idle_snapshot_s", "snapshot_s"):
            pooled = [x for xs in acc.get(key, []) for x in xs]
            if pooled:
                entry[key] = summarize(pooled)
        if "bytes_this_process" in acc:
            entry["bytes_this_process"] = acc["bytes_this_process"][-1]
        if "floor_passes" in acc:
            entry["floor_passes"] = sum(acc["floor_passes"])
        entry["breakdown"] = _mean_breakdown(acc["breakdown"])
        out["modes"][mode] = entry
        log.info("process %d size %s mode %s: median step %.3fs", proc, spec["size"], mode,
                 entry["step_s"]["median"])
    return out


def _measure_mode(spec: dict, mode: str, rnd: int, cfg: Any, mesh: Any, step_fn: Any, data: list,
                  orbax_steps: int, idle: bool) -> dict[str, Any]:
    """One mode of one round on a fresh state: its raw step, call and snapshot times and its breakdown."""
    import jax
    import orbax.checkpoint as ocp

    import jaxckpt
    from jaxckpt.tools.bench import gpt
    from jaxckpt.tools.bench.breakdown import Breakdown, FloorCopy, copy_floor, take_views

    proc = jax.process_index()
    out: dict[str, Any] = {}
    steps = orbax_steps if mode == "orbax" else spec["steps"]
    n = spec["warmup"] + steps
    state = gpt.init_state(cfg, mesh, seed=0)
    out["state_bytes"] = gpt.state_bytes(state)
    out["leaves"] = len(jax.tree_util.tree_leaves(state))
    step_times, call_times, snap_times, idle_times, nbytes = [], [], [], [], 0
    ck = tmp = ckptr = fused = floor = views = None
    if mode in ("copy-floor", "view-floor"):
        sizes, plan = _saved(spec, state)
        floor = FloorCopy(sizes)
        views = plan if mode == "view-floor" else None
    if mode.startswith("jaxckpt"):
        shm = {"store": "shm", "shm_dir": agent_dir(spec, mode)} if mode.endswith("-shm") else {}
        whole = {"replicas": "whole"} if mode == "jaxckpt-whole" else {}
        # The launcher names the node through JAXCKPT_NODE_NAME, which a Checkpointer's Config.with_env()
        # applies over any node_name given: each process its own node goes through the same variable.
        node = os.environ.get("JAXCKPT_NODE_NAME")
        if whole:
            os.environ["JAXCKPT_NODE_NAME"] = f"stall-node{proc}"
        try:
            ck = jaxckpt.Checkpointer(jaxckpt.Config(job_id=job_id(spec, mode), keep=1, **shm,
                                                     **(whole or {"replicas": "split"})))
        finally:
            if whole and node is None:
                os.environ.pop("JAXCKPT_NODE_NAME", None)
            elif whole:
                os.environ["JAXCKPT_NODE_NAME"] = node
        if mode.startswith("jaxckpt-fused"):
            fused = ck.wrap_step(step_fn, copy="in_program" if "-program" in mode else "auto")
    elif mode == "orbax":
        tmp = spec["orbax_dir"]
        ckptr = ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())
    handles = []
    probe = Breakdown(ck)
    for i, batch in enumerate(data[:n]):
        if i == spec["warmup"]:
            probe.start()
        t0 = time.perf_counter()
        if fused is not None:
            state, loss = fused(state, batch, save_step=i)
            # The calling thread's time in the save (before the step: its wait for the copy too), as for save():
            # the program's dispatch, which a step without snapshots pays as well, is not the save's.
            call = fused.last_save.save_call_seconds
        else:
            state, loss = step_fn(state, batch)
            # A training loop that logs its loss waits for the step here; saving after that measures what
            # save() itself costs the training thread (on CPU a view of an unfinished array would wait too).
            loss.block_until_ready()
            tc = time.perf_counter()
            if ck is not None:
                handles.append(ck.save(i, state))
                if mode == "jaxckpt-wait":
                    handles[-1].result()
            elif floor is not None:
                held = None if views is None else take_views(jax.tree_util.tree_leaves(state), views)
                viewed = time.perf_counter()  # view-floor's call: the views alone (start may wait for a pass)
                floor.start(held)
                del held  # the pass's thread holds the last reference: it drops the views when the pass ends
            elif mode == "orbax":
                ckptr.save(os.path.join(tmp, f"{mode}-r{rnd}-{i}"), args=ocp.args.StandardSave(state))
                if proc == 0 and i >= 2:  # keep tmpfs bounded; save i waited for save i-1, so i-2 is final
                    shutil.rmtree(os.path.join(tmp, f"{mode}-r{rnd}-{i - 2}"), ignore_errors=True)
            call = (viewed if floor is not None else time.perf_counter()) - tc
        loss.block_until_ready()
        if i >= spec["warmup"]:
            step_times.append(time.perf_counter() - t0)
            call_times.append(call)
    if ck is not None:
        ck.wait()  # the last copy's CPU counts in the breakdown
        breakdown = probe.stop(steps)
        if idle:  # once per mode: the last round's
            out["floor"] = copy_floor(ck.engine.last_chunk_sizes())
        if fused is None:
            snap_times = [h.snapshot_seconds for h in handles[spec["warmup"]:]]
            nbytes = handles[-1].nbytes
        # Idle throughput: save and wait with nothing else running, slots already warm (the last round's).
        for k in range(spec["idle_repeats"] if idle else 0):
            h = ck.save(n + k, state)
            h.result()
            idle_times.append(h.snapshot_seconds)
            nbytes = h.nbytes
        ck.close()
        if mode.endswith("-shm"):  # free the agent's memory before the next mode: 1 GB states need it back
            from jax.experimental import multihost_utils

            from jaxckpt.backends.agent import protocol as proto
            multihost_utils.sync_global_devices(f"stall {spec['size']} {mode} closed")
            if proc == 0:
                proto.stop_agent(agent_dir(spec, mode), job_id(spec, mode), timeout_s=60)
        out.update(step_s=step_times, save_call_s=call_times, idle_snapshot_s=idle_times, breakdown=breakdown,
                   snapshot_s=snap_times, **({"bytes_this_process": nbytes} if nbytes else {}))
    else:
        if ckptr is not None:
            ckptr.wait_until_finished()
            ckptr.close()
        if floor is not None:
            floor.wait()  # the last pass's CPU counts in the breakdown, as a save's does
        out.update(step_s=step_times, breakdown=probe.stop(steps))
        if floor is not None:
            floor.close()
            out.update(bytes_this_process=floor.bytes, floor_passes=floor.passes)
        if mode in ("orbax", "view-floor"):  # view-floor's call: taking the views
            out["save_call_s"] = call_times
    del state
    log.debug("process %d size %s mode %s round %d: median step %.3fs", proc, spec["size"], mode, rnd,
              float(np.median(step_times)))
    return out


def _saved(spec: dict, state: Any) -> tuple[list[int], Any]:
    """The pieces a jaxckpt save of ``state`` moves on this process, in order, and the buffers it views
    (``breakdown.saved_views``): one save to the memory store, of a job of its own, waited for (every process
    calls it: the save is collective)."""
    import jaxckpt
    from jaxckpt.tools.bench.breakdown import saved_views

    ck = jaxckpt.Checkpointer(jaxckpt.Config(job_id=job_id(spec, "copy-floor"), keep=1, replicas="split"))
    try:
        ck.save(0, state).result()
        return list(ck.engine.last_chunk_sizes()), saved_views(ck)
    finally:
        ck.close()


def _mean_breakdown(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-save breakdowns of a mode's rounds (each of the same number of saves), averaged key by key."""
    def mean(values: list[Any]) -> Any:
        if isinstance(values[0], dict):
            keys = {k for v in values for k in v}
            return {k: mean([v.get(k, 0.0) for v in values]) for k in sorted(keys)}
        return round(sum(values) / len(values), 3)
    return mean(parts)



def merge_row(size: str, procs: int, per_proc: list[dict], memcpy: dict) -> dict:
    """One result row per size and process count: the slowest process's medians (the step waits for the
    slowest)."""
    def worst(mode: str, key: str) -> float | None:
        vals = [p["modes"][mode][key]["median"] for p in per_proc if key in p["modes"].get(mode, {})]
        return max(vals) if vals else None

    row: dict[str, Any] = {"size": size, "procs": procs, "state_bytes": per_proc[0]["state_bytes"],
                           "leaves": per_proc[0].get("leaves"), "processes": per_proc}
    base = worst("none", "step_s")
    summary: dict[str, Any] = {"step_s_none": base}
    for mode in MODES[1:]:
        if mode not in per_proc[0]["modes"]:
            continue
        st = worst(mode, "step_s")
        summary[f"step_s_{mode}"] = st
        summary[f"overhead_pct_{mode}"] = 100.0 * (st - base) / base
        summary[f"save_call_s_{mode}"] = worst(mode, "save_call_s")
    for mode in MODES:
        if mode.startswith("jaxckpt") and mode in per_proc[0]["modes"]:
            gbps = min(p["modes"][mode]["bytes_this_process"] / p["modes"][mode]["idle_snapshot_s"]["median"] / 1e9
                       for p in per_proc)
            summary[f"idle_snapshot_gbps_{mode}"] = gbps
            summary[f"idle_snapshot_vs_memcpy_{mode}"] = gbps / memcpy["median"]
    floor = max((p["floor"]["copy_crc_s"] for p in per_proc if "floor" in p), default=None)
    if floor:
        summary["floor_copy_crc_s"] = floor  # the slowest process's, as the step waits for the slowest
        for mode in MODES[1:]:
            if f"step_s_{mode}" in summary:
                summary[f"cost_vs_floor_{mode}"] = (summary[f"step_s_{mode}"] - base) / floor
    if "copy-floor" in per_proc[0]["modes"]:  # what a snapshot costs the step beyond moving its bytes once
        for mode in MODES[2:]:
            if f"overhead_pct_{mode}" in summary:
                summary[f"beyond_copy_floor_pts_{mode}"] = (summary[f"overhead_pct_{mode}"]
                                                            - summary["overhead_pct_copy-floor"])
    if "view-floor" in per_proc[0]["modes"]:
        # Taking the views alone, in points of step time: every mode takes them on the training thread.
        summary["views_pts"] = 100.0 * summary["save_call_s_view-floor"] / base
        for mode in OVERLAPPED:  # ... and beyond what JAX's part and the bytes cost a save that returns at once
            if f"overhead_pct_{mode}" in summary:
                summary[f"beyond_view_floor_pts_{mode}"] = (summary[f"overhead_pct_{mode}"]
                                                            - summary["overhead_pct_view-floor"])
    if "orbax" in per_proc[0]["modes"] and "jaxckpt" in per_proc[0]["modes"]:
        summary["save_call_ratio_orbax_over_jaxckpt"] = summary["save_call_s_orbax"] / summary["save_call_s_jaxckpt"]
    if "orbax" in per_proc[0]["modes"]:
        orbax = summary["overhead_pct_orbax"]
        for mode in MODES[1:-1]:  # each jaxckpt mode's step-time overhead as a share of Orbax's (issue 13: <= 0.1)
            if f"overhead_pct_{mode}" in summary and orbax > 0:
                summary[f"overhead_of_orbax_{mode}"] = summary[f"overhead_pct_{mode}"] / orbax
    row["summary"] = summary
    return row


def run(args: argparse.Namespace) -> int:
    """Drive the benchmark: memcpy first, then each size in ``--procs`` launched processes (or, with
    ``--from-json``, measure nothing and render that result)."""
    import importlib.util

    if args.from_json:
        from jaxckpt.tools.bench.report import read_json

        result = read_json(args.from_json)
        _update_md(args, result)
        print(render_stall(result))
        return 0
    try:
        procs_list(args.procs)
        modes(args)
        if getattr(args, "orbax_steps", None) is not None and args.orbax_steps < 1:
            raise ValueError(f"--orbax-steps {args.orbax_steps}: at least 1")
        if getattr(args, "rounds", 1) < 1:
            raise ValueError(f"--rounds {args.rounds}: at least 1")
        unknown = [z for z in args.sizes.split(",") if z not in SIZES]
        if unknown:
            raise ValueError(f"--sizes: unknown preset(s) {unknown}; the presets are {sorted(SIZES)}")
    except ValueError as e:
        log.error("bench stall: %s", e)
        return 2
    if not all(importlib.util.find_spec(m) for m in ("flax", "optax")):
        log.error("bench stall trains a Flax GPT: pip install 'jaxckpt[bench]' (flax and optax)")
        return 2
    from jaxckpt.backends.agent import protocol as proto
    from jaxckpt.tools.bench.memcpy import memcpy_gbps
    from jaxckpt.tools.bench.report import write_json
    from jaxckpt.tools.launcher import expect_ok, launch

    sizes = ["tiny"] if args.quick else args.sizes.split(",")
    steps, warmup = (3, 1) if args.quick else (args.steps, args.warmup)
    orbax_steps = min(steps, args.orbax_steps) if getattr(args, "orbax_steps", None) else steps
    rounds = getattr(args, "rounds", 1)
    memcpy = summarize(memcpy_gbps(64 << 20 if args.quick else 256 << 20, 5 if args.quick else 10))
    result: dict[str, Any] = {"bench": "stall", "mode": "quick" if args.quick else "full", "date": now_utc(),
                              "machine": machine_facts(), "command": command(args),
                              "memcpy_gbps": memcpy, "procs": procs_list(args.procs), "steps": steps,
                              "warmup": warmup, "orbax_steps": orbax_steps, "rounds": rounds,
                              "fused_call": "save", "results": []}
    for size, procs in [(size, n) for size in sizes for n in procs_list(args.procs)]:
        tmp = tempfile.mkdtemp(prefix="jaxckpt-stall-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        spec = {"size": size, "gpt": gpt_config(size, args.seq_len), "batch": args.batch, "steps": steps,
                "warmup": warmup, "orbax_steps": orbax_steps, "modes": modes(args), "orbax_dir": tmp,
                "idle_repeats": 2 if args.quick else 5, "rounds": rounds}
        try:
            log.info("bench stall: size %s on %d processes", size, procs)
            per_proc = expect_ok(launch(run_process, nodes=1, procs_per_node=procs,
                                        devices_per_proc=8 // procs, args=(spec,), timeout=args.timeout))
            result["results"].append(merge_row(size, procs, per_proc, memcpy))
        finally:
            for mode in MODES:
                if mode.endswith("-shm"):  # the agents the trainers spawned: free their memory before the next size
                    proto.stop_agent(agent_dir(spec, mode), job_id(spec, mode), timeout_s=60)
                    proto.kill_agent(agent_dir(spec, mode), remove_memory=True)  # only if it did not stop
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        write_json(args.json, result)
    _update_md(args, result)
    for row in result["results"]:
        log.info("size %s, %d processes: %s", row["size"], row["procs"],
                 {k: round(v, 4) for k, v in row["summary"].items() if v is not None})
    return 0


def modes(args: argparse.Namespace) -> list[str]:
    """The modes of this run: every mode but the optional ones ``--replicas`` does not ask for, or the subset
    ``--modes`` names (with ``none``, the baseline every other mode is measured against)."""
    asked = {r.strip() for r in str(getattr(args, "replicas", "split")).split(",") if r.strip()}
    bad = asked - {"split", "whole"}
    if bad:
        raise ValueError(f"--replicas {args.replicas!r}: expected split, whole or split,whole")
    out = [m for m in MODES if m not in OPTIONAL or OPTIONAL[m] in asked]
    if getattr(args, "modes", None):
        want = [m.strip() for m in args.modes.split(",") if m.strip()]
        unknown = [m for m in want if m not in MODES]
        if unknown or "none" not in want:
            raise ValueError(f"--modes {args.modes!r}: a comma-separated subset of {', '.join(MODES)} that "
                             f"includes none (the baseline)")
        off = [m for m in want if m not in out]
        if off:
            raise ValueError(f"--modes {args.modes!r}: {', '.join(off)} needs --replicas split,whole")
        out = [m for m in out if m in want]
    return out


def procs_list(value: str | int) -> list[int]:
    """``--procs``: one process count or several, comma-separated; each must split the 8 CPU devices."""
    counts = [int(v) for v in str(value).split(",") if v.strip()]
    bad = [n for n in counts if n < 1 or 8 % n]
    if not counts or bad:
        raise ValueError(f"--procs {value!r}: each count must divide the 8 CPU devices (1, 2, 4 or 8)")
    return counts


def _update_md(args: argparse.Namespace, result: dict) -> None:
    """With ``--update-md``: the stall section, and its JSON kept beside the plots (docs/bench/stall.json)."""
    if args.update_md:
        from jaxckpt.tools.bench.report import record_dir, record_json, replace_section

        replace_section(args.update_md, "stall", render_stall(result))
        record_json(record_dir(args.update_md), "stall", result)


def command(args: argparse.Namespace) -> str:
    """The command line that repeats this run (built from the options, not from sys.argv: the CLI may be
    reached through ``python -m jaxckpt.cli --log-level ...`` or ``jaxckpt bench all``)."""
    words = ["jaxckpt", "bench", "stall"]
    if args.quick:
        words.append("--quick")
    else:
        words += ["--sizes", args.sizes, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    words += ["--procs", ",".join(map(str, procs_list(args.procs)))]
    if getattr(args, "replicas", "split") != "split":
        words += ["--replicas", args.replicas]
    if getattr(args, "modes", None):
        words += ["--modes", ",".join(modes(args))]
    if getattr(args, "orbax_steps", None) and not args.quick:
        words += ["--orbax-steps", str(args.orbax_steps)]
    if getattr(args, "rounds", 1) != 1:
        words += ["--rounds", str(args.rounds)]
    for flag, value in (("--json", args.json), ("--update-md", args.update_md)):
        if value:
            words += [flag, value]
    return shlex.join(words)


def render_stall(result: dict) -> str:
    """The BENCHMARKS.md section of a stall result (every number from the JSON)."""
    from jaxckpt.tools.bench.report import machine_line, table

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.2f}"

    lines = ["### `jaxckpt bench stall`: step time with a snapshot every step, against Orbax", ""]
    if result.get("mode") == "quick":
        lines += ["> **Quick run, placeholder until the full run.** A tiny model and 3 steps on a shared machine: "
                  "these numbers show the shape of the table, not the performance.", ""]
    counts = result["procs"] if isinstance(result["procs"], list) else [result["procs"]]
    lines += [f"`{result['command']}` on {' and '.join(map(str, counts))} process(es), {result['date']}; "
             + (f"{result['rounds']} rounds (every mode once per round, in turn, on a fresh state), pooled: "
                if result.get("rounds", 1) > 1 else "")
             + f"medians over {result['steps']} steps after {result['warmup']} warm-up steps"
             + (f" (Orbax over {result['orbax_steps']})" if result.get("orbax_steps", result["steps"])
                != result["steps"] else "") + ".", "",
             # memcpy_gbps is a summary here (a number in the other benches): its own line below.
             machine_line({k: v for k, v in result.items() if k != "memcpy_gbps"}), "",
             f"memcpy (one thread, same run): median {result['memcpy_gbps']['median']:.2f} GB/s", ""]
    rows = []
    for row in result["results"]:
        s = row["summary"]
        head = [row["size"], str(row.get("procs", counts[0])), str(row.get("leaves") or "-"),
                f"{row['state_bytes'] / 1e9:.2f}"]
        for mode in MODES:
            if mode == "none":
                rows.append([*head, mode, ms(s["step_s_none"]), "-", "-", "-", "-"])
                continue
            if f"step_s_{mode}" not in s:
                continue
            gbps = s.get(f"idle_snapshot_gbps_{mode}")
            share = s.get(f"overhead_of_orbax_{mode}")
            rows.append([*head, mode, ms(s[f"step_s_{mode}"]), f"{s[f'overhead_pct_{mode}']:+.1f}%",
                         "-" if share is None else f"{share:+.2f}", ms(s[f"save_call_s_{mode}"]),
                         "-" if gbps is None else f"{gbps:.2f} ({100 * s[f'idle_snapshot_vs_memcpy_{mode}']:.0f}%)"])
    lines.append(table(["size", "processes", "leaves", "state GB", "mode", "step ms", "overhead",
                        "overhead / Orbax's", "save() call ms", "idle snapshot GB/s per process (vs memcpy)"], rows))
    if any("step_s_copy-floor" in row["summary"] for row in result["results"]):
        lines += ["", "`copy-floor` checkpoints nothing: where the other modes save, one thread copies the bytes a "
                      "jaxckpt save moves, in the same pieces, each with its crc32c, into a buffer of its own. Its "
                      "overhead is what moving those bytes once costs the step on this machine, beside XLA's "
                      "threads: the bytes' own share of a snapshot's cost. Each mode's \"beyond the copy floor\" "
                      "below is its overhead less that one, in points of step time."]
    if any("step_s_view-floor" in row["summary"] for row in result["results"]):
        lines += ["", "`view-floor` is `copy-floor` with, before each pass, zero-copy views of every buffer a "
                      "jaxckpt save views, taken on the training thread the way save() takes them (JAX exposing "
                      "each array's local buffers, then a view of each one read) and held until the pass ends, as "
                      "a save's are: what the part of a snapshot JAX decides costs the step, beside the bytes' "
                      "(its save() call column: taking the views, a share of the step every mode pays on the "
                      "training thread). \"Beyond the view floor\", for the modes whose save() returns before "
                      "its copy (`jaxckpt`, `jaxckpt-shm`, `jaxckpt-whole`), is a mode's overhead less that one; "
                      "`wrap_step` on CPU devices waits for its copy and lets the views go before the step (the "
                      "donation not held back), so its floor is the views' share plus the copy's wait."]
    if any("step_s_jaxckpt-wait" in row["summary"] for row in result["results"]):
        lines += ["", "`jaxckpt-wait` waits for each save before the next step: its save() call column is the call "
                      "and that wait."]
    if any("step_s_jaxckpt-fused-program" in row["summary"] or "step_s_jaxckpt-fused-program-shm" in row["summary"]
           for row in result["results"]):
        lines += ["", "`jaxckpt-fused` is `wrap_step` as a user gets it (`copy=\"auto\"`: on CPU devices a save() "
                      "waited for before the plain program); `jaxckpt-fused-program` is `copy=\"in_program\"`, the "
                      "program's own copy to pinned host that an accelerator takes, here on CPU devices too."]
    if any(key.startswith("step_s_jaxckpt-fused") for row in result["results"] for key in row["summary"]):
        lines += ["", "The save() call column of the `wrap_step` modes (`jaxckpt-fused*`) is "
                  + ("the calling thread's time in the save (before the step, its wait for the copy too), the "
                     "program's dispatch excluded, as a step without snapshots dispatches it too."
                     if result.get("fused_call") == "save" else
                     "the whole wrapped call: the save and the program's dispatch.")]
    lines += ["", "Where a snapshot's time goes (process 0; per step, against `none` in the same run; the floor is "
                  "copy + crc32c of the same bytes in the same pieces on one thread; CPU figures need a quiet "
                  "machine to compare across runs):", ""]
    for row in result["results"]:
        lines += _breakdown_lines(row)
    ratios = [f"{row['size']} on {row.get('procs', counts[0])}: "
              f"{row['summary']['save_call_ratio_orbax_over_jaxckpt']:.0f}x"
              for row in result["results"] if "save_call_ratio_orbax_over_jaxckpt" in row["summary"]]
    if ratios:
        lines += ["", "Orbax save-call time / jaxckpt save-call time: " + ", ".join(ratios)]
    return "\n".join(lines)


def _breakdown_lines(row: dict) -> list[str]:
    from jaxckpt.tools.bench.breakdown import blocked_added, describe

    p0, s = row["processes"][0], row["summary"]
    base = p0["modes"].get("none", {}).get("breakdown")
    out = []
    for mode in MODES[1:]:
        b = p0["modes"].get(mode, {}).get("breakdown")
        if b is None or base is None:
            continue
        added = {k: v - base["cpu_ms"].get(k, 0.0) for k, v in b["cpu_ms"].items()}
        cost = s.get(f"cost_vs_floor_{mode}")
        beyond, past = s.get(f"beyond_copy_floor_pts_{mode}"), s.get(f"beyond_view_floor_pts_{mode}")
        views = s.get("views_pts") if mode == "view-floor" or mode.startswith("jaxckpt") else None
        head = "".join([f"- {row['size']} on {row.get('procs', 1)}, `{mode}`: ",
                        "" if cost is None else f"step time added {cost:.1f}x the floor; ",
                        "" if beyond is None else f"{beyond:+.1f} points beyond the copy floor's "
                                                  f"{s['overhead_pct_copy-floor']:+.1f}%; ",
                        "" if past is None else f"{past:+.1f} beyond the view floor's "
                                                f"{s['overhead_pct_view-floor']:+.1f}%; ",
                        "" if views is None else f"the views alone {views:.1f} points; ",
                        "CPU added per step ", ", ".join(f"{k} {v:+.2f} ms" for k, v in sorted(added.items())),
                        "".join(f"; {t}" for t in [blocked_added(b, base)] if t)])
        out.append(head)
        out += ["  " + line for line in describe(b, p0.get("floor") if mode == "jaxckpt" else None).splitlines()]
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register ``jaxckpt bench stall``'s flags."""
    p.add_argument("--sizes", default="0.2G,1G", help=f"comma-separated presets from {sorted(SIZES)}")
    p.add_argument("--steps", type=int, default=20, help="measured steps per mode (after warm-up)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--procs", default="2", help="JAX processes (8 CPU devices split between them); several, "
                                                 "comma-separated (e.g. 1,2), run each size on each count")
    p.add_argument("--replicas", default="split", help="Config.replicas of the jaxckpt modes: split (default), or "
                                                       "split,whole to add mode jaxckpt-whole (each process its "
                                                       "own node, saving whole copies of the replicated arrays)")
    p.add_argument("--modes", default=None, help="comma-separated subset of the modes to measure, none (the "
                                                 "baseline) among them (default: every mode)")
    p.add_argument("--orbax-steps", type=int, default=None, help="time Orbax over this many steps only (at most "
                   "--steps; default --steps): its save of thousands of leaves per step (4k-leaves) outlasts the "
                   "other modes together")
    p.add_argument("--rounds", type=int, default=1, help="measure every mode this many times, in turn (each "
                   "round every mode once on a fresh state), pooling each mode's steps: a drift of a shared "
                   "machine's speed then falls on every mode alike")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--quick", action="store_true", help="tiny model, 3 steps: checks the machinery, not speed")
    p.add_argument("--json", default="", help="write results here")
    p.add_argument("--update-md", default="", help="regenerate this BENCHMARKS.md's stall section (and keep its "
                                                   "JSON in docs/bench/stall.json beside it)")
    p.add_argument("--from-json", default="", metavar="PATH", help="measure nothing: render (and --update-md) "
                                                                   "this result file")
    p.set_defaults(run=run)
