"""``jaxckpt bench device``: the benchmarks whose numbers change on an accelerator, in one prepared command.

On a machine with a GPU (or any default JAX backend) it runs, one after another, each in fresh processes with
``JAXCKPT_BENCH_DEVICES=default`` (the benchmark state lives on the default backend's devices) and
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (a restorer process and the saver's agent share the device and host with
nothing reserved up front):

- ``floors``:  what the hardware allows: device -> host of the state's arrays into fresh host memory
  (``jax.device_get``) and into pinned host memory (``device_put`` to memory kind ``pinned_host``), host ->
  device (``device_put`` onto the arrays' shardings), and host memcpy, for each state size;
- ``save``:    ``bench save``'s sizes table (save() call, snapshot, restore; Orbax beside it) on those devices;
- ``restore``: ``bench restore`` (restore from memory, from the node agent in fresh processes, Orbax from tmpfs
  and from a page-cache-dropped directory) on those devices;
- ``stall``:   ``bench stall``'s GPT trained on those devices in one process, a snapshot every step: none,
  save(), ``wrap_step`` (the step's own copy to pinned host), save() to the node agent, Orbax;
- ``torch``:   ``bench torch`` (the torch front end against PyTorch DCP) with the state dict's tensors on the GPU
  where torch sees one (on the CPU otherwise); left out of the default parts, with a logged note, where torch
  is not installed.

A part that fails is recorded with its exit status and the end of its log, and the others still run (the run's
exit status is then 1): a device lease is short, and one part's failure must not cost the others' numbers.
Every part's JSON and log go to ``--out``; the combined result renders BENCHMARKS.md's ``bench:device`` section.
Without an accelerator the same run measures the CPU backend's one device and says so.
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Mapping

from jaxckpt.tools.bench import report, runner

log = logging.getLogger("jaxckpt.tools.bench")

PARTS = ("floors", "save", "restore", "stall", "torch")
# The full run is sized to fit one device lease (15 minutes, the machine's start included). On an H200 at 1 GiB
# (3 repeats, one GPT over 10 steps) the parts took floors 17 s, save 12 s, restore 18 s, stall 45 s; with 4 GiB
# too, floors 35 s, save 91 s, restore over 200 s (each 4 GiB restorer about 50 s), stall (both GPTs, 20 steps)
# 198 s (2026-12-04, BENCHMARKS.md): 4 GiB is asked for with --sizes 1G,4G.
FULL = {"sizes": "1G", "repeats": 5, "warmup": 2, "restorers": 2, "gpt_sizes": "1G,0.2G-deep", "steps": 20,
        "orbax_steps": 5, "batch": 32, "seq_len": 256, "timeout": 240.0}
QUICK = {"sizes": "4M", "repeats": 2, "warmup": 1, "restorers": 1, "gpt_sizes": "tiny", "steps": 3,
         "orbax_steps": 3, "batch": 8, "seq_len": 32, "timeout": 300.0}
STALL_MODES = ("none", "jaxckpt", "jaxckpt-fused", "jaxckpt-shm", "orbax")
ENV = {"JAXCKPT_BENCH_DEVICES": "default", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``jaxckpt bench device``."""
    def default(key: str) -> str:
        return f"default {FULL[key]}, --quick {QUICK[key]}"
    p.add_argument("--parts", default=None, help=f"comma-separated subset of {','.join(PARTS)} (default: all; "
                                                 f"torch where it is installed)")
    p.add_argument("--sizes", default=None, help=f"state sizes of floors, save and restore ({default('sizes')})")
    p.add_argument("--repeats", type=int, default=None, help=f"timed repeats per size ({default('repeats')})")
    p.add_argument("--warmup", type=int, default=None, help=f"untimed rounds first ({default('warmup')})")
    p.add_argument("--restorers", type=int, default=None, help=f"fresh restorer processes ({default('restorers')})")
    p.add_argument("--gpt-sizes", default=None, help=f"bench stall presets to train ({default('gpt_sizes')})")
    p.add_argument("--steps", type=int, default=None, help=f"measured steps per stall mode ({default('steps')})")
    p.add_argument("--orbax-steps", type=int, default=None, help=f"steps Orbax is timed over "
                                                                 f"({default('orbax_steps')})")
    p.add_argument("--batch", type=int, default=None, help=f"GPT batch ({default('batch')})")
    p.add_argument("--seq-len", type=int, default=None, help=f"GPT sequence length ({default('seq_len')})")
    p.add_argument("--out", default=None, help="every part's JSON and log go here (default: a temporary directory, "
                                               "removed afterwards)")
    p.add_argument("--child", choices=("floors", "stall"), default=None, help=argparse.SUPPRESS)
    runner.output_arguments(p, "device", "tiny sizes and a tiny GPT: the machinery, not the speed",
                            timeout=None)
    p.add_argument("--timeout", type=float, default=None, help=f"limit for each part, in seconds "
                                                               f"({default('timeout')})")
    p.set_defaults(run=run)


