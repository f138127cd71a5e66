"""``jaxckpt chaos --profile soak``: does anything grow over a long run? Sampler, slope fit and verdict.

The soak is a chaos run (jaxckpt/tools/chaos/run.py) whose incarnations train long: 3 simulated nodes, one numpy
trainer each, ``store="shm"`` with the node agents' memory budget, protection ``hybrid``, a snapshot every step.
Each incarnation trains a **segment** of ``fault_every`` steps; then one fault of a seeded random kind (the chaos
kinds, see :data:`SOAK_FAULTS`) strikes, the job is stopped, and the next incarnation's restore is checked bit
for bit exactly as in every chaos trial. Faults that act at a phase of a save are pushed back to the segment's
end, so every segment trains undisturbed. While a segment trains, every ``sample_every`` steps the driver reads
from /proc, per process (trainers and agents):

  rss        VmRSS (every resident page, the mapped shared memory it touched included)
  rss_anon   RssAnon (the private heap: where a Python-level leak shows)
  fds        entries of /proc/PID/fd
  sockets    those fds that are sockets
  threads    Threads of /proc/PID/status
and per agent the node directory (``shm_dir``: its segments, records and small files):
  shm_bytes  allocated blocks of its files (st_blocks: the bytes actually resident in tmpfs, not their sizes)
  shm_files  the files there
and for the job, the coordination service's live keys (files of the incarnation's FileCoordinator directory).

**Series and segments.** A series is one metric of one process in one segment: a trainer restarted after a fault
is a new process, and an agent (which lives across trainer incarnations) starts a new series with each
incarnation too, since its state between segments is what a fault and a restart left. Each series is fitted on its
steady part: the samples at least ``warmup_steps`` after the segment's first step (start-up: imports, first
allocations, the keep and pending slots filling up). A series with fewer than MIN_POINTS samples there is
reported, not judged; so are an agent process's series in its first segment, its warm-up: an agent starts with
the job (or after its restart) and its heap climbs over its first ~4,000 steps, then stays flat (measured: level
from step 4,000 to 12,000 of one 12,000-step segment, and from its second segment on), and it is judged in every
later segment and across them (below). A trainer is a new process in every segment and is judged in each. The
run's length comes from the segments: ``steps // fault_every`` of them, so ``steps // fault_every - 1`` faults (the
last incarnation, which checks the last fault, trains one too).

**The rule for growth** (:func:`fit`). Least squares y = a + b x with x in thousands of steps; b is the slope per
1,000 steps. Its noise band is ``Z`` standard errors, the standard error taken from the residuals and widened for
their lag-1 autocorrelation r (effective sample size n (1 - r) / (1 + r)), since samples of a slowly wandering
level are not independent. A series **grows** when all three hold:
  1) b > band                                   (the rise is beyond the noise);
  2) b > TOLERANCE[metric].per_1000_steps       (and beyond a small absolute rate: 256 KiB of memory, 64 KiB of
                                                tmpfs, half a file, socket or thread, 2 keys per 1,000 steps);
  3) b x span > TOLERANCE[metric].total         (and it added up to something over the fitted span: 512 KiB of
                                                memory, 256 KiB of tmpfs, 4 segment files, 2 of another
                                                count, 6 keys);
  4) and 1)-3) still hold for the slope fitted beside one level shift, at the pair of samples where it fits
     best (least squares of y = a + b x + c [x >= x_k] over k): a leak climbs in every interval, while a one-time
     step of the heap's high-water mark (measured: ~530 KiB in each trainer, once, at a step between 190 and 260
     with hybrid protection, none without) is a level that a 100-step fit would read as a slope.
So the tolerated slope is max(rate, total / span): over the soak's 3,000-step fits the rate governs memory (and
counts to within 0.67 per 1,000 steps), while a quick run's 100-step fits tolerate its start-up drift (a few
MiB per 1,000 steps) and still catch a leak of 8 KiB or of an fd per step. A falling series never fails. The
quick run bounds the per-step records at 16 steps (``SoakPlan.steps_kept``, jaxckpt.core.trim) so that they are
full within its 50-step warm-up: filling to the default bound takes 2,048 steps at about 1.8 KiB a step, a
slope within 2-3x of the quick run's tolerance that a loaded machine pushed over it.

An agent lives across segments: its steady level per segment (the fitted median) must not rise from its second
segment (the first is its warm-up) to its last by more than the total tolerance (:func:`across_segments`): what a
fault and a restart leave behind each time. The run fails on any growing series, on a stall (no step trained for
the driver's time-out), on a trainer that ended during a segment without a fault, on an incarnation that could not
restore, and on any failed chaos check (wrong restore, hang, unexpected loss, unrecovered fault).

    jaxckpt chaos --profile soak --seed 0 [--steps 20000] [--json] [--update-md BENCHMARKS.md]
    jaxckpt chaos --profile soak-quick                    # 2 segments of 150 steps, 1 fault (tests/test_soak.py)
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from jaxckpt.core.trim import ENV_STEPS_KEPT
from jaxckpt.tools.chaos import run as chaos

log = logging.getLogger("jaxckpt.tools.chaos.soak")

Z = 3.0  # the noise band, in (autocorrelation-widened) standard errors of the slope
MIN_POINTS = 8  # samples a series needs on its steady part to be judged
KIB, MIB = 1 << 10, 1 << 20
PROC_METRICS = ("rss", "rss_anon", "fds", "sockets", "threads")
AGENT_METRICS = ("shm_bytes", "shm_files")
JOB_METRICS = ("keys",)
# The chaos kinds a soak draws from: not the peer faults, whose proxy would sit in front of a node for the whole
# segment (a degraded link for thousands of steps, not a fault spaced out); pass --faults to add them.
SOAK_FAULTS = ("kill-trainer", "kill-trainer-phase", "kill-agent", "kill-agent-wipe", "kill-agent-phase",
               "kill-agent-phase-wipe", "corrupt-chunk", "corrupt-record", "fill-budget", "node-loss")


@dataclass(frozen=True)
class Tolerance:
    per_1000_steps: float  # the slope a series may have (its unit per 1,000 steps)
    total: float  # the growth it may add up to over its fitted span


# Live coordination keys wander with the protection lag (a step's early skip answer lives until every process
# was seen in a later round) and the rounds in flight; a leaked key per round would be 1,000 per 1,000 steps. An
# agent's segment files wander with it too: the steps held while their protection is pending, and the pool. On a
# loaded machine that wander reached 3 files within one quick run's 100-step fit (the suite beside a CPU-bound
# process); a leaked segment per save would be 1,000 per 1,000 steps, so 4 in all still catches one per 25 steps.
TOLERANCE = {"rss": Tolerance(256 * KIB, 512 * KIB), "rss_anon": Tolerance(256 * KIB, 512 * KIB),
             "shm_bytes": Tolerance(64 * KIB, 256 * KIB), "shm_files": Tolerance(0.5, 4), "fds": Tolerance(0.5, 2),
             "sockets": Tolerance(0.5, 2), "threads": Tolerance(0.5, 2), "keys": Tolerance(2, 6)}
BYTES = {"rss", "rss_anon", "shm_bytes"}


@dataclass(frozen=True)
class SoakPlan:
    steps: int  # steps to train in all (the segments add up to at least this)
    fault_every: int  # steps per segment: a fault between two segments
    sample_every: int  # steps between two samples
    warmup_steps: int  # a segment's first steps, not fitted
    # The bound of every process's per-step records (JAXCKPT_STEPS_KEPT, jaxckpt.core.trim; 0: the library's
    # 1,024). A short soak sets one its warm-up covers: the records fill for 2 x the bound steps, and a
    # 100-step fit of that fill (about 1.8 KiB a step) is within 2-3x of what it calls a leak.
    steps_kept: int = 0


# The chaos Profile of the job (trials are set from the plan) and the plan of the soak.
PROFILES: dict[str, tuple[chaos.Profile, SoakPlan]] = {
    "soak": (chaos.Profile(trials=0, jax_trials=0, nodes=3, procs_per_node=1, interval=1, protection="hybrid"),
             # The warm-up covers the bounded per-step records filling to their bound (jaxckpt.core.trim:
             # 2 * STEPS_KEPT entries, then trimmed) and the dict tables that hold them: the 2026-12-01 soak with
             # a 1,000-step warm-up saw each trainer's RSS ramp 0.8 MiB to a plateau near step 3,000 of its
             # segment (tracemalloc: the Python heap bounded, a sawtooth between 1,024 and 2,048 records). A
             # later one with 6,000-step segments still saw a last 1 MiB step of the trainers' RSS between steps
             # 5,000 and 7,000; one 15,000-step segment showed each trainer flat from step 8,000 on (51.3 MiB,
             # within 0.1 MiB to step 15,000). So segments are 10,000 steps, the first 8,000 their warm-up.
             SoakPlan(steps=40_000, fault_every=10_000, sample_every=50, warmup_steps=8_000)),
    "soak-quick": (chaos.Profile(trials=0, jax_trials=0, nodes=3, procs_per_node=1, interval=1, protection="hybrid"),
                   SoakPlan(steps=300, fault_every=150, sample_every=5, warmup_steps=50, steps_kept=16)),
}


# ------------------------------------------------------------------------------------------------ sampling
def proc_stats(pid: int) -> dict[str, int] | None:
    """rss, rss_anon, fds, sockets, threads of process ``pid`` from /proc; None once it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
        fds = os.listdir(f"/proc/{pid}/fd")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if "VmRSS" not in fields:  # a zombie has no memory left to report
        return None
    sockets = 0
    for fd in fds:
        try:
            sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:  # closed since the listing
            pass
    kib = lambda k: int(fields[k].split()[0]) * KIB  # noqa: E731 - /proc reports kB
    return {"rss": kib("VmRSS"), "rss_anon": kib("RssAnon") if "RssAnon" in fields else kib("VmRSS"),
            "fds": len(fds), "sockets": sockets, "threads": int(fields["Threads"])}


