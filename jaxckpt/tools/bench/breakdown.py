"""Where a snapshot's time goes: per-thread CPU and run-queue waits, the collector's pauses, the node agent's
round trips, and the copy + crc32c floor of the same bytes in the same pieces, measured in the same run.

Used by ``jaxckpt bench stall`` and the README's main job (``examples/train_flax.py``)::

    probe = Breakdown(ckpt)        # on the training thread
    probe.start()
    ...                            # timed steps, a save() after each
    per_save = probe.stop(saves)   # dict: milliseconds (and counts) per save
    floor = copy_floor(ckpt.engine.last_chunk_sizes())

Per thread, Linux's ``/proc/self/task/*/schedstat`` gives the CPU time each thread ran and the time it waited
on the run queue (ready, no core free): on a machine of 2 cores shared by XLA's threads and the copy, the
second is where a busy machine shows. Threads are grouped by the names jaxckpt gives its own (the copy
workers, the dispatcher, the commit thread); the rest of the process is XLA's and JAX's. The time the training
thread waits for the GIL is not counted by the interpreter (CPython 3.11); what holds it for long is: the
collector's pauses (``gc.callbacks``, CPU time of whichever thread collects; a collection holds the GIL
throughout) and the save() call itself, both reported. What bounds it: the training thread's blocked time (the
span's wall time less its CPU and run-queue time: off a core by its own wait, for the GIL, a lock, XLA's results or
the agent's reply) and its voluntary context switches (``/proc/self/task/*/status``: a GIL wait that blocks is
one); the snapshot's added blocked time, less the agent's round trips (reported apart) and, for ``wrap_step``,
its wait for the copy, is the most its GIL waits can be. Compare per-save CPU figures between runs of the same
machine load only, and the ratios to the floor within one run.
"""
from __future__ import annotations

import gc
import glob
import queue
import statistics
import threading
import time
from typing import Any, Sequence

import numpy as np

GROUPS = (("jaxckpt-copy", "copy workers"), ("jaxckpt-dispatch", "dispatcher"), ("jaxckpt-commit", "commit"))


def _threads() -> dict[int, tuple[int, int]]:
    """native thread id -> (ns on a CPU, ns waiting on the run queue)."""
    out = {}
    for path in glob.glob("/proc/self/task/*/schedstat"):
        try:
            with open(path) as f:
                run, wait, _ = f.read().split()
            out[int(path.split("/")[-2])] = (int(run), int(wait))
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
    return out


def _switches(tid: int) -> int:
    """Voluntary context switches of thread ``tid`` of this process so far (0 where Linux does not say)."""
    try:
        with open(f"/proc/self/task/{tid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


class Breakdown:
    """Counts a span of a training loop on the thread that calls :meth:`start` (the training thread)."""

    def __init__(self, ckpt: Any = None) -> None:
        self._store = getattr(getattr(ckpt, "engine", None), "store", None)
        self._training = threading.get_native_id()
        self._gc: dict[str, float] = {}
        self._gc_t0 = 0.0
        self._t0: dict[int, tuple[int, int]] = {}
        self._agent0 = (0, 0)
        self._wall0, self._switches0 = 0, 0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.thread_time()
            return
        dt = time.thread_time() - self._gc_t0  # CPU: a loaded machine's preemptions are not the collector's
        where = "training" if threading.get_native_id() == self._training else "other"
        for key in (f"gen{info['generation']}_n", f"gen{info['generation']}_ms"):
            self._gc.setdefault(key, 0.0)
        self._gc[f"gen{info['generation']}_n"] += 1
        self._gc[f"gen{info['generation']}_ms"] += dt * 1e3
        self._gc[f"on_{where}_ms"] = self._gc.get(f"on_{where}_ms", 0.0) + dt * 1e3

    def _agent(self) -> tuple[int, int]:
        m = getattr(self._store, "metrics", None) or {}
        return m.get("agent_requests", 0), m.get("agent_request_ns", 0)

    def start(self) -> None:
        """Begin counting (call on the training thread)."""
        self._training = threading.get_native_id()
        self._gc = {}
        gc.callbacks.append(self._on_gc)
        self._agent0 = self._agent()
        self._switches0 = _switches(self._training)
        self._t0 = _threads()
        self._wall0 = time.perf_counter_ns()

    def stop(self, saves: int) -> dict[str, Any]:
        """Stop counting; per save (``saves`` of them in the span): milliseconds and counts."""
        wall = time.perf_counter_ns() - self._wall0
        t1 = _threads()
        switches = _switches(self._training) - self._switches0
        agent1 = self._agent()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        names = {t.native_id: t.name for t in threading.enumerate()}
        n = max(saves, 1)
        groups: dict[str, list[float]] = {}
        for tid, (run, wait) in t1.items():
            run0, wait0 = self._t0.get(tid, (0, 0))
            name = names.get(tid, "")
            if tid == self._training:
                group = "training thread"
            else:
                group = next((g for prefix, g in GROUPS if name.startswith(prefix)), "XLA and the rest")
            g = groups.setdefault(group, [0.0, 0.0])
            g[0] += (run - run0) / 1e6 / n
            g[1] += (wait - wait0) / 1e6 / n
        out: dict[str, Any] = {"cpu_ms": {k: round(v[0], 3) for k, v in groups.items()},
                               "runqueue_ms": {k: round(v[1], 3) for k, v in groups.items()},
                               "gc": {k: round(v / n, 3) for k, v in sorted(self._gc.items())}}
        mine = groups.get("training thread")
        if mine is not None:  # off a core by its own wait: the GIL, a lock, XLA's results, the agent's reply
            out["training"] = {"wall_ms": round(wall / 1e6 / n, 3),
                               "blocked_ms": round(max(0.0, wall / 1e6 / n - mine[0] - mine[1]), 3),
                               "switches": round(switches / n, 3)}
        if self._store is not None and hasattr(self._store, "metrics"):
            out["agent_requests"] = (agent1[0] - self._agent0[0]) / n
            out["agent_request_ms"] = round((agent1[1] - self._agent0[1]) / 1e6 / n, 3)
        return out


def _pieces(sizes: Sequence[int]) -> tuple[int, list[tuple[np.ndarray, np.ndarray]]]:
    """Total bytes, and per piece (source, destination) slices of two buffers of those bytes: random source bytes,
    the destination's pages faulted in (a store's slot is reused, its memory already mapped)."""
    total = int(sum(sizes))
    src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    dst = np.empty(total, np.uint8)
    dst[:] = 1
    bounds = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))]).tolist()
    return total, [(src[a:b], dst[a:b]) for a, b in zip(bounds, bounds[1:])]


