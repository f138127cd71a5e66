"""What a hang leaves behind: why the job stopped, said at once, and (``--keep-hangs DIR``) everything to read later.

A hang is a wait of the driver that expired (``jaxckpt.tools.chaos.run``): the job is SIGKILLed and the run goes
on, so whatever explains it must be taken first. Each process's trainer reports its refused saves and failed
restores as events, not log lines; the first thing said is each process's last one and how many there were (stop
52's hangs were 4,700 refused saves, `BudgetExceededError`, that no log line showed). With a directory to keep
them in, every trainer and node agent also writes every thread's stack to its log (``SIGUSR1``: the trainer and
the agent register ``faulthandler`` for it), and the logs, the incarnation's events and its coordination keys
are copied there, one folder a hang.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
from collections import Counter
from typing import Iterable

log = logging.getLogger("jaxckpt.tools.chaos.hang")

FAILURES = ("save-failed", "restore-failed")  # the events that say why a job stops committing
STACKS_WAIT_S = 1.0  # for every process to write its stacks (faulthandler writes them from its signal handler)


def why_stalled(events: Iterable[dict]) -> list[str]:
    """Per process: how many saves and restores failed, and the last failure's error (the events in order)."""
    counts: Counter = Counter()
    last: dict[int, dict] = {}
    for e in events:
        if e.get("ev") in FAILURES:
            counts[e["p"]] += 1
            last[e["p"]] = e
    return [f"process {p}: {counts[p]} failed save(s) and restore(s), the last {last[p]['ev']} of step "
            f"{last[p].get('step')}: {last[p].get('error')}" for p in sorted(last)]


def dump_stacks(pids: Iterable[int]) -> None:
    """Ask each process to write every thread's stack to its log (SIGUSR1), and give them the time to."""
    asked = False
    for pid in pids:
        try:
            os.kill(pid, signal.SIGUSR1)
            asked = True
        except ProcessLookupError:
            pass
    if asked:
        time.sleep(STACKS_WAIT_S)


def keep(dest: str, logs: Iterable[str], events: list[dict], coord_dir: str) -> None:
    """Copy ``logs`` (those that exist), the events (JSON lines) and the coordination keys' names, sizes and ages
    into ``dest``."""
    os.makedirs(dest, exist_ok=True)
    for path in logs:
        if os.path.exists(path):
            shutil.copy(path, os.path.join(dest, os.path.basename(path)))
    with open(os.path.join(dest, "events.jsonl"), "w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
    now = time.time()
    with open(os.path.join(dest, "coordination.txt"), "w") as f:
        for root, _, files in os.walk(coord_dir):
            for name in sorted(files):
                path = os.path.join(root, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                f.write(f"{os.path.relpath(path, coord_dir)}\t{st.st_size} bytes\t{now - st.st_mtime:.3f} s old\n")
