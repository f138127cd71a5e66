"""A chaos trial's result, and the trainer processes of one incarnation of the job (jaxckpt/tools/chaos/run.py
describes both): the driver and the faults (jaxckpt/tools/chaos/faults.py) share them."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from jaxckpt.tools import deathsig


@dataclass
class TrialResult:
    """One fault, and what the restores after it made of it."""

    trial: int
    kind: str
    mode: str = "numpy"
    detail: str = ""
    trained: int = 0  # newest step trained by any process before the job was stopped
    committed: int = 0  # newest step reported committed
    protected: int = 0  # newest step reported protected before the fault (node-loss faults must keep it)
    restored: int | None = None  # the step the next incarnation restored
    checks: int = 0  # restores that checked this fault's aftermath
    recovered: bool = False  # an incarnation restored after the fault, with no wrong restore
    lost: int = 0  # steps of work lost: trained - restored (the most of any check)
    wrong: int = 0
    unexpected_loss: bool = False
    hang: bool = False
    relaunches: int = 0
    relaunches_bad_bytes: int = 0  # of which a step's bytes failed their checks with nothing older to fall back to
    fell_back: int = 0  # newer steps a restore passed over for bad bytes, inside the call (no relaunch)
    saves_resumed: bool | None = None  # agent and budget faults: a save committed after the fault was over
    seconds: float = 0.0  # wall time of the trial, from its incarnation's launch to the job's stop


# ------------------------------------------------------------------------------------------- processes
class Incarnation:
    """The trainer processes of one run of the job, their events (JSON lines); ``stop()`` SIGKILLs them all."""

    def __init__(self, tmp: str, epoch: int, specs: list[dict]) -> None:
        self.events: list[dict] = []
        self._logs: list[str] = []
        self._cv = threading.Condition()
        self.procs: list[subprocess.Popen] = []
        self._threads: list[threading.Thread] = []
        env = {**os.environ, "JAXCKPT_LOG_LEVEL": os.environ.get("JAXCKPT_CHAOS_TRAINER_LOG", "WARNING")}
        for spec in specs:
            path = os.path.join(tmp, f"spec-{epoch}-{spec['process']}.json")
            with open(path, "w") as f:
                json.dump(spec, f)
            self._logs.append(os.path.join(tmp, f"trainer-{spec['process']}.log"))
            with open(self._logs[-1], "ab") as err:
                p = subprocess.Popen(deathsig.command([sys.executable, "-m", "jaxckpt.tools.chaos.trainer", path]),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                     start_new_session=True, env=env)
            self.procs.append(p)
            t = threading.Thread(target=self._read, args=(p,), daemon=True, name="jaxckpt-chaos-events")
            t.start()
            self._threads.append(t)

    def _read(self, p: subprocess.Popen) -> None:
        for line in p.stdout:
            try:
                ev = json.loads(line)
            except ValueError:  # a line cut short by SIGKILL
                continue
            with self._cv:
                self.events.append(ev)
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    @property
    def lock(self) -> threading.Condition:
        """What the event readers hold while they append to ``events``: hold it to read or trim them at once."""
        return self._cv

    def wait(self, pred: Callable[[], Any], timeout: float) -> bool:
        """Until ``pred()`` holds or every process has exited (then: ``pred()``); False on time-out."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not pred():
                if all(p.poll() is not None for p in self.procs) and not any(t.is_alive() for t in self._threads):
                    return bool(pred())
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.05))
            return True

    def of(self, ev: str, p: int | None = None) -> list[dict]:
        return [e for e in self.events if e["ev"] == ev and (p is None or e["p"] == p)]

    @property
    def logs(self) -> list[str]:
        """Each trainer's log (its stderr), by process."""
        return list(self._logs)

    def last(self, ev: str) -> int:
        return max((e["step"] for e in self.of(ev)), default=0)

    def exited(self) -> bool:
        return any(p.poll() is not None for p in self.procs)

    def exit_report(self, lines: int = 4) -> str:
        """Which trainers have ended, their exit codes and the last lines of their logs: why a trial's job ended
        while the driver still waited on it."""
        out = []
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                continue
            try:
                with open(self._logs[i], "rb") as f:
                    tail = f.read()[-4096:].decode(errors="replace").strip().splitlines()[-lines:]
            except OSError:
                tail = []
            out.append(f"trainer {i} exited with {p.returncode}" + (": " + " | ".join(tail) if tail else ""))
        return "; ".join(out)

    def stop(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            p.wait()
        for t in self._threads:  # they end at the end of the pipes, with every event read
            t.join(timeout=10)
        for p in self.procs:
            p.stdout.close()
