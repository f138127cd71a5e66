"""The agent fixes glibc's mmap threshold: a freed big buffer goes back to the system, and the next one of its
size is mapped again instead of being carved from (and fragmenting) the heap. Checked in fresh processes with
glibc's own counters (``mallinfo2``: blocks mapped right now)."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import ctypes, sys
if sys.argv[1] == "fix":
    from jaxckpt.backends.agent import heap
    print(heap.fix_mmap_threshold())
else:
    print(None)
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
def mapped(n):
    before = libc.mallinfo2().hblks
    p = libc.malloc(n)
    during = libc.mallinfo2().hblks
    libc.free(p)
    return during > before
# 4 MiB, not just over the 128 KiB threshold: a request the heap can serve from a free chunk is never mapped,
# and what the interpreter and jaxckpt's imports freed (their size varies with the environment's) can leave
# free chunks of a few hundred KiB
print(mapped(4 << 20), mapped(4 << 20))
"""


def _glibc() -> bool:
    try:
        libc = ctypes.CDLL(None)
        return hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallinfo2")
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _glibc(), reason="glibc with mallinfo2 (2.33+) only")


def _run(mode: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env={**clean, **env}, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_glibc_alone_moves_a_freed_big_block_size_into_the_heap():
    # The behaviour the agent turns off: the second 4 MiB block comes from the heap.
    assert _run("plain") == ["None", "True", "False"]


def test_the_agent_keeps_big_blocks_mapped():
    assert _run("fix") == ["True", "True", "True"]


def test_a_threshold_the_user_set_is_kept():
    assert _run("fix", MALLOC_MMAP_THRESHOLD_="131072") == ["False", "True", "True"]