def dir_stats(directory: str) -> dict[str, int] | None:
    """shm_bytes (allocated blocks: resident in tmpfs) and shm_files of the regular files in ``directory``."""
    nbytes = files = 0
    try:
        with os.scandir(directory) as it:
            for e in it:
                try:
                    if e.is_file(follow_symlinks=False):
                        files += 1
                        nbytes += e.stat(follow_symlinks=False).st_blocks * 512
                except FileNotFoundError:  # freed since the listing
                    pass
    except FileNotFoundError:
        return None
    return {"shm_bytes": nbytes, "shm_files": files}


def live_keys(directory: str) -> int:
    """The keys a FileCoordinator holds in ``directory`` (one file each; a ``.tmp`` is a write in flight)."""
    try:
        return sum(not name.endswith(".tmp") for name in os.listdir(directory))
    except FileNotFoundError:
        return 0


class Sampler:
    """Series of (step, value) per (process, metric, segment), in the order they were sampled."""

    def __init__(self) -> None:
        self.series: dict[tuple[str, str, int, int], dict[str, Any]] = {}

    def add(self, proc: str, role: str, pid: int, segment: int, step: int, values: Mapping[str, int]) -> None:
        for metric, v in values.items():
            s = self.series.setdefault((proc, metric, pid, segment), {
                "proc": proc, "role": role, "metric": metric, "pid": pid, "segment": segment, "steps": [],
                "values": []})
            s["steps"].append(int(step))
            s["values"].append(int(v))

    def sample(self, step: int, segment: int, trainers: Sequence[tuple[str, int]],
               agents: Sequence[tuple[str, int, str]], coord_dir: str) -> None:
        """One sample of every process: trainers (name, pid), agents (name, pid, node directory), the job's keys."""
        for name, pid in trainers:
            st = proc_stats(pid)
            if st is not None:
                self.add(name, "trainer", pid, segment, step, st)
        for name, pid, d in agents:
            st, ds = proc_stats(pid), dir_stats(d)
            if st is not None and ds is not None:
                self.add(name, "agent", pid, segment, step, {**st, **ds})
        self.add("job", "job", 0, segment, step, {"keys": live_keys(coord_dir)})


