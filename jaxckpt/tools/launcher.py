"""Run a function, or a command, in N real JAX processes on this machine, grouped into simulated nodes.

Tests, examples and benchmarks all start their multi-process jobs here, so every one of them gets the same
guarantees: each process is a fresh interpreter (``subprocess``, never a fork of a process that already holds
JAX state) in its own process group, the job has a time-out, and whatever happens (success, a failed process,
a time-out, an exception or Ctrl-C in the caller) every process and every child it started is killed and
reaped before the launcher returns.

Call order for ``launch(fn, ...)``:
  0) (launcher) writes a JSON spec, picks a free loopback port, starts ``python -m jaxckpt.tools.worker``
     once per process with the variables of :mod:`jaxckpt.tools.node` set;
  1) (every worker) ``init_from_env()`` (CPU devices; with 2+ processes gloo and ``jax.distributed``), imports ``fn``,
     calls it, writes its JSON result (or traceback) to a file, shuts JAX down and exits;
  2) (launcher) waits; if a process fails, the others get ``fail_fast_grace`` seconds before they are killed
     (they would otherwise block on the dead process until JAX's own time-outs); on time-out everything is
     killed; then it reads the result files.
Results travel as JSON files, never pickle.
"""
from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from jaxckpt.errors import LaunchError
from jaxckpt.tools.node import PIDS_FILE, WORKER_PID_FILE, launch_env

log = logging.getLogger("jaxckpt.testing")

OUTPUT_TAIL = 8000  # characters of each process's output kept in its ProcResult
REAP_TIMEOUT_S = 60.0  # a SIGKILLed process is gone within this even on a loaded machine


