"""Main job: a Flax GPT training process on 8 CPU devices, saving a snapshot every step to its node agent, is
SIGKILLed while a snapshot is in flight, relaunched, restores from the agent's shared memory and trains on; the
result is compared bit for bit with an uninterrupted run.

    python examples/train_flax.py                      # defaults: a minute or two on 2 CPU cores
    python examples/train_flax.py --steps 12 --kill-at 6 --d-model 32 --layers 2 --heads 2 --vocab 64

What runs (each a separate Python process started by this one, which only watches, kills and reports):

1. Run 1: the trainer builds ``jaxckpt.Checkpointer(Config(store="shm", ...))`` (which starts the node agent, a
   separate daemon holding snapshots in shared memory), trains on a data x model mesh (4 x 2) and calls
   ``ckpt.save(step + 1, state)`` after every step. Right after ``save(K)`` returns for ``K = --kill-at`` the
   trainer stops itself (SIGSTOP: every thread frozen where it is, the background copy of step K included; only
   a clock read and the signal call run between save() and the stop, microseconds, where copying and committing
   a step take milliseconds) and this driver SIGKILLs it: a kill at a moment chosen, not left to a timer. How we know it
   landed while the snapshot was in flight (checked, and the run fails otherwise): the exit status is -9, the
   agent logs that process 0's writer of step K disconnected mid-write and discards the half-written slot, and
   the relaunched trainer finds an older step as the newest committed one.
2. Run 2: the same trainer program, relaunched. It finds the agent's committed snapshot, restores it (onto the
   training shardings) and trains to the end, saving every step.
3. Uninterrupted run, in a third process: the same training without checkpointing, the reference for the
   checks. Then, in that process with the same warm compiled step: blocks of steps with and without a snapshot
   every step (median step time of each), the time from save() to committed, and a restore of one state by
   jaxckpt (from its agent's shared memory) and by Orbax's StandardCheckpointer (saved to tmpfs first; only
   the restores are timed).
4. Checks: per-step losses, the restored state and the final state (params, AdamW moments, counters) are
   byte-identical to the uninterrupted run's; Orbax's and jaxckpt's restores equal the state they saved. Exit
   status 1 if a check fails. The agents, their memory and every file of the run are removed at exit.

JAX's persistent compilation cache (in the run's temporary directory) lets the relaunched process load the
compiled step instead of compiling it again, as production jobs do; ``--no-compile-cache`` turns it off.
"""
from __future__ import annotations

import time

T_PROCESS_START = time.monotonic()  # before the imports: a relaunched trainer's start-up is part of its recovery

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import warnings  # noqa: E402