# ---------------------------------------------------------------------------------------------------- fits
@dataclass(frozen=True)
class Fit:
    """The steady-part fit of one series (see the module docstring for the rule)."""

    slope: float  # per 1,000 steps
    band: float  # Z widened standard errors of the slope
    resid_std: float
    level: float  # the median of the fitted samples
    points: int
    span_steps: int
    growth: bool
    level_shift: float = 0.0  # the one level shift allowed when judging growth (rule 4), if it was judged


def fit(steps: Sequence[int], values: Sequence[float], metric: str) -> Fit | None:
    """Least-squares slope of ``values`` over ``steps`` with its noise band and the growth verdict; None for
    fewer than MIN_POINTS samples or a single step. A series grows only if it also does once one level shift is
    allowed (rule 4 of the module docstring): a leak climbs in every interval, while one allocator step (the
    heap's high-water mark reached once) is a level, which a short fit would otherwise read as a slope."""
    x = np.asarray(steps, np.float64) / 1000.0
    y = np.asarray(values, np.float64)
    if x.size < MIN_POINTS or np.ptp(x) == 0:
        return None
    xc = x - x.mean()
    b, band, s, growth = _judge(xc, y, np.ones_like(x)[:, None], metric)
    shift = 0.0
    if growth:  # the best single level shift, between samples k - 1 and k, and the slope beside it
        best = None
        for k in range(2, x.size - 1):
            cols = np.stack([np.ones_like(x), (np.arange(x.size) >= k).astype(np.float64)], axis=1)
            coef, res, *_ = np.linalg.lstsq(np.column_stack([cols, xc]), y, rcond=None)
            ss = float(res[0]) if res.size else float(np.sum((y - np.column_stack([cols, xc]) @ coef) ** 2))
            if best is None or ss < best[0]:
                best = (ss, cols, float(coef[1]))
        if best is not None:
            growth = _judge(xc, y, best[1], metric)[3]
            shift = best[2]
    return Fit(round(b, 4), round(band, 4), round(s, 4), float(np.median(y)), int(x.size),
               int(round(float(np.ptp(x)) * 1000)), bool(growth), round(shift, 4))