@dataclass
class ProcResult:
    """What one launched process did: its JSON return value, or the reason it has none."""

    process_id: int
    node: int
    local_rank: int
    reported: bool = False  # the process wrote a result (a value or its traceback)
    value: Any = None
    error: str | None = None  # traceback text, or why the process has no result
    returncode: int | None = None  # negative: killed by that signal
    timed_out: bool = False
    killed: bool = False  # killed by the launcher or a kill_node helper, not by its own failure
    output: str = ""  # tail of its stdout and stderr

    @property
    def ok(self) -> bool:
        """True when the function returned normally (the process may have been reaped afterwards)."""
        return self.reported and self.error is None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that were free a moment ago (bound together, then let go)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_worker(launch_dir: str, process_id: int, sig: int) -> None:
    """``sig`` to the worker of ``process_id`` itself, found by the pid it wrote (a worker that a prefix such as
    srun started is no child of ours: signalling srun would not reach it), and to its process group."""
    try:
        with open(os.path.join(launch_dir, WORKER_PID_FILE.format(process_id))) as f:
            pid = int(f.read())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"jaxckpt.tools.worker" not in f.read():
                return  # it exited and the pid is another process's now
    except (OSError, ValueError):
        return
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Job:
    """Processes started by the launcher; ``close()`` (or leaving ``with``) kills and reaps every one of them."""

    def __init__(self, commands: Sequence[Sequence[str]], envs: Sequence[dict[str, str]], *, procs_per_node: int,
                 launch_dir: str, owns_dir: bool, forward_output: bool = False,
                 fail_fast_grace: float | None = 5.0, wrapped: bool = False) -> None:
        self.launch_dir = launch_dir
        self.wrapped = wrapped  # commands run the worker through a prefix (srun): signals go to the worker too
        self.procs_per_node = procs_per_node
        self.fail_fast_grace = fail_fast_grace
        self._owns_dir = owns_dir
        self._procs: list[subprocess.Popen] = []
        # One reaper thread per process does the only blocking wait on it. The thread that called the launcher
        # then never holds a Popen's internal lock when a signal (ctrl-c) interrupts it: a KeyboardInterrupt
        # landing inside Popen.poll() can leave that lock taken, and a later Popen.wait() then blocks forever.
        self._reaped: list[threading.Event] = []
        self._logs: list[Any] = []
        self._threads: list[threading.Thread] = []
        self._reason: dict[int, str] = {}  # process id -> why the launcher (or kill_node) killed it
        self._timed_out = False
        self._failed_at: float | None = None
        self._failed = -1
        self._results: list[ProcResult] | None = None
        self._closed = False
        self._out_lock = threading.Lock()
        atexit.register(self.close)
        try:
            for i, (cmd, env) in enumerate(zip(commands, envs)):
                if forward_output:
                    p = subprocess.Popen(list(cmd), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, start_new_session=True)
                    t = threading.Thread(target=self._forward, args=(i, p.stdout), daemon=True,
                                         name=f"jaxckpt-launch-out{i}")
                    t.start()
                    self._threads.append(t)
                else:
                    out = open(self._log_path(i), "wb")
                    self._logs.append(out)
                    p = subprocess.Popen(list(cmd), env=env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
                self._procs.append(p)
                self._reaped.append(threading.Event())
                r = threading.Thread(target=self._reap, args=(p, self._reaped[-1]), daemon=True,
                                     name=f"jaxckpt-launch-reap{i}")
                r.start()
            pids = {i: [p.pid, i // procs_per_node] for i, p in enumerate(self._procs)}
            tmp = os.path.join(launch_dir, PIDS_FILE + ".tmp")
            with open(tmp, "w") as f:
                json.dump(pids, f)
            os.replace(tmp, os.path.join(launch_dir, PIDS_FILE))
        except BaseException:
            self.close()
            raise
        log.info("launched %d processes (%d per node) in %s", len(self._procs), procs_per_node, launch_dir)

    # ------------------------------------------------------------------------------------------ inspect
    @property
    def size(self) -> int:
        return len(self._procs)

    def pids(self, node: int | None = None) -> list[int]:
        """Pids of every process, or of simulated ``node``'s processes, by process id."""
        return [p.pid for i, p in enumerate(self._procs) if node is None or i // self.procs_per_node == node]

    def poll(self) -> list[int | None]:
        """Each process's exit code, None while it runs."""
        return [p.returncode if done.is_set() else None for p, done in zip(self._procs, self._reaped)]

    @staticmethod
    def _reap(p: subprocess.Popen, done: threading.Event) -> None:
        p.wait()
        done.set()

    # ---------------------------------------------------------------------------------------------- kill
    def kill_process(self, process_id: int, sig: int = signal.SIGKILL, reason: str = "killed by kill_process") -> None:
        """Send ``sig`` to one process and everything it started (its process group)."""
        if not 0 <= process_id < self.size:  # a negative index would pick a process from the end
            raise LaunchError(f"process {process_id}: no such process (job has {self.size} processes)")
        self._reason.setdefault(process_id, reason)
        self._signal(process_id, sig)

    def kill_node(self, node: int, sig: int = signal.SIGKILL) -> list[int]:
        """SIGKILL (or ``sig``) every process of simulated ``node`` at once; returns their process ids."""
        ids = [i for i in range(self.size) if i // self.procs_per_node == node]
        if not ids:
            raise LaunchError(f"node {node}: no such simulated node (job has {self.size} processes, "
                              f"{self.procs_per_node} per node)")
        for i in ids:
            self._reason.setdefault(i, f"node {node} killed by kill_node")
        for i in ids:
            self._signal(i, sig)
        return ids

    def _signal(self, i: int, sig: int) -> None:
        if self.wrapped:
            _signal_worker(self.launch_dir, i, sig)
        _signal_group(self._procs[i].pid, sig)

    def _note_marked_kills(self) -> None:
        # kill_node() inside a worker leaves a marker per pid so its intended deaths are not failures.
        for i, p in enumerate(self._procs):
            if i not in self._reason and os.path.exists(os.path.join(self.launch_dir, f"killed-{p.pid}")):
                self._reason[i] = f"node {i // self.procs_per_node} killed by kill_node"

    # ---------------------------------------------------------------------------------------------- wait
    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every process has exited, or ``timeout`` seconds; True if all exited.

        A process that fails (non-zero exit, not killed on purpose) gives the others ``fail_fast_grace``
        seconds to finish, then they are killed: they would otherwise block on it.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            codes = self.poll()
            if all(c is not None for c in codes):
                return True
            now = time.monotonic()
            self._note_marked_kills()
            if self.fail_fast_grace is not None:
                if self._failed_at is None:
                    bad = [i for i, c in enumerate(codes) if c not in (None, 0) and i not in self._reason]
                    if bad:
                        self._failed_at = now
                        self._failed = bad[0]
                elif now - self._failed_at >= self.fail_fast_grace:
                    alive = [i for i, c in enumerate(codes) if c is None]
                    # Stopped first, all of them, then killed: a process killed before another is SIGKILLed
                    # closes its sockets, and the other, still running, would report that (a loaded machine
                    # can put milliseconds between two kills) instead of dying for the failure it stops for.
                    for i in alive:
                        self._signal(i, signal.SIGSTOP)
                    for i in alive:
                        self.kill_process(i, reason=f"killed {self.fail_fast_grace:g}s after process "
                                                    f"{self._failed} failed")
            if deadline is not None and now >= deadline:
                return False
            time.sleep(0.02)

    def time_out(self, seconds: float) -> None:
        """Kill every running process as timed out after ``seconds``."""
        self._timed_out = True
        for i, c in enumerate(self.poll()):
            if c is None:
                self.kill_process(i, reason=f"timed out after {seconds:g}s")

    def close(self, grace: float = 3.0) -> None:
        """Terminate whatever still runs (SIGTERM, SIGKILL after ``grace``), reap it all, collect results."""
        if self._closed:
            return
        self._closed = True
        try:
            running = [i for i, c in enumerate(self.poll()) if c is None]
            for i in running:
                self._reason.setdefault(i, "killed when the launcher closed")
                self._signal(i, signal.SIGTERM)
            deadline = time.monotonic() + grace
            for i in running:
                self._reaped[i].wait(max(0.0, deadline - time.monotonic()))
        finally:
            # Always SIGKILL every group, even of leaders that exited: children they left behind die too.
            for i in range(len(self._procs)):
                self._signal(i, signal.SIGKILL)
            for i, done in enumerate(self._reaped):
                if not done.wait(REAP_TIMEOUT_S):
                    log.error("process %d (pid %d) not reaped %gs after SIGKILL", i, self._procs[i].pid,
                              REAP_TIMEOUT_S)
            for t in self._threads:
                t.join(timeout=5)
            for f in self._logs:
                f.close()
            atexit.unregister(self.close)
            if self._results is None:
                self._results = self._collect()
            if self._owns_dir:
                shutil.rmtree(self.launch_dir, ignore_errors=True)

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- results
    def results(self) -> list[ProcResult]:
        """Every process's ProcResult, by process id; the processes must have exited (wait or close first)."""
        if self._results is None:
            if any(c is None for c in self.poll()):
                raise LaunchError("results(): processes are still running; call wait() or close() first")
            self._results = self._collect()
        return self._results

    def _log_path(self, i: int) -> str:
        return os.path.join(self.launch_dir, f"proc{i}.log")

    def _collect(self) -> list[ProcResult]:
        self._note_marked_kills()
        out = []
        for i, p in enumerate(self._procs):
            r = ProcResult(i, i // self.procs_per_node, i % self.procs_per_node, returncode=p.returncode)
            r.killed = i in self._reason
            r.timed_out = self._timed_out and r.killed and self._reason[i].startswith("timed out")
            try:
                r.output = Path(self._log_path(i)).read_bytes()[-OUTPUT_TAIL:].decode("utf-8", "replace")
            except OSError:
                pass
            path = os.path.join(self.launch_dir, f"result-{i}.json")
            try:
                with open(path) as f:
                    data = json.load(f)
            except (OSError, ValueError):
                data = None
            if isinstance(data, dict) and "ok" in data:
                r.reported = True
                r.value = data.get("value")
                r.error = None if data["ok"] else str(data.get("error"))
            else:
                why = self._reason.get(i) or f"exited with code {r.returncode}"
                r.error = f"process {i} (node {r.node}) reported no result: {why}"
            out.append(r)
        return out

    def _forward(self, i: int, stream: Any) -> None:
        prefix = f"[{i}] ".encode()
        for line in iter(stream.readline, b""):
            with self._out_lock:
                sys.stdout.buffer.write(prefix + line)
                sys.stdout.buffer.flush()
        stream.close()


# ---------------------------------------------------------------------------------------------- launching
def _target(fn: Callable) -> dict[str, Any]:
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not callable(fn) or not module or not qualname or "<" in qualname:
        raise TypeError(f"launch() needs a module-level function, got {fn!r} (lambdas, closures and partials "
                        f"cannot be found by name in a fresh process)")
    file = getattr(sys.modules.get(module), "__file__", None)
    root = None
    if module == "__main__":
        if not file:
            raise TypeError(f"launch(): {qualname} is defined in an interactive __main__ with no file")
        root = str(Path(file).resolve().parent)  # a script imports its neighbours
    elif file:
        # The folder from which ``module`` imports (pytest puts test folders on sys.path this way).
        up = len(module.split(".")) - (0 if Path(file).name == "__init__.py" else 1)
        root = str(Path(file).resolve().parents[up])
    return {"module": module, "qualname": qualname, "file": file, "root": root}


def _envs(n_nodes: int, procs_per_node: int, devices_per_proc: int, launch_dir: str, env: dict[str, str] | None,
          pythonpath: str | None = None) -> list[dict[str, str]]:
    if n_nodes < 1 or procs_per_node < 1 or devices_per_proc < 1:
        raise LaunchError(f"nodes={n_nodes}, procs_per_node={procs_per_node}, devices_per_proc="
                          f"{devices_per_proc}: each must be at least 1")
    coordinator = f"127.0.0.1:{free_port()}"
    base = dict(os.environ)
    base.setdefault("JAX_PLATFORMS", "cpu")
    if pythonpath:
        base["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, base.get("PYTHONPATH")) if p)
    base.update(env or {})
    return [{**base, **launch_env(process_id=i, nodes=n_nodes, procs_per_node=procs_per_node,
                                  devices_per_proc=devices_per_proc, coordinator=coordinator,
                                  launch_dir=launch_dir)}
            for i in range(n_nodes * procs_per_node)]


def start(fn: Callable, *, nodes: int, procs_per_node: int, devices_per_proc: int = 2, args: Sequence[Any] = (),
          env: dict[str, str] | None = None, distributed: bool = True, fail_fast_grace: float | None = 5.0,
          launch_dir: str | None = None, prefix: Callable[[int], Sequence[str]] | None = None,
          before: Callable | None = None) -> Job:
    """Start ``fn(*args)`` in ``nodes * procs_per_node`` processes and return the running Job at once.

    ``fn`` must be a module-level function, ``args`` and its return value JSON-serialisable. With
    ``distributed=False`` the workers skip JAX set-up (plain processes with the same node layout). Workers
    die with the thread that started them (Linux parent-death signal), so start jobs from a long-lived thread.
    ``prefix(node)``: words that start each process of ``node`` through another launcher (``srun`` placing it on
    a node of an allocation, :mod:`jaxckpt.tools.bench.srun`); the worker is then that launcher's child, not
    ours, and the Job's signals reach it through the pid it writes.
    ``before(*args)``: a module-level function each process calls before it joins JAX (and imports it), as a
    training script's first lines would (``jaxckpt.start_agent()``).
    """
    target = _target(fn)
    try:
        args_json = json.loads(json.dumps(list(args)))
    except (TypeError, ValueError) as e:
        raise TypeError(f"launch(): args must be JSON-serialisable ({e})") from None
    owns = launch_dir is None
    launch_dir = launch_dir or tempfile.mkdtemp(prefix="jaxckpt-launch-")
    try:
        spec = {"target": target, "args": args_json, "distributed": distributed,
                "parent_pid": None if prefix else os.getpid(), "before": _target(before) if before else None}
        spec_path = os.path.join(launch_dir, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        envs = _envs(nodes, procs_per_node, devices_per_proc, launch_dir, env, target["root"])
        cmd = [sys.executable, "-m", "jaxckpt.tools.worker", spec_path]
        cmds = [[*(prefix(i // procs_per_node) if prefix else ()), *cmd] for i in range(len(envs))]
        return Job(cmds, envs, procs_per_node=procs_per_node, launch_dir=launch_dir, owns_dir=owns,
                   fail_fast_grace=fail_fast_grace, wrapped=prefix is not None)
    except BaseException:
        if owns:
            shutil.rmtree(launch_dir, ignore_errors=True)
        raise


def launch(fn: Callable, *, nodes: int, procs_per_node: int, devices_per_proc: int = 2, args: Sequence[Any] = (),
           timeout: float = 120.0, env: dict[str, str] | None = None, distributed: bool = True,
           fail_fast_grace: float | None = 5.0, prefix: Callable[[int], Sequence[str]] | None = None
           ) -> list[ProcResult]:
    """Run ``fn(*args)`` in ``nodes * procs_per_node`` JAX processes; each process's ProcResult, by process id.

    Each process has ``devices_per_proc`` CPU devices and sees its place through ``jaxckpt.testing.node_info()``.
    After ``timeout`` seconds every process still running is killed and reported ``timed_out``. Never raises
    for a failure inside ``fn``: look at ``ProcResult.error`` (or use :func:`expect_ok`).
    """
    with start(fn, nodes=nodes, procs_per_node=procs_per_node, devices_per_proc=devices_per_proc, args=args,
               env=env, distributed=distributed, fail_fast_grace=fail_fast_grace, prefix=prefix) as job:
        if not job.wait(timeout):
            job.time_out(timeout)
            job.wait(10)
    return job.results()


def expect_ok(results: Sequence[ProcResult]) -> list[Any]:
    """The return values of every process; raises LaunchError with every failure's traceback if any failed."""
    bad = [r for r in results if not r.ok]
    if bad:
        details = "\n".join(f"--- process {r.process_id} (node {r.node}, rc {r.returncode}):\n{r.error}\n"
                            f"--- output tail:\n{r.output[-2000:]}" for r in bad)
        raise LaunchError(f"{len(bad)} of {len(results)} processes failed:\n{details}")
    return [r.value for r in results]


# ---------------------------------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    """``jaxckpt launch --nodes N --procs-per-node P [--devices-per-proc D] [--timeout S] -- CMD ...``."""
    p.add_argument("--nodes", type=int, default=1, help="simulated nodes (default 1)")
    p.add_argument("--procs-per-node", type=int, default=1, help="processes per node (default 1)")
    p.add_argument("--devices-per-proc", type=int, default=2, help="CPU devices per process (default 2)")
    p.add_argument("--timeout", type=float, default=0.0, help="kill everything after this many seconds (0: never)")
    p.add_argument("--compilation-cache", default="", metavar="DIR",
                   help="JAX's persistent compilation cache for every process (Config.compilation_cache_dir through "
                        "JAXCKPT_COMPILATION_CACHE_DIR): a relaunched job loads its compiled step instead of "
                        "compiling it again")
    p.add_argument("cmd", nargs=argparse.REMAINDER,
                   help="the command each process runs; it calls jaxckpt.testing.init_from_env()")
    p.set_defaults(run=run_cli)


def cache_env(directory: str) -> dict[str, str]:
    """The environment that gives every launched process JAX's persistent compilation cache in ``directory``:
    read by ``Config().with_env()`` (a Checkpointer turns it on) and by JAX itself (a process without one)."""
    if not directory:
        return {}
    directory = os.path.abspath(directory)
    return {"JAXCKPT_COMPILATION_CACHE_DIR": directory, "JAX_COMPILATION_CACHE_DIR": directory,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def run_cli(args: argparse.Namespace) -> int:
    """Run ``args.cmd`` once per process with the launcher's environment; the first failing exit code."""
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("jaxckpt launch: no command given (jaxckpt launch --nodes 2 --procs-per-node 2 -- python x.py)",
              file=sys.stderr)
        return 2
    launch_dir = tempfile.mkdtemp(prefix="jaxckpt-launch-")
    envs = _envs(args.nodes, args.procs_per_node, args.devices_per_proc, launch_dir, cache_env(args.compilation_cache))
    job = Job([cmd] * len(envs), envs, procs_per_node=args.procs_per_node, launch_dir=launch_dir, owns_dir=True,
              forward_output=True)
    try:
        if not job.wait(args.timeout or None):
            print(f"jaxckpt launch: timed out after {args.timeout:g}s; killing all processes", file=sys.stderr)
            job.time_out(args.timeout)
            job.wait(10)
            return 124
    except KeyboardInterrupt:
        return 130
    finally:
        job.close()
    codes = job.poll()
    for i, c in enumerate(codes):
        if c:
            print(f"jaxckpt launch: process {i} exited with code {c}", file=sys.stderr)
    bad = [c for c in codes if c]
    return 0 if not bad else (bad[0] if bad[0] > 0 else 128 - bad[0])