def copy_floor(sizes: Sequence[int], repeats: int = 5) -> dict[str, float]:
    """Medians, in seconds, of copying ``sizes`` pieces (the chunks of a save, in order) into one buffer on one
    thread, alone (``copy_s``) and each followed by its crc32c (``copy_crc_s``), the way the copy workers do."""
    from jaxckpt.core.checksum import crc32c

    total, pieces = _pieces(sizes)
    copy, both = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for s, d in pieces:
            np.copyto(d, s)
        copy.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for s, d in pieces:
            np.copyto(d, s)
            crc32c(d)
        both.append(time.perf_counter() - t0)
    return {"copy_s": statistics.median(copy), "copy_crc_s": statistics.median(both), "bytes": total,
            "pieces": len(sizes)}


class FloorCopy:
    """The floor as a snapshot a training loop can take: one thread of its own copies ``sizes`` pieces (a save's
    chunks, in order) from one buffer into another, each piece followed by its crc32c, once per :meth:`start`,
    while the caller goes on. Both buffers are made once, as ``copy_floor``'s (``_pieces``).

    ``bench stall``'s ``copy-floor`` mode starts one pass where the other modes save: its step-time overhead is
    what moving the same bytes once, in native calls that release the GIL, costs the loop on this machine (the
    copy's memory traffic and core time beside XLA's), with none of jaxckpt's per-shard work, round trips or
    donation held back: the bytes' own share of a snapshot's cost. ``view-floor`` hands each pass the views
    ``take_views`` took of the state (``start(hold)``): they live until the pass ends, as a save's do."""

    def __init__(self, sizes: Sequence[int]) -> None:
        total, self._pieces = _pieces(sizes)
        self.bytes, self.passes = total, 0
        self._todo: queue.Queue = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        # Named as jaxckpt's copy workers are, so that Breakdown counts its CPU in the same group.
        self._thread = threading.Thread(target=self._run, name="jaxckpt-copy floor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from jaxckpt.core.checksum import crc32c

        while True:
            hold = self._todo.get()
            if hold is None:
                return
            for s, d in self._pieces:
                np.copyto(d, s)
                crc32c(d)
            # Dropped here, on this thread, as a save's views are dropped on its workers: a donating step that
            # starts before now finds its buffers still viewed and leaves them alone.
            hold = None
            self.passes += 1
            self._idle.set()

    def start(self, hold: Any = True) -> None:
        """One pass, after the previous one ended (as a save waits for a free slot); ``hold`` (views of the
        state) is kept until the pass ends."""
        self._idle.wait()
        self._idle.clear()
        self._todo.put(True if hold is None else hold)

    def wait(self) -> None:
        """Until the latest pass ended."""
        self._idle.wait()

    def close(self) -> None:
        """Wait for the latest pass and end the thread."""
        self.wait()
        self._todo.put(None)
        self._thread.join()


ViewPlan = list[tuple[int, Any, tuple[int, ...], tuple[int, ...], bool]]


def saved_views(ck: Any) -> ViewPlan:
    """The buffers the latest state layout saved through ``ck`` reads through zero-copy views (JAX arrays on CPU
    devices): per such array, (leaf index, how its plan reaches them, positions in ``_arrays``, device ids,
    viewed through the buffer protocol?), as ``jaxckpt.jax.snapshot.Saver`` planned them."""
    plan = ck.frontend.saver.latest()
    return [(r[1], r[4], r[2], r[3], r[5]) for r in plan.reads or () if r[0] == "view"] if plan else []


def take_views(leaves: list[Any], plan: ViewPlan) -> list[Any]:
    """Zero-copy views of the buffers ``plan`` (``saved_views``) names, of ``leaves`` a step just made: the part
    of a snapshot JAX decides (exposing the local buffers of each array, then a view of each buffer read), taken
    the cheapest way this JAX gives, as save() takes them, and nothing else (no plan, no record, no copy)."""
    from jaxckpt.core import collector
    from jaxckpt.jax import buffers
    from jaxckpt.jax.snapshot import fast_view

    out, direct = [], fast_view()  # jaxlib's own view, for dtypes numpy's buffer protocol does not carry
    with collector.paused(), buffers.shared_shardings():
        for i, how, pos, devices, protocol in plan:
            x = leaves[i]
            if how == "one":
                arrs = [x._fully_replicated_shard()]
            elif how == "public":
                arrs = buffers.public(x, devices)
            else:
                arrs = x._arrays
                if how is not True:
                    arrs = [arrs[p] for p in pos]
            out.append(list(map(np.asarray, arrs)) if protocol else direct(arrs))
    return out


def describe(per_save: dict[str, Any], floor: dict[str, float] | None = None) -> str:
    """One line per figure, for a summary."""
    cpu, queue = per_save["cpu_ms"], per_save["runqueue_ms"]
    lines = ["CPU ms per save by thread: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(cpu.items())),
             "run-queue wait ms per save: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(queue.items()))]
    g = per_save["gc"]
    if g:
        gens = ", ".join(f"gen{k} {g.get(f'gen{k}_n', 0):.2f} x {g.get(f'gen{k}_ms', 0) / max(g.get(f'gen{k}_n', 0), 1e-9):.1f} ms"
                         for k in range(3) if g.get(f"gen{k}_n"))
        lines.append(f"collector pauses per save (hold the GIL): {gens}; on the training thread "
                     f"{g.get('on_training_ms', 0):.2f} ms, elsewhere {g.get('on_other_ms', 0):.2f} ms")
    if "training" in per_save:
        t = per_save["training"]
        lines.append(f"training thread blocked ms per save (waiting for the GIL, a lock, XLA's results or the agent): "
                     f"{t['blocked_ms']:.2f} of {t['wall_ms']:.2f}, voluntary switches {t['switches']:.1f}")
    if "agent_requests" in per_save:
        lines.append(f"agent round trips per save: {per_save['agent_requests']:.2f} "
                     f"({per_save['agent_request_ms']:.2f} ms)")
    if floor:
        lines.append(f"floor, one thread, same run: copy + crc32c of the {floor['bytes'] / 2**20:.1f} MiB in its "
                     f"{floor['pieces']:,} pieces {floor['copy_crc_s'] * 1e3:.2f} ms (copy alone "
                     f"{floor['copy_s'] * 1e3:.2f} ms)")
    return "\n".join(lines)


def blocked_added(per_save: dict[str, Any], base: dict[str, Any]) -> str:
    """The training thread's blocked time and voluntary switches per save over ``base``'s (the same steps without
    a snapshot): the most its waits for the GIL can add, with the agent's round trips and any wait for the copy
    among them. Empty where either lacks them."""
    a, b = per_save.get("training"), base.get("training")
    if not a or not b:
        return ""
    return (f"training thread blocked {a['blocked_ms'] - b['blocked_ms']:+.2f} ms, voluntary switches "
            f"{a['switches'] - b['switches']:+.1f}")


def process_cpu_ms(per_save: dict[str, Any]) -> float:
    """All of the process's CPU per save (every thread), milliseconds."""
    return float(sum(per_save["cpu_ms"].values()))


__all__ = ["Breakdown", "FloorCopy", "blocked_added", "copy_floor", "describe", "process_cpu_ms"]