def _judge(xc: np.ndarray, y: np.ndarray, levels: np.ndarray, metric: str) -> tuple[float, float, float, bool]:
    """Least squares of ``y`` on the columns ``levels`` (a constant, maybe a level shift) and the centred steps
    ``xc``: (slope per 1,000 steps, its band, the residuals' deviation, whether that is growth by rules 1-3)."""
    a = np.column_stack([levels, xc])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    b = float(coef[-1])
    r = y - a @ coef
    ss = float(r @ r)
    dof = max(1, y.size - a.shape[1])
    s = math.sqrt(ss / dof)
    # the slope's standard error: the residual variance times the last diagonal entry of (A^T A)^-1
    var_b = float(np.linalg.inv(a.T @ a)[-1, -1])
    r1 = min(max(float(r[:-1] @ r[1:]) / ss, 0.0), 0.95) if ss > 0 else 0.0
    band = Z * s * math.sqrt(var_b) * math.sqrt((1 + r1) / (1 - r1))
    span = float(np.ptp(xc))
    tol = TOLERANCE[metric]
    return b, band, s, b > band and b > tol.per_1000_steps and b * span > tol.total


def fit_series(series: Mapping[str, Any], warmup_steps: int) -> dict[str, Any]:
    """A series' record for the report: its identity, the steady part's first step and its fit (or None)."""
    first = series["steps"][0] if series["steps"] else 0
    keep = [(s, v) for s, v in zip(series["steps"], series["values"]) if s >= first + warmup_steps]
    f = fit([s for s, _ in keep], [v for _, v in keep], series["metric"]) if keep else None
    return {k: series[k] for k in ("proc", "role", "metric", "pid", "segment")} | {
        "first_step": first, "fit": asdict(f) if f is not None else None}