def options(args: argparse.Namespace) -> dict[str, Any]:
    """Effective settings: explicit flags over the --quick or full defaults; ValueError for bad ones."""
    from jaxckpt.tools.bench.save import parse_size
    from jaxckpt.tools.bench.stall import SIZES

    out = dict(QUICK if args.quick else FULL, quick=args.quick)
    for key in FULL:
        if getattr(args, key, None) is not None:
            out[key] = getattr(args, key)
    asked = getattr(args, "parts", None)
    if asked is None:
        import importlib.util
        out["parts"] = [p for p in PARTS if p != "torch" or importlib.util.find_spec("torch") is not None]
        if "torch" not in out["parts"]:
            log.warning("bench device: torch is not installed (pip install 'jaxckpt[torch]'): leaving out its part")
    else:
        out["parts"] = [p.strip() for p in str(asked).split(",") if p.strip()]
    unknown = [p for p in out["parts"] if p not in PARTS]
    if unknown or not out["parts"]:
        raise ValueError(f"bench device: --parts {','.join(out['parts'])!r}: a subset of {','.join(PARTS)}")
    out["size_list"] = [parse_size(s) for s in str(out["sizes"]).split(",") if s.strip()]
    out["gpt_list"] = [s.strip() for s in str(out["gpt_sizes"]).split(",") if s.strip()]
    bad = [s for s in out["gpt_list"] if s not in SIZES]
    if bad or not out["gpt_list"] or not out["size_list"]:
        raise ValueError(f"bench device: --sizes {out['sizes']!r} and --gpt-sizes {out['gpt_sizes']!r}: at least one "
                         f"each; GPT presets are {sorted(SIZES)}")
    for key in ("repeats", "warmup", "restorers", "steps", "orbax_steps", "batch", "seq_len"):
        if int(out[key]) < 1:
            raise ValueError(f"bench device: --{key.replace('_', '-')} {out[key]}: at least 1")
    if out["timeout"] <= 0:
        raise ValueError(f"bench device: --timeout {out['timeout']}: must be positive")
    return out


def command(args: argparse.Namespace) -> str:
    """The command line that repeats this run."""
    flags = [("--parts", "parts"), ("--sizes", "sizes"), ("--repeats", "repeats"), ("--warmup", "warmup"),
             ("--restorers", "restorers"), ("--gpt-sizes", "gpt_sizes"), ("--steps", "steps"),
             ("--orbax-steps", "orbax_steps"), ("--batch", "batch"), ("--seq-len", "seq_len"),
             ("--timeout", "timeout")]
    return runner.command_line("device", args, flags)


