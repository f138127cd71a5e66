"""Cleaning up after node agents in tests and examples: every agent under a base directory stopped, its memory,
log and directory removed, and no agent process left running."""
from __future__ import annotations

import os
import shutil
import time
from typing import Iterable

from jaxckpt.backends.agent import protocol as proto
from jaxckpt.errors import JaxckptError


def agent_processes(marker: str) -> list[int]:
    """Pids of live (not zombie) processes whose command line mentions ``marker`` (agents name their directory)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if marker.encode() in cmd and not zombie:
            out.append(int(pid))
    return out


def remove_agents(base: str, also: Iterable[str] = (), timeout_s: float = 30.0) -> list[str]:
    """Stop the agent of every directory under ``base`` (and of ``also``), then remove their memory, logs and
    directories and ``base`` itself; wait until no process names ``base``.

    Returns the directories whose agent answered the shutdown but left its directory behind (an agent removes it
    last when it stops cleanly). Raises RuntimeError if agent processes are still running after ``timeout_s``.
    """
    dirs = sorted({*(os.path.join(base, n) for n in (os.listdir(base) if os.path.isdir(base) else [])), *also})
    left = []
    for d in dirs:
        try:
            if os.path.isdir(d) and proto.stop_agent(d, timeout_s=timeout_s) and os.path.exists(d):
                left.append(d)
        except JaxckptError:  # something else where the socket goes (a test put it there): remove it below
            pass
        proto.kill_agent(d, remove_memory=True)  # only if it did not stop
        shutil.rmtree(d, ignore_errors=True)
        try:
            os.unlink(proto.default_log_path(d))
        except FileNotFoundError:
            pass
    shutil.rmtree(base, ignore_errors=True)
    deadline = time.monotonic() + timeout_s
    while agent_processes(base) and time.monotonic() < deadline:
        time.sleep(0.05)  # a stopped agent has removed its directory, and exits right after
    alive = agent_processes(base)
    if alive:
        raise RuntimeError(f"agent processes {alive} of {base} still run {timeout_s:g}s after being stopped")
    return left