MARK = "@@jaxckpt-example "  # prefix of the JSON event lines a child process prints for the driver
MIDWRITE = re.compile(r"process 0 step (\d+): writer disconnected mid-write; slot discarded")
MODEL_FLAGS = ("d_model", "layers", "heads", "vocab", "seq_len", "batch", "model_parallel", "seed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    p.add_argument("--kill-at", type=int, default=None,
                   help="run 1 is killed while the snapshot of this step is in flight (default steps//2)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="global batch, split over the data axis")
    p.add_argument("--model-parallel", type=int, default=2, help="size of the mesh's model axis (default 2)")
    p.add_argument("--seed", type=int, default=0)
    # 8 a kind gave medians that moved x1.05-x1.18 between quiet runs of the same code on 2 shared cores
    p.add_argument("--timing-steps", type=int, default=24,
                   help="timed steps with and (as many) without a snapshot every step (default 24)")
    p.add_argument("--timing-block", type=int, default=2,
                   help="timed steps per block; the kinds alternate, so load that drifts hits both (default 2)")
    p.add_argument("--restore-reps", type=int, default=3,
                   help="restores by jaxckpt and by Orbax, alternated (default 3)")
    p.add_argument("--mtbf-node-hours", type=float, default=24.0,
                   help="for the interval advice: mean time between failures of one node (default 24 h)")
    p.add_argument("--nodes", type=int, default=1024, help="for the interval advice: nodes in the job (default 1024)")
    p.add_argument("--no-compile-cache", dest="compile_cache", action="store_false",
                   help="do not use JAX's persistent compilation cache (the relaunch compiles the step again)")
    p.add_argument("--timeout", type=float, default=300.0, help="time-out of each process in seconds (default 300)")
    p.add_argument("--role", choices=("trainer", "reference"), help=argparse.SUPPRESS)
    p.add_argument("--opts", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role:
        return args
    if args.kill_at is None:
        args.kill_at = args.steps // 2
    if not 1 <= args.kill_at < args.steps:
        p.error(f"--kill-at must be in [1, {args.steps - 1}], got {args.kill_at}")
    for name in ("timing_steps", "timing_block", "restore_reps", "nodes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.mtbf_node_hours > 0:
        p.error(f"--mtbf-node-hours must be positive, got {args.mtbf_node_hours}")
    return args


# ------------------------------------------------------------------------------ runs in the child processes
def _emit(ev: str, **fields) -> None:
    sys.stdout.write(MARK + json.dumps({"ev": ev, "t": time.monotonic(), **fields}) + "\n")
    sys.stdout.flush()


def _setup(o: dict):
    """JAX on 8 host devices, the GPT, the mesh, the jitted step (donating the state) and the restore target."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    if o["cache_dir"]:
        jax.config.update("jax_compilation_cache_dir", o["cache_dir"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # A snapshot's zero-copy views keep the next step from reusing those buffers (jaxckpt relies on that for
    # consistency); JAX reports each skipped donation, which is expected here and not worth a line per step.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    from jaxckpt.tools.bench import gpt

    cfg = gpt.GPTConfig(vocab=o["vocab"], seq_len=o["seq_len"], d_model=o["d_model"], layers=o["layers"],
                        heads=o["heads"])
    mesh = gpt.make_mesh(model=o["model_parallel"])
    jax.devices()
    return jax, gpt, cfg, mesh, gpt.make_train_step(cfg, mesh), gpt.abstract_state(cfg, mesh)


def _digests(jax, tree) -> list[str]:
    """sha256 of every array leaf's bytes, gathered to the host: the unit of 'bit-identical' across processes."""
    import numpy as np

    return [hashlib.sha256(np.asarray(x).tobytes()).hexdigest() for x in jax.tree.leaves(tree)]


def trainer(o: dict) -> None:
    """Restore the newest committed snapshot if the node agent holds one, else start fresh; train, saving every
    step. With ``kill_at``: stop right after ``save(kill_at)`` returns, to be SIGKILLed by the driver."""
    jax, gpt, cfg, mesh, step_fn, target = _setup(o)
    import numpy as np

    import jaxckpt

    _emit("ready", start=T_PROCESS_START, devices=len(jax.devices()))
    ckpt = jaxckpt.Checkpointer(jaxckpt.Config(store="shm", job_id=o["job"], shm_dir=o["node_dir"],
                                               commit_timeout_s=60.0))
    _emit("checkpointer")
    try:
        latest = ckpt.latest_step()
        if latest is None:
            _emit("initialising")
            state = gpt.init_state(cfg, mesh, o["seed"])
            ckpt.save(0, state)  # so a failure before the first step's snapshot still has somewhere to go back to
            start = 0
            _emit("fresh", state_bytes=gpt.state_bytes(state), params=gpt.param_count(cfg))
        else:
            state = ckpt.restore(target)
            jax.block_until_ready(state)
            start = int(state.step)
            _emit("restored", step=start, report=ckpt.last_restore_report.to_dict())
            _emit("hashed", digests=_digests(jax, state))  # the example's own check; not part of the recovery
        _emit("compiling")
        for step in range(start, o["steps"]):
            state, loss = step_fn(state, gpt.device_batch(cfg, mesh, step, o["batch"], o["seed"]))
            loss = np.asarray(loss)  # as any logging loop does: the save below then times only its own call
            _emit("step", step=step, loss=loss.tobytes().hex(), value=float(loss))
            t0 = time.perf_counter()
            ckpt.save(step + 1, state)  # snapshot k holds the state after k steps
            seconds = time.perf_counter() - t0
            if step + 1 == o["kill_at"]:
                # Nothing between save() and the stop: printing would let the copy threads run and commit.
                os.kill(os.getpid(), signal.SIGSTOP)
                raise SystemExit("continued after SIGSTOP: the driver was to SIGKILL this process")
            _emit("saved", step=step + 1, ms=seconds * 1e3, committed=ckpt.latest_step())
        ckpt.wait()
        _emit("done", digests=_digests(jax, state), committed=ckpt.latest_step())
    finally:
        ckpt.close()


def reference(o: dict) -> None:
    """The uninterrupted run, then the like-with-like timings in the same process with the same compiled step."""
    jax, gpt, cfg, mesh, step_fn, target = _setup(o)
    import numpy as np

    import jaxckpt

    def batch(step: int):
        return gpt.device_batch(cfg, mesh, step, o["batch"], o["seed"])

    _emit("ready")
    _emit("phase", text="initialising the state and compiling the step (or loading both from JAX's cache)")
    state = gpt.init_state(cfg, mesh, o["seed"])
    at = _digests(jax, state) if o["digest_at"] == 0 else None
    losses = []
    for step in range(o["steps"]):
        state, loss = step_fn(state, batch(step))
        loss = np.asarray(loss)
        losses.append(loss.tobytes().hex())
        _emit("step", step=step, value=float(loss))
        if step + 1 == o["digest_at"]:
            at = _digests(jax, state)
    _emit("reference", losses=losses, restored_digests=at, final=_digests(jax, state),
          names=[jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(state)])

    step = o["steps"]
    cfg_t = jaxckpt.Config(store="shm", job_id=o["job"] + "-timing", shm_dir=o["timing_dir"], commit_timeout_s=60.0)
    with jaxckpt.Checkpointer(cfg_t) as ckpt:
        # First save of a fresh agent: it creates its segments. Timed and reported, not part of the medians.
        state, loss = step_fn(state, batch(step))
        np.asarray(loss)
        t0 = time.perf_counter()
        ckpt.save(step + 1, state).result(timeout=60)
        first_save = time.perf_counter() - t0
        step += 1
        latency = []  # save() -> committed, each save waited for before the next step
        for _ in range(3):
            state, loss = step_fn(state, batch(step))
            np.asarray(loss)
            t0 = time.perf_counter()
            ckpt.save(step + 1, state).result(timeout=60)
            latency.append(time.perf_counter() - t0)
            step += 1
        _emit("phase", text="timing the warm step with and without a snapshot every step")
        times: dict[str, list[float]] = {"with": [], "without": []}
        save_calls = []
        blocks = -(-o["timing_steps"] // o["timing_block"])
        for b in range(2 * blocks):
            kind = ("without", "with")[b % 2]
            if kind == "without":
                ckpt.wait()  # no copy of the previous block still running into these steps
            else:
                # One untimed step with its save first, so every timed step has the previous one's copy in flight,
                # as it does when every step saves.
                state, loss = step_fn(state, batch(step))
                np.asarray(loss)
                ckpt.save(step + 1, state)
                step += 1
            for _ in range(min(o["timing_block"], o["timing_steps"] - len(times[kind]))):
                t0 = time.perf_counter()
                state, loss = step_fn(state, batch(step))
                np.asarray(loss)
                if kind == "with":
                    t1 = time.perf_counter()
                    ckpt.save(step + 1, state)
                    save_calls.append(time.perf_counter() - t1)
                times[kind].append(time.perf_counter() - t0)
                step += 1
                _emit("timing", kind=kind, n=len(times["with"]) + len(times["without"]))
        ckpt.wait()  # the newest snapshot now holds ``state``
        _emit("phase", text="where a snapshot's time goes: the same steps without and with a snapshot, per thread")
        from jaxckpt.tools.bench.breakdown import Breakdown, copy_floor

        breakdown = {}
        for kind in ("without", "with"):
            probe = Breakdown(ckpt)
            probe.start()
            for _ in range(o["timing_steps"]):
                state, loss = step_fn(state, batch(step))
                np.asarray(loss)
                if kind == "with":
                    ckpt.save(step + 1, state)
                step += 1
            ckpt.wait()  # the last copy's CPU counts too
            breakdown[kind] = probe.stop(o["timing_steps"])
        floor = copy_floor(ckpt.engine.last_chunk_sizes())

        _emit("phase", text="Orbax's StandardCheckpointer saves the same state to tmpfs (its first save compiles "
                            "its helpers: seconds)")
        import orbax.checkpoint as ocp

        live = _digests(jax, state)
        orbax_dir = os.path.join(o["base"], "orbax", f"step-{step}")
        orbax = ocp.StandardCheckpointer()
        try:
            t0 = time.perf_counter()
            orbax.save(orbax_dir, state)
            orbax.wait_until_finished()
            orbax_save = time.perf_counter() - t0
            _emit("phase", text=f"restoring that state {o['restore_reps']} times each with jaxckpt (from its agent) "
                                f"and Orbax, alternated")
            restores: dict[str, list[float]] = {"jaxckpt": [], "orbax": []}
            equal = {"jaxckpt": True, "orbax": True}
            for _ in range(o["restore_reps"]):
                for name, fn in (("jaxckpt", lambda: ckpt.restore(target)),
                                 ("orbax", lambda: orbax.restore(orbax_dir, target))):
                    t0 = time.perf_counter()
                    out = fn()
                    jax.block_until_ready(out)
                    restores[name].append(time.perf_counter() - t0)
                    equal[name] &= _digests(jax, out) == live
                    del out
        finally:
            orbax.close()
    _emit("timings", first_save=first_save, latency=latency, times=times, save_calls=save_calls,
          restores=restores, equal=equal, orbax_save=orbax_save, breakdown=breakdown, floor=floor)


# ------------------------------------------------------------------------------------------------ the driver
class Child:
    """A child process of this example: its JSON events line by line, its stderr in a file, a time-out."""

    def __init__(self, role: str, opts: dict, log_path: str, timeout: float, env: dict) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", role, "--opts",
                                      json.dumps(opts)], stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=env)
        self.timed_out = False
        self._timer = threading.Timer(timeout, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        self.timed_out = True
        self.proc.kill()

    def events(self):
        for line in self.proc.stdout:
            if line.startswith(MARK):
                yield json.loads(line[len(MARK):])

    def finish(self, expect_rc: int | None = 0) -> int:
        rc = self.proc.wait(timeout=60)
        self._timer.cancel()
        self._log.close()
        if self.timed_out:
            raise RuntimeError(f"{self.role_line()} timed out\n{self.tail()}")
        if expect_rc is not None and rc != expect_rc:
            raise RuntimeError(f"{self.role_line()} exited with {rc}, expected {expect_rc}\n{self.tail()}")
        return rc

    def role_line(self) -> str:
        return f"process {self.proc.pid} ({' '.join(self.proc.args[2:4])})"

    def tail(self, n: int = 30) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._timer.cancel()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


class Display:
    """Phase lines for everyone; a live progress bar on a terminal, a step line every few seconds otherwise."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                                   TimeElapsedColumn)

        self.console = Console(highlight=False, soft_wrap=True)
        self.live = self.console.is_terminal
        self.progress = Progress(SpinnerColumn(finished_text=" "), TextColumn("{task.description:<20}"),
                                 BarColumn(bar_width=16), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                                 TimeElapsedColumn(), console=self.console, disable=not self.live)
        # A row that keeps turning while a phase without steps runs (start-up, compiling, Orbax's first save).
        self._now = self.progress.add_task("now", total=None, info="")
        self.t0 = time.monotonic()
        self._last_line = 0.0

    def __enter__(self) -> "Display":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.remove_task(self._now)
        self.progress.stop()

    def say(self, text: str) -> None:
        room = max(20, self.console.width - 75)  # the other columns keep their room on a narrow terminal
        self.progress.update(self._now, info=text if len(text) <= room else text[:room - 3] + "...")
        self.progress.console.print(f"[{time.monotonic() - self.t0:6.1f}s] {text}", markup=False)

    def task(self, name: str, total: int) -> int:
        return self.progress.add_task(name, total=total, info="")

    def update(self, task: int, done: int, info: str, force: bool = False) -> None:
        self.progress.update(task, completed=done, info=info)
        if not self.live and (force or time.monotonic() - self._last_line >= 3.0):
            self._last_line = time.monotonic()
            t = self.progress.tasks[task]
            self.say(f"{t.description}: {done}/{t.total:.0f} {info}")


def _train(display: Display, child: Child, name: str, stop: int, kill_at: int | None) -> dict:
    """Follow one trainer's events up to step ``stop``; with ``kill_at``, SIGKILL it once it has stopped itself
    right after save(kill_at)."""
    run: dict = {"losses": {}, "saves": [], "events": {}, "committed": None}
    start = 0
    task = display.task(name, stop)
    loss = save = committed = "-"
    for ev in child.events():
        kind = ev["ev"]
        run["events"].setdefault(kind, ev)
        if kind == "ready":
            display.say(f"{name}: JAX ready ({ev['devices']} CPU devices), pid {child.proc.pid}")
        elif kind == "checkpointer":
            display.say(f"{name}: Checkpointer(store='shm') connected to the node agent")
        elif kind == "initialising":
            display.say(f"{name}: no snapshot held: initialising the state (compiling the init function)")
        elif kind == "fresh":
            run.update(state_bytes=ev["state_bytes"], params=ev["params"])
            display.say(f"{name}: fresh state of {ev['params']:,} params "
                        f"({ev['state_bytes'] / 2**20:.1f} MiB with the AdamW moments), step 0 saved")
        elif kind == "restored":
            run.update(restored=ev["step"], report=ev["report"])
            start = ev["step"]
            display.progress.update(task, total=stop - start)
            display.say(f"{name}: restored step {ev['step']} from the node agent's shared memory")
        elif kind == "hashed":
            run["restored_digests"] = ev["digests"]
        elif kind == "compiling":
            display.say(f"{name}: compiling the train step (or loading it from JAX's compilation cache), training")
        elif kind == "step":
            run["losses"][ev["step"]] = ev["loss"]
            loss = f"{ev['value']:.4f}"
            if kill_at is not None and ev["step"] + 1 == kill_at:
                display.update(task, ev["step"] + 1 - start, f"loss {loss}  save() issuing step {kill_at}...",
                               force=True)
                deadline = time.monotonic() + 60
                while not _stopped(child.proc.pid):
                    if child.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"{name}: the trainer did not stop after save({kill_at})\n{child.tail()}")
                    time.sleep(0.001)
                run["t_kill"] = time.monotonic()
                os.kill(child.proc.pid, signal.SIGKILL)
                run["rc"] = child.finish(expect_rc=None)
                display.update(task, ev["step"] + 1 - start, f"loss {loss}  SIGKILLed during save({kill_at})")
                display.say(f"{name}: trainer stopped right after save({kill_at}) returned; SIGKILLed it "
                            f"(exit status {run['rc']})")
                break
        elif kind == "saved":
            run["saves"].append(ev["ms"])
            save, committed = f"{ev['ms']:.1f} ms", ev["committed"]
            run["committed"] = committed
            display.update(task, ev["step"] - start, f"loss {loss}  save() {save}  committed step {committed}",
                           force=ev["step"] == stop)
        elif kind == "done":
            run.update(final=ev["digests"], committed=ev["committed"])
    if "rc" not in run:
        run["rc"] = child.finish()
    return run


def _reference(display: Display, child: Child, steps: int, timed: int) -> dict:
    out: dict = {}
    task = display.task("uninterrupted run", steps)
    timing = None
    for ev in child.events():
        kind = ev["ev"]
        if kind == "ready":
            display.say(f"uninterrupted run: JAX ready, pid {child.proc.pid}; no checkpointing")
        elif kind == "step":
            display.update(task, ev["step"] + 1, f"loss {ev['value']:.4f}", force=ev["step"] + 1 == steps)
        elif kind == "reference":
            out.update(ev)
        elif kind == "phase":
            display.say(f"uninterrupted run's process: {ev['text']}")
            if timing is None and "timing" in ev["text"]:
                timing = display.task("timing steps", 2 * timed)
        elif kind == "timing":
            display.update(timing, ev["n"], f"{ev['kind']} a snapshot", force=ev["n"] == 2 * timed)
        elif kind == "timings":
            out.update(ev)
    child.finish()
    return out


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _span(a: int, b: int) -> str:
    return "no steps" if b <= a else f"step {a}" if b == a + 1 else f"steps {a}..{b - 1}"


def _ms(xs: list[float]) -> str:
    return ", ".join(f"{x * 1e3:.1f}" for x in xs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role:
        (trainer if args.role == "trainer" else reference)(json.loads(args.opts))
        return 0
    from jaxckpt.backends.agent import protocol as proto
    from jaxckpt.core.advise import advise_interval
    from jaxckpt.testing import remove_agents

    base = tempfile.mkdtemp(prefix="jaxckpt-example-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    opts = {k: getattr(args, k) for k in MODEL_FLAGS}
    opts.update(steps=args.steps, base=base, job=f"train-flax-{os.getpid()}", node_dir=os.path.join(base, "node"),
                timing_dir=os.path.join(base, "timing"), kill_at=None, timing_steps=args.timing_steps,
                timing_block=args.timing_block, restore_reps=args.restore_reps,
                cache_dir=os.path.join(base, "jax-cache") if args.compile_cache else "")
    # JAXCKPT_* settings would override the Config below (its directories among them); INFO: the agent inherits
    # it, and its log names the slots it discards.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("JAXCKPT_")}, "JAXCKPT_LOG_LEVEL": "INFO"}
    children: list[Child] = []
    agent_log = ""

    def child(role: str, **extra) -> Child:
        c = Child(role, {**opts, **extra}, os.path.join(base, f"{role}-{len(children)}.log"), args.timeout, env)
        children.append(c)
        return c

    t_start = time.monotonic()
    try:
        with Display() as display:
            display.say(f"working directory {base} (agents' shared memory, logs, JAX cache; removed at exit)")
            display.say(f"GPT d_model={args.d_model} layers={args.layers} heads={args.heads} vocab={args.vocab} "
                        f"seq_len={args.seq_len}, batch {args.batch}, mesh data={8 // args.model_parallel} x "
                        f"model={args.model_parallel}; {args.steps} steps; run 1 is killed at save({args.kill_at})")
            run1 = _train(display, child("trainer", kill_at=args.kill_at), f"run 1 (kill at {args.kill_at})",
                          args.kill_at, args.kill_at)
            display.say("relaunching the trainer (the node agent and its shared memory live on)")
            c2 = child("trainer")
            run2 = _train(display, c2, "run 2 (relaunched)", args.steps, None)
            if "restored" not in run2:
                raise RuntimeError("run 2 found no snapshot in the node agent and started from scratch")
            restored = run2["restored"]
            with open(proto.default_log_path(opts["node_dir"]), errors="replace") as f:
                agent_log = f.read()
            display.say("uninterrupted run (the reference) and the like-with-like timings, in a third process")
            ref = _reference(display, child("reference", digest_at=restored), args.steps, args.timing_steps)
    except (RuntimeError, KeyboardInterrupt) as e:  # anything else propagates with its traceback (exit status 1)
        print(f"FAILED: {e!r}" if isinstance(e, KeyboardInterrupt) else f"FAILED: {e}", file=sys.stderr)
        return 1
    finally:  # also on failure: no trainer, agent, shared memory or file of this run outlives it
        for c in children:
            c.stop()
        remove_agents(base)
    wall = time.monotonic() - t_start
    return report(args, run1, run2, ref, agent_log, wall, advise_interval)


def _breakdown(ref: dict, overhead: float) -> str:
    """The per-thread CPU of a step with a snapshot against one without, beside the copy + crc32c floor."""
    from jaxckpt.tools.bench.breakdown import blocked_added, describe

    b, floor = ref["breakdown"], ref["floor"]
    cpu = {k: b["with"]["cpu_ms"].get(k, 0.0) - b["without"]["cpu_ms"].get(k, 0.0)
           for k in b["with"]["cpu_ms"]}
    extra = sum(cpu.values())
    text = (f"{overhead * 1e3:.1f} ms of step time = {overhead / floor['copy_crc_s']:.1f}x the floor; CPU added "
            f"per step {extra:.1f} ms = {extra / (floor['copy_crc_s'] * 1e3):.1f}x the floor (" +
            ", ".join(f"{k} {v:+.1f}" for k, v in sorted(cpu.items())) + ")" +
            "".join(f"; {t}" for t in [blocked_added(b["with"], b["without"])] if t) + "\n")
    return text + "\n".join(" " * 33 + line for line in describe(b["with"], floor).splitlines())


def report(args, run1: dict, run2: dict, ref: dict, agent_log: str, wall: float, advise_interval) -> int:
    """Print the summary and the checks; 0 if every check passed."""
    k, r, n = args.kill_at, run2["restored"], args.steps
    discarded = sorted({int(m) for m in MIDWRITE.findall(agent_log)})
    in_flight = run1["rc"] == -signal.SIGKILL and k in discarded and r < k
    losses = [run1["losses"].get(s) if s < r else run2["losses"].get(s) for s in range(n)]
    redone = all(run1["losses"][s] == run2["losses"][s] for s in range(r, k))
    loss_ok = losses == ref["losses"] and redone
    restored_ok = run2["restored_digests"] == ref["restored_digests"]
    final_ok = run2["final"] == ref["final"]
    orbax_ok = ref["equal"]["orbax"] and ref["equal"]["jaxckpt"]

    ev = run2["events"]
    parts = [("relaunch (reap, spawn, Python start)", ev["ready"]["start"] - run1["t_kill"]),
             ("imports + JAX start", ev["ready"]["t"] - ev["ready"]["start"]),
             ("Checkpointer()", ev["checkpointer"]["t"] - ev["ready"]["t"]),
             ("restore", ev["restored"]["t"] - ev["checkpointer"]["t"]),
             ("first step", ev["step"]["t"] - ev["hashed"]["t"])]
    hashing = ev["hashed"]["t"] - ev["restored"]["t"]
    kill_to_step = sum(s for _, s in parts)
    with_ms, without_ms = _median(ref["times"]["with"]), _median(ref["times"]["without"])
    overhead = max(0.0, with_ms - without_ms)
    latency = _median(ref["latency"])
    advice = advise_interval(mtbf_node_s=args.mtbf_node_hours * 3600, nodes=args.nodes, step_time_s=without_ms,
                             overhead_s=overhead, latency_s=latency, restart_s=kill_to_step)
    saves = run1["saves"] + run2["saves"]
    names = ref["names"]
    jx, ob = ref["restores"]["jaxckpt"], ref["restores"]["orbax"]
    yes = {True: "yes", False: "NO"}
    cache = "loaded from JAX's compilation cache" if args.compile_cache else "compiled again: --no-compile-cache"
    src = ", ".join(f"{kind} {b:,} B" for kind, b in sorted(run2["report"]["bytes_by_kind"].items()))
    nw, nt = len(ref["times"]["without"]), len(ref["times"]["with"])
    rows = [
        ("model", f"{run1['params']:,} params, state {run1['state_bytes'] / 2**20:.1f} MiB (params + AdamW moments), "
                  f"{len(names)} arrays"),
        ("run 1", f"trained {_span(0, k)}, save() after every step (newest committed step it saw: "
                  f"{run1['committed']}); SIGKILLed right after save({k}) returned; exit status {run1['rc']}"),
        ("kill landed mid-snapshot", f"{yes[in_flight]} (the agent discarded step(s) {discarded} as written mid-way by "
                                     f"a writer that disconnected; newest committed step after the kill: {r})"),
        ("run 2 (relaunched)", f"restored step {r} from the node agent's shared memory ({src}), trained "
                               f"{_span(r, n)}"),
        ("step time, warm", f"without a snapshot {without_ms * 1e3:.1f} ms, with a snapshot every step "
                            f"{with_ms * 1e3:.1f} ms: x{with_ms / without_ms:.3f}, {overhead * 1e3:.1f} ms per "
                            f"snapshot "
                            f"(medians of {nw} and {nt} steps; one process, one compiled step)"),
        ("snapshot cost, per step", _breakdown(ref, overhead)),
        ("save() call", f"median {_median(saves):.2f} ms, max {max(saves):.2f} ms over the {len(saves)} saves of runs "
                        f"1 and 2; median {_median(ref['save_calls']) * 1e3:.2f} ms in the timed steps"),
        ("save() -> committed", f"{_ms(ref['latency'])} ms, each waited for (the first save to a fresh agent, "
                                f"{ref['first_save'] * 1e3:.1f} ms, creates its segments and is not among these)"),
        ("restore, same state", f"jaxckpt from its agent's shared memory median {_median(jx) * 1e3:.1f} ms "
                                f"({_ms(jx)}); "
                                f"Orbax StandardCheckpointer from tmpfs median {_median(ob) * 1e3:.1f} ms ({_ms(ob)}): "
                                f"Orbax / jaxckpt x{_median(ob) / _median(jx):.2f} (one process, one target; Orbax's "
                                f"save, {ref['orbax_save']:.1f} s, not timed in)"),
        ("kill -> first trained step", f"{kill_to_step:.2f} s = " + " + ".join(f"{name} {s:.2f} s" for name, s in parts)
                                       + f" (the step's program {cache}; not counted: the example hashing the "
                                         f"restored state for its check, {hashing * 1e3:.0f} ms)"),
        ("interval advice", f"{advice.describe()} (--mtbf-node-hours {args.mtbf_node_hours:g}, --nodes {args.nodes}; "
                            f"overhead and step from the timed steps, commit latency {latency * 1e3:.1f} ms, restart = "
                            f"kill -> first trained step)"),
        ("wall time", f"{wall:.1f} s"),
        ("loss curve bit-identical", f"{yes[loss_ok]} ({n} steps: {_span(0, r)} from run 1, {_span(r, n)} from run 2; "
                                     f"run 1's {_span(r, k)}, redone after the restore, match"
                                     f"{'es' if k - r == 1 else ''} too)"),
        ("restored state bit-identical", f"{yes[restored_ok]} (the uninterrupted run's state after {r} steps)"),
        ("final state bit-identical", f"{yes[final_ok]} (all {len(names)} arrays)"),
        ("restores equal saved state", f"{yes[orbax_ok]} (jaxckpt and Orbax, every repetition)"),
    ]
    print("summary")
    for label, text in rows:
        print(f"  {label + ':':<30} {text}")
    ok = in_flight and loss_ok and restored_ok and final_ok and orbax_ok
    if not ok:
        bad = [s for s in range(n) if losses[s] != ref["losses"][s]]
        diff = [names[i] for i, (a, b) in enumerate(zip(run2["final"], ref["final"])) if a != b]
        print(f"MISMATCH: losses differ at steps {bad[:5]}, final arrays differ: {diff[:5]}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
