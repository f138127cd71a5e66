"""``python -m jaxckpt.tools.deathsig PARENT_PID -- CMD...``: run CMD so that it dies with PARENT_PID (Linux).

What ``preexec_fn`` would do, without running Python in a child forked from a multithreaded parent (JAX is;
that can deadlock): this small process sets its parent-death signal to SIGKILL, checks the parent still lives,
and replaces itself with CMD (the signal survives ``execv``; the pid stays the same, so the parent's Popen is
CMD's). Start it with ``start_new_session=True`` for a process group of its own.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def command(cmd: list[str], parent_pid: int | None = None) -> list[str]:
    """``cmd`` wrapped so that it dies with ``parent_pid`` (default: this process)."""
    return [sys.executable, "-m", "jaxckpt.tools.deathsig", str(parent_pid or os.getpid()), "--", *cmd]


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        sys.stderr.write("usage: python -m jaxckpt.tools.deathsig PARENT_PID -- CMD...\n")
        return 2
    parent = int(argv[0])
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        return 3  # the parent died before the signal was armed
    os.execvp(argv[2], argv[2:])
    return 127  # not reached: execvp raises on failure


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