# ------------------------------------------------------------------------------------------------- the driver
def part_command(part: str, opts: Mapping[str, Any], json_path: str) -> list[str]:
    """The process that measures ``part``, writing its result to ``json_path``."""
    py = sys.executable
    sizes = ["--sizes", str(opts["sizes"]), "--repeats", str(opts["repeats"]), "--warmup", str(opts["warmup"])]
    if part == "save":
        return [py, "-m", "jaxckpt.tools.bench.save", *sizes, "--leaf-counts", "none", "--json", json_path]
    if part == "torch":
        return [py, "-m", "jaxckpt.tools.bench.torch_dcp", *sizes, "--json", json_path]
    if part == "restore":
        return [py, "-m", "jaxckpt.tools.bench.restore", "--sizes", str(opts["sizes"]), "--repeats",
                str(opts["repeats"]), "--restorers", str(opts["restorers"]), "--timeout", str(opts["timeout"]),
                "--json", json_path]
    words = [py, "-m", "jaxckpt.tools.bench.device", "--child", part, *sizes, "--gpt-sizes", str(opts["gpt_sizes"]),
             "--steps", str(opts["steps"]), "--orbax-steps", str(opts["orbax_steps"]), "--batch",
             str(opts["batch"]), "--seq-len", str(opts["seq_len"]), "--json", json_path]
    return words + (["--quick"] if opts["quick"] else [])


