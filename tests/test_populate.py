"""``protocol.populate``: a trainer maps a snapshot's pages in one call before it reads them (what a relaunch's
first restore would otherwise fault in page by page), exactly the range it is given, without holding the GIL
while it does (the training thread runs on beside a start-up's prefetch)."""
import mmap
import os
import shutil
import sys
import uuid

import numpy as np

from jaxckpt.backends.agent import protocol as proto

BASE = f"/dev/shm/jaxckpt-test-populate-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _rss_kib(address: int) -> int:
    """Resident KiB of this process's mapping that starts at ``address`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if "-" in line.split(" ", 1)[0] and int(line.split("-", 1)[0], 16) == address:
            return next(int(l.split()[1]) for l in lines[i + 1:] if l.startswith("Rss:"))
    raise AssertionError(f"no mapping at {address:#x}")


def _segment(tmp_dir: str, nbytes: int) -> mmap.mmap:
    path = os.path.join(tmp_dir, "seg")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
        os.unlink(path)  # the mapping keeps the pages


def test_populate_maps_the_range_it_is_given_and_no_more():
    d = f"{BASE}-maps"
    os.makedirs(d)
    try:
        m = _segment(d, 64 << 20)
        address = np.frombuffer(m, dtype=np.uint8).ctypes.data
        assert _rss_kib(address) == 0
        proto.populate(m, (16 << 20) + 1)  # rounded up to whole pages
        assert _rss_kib(address) == (16 << 10) + 4
        proto.populate(m, 1 << 40)  # clipped to the mapping
        assert _rss_kib(address) == 64 << 10
        proto.populate(m, 0)
    finally:
        shutil.rmtree(d)


def test_populate_lets_other_threads_run_while_it_maps():
    """A start-up's prefetch populates the newest step on a thread of its own; the training thread must not wait
    for it (mmap.madvise held the GIL for the whole call). With a switch interval of 100 s no thread gives the GIL
    up unless it blocks, so the main thread can see the populate still running only if populate released it."""
    import threading
    d = f"{BASE}-gil"
    os.makedirs(d)
    interval = sys.getswitchinterval()
    seen = []
    try:
        for _ in range(3):  # each try maps fresh pages (allocated and zeroed by tmpfs: tens of ms for 512 MiB)
            m = _segment(d, 512 << 20)
            inside, started = [False], threading.Event()

            def run() -> None:
                inside[0] = True
                started.set()  # wakes the main thread, which then needs the GIL
                proto.populate(m, len(m))
                inside[0] = False

            sys.setswitchinterval(100)
            t = threading.Thread(target=run)
            t.start()
            started.wait()
            seen.append(inside[0])  # True only if populate dropped the GIL before it finished
            sys.setswitchinterval(interval)
            t.join()
            del m
            if seen[-1]:
                break
    finally:
        sys.setswitchinterval(interval)
        shutil.rmtree(d)
    assert True in seen, f"the main thread never ran while populate mapped ({len(seen)} tries)"
