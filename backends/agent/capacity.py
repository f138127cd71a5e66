"""The shared-memory filesystem under a node agent's directory: how big it is, and whether the budget fits.

Containers often get a small /dev/shm (Docker's default is 64 MB; a Kubernetes pod's is its ``emptyDir`` with
``medium: Memory``). ``store="shm"`` checks at ``Checkpointer()`` that the configured memory budget of the node's
processes fits the filesystem (:func:`check_budget`), so a too-small one is an error naming the sizes and the
fix there, not at the first save; ``jaxckpt doctor`` shows the same figures (:func:`shm_capacity`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from jaxckpt.errors import ConfigError

FIX = ("give the node a bigger shared-memory filesystem (Docker: --shm-size; Kubernetes: an emptyDir with medium: "
       "Memory and a sizeLimit, mounted at /dev/shm; a host: mount -o remount,size=... /dev/shm), point "
       "Config.shm_dir (JAXCKPT_SHM_DIR) at a larger tmpfs, or lower Config.memory_budget_bytes")


@dataclass(frozen=True)
class ShmCapacity:
    """The filesystem holding ``path``: mounted at ``mount`` (type ``fstype``), ``size`` and ``free`` bytes;
    ``huge``: a tmpfs's transparent huge page mode (``never``, ``always``, ``within_size``, ``advise``; "" for
    another filesystem)."""

    path: str
    mount: str
    fstype: str
    size: int
    free: int
    huge: str = ""


def shm_capacity(path: str) -> ShmCapacity:
    """The filesystem that holds (or will hold) ``path``: its nearest existing ancestor's."""
    probe = os.path.abspath(path)
    if not os.path.exists(probe):
        probe = nearest_existing(probe)
    st = os.statvfs(probe)
    mount, fstype, options = _mount_of(probe)
    return ShmCapacity(path, mount, fstype, st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize,
                       _huge_mode(fstype, options))


def nearest_existing(path: str) -> str:
    """The nearest directory above ``path`` that exists (where making ``path`` writes, whose filesystem holds it)."""
    above = os.path.dirname(path)
    while above and not os.path.lexists(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)
    return above


def _huge_mode(fstype: str, options: str) -> str:
    """A tmpfs mount's huge page mode: its ``huge=`` option (none: never), unless the kernel forces or denies huge
    pages on every tmpfs (/sys/kernel/mm/transparent_hugepage/shmem_enabled: ``force``, ``deny``)."""
    if fstype != "tmpfs":
        return ""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            chosen = next((w[1:-1] for w in f.read().split() if w.startswith("[")), "")
    except OSError:  # a kernel without transparent huge pages
        return "never"
    if chosen in ("force", "deny"):
        return "always" if chosen == "force" else "never"
    return next((o[len("huge="):] for o in options.split(",") if o.startswith("huge=")), "never")


def held_bytes(directory: str) -> int:
    """Bytes the files of ``directory`` take (an agent's segments already there count as room for its job)."""
    total = 0
    try:
        with os.scandir(directory) as it:
            for e in it:
                try:
                    if e.is_file(follow_symlinks=False):
                        total += e.stat(follow_symlinks=False).st_blocks * 512
                except OSError:
                    continue
    except OSError:
        return 0
    return total


def check_budget(directory: str, budget: int, processes: int, node: str) -> ShmCapacity:
    """ConfigError unless ``processes`` processes of ``node`` with ``budget`` bytes each (0: no budget, nothing
    to check) fit the filesystem of ``directory``: its size, and its free bytes plus what the directory holds."""
    cap = shm_capacity(directory)
    if budget <= 0:
        return cap
    need = budget * max(1, processes)
    who = f"{processes} processes" if processes > 1 else "1 process"
    where = f"{cap.mount} ({cap.fstype})" if cap.mount else directory
    if cap.size < need:
        raise ConfigError(f"Config.memory_budget_bytes={budget} ({fmt_bytes(budget)}) for {who} of node {node} "
                          f"needs {fmt_bytes(need)} of shared memory, but {where} holds {fmt_bytes(cap.size)} in "
                          f"all: {FIX}")
    room = cap.free + held_bytes(directory)
    if room < budget:
        raise ConfigError(f"Config.memory_budget_bytes={budget} ({fmt_bytes(budget)}) on node {node}: {where} has "
                          f"{fmt_bytes(cap.free)} free of {fmt_bytes(cap.size)}: free it, or {FIX}")
    return cap


def shortage(directory: str) -> str:
    """The filesystem's figures and the fix, for an allocation that failed for lack of room."""
    try:
        cap = shm_capacity(directory)
    except OSError:
        return FIX
    return f"{cap.mount or directory} holds {fmt_bytes(cap.size)}, {fmt_bytes(cap.free)} free: {FIX}"


def fmt_bytes(n: int) -> str:
    """``n`` bytes in binary units (64.0 MiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _mount_of(path: str) -> tuple[str, str, str]:
    """(mount point, filesystem type, options) of ``path`` from /proc/self/mounts (the longest matching mount
    point; the last one mounted there when several are)."""
    best = ("", "", "")
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 4:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, parts[2], parts[3])
    except OSError:
        pass
    return best