# -------------------------------------------------------------------------------------------------- the run
class _Progress:
    """The newest step trained and whether a phase fault went off, read incrementally from an incarnation's
    events (called under its lock: a full scan per event would be quadratic over thousands of steps)."""

    def __init__(self, inc: chaos.Incarnation) -> None:
        self.inc, self.seen, self.step, self.fault = inc, 0, 0, False

    def update(self) -> int:
        events = self.inc.events
        for e in events[self.seen:]:
            if e["ev"] == "trained":
                self.step = max(self.step, e["step"])
            elif e["ev"] == "phase-fault":
                self.fault = True
        self.seen = len(events)
        return self.step


class SoakRun(chaos.ChaosRun):
    """A chaos run of long segments with a sampler (see the module docstring). ``test_leaks`` is a TEST FAULT for
    tests/test_soak.py: {process: leak}, that trainer leaks fds or memory every step (trainer.Trainer.test_leak)."""

    def __init__(self, profile: chaos.Profile, plan: SoakPlan, seed: int, faults: list[str] | None = None,
                 test_leaks: Mapping[int, Mapping[str, Any]] | None = None) -> None:
        if plan.steps < plan.fault_every or plan.sample_every < 1 or plan.warmup_steps >= plan.fault_every:
            raise ValueError(f"a soak needs steps >= fault_every > warmup_steps and sample_every >= 1: {plan}")
        super().__init__(profile, seed, trials=plan.steps // plan.fault_every - 1, jax_trials=0,
                         faults=list(faults or SOAK_FAULTS))
        self.plan, self.test_leaks = plan, {int(q): dict(v) for q, v in (test_leaks or {}).items()}
        self.sampler = Sampler()
        self.steps_trained = 0
        self.segment_seconds = 0.0
        self.segments: list[dict[str, Any]] = []
        self.incidents: list[str] = []
        self._coord_dir = ""

    def specs(self, mode: str, fault: dict | None, target: int) -> list[dict]:
        specs = super().specs(mode, fault, target)
        self._coord_dir = specs[0]["coord_dir"]
        for s in specs:
            f = s.get("fault")
            if f and "after" in f and f["phase"] != "restore":  # strike after the segment, not inside it
                s["fault"] = {**f, "after": f["after"] + self.plan.fault_every // self.profile.interval}
            if s["process"] in self.test_leaks:
                s["test_leak"] = self.test_leaks[s["process"]]
        return specs

    def launch(self, prev: chaos.TrialResult | None, mode: str, fault: dict | None = None,
               target: int = -1) -> chaos.Incarnation | None:
        """ChaosRun.launch, then the incarnation's segment (unless the fault strikes in its restore)."""
        inc = super().launch(prev, mode, fault, target)
        if inc is None:
            self.incidents.append(f"incarnation {self.epoch}: the job could not restore and train "
                                  f"(relaunched {chaos.MAX_RELAUNCH} times)")
        elif not (fault is not None and fault.get("phase") == "restore"):
            self._segment(inc)  # a fault in the restore leaves its damage to the fault's own handling: no segment
        return inc

    def _segment(self, inc: chaos.Incarnation) -> None:
        """Train ``fault_every`` steps, sampling every ``sample_every``; stop early at a phase fault or an exit."""
        prog = _Progress(inc)
        with inc.lock:
            prog.update()
        first = min(e["step"] for e in inc.of("trained"))
        inc.soak_first = first
        end, seg, t0 = first + self.plan.fault_every - 1, self.epoch, time.monotonic()
        trainers = [(f"trainer {q}", p.pid) for q, p in enumerate(inc.procs)]
        agents = [(f"agent {os.path.basename(d)}", p.pid, d) for d, p in self.agents.items() if d in self.node_dirs]
        mark = first
        while True:
            if not inc.wait(lambda: prog.update() >= mark or prog.fault or inc.exited(), self.profile.timeout_s):
                self.incidents.append(f"segment {seg}: no step trained past {prog.step} for "
                                      f"{self.profile.timeout_s:g} s")
                self.unattributed["hangs"] += 1
                break
            if prog.fault:
                break
            if inc.exited():
                self.incidents.append(f"segment {seg}: a trainer ended at step {prog.step} without a fault")
                break
            self.sampler.sample(prog.step, seg, trainers, agents, self._coord_dir)
            if prog.step >= end:
                break
            mark = prog.step + self.plan.sample_every
        self.segments.append({"segment": seg, "first_step": first, "last_step": prog.step,
                              "seconds": round(time.monotonic() - t0, 2)})
        self.segment_seconds += time.monotonic() - t0
        _trim(inc)

    def stop(self, inc: chaos.Incarnation) -> None:
        super().stop(inc)
        first = getattr(inc, "soak_first", None)
        if first is not None:
            self.steps_trained += max(0, inc.last("trained") - first + 1)

    def run(self) -> dict:
        """The soak, then its report (the chaos report of its faults inside)."""
        t0 = time.monotonic()
        saved = os.environ.get(ENV_STEPS_KEPT)
        if self.plan.steps_kept:  # every trainer and agent the run starts inherits it
            os.environ[ENV_STEPS_KEPT] = str(self.plan.steps_kept)
        try:
            rep = super().run()
        finally:
            if saved is None:
                os.environ.pop(ENV_STEPS_KEPT, None)
            else:
                os.environ[ENV_STEPS_KEPT] = saved
        return soak_report(self, rep, time.monotonic() - t0)


def _trim(inc: chaos.Incarnation) -> None:
    """Keep, of an incarnation's per-step events, only each process's newest of each kind (what the fault code
    reads: the newest trained, committed and protected steps), in their order; every other event stays."""
    per_step = ("trained", "committed", "protected")
    with inc.lock:
        newest = {(e["ev"], e["p"]): i for i, e in enumerate(inc.events) if e["ev"] in per_step}
        keep = set(newest.values())
        inc.events[:] = [e for i, e in enumerate(inc.events) if e["ev"] not in per_step or i in keep]


def across_segments(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per agent process and metric, its steady level (the fitted median) in each segment it lived through, and
    whether it rose across them: a leak per fault (a connection or a slot kept per restarted peer) shows only
    there. The first segment of an agent process is its warm-up; it grows when its last level exceeds the one
    of its second segment by more than the metric's total tolerance."""
    by: dict[tuple[str, str, int], list[tuple[int, float]]] = {}
    for r in records:
        if r["role"] == "agent" and r["fit"] is not None:
            by.setdefault((r["proc"], r["metric"], r["pid"]), []).append((r["segment"], r["fit"]["level"]))
    out = []
    for (proc, metric, pid), levels in by.items():
        levels.sort()
        if len(levels) < 3:
            continue
        rise = levels[-1][1] - levels[1][1]
        out.append({"proc": proc, "metric": metric, "pid": pid, "segments": [g for g, _ in levels],
                    "levels": [v for _, v in levels], "rise": rise, "growth": rise > TOLERANCE[metric].total})
    return out


def soak_report(run: SoakRun, chaos_rep: dict, seconds: float) -> dict:
    """The soak's report: its plan, the chaos report of its faults, every series with its fit, the verdict."""
    fits = [fit_series(s, run.plan.warmup_steps) for s in run.sampler.series.values()]
    first: dict[tuple[str, int], int] = {}  # an agent process's first segment: its warm-up
    for f in fits:
        if f["role"] == "agent":
            first[(f["proc"], f["pid"])] = min(first.get((f["proc"], f["pid"]), f["segment"]), f["segment"])
    for f in fits:
        f["judged"] = f["fit"] is not None and first.get((f["proc"], f["pid"])) != f["segment"]
    growing = [f"{f['proc']} {f['metric']} (segment {f['segment']})" for f in fits
               if f["judged"] and f["fit"]["growth"]]
    across = across_segments(fits)
    growing += [f"{a['proc']} {a['metric']} (across segments {a['segments'][1]}..{a['segments'][-1]})"
                for a in across if a["growth"]]
    return {"soak": asdict(run.plan), "profile": chaos_rep["profile"], "seed": run.seed,
            "seconds": round(seconds, 1), "steps_trained": run.steps_trained,
            "steps_per_s": round(run.steps_trained / run.segment_seconds, 2) if run.segment_seconds else 0.0,
            "segments": run.segments, "faults": [{k: r[k] for k in ("kind", "detail", "recovered", "lost")}
                                                 for r in chaos_rep["results"]],
            "chaos_ok": chaos.ok(chaos_rep), "incidents": run.incidents, "growing": growing,
            "fitted": sum(f["fit"] is not None for f in fits), "judged": sum(f["judged"] for f in fits),
            "tolerance": {k: asdict(v) for k, v in TOLERANCE.items()},
            "z": Z, "across_segments": across, "series": [s | {k: f[k] for k in ("fit", "judged", "first_step")}
                               for s, f in zip(run.sampler.series.values(), fits)],
            "chaos": {k: v for k, v in chaos_rep.items() if k != "results"}}


def ok(rep: Mapping[str, Any]) -> bool:
    """Nothing grew, some series were judged, no incident, and every chaos check passed."""
    return rep["chaos_ok"] and not rep["growing"] and not rep["incidents"] and rep["judged"] > 0


def run_soak(profile: str = "soak-quick", seed: int = 0, steps: int | None = None, **kw: Any) -> dict:
    """Run soak profile ``profile`` (``steps`` overrides its length; ``faults=``, ``test_leaks=`` pass on)."""
    prof, plan = PROFILES[profile]
    return SoakRun(prof, with_steps(plan, steps), seed, **kw).run()


def with_steps(plan: SoakPlan, steps: int | None) -> SoakPlan:
    """``plan`` shortened or lengthened to ``steps``; a run shorter than a segment is one segment, its warm-up
    and sampling scaled down with it (a third of it warm-up, at least 30 samples)."""
    if steps is None:
        return plan
    if steps >= plan.fault_every:
        return dataclasses.replace(plan, steps=steps)
    return dataclasses.replace(plan, steps=steps, fault_every=steps,
                               sample_every=max(1, min(plan.sample_every, steps // 30)),
                               warmup_steps=min(plan.warmup_steps, steps // 3))


def format_summary(rep: Mapping[str, Any]) -> str:
    """The report in a few lines: steps, rate, faults, and every judged series' slope (the growing ones marked)."""
    lines = [f"jaxckpt chaos soak: seed {rep['seed']}, {rep['steps_trained']} steps in {len(rep['segments'])} "
             f"segments at {rep['steps_per_s']:g} steps/s, {len(rep['faults'])} faults "
             f"({', '.join(f['kind'] for f in rep['faults']) or 'none'}), {rep['seconds']} s; chaos checks "
             f"{'passed' if rep['chaos_ok'] else 'FAILED'}; {len(rep['growing'])} of {rep['judged']} judged series "
             f"grow"]
    lines += [f"  incident: {i}" for i in rep["incidents"]]
    for s in rep["series"]:
        f = s["fit"]
        if f is not None:
            unit = "B" if s["metric"] in BYTES else ""
            verdict = ("GROWS" if f["growth"] else "flat ") if s["judged"] else "warm-up"
            lines.append(f"  {verdict:<7} {s['proc']:<12} {s['metric']:<9} segment "
                         f"{s['segment']:<3} slope {f['slope']:>12.1f}{unit} +- {f['band']:.1f}{unit} per 1000 steps "
                         f"over {f['span_steps']} steps (level {f['level']:.0f}{unit})")
    return "\n".join(lines)
