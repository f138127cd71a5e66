"""The memory cgroup a node agent runs in: how much more it may hold before the kernel ends it.

The pages of a snapshot's segment are charged to the memory cgroup of the process that allocates them, the
agent (its ``posix_fallocate``). Where that cgroup has a limit (a Kubernetes container's or pod's memory limit; under
SLURM's ``ConstrainRAMSpace``, the job's ``--mem`` on the node, which its trainers' steps and the agent's own step
share), a segment that does not fit sets off the kernel's OOM killer
in it, which ends the agent (or a trainer beside it): every process of the node then skips its saves until an
agent serves again. The agent asks :func:`room` before it allocates, and refuses such a segment as a save over
budget instead, naming the limit (``table.py``).

Both cgroup versions: v1's memory controller (``memory.limit_in_bytes``, ``memory.usage_in_bytes``) and v2's
unified hierarchy (``memory.max``, ``memory.current``). Every level from the agent's cgroup up to the root of
the mounted hierarchy counts (a pod's limit above its container's); at each, file cache the kernel can reclaim
(``active_file`` and ``inactive_file``, which hold no tmpfs pages) is room, not use.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

V1_ROOT = "/sys/fs/cgroup/memory"
V2_ROOT = "/sys/fs/cgroup"
NO_LIMIT = 1 << 62  # v1 writes "no limit" as a page-rounded 2**63 - 1
MARGIN = 8 << 20  # left free beyond a segment: the page tables of its mappings, the agent's own growth


@dataclass(frozen=True)
class Room:
    """The tightest level: ``limit`` bytes, of which ``used`` are not reclaimable; ``path`` names the cgroup."""

    path: str
    limit: int
    used: int

    @property
    def free(self) -> int:
        """What a new segment may take (``MARGIN`` kept back)."""
        return max(0, self.limit - self.used - MARGIN)


def room(proc_cgroup: str = "/proc/self/cgroup", v1_root: str = V1_ROOT, v2_root: str = V2_ROOT) -> Room | None:
    """The least room over this process's memory cgroup and its ancestors, or None where no level has a limit
    (or no memory cgroup can be read: a host without one, a container that hides it)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if "memory" in controllers.split(","):
            v1 = path
        elif controllers == "":
            v2 = path
    if v1 is not None and os.path.isfile(os.path.join(v1_root, "memory.limit_in_bytes")):
        return _tightest(_levels(v1_root, v1), "memory.limit_in_bytes", "memory.usage_in_bytes",
                         ("total_active_file", "total_inactive_file"))
    if v2 is not None and os.path.isfile(os.path.join(v2_root, "cgroup.controllers")):
        return _tightest(_levels(v2_root, v2), "memory.max", "memory.current", ("active_file", "inactive_file"))
    return None


def _levels(root: str, path: str) -> list[str]:
    """The cgroup directories of ``path`` under ``root``, innermost first, up to ``root``. A container that
    mounts its own cgroup at ``root`` while /proc names the host's path (no cgroup namespace): ``root`` alone."""
    own = os.path.join(root, path.lstrip("/"))
    if not os.path.isdir(own):
        return [root]
    out = [own]
    while os.path.normpath(out[-1]) != os.path.normpath(root):
        out.append(os.path.dirname(out[-1]))
    return out


def _tightest(levels: list[str], limit_name: str, usage_name: str, reclaimable: tuple[str, ...]) -> Room | None:
    best: Room | None = None
    for d in levels:
        try:
            limit = _number(os.path.join(d, limit_name))
            if limit is None or limit >= NO_LIMIT:
                continue
            used = _number(os.path.join(d, usage_name)) or 0
            with open(os.path.join(d, "memory.stat")) as f:
                stat = dict(line.split(None, 1) for line in f if " " in line)
            used -= sum(int(stat.get(k, 0)) for k in reclaimable)
        except (OSError, ValueError):
            continue  # a level that cannot be read limits nothing we can know
        level = Room(d, limit, max(0, used))
        if best is None or level.free < best.free:
            best = level
    return best


def _number(path: str) -> int | None:
    with open(path) as f:
        text = f.read().strip()
    return None if text == "max" else int(text)