def measure(opts: Mapping[str, Any], cmd: str, out_dir: str | None) -> dict[str, Any]:
    """Run every part in its own processes, one after another; the combined result (failed parts recorded)."""
    where = out_dir or tempfile.mkdtemp(prefix="jaxckpt-bench-device-")
    os.makedirs(where, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    # The project's launcher pins JAX_PLATFORMS=cpu unless the variable is set: empty means JAX's own default.
    env.update(ENV, JAX_PLATFORMS="")
    result: dict[str, Any] = {"bench": "device", "mode": "quick" if opts["quick"] else "full",
                              "date": report.now_utc(), "machine": report.machine_facts(), "command": cmd,
                              "setup": {k: opts[k] for k in FULL}, "parts": {}, "failed": {}}
    try:
        for i, part in enumerate(opts["parts"]):
            path, log_path = os.path.join(where, f"{part}.json"), os.path.join(where, f"{part}.log")
            argv = part_command(part, opts, path)
            log.info("bench device: part %d of %d, %s: %s", i + 1, len(opts["parts"]), part, shlex.join(argv))
            t0 = time.perf_counter()
            before = _scratch()
            with open(log_path, "w") as f:
                # A session of its own: a part that runs out of time goes with every process it started.
                proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
                try:
                    rc: int | str = proc.wait(timeout=opts["timeout"])
                except BaseException as e:
                    rc = "timeout"
                    left = _reap(proc, before)
                    if not isinstance(e, subprocess.TimeoutExpired):
                        raise
                    if left:
                        log.warning("bench device: %s ran out of time: killed its processes and agents, removed %s",
                                    part, ", ".join(left))
            wall = time.perf_counter() - t0
            if rc == 0 and os.path.exists(path):
                result["parts"][part] = report.read_json(path)
                result["parts"][part]["wall_s"] = wall
                log.info("bench device: %s done in %.0f s", part, wall)
            else:
                with open(log_path, errors="replace") as f:
                    tail = f.read()[-4000:]
                result["failed"][part] = {"rc": rc, "wall_s": wall, "log_tail": tail}
                log.error("bench device: %s failed (%s) after %.0f s; its log ends:\n%s", part, rc, wall, tail)
    finally:
        if out_dir is None:
            shutil.rmtree(where, ignore_errors=True)
    return result


SCRATCH = ("jaxckpt-bench-", "jaxckpt-device-")  # the prefixes of the parts' own scratch directories


def _scratch() -> set[str]:
    """The parts' scratch directories there are now, in /dev/shm and the temporary directory."""
    out = set()
    for root in {"/dev/shm", tempfile.gettempdir()}:
        if os.path.isdir(root):
            out |= {os.path.join(root, n) for n in os.listdir(root) if n.startswith(SCRATCH)}
    return out


def _reap(proc: subprocess.Popen, before: set[str]) -> list[str]:
    """After a part ran out of time: SIGKILL its session, stop the node agents it spawned (they run in sessions
    of their own, holding their memory for a restart that will not come) and remove the scratch directories it
    made; the directories removed."""
    from jaxckpt.backends.agent import protocol as proto
    from jaxckpt.testing.agents import agent_processes

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    left = sorted(_scratch() - before)
    for path in left:
        for dirpath, _, _ in os.walk(path):
            proto.kill_agent(dirpath, remove_memory=True)  # a directory without an agent's pid file: nothing
        # An agent still starting has written no pid file yet: it names its directory on its command line.
        for pid in agent_processes(path):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(path, ignore_errors=True)
    return left


# ---------------------------------------------------------------------------------------- the child processes
def floors(opts: Mapping[str, Any]) -> dict[str, Any]:
    """The transfer floors of each state size on the default backend's devices, and what the devices are."""
    import importlib.metadata

    import numpy as np

    from jaxckpt.tools.bench import memcpy
    from jaxckpt.tools.bench.state import devices_text, make_state, setup_jax

    jax = setup_jax("device")
    import jax.numpy as jnp

    dev = jax.devices()[0]
    versions = {}
    for name in ("jax", "jaxlib", "orbax-checkpoint", "flax", "numpy"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    facts = {"backend": jax.default_backend(), "device_kind": dev.device_kind, "devices": jax.device_count(),
             "devices_text": devices_text(), "versions": versions}
    mem = report.summarize(memcpy.memcpy_gbps(64 << 20 if opts["quick"] else 1 << 30, 5))
    rows = []
    for size in opts["size_list"]:
        state = make_state(size)
        nbytes = sum(x.nbytes for x in state.values())
        shardings = {k: v.sharding for k, v in state.items()}
        d2h, pinned, h2d = [], [], []
        host = None
        for i in range(opts["warmup"] + opts["repeats"]):
            # A fresh copy each time: an array keeps the host copy it once made, and would hand it back free.
            fresh = jax.block_until_ready(jax.tree.map(jnp.copy, state))
            t0 = time.perf_counter()
            host = jax.device_get(fresh)
            t1 = time.perf_counter()
            try:
                out = jax.block_until_ready(jax.device_put(
                    fresh, {k: s.with_memory_kind("pinned_host") for k, s in shardings.items()}))
                t2 = time.perf_counter()
                del out
            except Exception as e:  # a backend without pinned host memory: said in the result, not hidden
                t2 = None
                facts["pinned_host"] = f"unavailable: {type(e).__name__}: {e}"
            del fresh
            t3 = time.perf_counter()
            back = jax.block_until_ready(jax.device_put(host, shardings))
            t4 = time.perf_counter()
            if i == 0:
                for k, v in state.items():
                    if not np.array_equal(np.asarray(back[k]), host[k]):
                        raise AssertionError(f"floors: {k} came back from the host changed")
            del back
            if i >= opts["warmup"]:
                d2h.append(t1 - t0)
                h2d.append(t4 - t3)
                if t2 is not None:
                    pinned.append(t2 - t1)
        row = {"size_bytes": nbytes, "d2h_s": report.summarize(d2h), "h2d_s": report.summarize(h2d)}
        if pinned:
            row["d2h_pinned_s"] = report.summarize(pinned)
            row.update(pinned_reads(state, opts["repeats"]))
        rows.append(row)
        log.info("floors %s: device->host %.1f ms, ->pinned %s, host->device %.1f ms", report.fmt_size(nbytes),
                 row["d2h_s"]["median"] * 1e3,
                 f"{row['d2h_pinned_s']['median'] * 1e3:.1f} ms" if pinned else "-", row["h2d_s"]["median"] * 1e3)
        del state, host
    return {"facts": facts, "memcpy_gbps": mem, "results": rows, "donation": donation_check(opts)}


def pinned_reads(state: dict[str, Any], repeats: int) -> dict[str, Any]:
    """What a copy worker pays to read a pinned host copy of ``state``: ``np.asarray`` of every shard, and whether
    jaxlib hands the pinned memory itself (``did_copy`` False) or copies it into new memory."""
    import jax
    import numpy as np

    pin = jax.block_until_ready(jax.device_put(state, {k: v.sharding.with_memory_kind("pinned_host")
                                                       for k, v in state.items()}))
    first = next(iter(pin.values())).addressable_data(0)
    did_copy = first._single_device_array_to_np_array_did_copy()[1] \
        if hasattr(first, "_single_device_array_to_np_array_did_copy") else None
    times = []
    for _ in range(repeats):
        shards = [s.data for v in pin.values() for s in v.addressable_shards]  # fresh arrays: no cached value
        t0 = time.perf_counter()
        for a in shards:
            np.asarray(a)
        times.append(time.perf_counter() - t0)
    return {"pinned_read_s": report.summarize(times), "pinned_read_did_copy": did_copy}


def donation_check(opts: Mapping[str, Any], saves: int = 3) -> dict[str, Any]:
    """Plain ``save()`` then a step that donates the state, ``saves`` times; every restored bit checked against the
    state each save was given (AssertionError naming the step and array otherwise)."""
    import jax
    import numpy as np

    from jaxckpt import Checkpointer, Config
    from jaxckpt.tools.bench.state import make_state, restore_target

    state = make_state(min(opts["size_list"]))
    target = restore_target(state)
    step = jax.jit(lambda st: jax.tree.map(lambda a: a * 3.0 + 1.0, st), donate_argnums=0)
    expected = {}
    with Checkpointer(Config(job_id="bench-device-donation", keep=saves)) as ck:
        for k in range(saves):
            expected[k] = jax.device_get(state)
            ck.save(k, state)
            state = step(state)  # donates the buffers the save is copying
        jax.block_until_ready(state)
        ck.wait()
        for k in range(saves):
            out = ck.restore(target, step=k)
            for name, want in expected[k].items():
                if not np.array_equal(np.asarray(out[name]).view(np.uint8), want.view(np.uint8)):
                    raise AssertionError(f"donation check: step {k}, {name}: restored bytes differ from the state "
                                         f"save() was given")
    log.info("donation check: %d saves each followed by a donating step, restored bit for bit", saves)
    return {"saves": saves, "bitwise": True}


def stall_child(opts: Mapping[str, Any]) -> dict[str, Any]:
    """``bench stall``'s measurement in this one process, on the default backend's devices, for each preset."""
    from jaxckpt.backends.agent import protocol as proto
    from jaxckpt.tools.bench import memcpy, stall
    from jaxckpt.tools.bench.state import setup_jax

    jax = setup_jax("device")
    logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax logs every save at INFO
    mem = report.summarize(memcpy.memcpy_gbps(64 << 20 if opts["quick"] else 256 << 20, 5))
    steps, orbax_steps = opts["steps"], min(opts["steps"], opts["orbax_steps"])
    result: dict[str, Any] = {"bench": "stall", "mode": "quick" if opts["quick"] else "full",
                              "date": report.now_utc(), "machine": report.machine_facts(),
                              "command": "jaxckpt bench device --parts stall", "memcpy_gbps": mem, "procs": [1],
                              "steps": steps, "warmup": opts["warmup"], "orbax_steps": orbax_steps,
                              "devices": f"{jax.device_count()} {jax.devices()[0].device_kind}", "results": []}
    for size in opts["gpt_list"]:
        tmp = tempfile.mkdtemp(prefix="jaxckpt-device-stall-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        spec = {"size": size, "gpt": stall.gpt_config(size, opts["seq_len"]), "batch": opts["batch"], "steps": steps,
                "warmup": opts["warmup"], "orbax_steps": orbax_steps, "modes": list(STALL_MODES), "orbax_dir": tmp,
                "idle_repeats": 2 if opts["quick"] else 5}
        try:
            log.info("bench device stall: %s", size)
            result["results"].append(stall.merge_row(size, 1, [stall.run_process(spec)], mem))
        finally:
            for mode in STALL_MODES:
                if mode.endswith("-shm"):  # free the agent's memory before the next size, whatever happened
                    proto.stop_agent(stall.agent_dir(spec, mode), stall.job_id(spec, mode), timeout_s=60)
                    proto.kill_agent(stall.agent_dir(spec, mode), remove_memory=True)
            shutil.rmtree(tmp, ignore_errors=True)
    return result


# ------------------------------------------------------------------------------------------------ markdown
def _demoted(md: str) -> str:
    """A benchmark's own section as a subsection of this one."""
    return "\n".join("#" + line if line.startswith("### ") else line for line in md.splitlines())


def render(result: Mapping[str, Any]) -> str:
    """The BENCHMARKS.md section of a ``bench device`` result."""
    from jaxckpt.tools.bench import restore, save, stall, torch_dcp

    fs, fm, fn = report.fmt_size, report.fmt_ms, report.fmt_num
    parts, failed = result["parts"], result["failed"]
    lines = ["### `jaxckpt bench device`: save, restore and a snapshot every step on an accelerator", ""]
    if result.get("mode") == "quick":
        lines += ["> **Quick run, placeholder until a run on an accelerator.** Tiny states and a tiny GPT.", ""]
    lines += [f"Command: `{result['command']}`", "", report.machine_line(result), ""]
    fl = parts.get("floors")
    if fl:
        f = fl["facts"]
        lines += [f"Devices: {f['devices_text']} (backend `{f['backend']}`); "
                  + ", ".join(f"{k} {v}" for k, v in f["versions"].items()) + ". Host memcpy (one thread): "
                  f"{fn(fl['memcpy_gbps']['median'])} GB/s.", ""]
        rows = []
        for r in fl["results"]:
            n = r["size_bytes"]
            pin = r.get("d2h_pinned_s")
            read = r.get("pinned_read_s")
            rows.append([fs(n), f"{fm(r['d2h_s'])} ({fn(n / r['d2h_s']['median'] / 1e9)} GB/s)",
                         "-" if not pin else f"{fm(pin)} ({fn(n / pin['median'] / 1e9)} GB/s)",
                         "-" if not read else f"{fm(read)} ({'a copy' if r['pinned_read_did_copy'] else 'no copy'})",
                         f"{fm(r['h2d_s'])} ({fn(n / r['h2d_s']['median'] / 1e9)} GB/s)"])
        lines += ["Floors: the state's arrays (those of `bench save`) moved by JAX alone, median (min–max) ms:", "",
                  report.table(["state", "device -> new host memory (`device_get`)",
                                "device -> pinned host (`device_put`)", "reading the pinned copy (`np.asarray`)",
                                "host -> device (`device_put`)"], rows), ""]
        if fl.get("donation"):
            lines += [f"Donation: {fl['donation']['saves']} plain `save()` calls, each followed at once by a step "
                      f"that donates the state, restored bit for bit.", ""]
        sv = parts.get("save")
        if sv:
            against = []
            for r, f_row in zip(sv["results"], fl["results"]):
                floor = f_row.get("d2h_pinned_s", f_row["d2h_s"])["median"]
                against.append(f"{fs(r['size_bytes'])}: snapshot {fn(r['jaxckpt']['snapshot_s']['median'] / floor)}x "
                               f"the pinned device -> host floor, restore "
                               f"{fn(r['jaxckpt']['restore_s']['median'] / f_row['h2d_s']['median'])}x the "
                               f"host -> device floor")
            lines += ["jaxckpt against the floors (medians of the same run): " + "; ".join(against) + ".", ""]
    renderers = {"save": save.render, "restore": restore.render, "stall": stall.render_stall,
                 "torch": torch_dcp.render_torch}
    for name in PARTS[1:]:
        if name in parts:
            lines += [_demoted(renderers[name](parts[name])), ""]
    for name, why in failed.items():
        lines += [f"Part `{name}` failed ({why['rc']}, after {why['wall_s']:.0f} s); the end of its log:", "",
                  "```", why["log_tail"].strip()[-1500:], "```", ""]
    return "\n".join(lines).rstrip() + "\n"


# ------------------------------------------------------------------------------------------------ entry points
def run(args: argparse.Namespace) -> int:
    """``jaxckpt bench device``: every part (or, with ``--child``, one part in this process); exit 1 if any failed."""
    if args.child:
        opts = options(args)
        result = floors(opts) if args.child == "floors" else stall_child(opts)
        report.write_json(args.json, result)
        return 0
    failed: list[str] = []

    def measured(a: argparse.Namespace, o: Any) -> dict[str, Any]:
        res = measure(o, command(a), a.out)
        failed.extend(res["failed"])
        return res
    rc = runner.run(args, "device", options, measured, render)
    return rc or (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(runner.main(__name__, __doc__, add_arguments, run))
