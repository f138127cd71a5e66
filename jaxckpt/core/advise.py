"""How often to snapshot: the interval that minimises the expected time a job loses (Young/Daly).

Model (first order, the assumptions of Young 1974 and Daly 2006):

* failures arrive as a Poisson process; a job on ``nodes`` nodes, each failing on average every ``mtbf_node_s``
  seconds, fails every ``M = mtbf_node_s / nodes`` seconds on average;
* a snapshot costs the job ``delta`` seconds of wall time (the step-time overhead of one snapshot: for jaxckpt
  the time ``save()`` blocks the caller plus whatever the background copy slows the step, not the copy itself);
* a failure loses the work since the newest snapshot that survives it, plus the time to get going again: on
  average half an interval ``tau / 2``, plus the latency ``L`` from ``save()`` until that snapshot is recoverable
  (committed, or protected for the loss of a node), plus the restart ``R`` (relaunch and restore).

The fraction of time lost is then ``W(tau) = delta / tau + (tau / 2 + L + R) / M``, least at Young's
``tau = sqrt(2 * delta * M)``; Daly's higher-order form, used here, is
``tau = sqrt(2 delta M) * (1 + sqrt(delta / (2M)) / 3 + (delta / (2M)) / 9) - delta`` for ``delta < 2M``, else
``tau = M``. ``L`` and ``R`` do not move the optimum, only the loss. The interval is rounded to whole steps by
comparing ``W`` at the two nearest step counts, and is never below one step: with in-memory snapshots whose
overhead is tiny the answer is "every step".
"""
from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass
from typing import Mapping

from jaxckpt.errors import ConfigError


@dataclass(frozen=True)
class IntervalAdvice:
    """The advised snapshot interval and what it is expected to cost."""

    interval_steps: int          # snapshot every this many steps
    interval_s: float            # the same in seconds of training (interval_steps * step_time_s)
    optimum_s: float             # Daly's continuous optimum, before rounding to steps
    job_mtbf_s: float            # mtbf_node_s / nodes
    overhead_s: float            # delta: step-time cost of one snapshot
    step_time_s: float
    latency_s: float             # L: save() -> recoverable
    restart_s: float             # R: relaunch and restore
    lost_fraction: float         # W at interval_steps: expected fraction of time lost to snapshots and failures
    lost_fraction_every_step: float  # W when saving every step, for comparison

    def describe(self) -> str:
        """One line a person reads."""
        return (f"snapshot every {self.interval_steps} step(s) ({self.interval_s:.3g} s): expected time lost "
                f"{100 * self.lost_fraction:.3g}% (every step: {100 * self.lost_fraction_every_step:.3g}%), for a job "
                f"MTBF of {self.job_mtbf_s:.4g} s, a snapshot overhead of {1e3 * self.overhead_s:.3g} ms per "
                f"snapshot, a step of {1e3 * self.step_time_s:.3g} ms")


def lost_fraction(tau_s: float, overhead_s: float, job_mtbf_s: float, latency_s: float = 0.0,
                  restart_s: float = 0.0) -> float:
    """``W(tau)``: the expected fraction of wall time lost to snapshot overhead and to failures."""
    return overhead_s / tau_s + (tau_s / 2 + latency_s + restart_s) / job_mtbf_s


def daly_optimum(overhead_s: float, job_mtbf_s: float) -> float:
    """Daly's optimal interval in seconds for a snapshot cost ``overhead_s`` and a job MTBF ``job_mtbf_s``."""
    if overhead_s <= 0:
        return 0.0
    if overhead_s >= 2 * job_mtbf_s:
        return job_mtbf_s
    r = overhead_s / (2 * job_mtbf_s)
    return math.sqrt(2 * overhead_s * job_mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - overhead_s


def advise_interval(*, mtbf_node_s: float, nodes: int, step_time_s: float, overhead_s: float,
                    latency_s: float = 0.0, restart_s: float = 0.0) -> IntervalAdvice:
    """The snapshot interval, in steps, that minimises the expected lost time (module docstring: the model)."""
    for name, v in (("mtbf_node_s", mtbf_node_s), ("step_time_s", step_time_s)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ConfigError(f"advise_interval: {name}={v!r} must be a positive number of seconds")
    for name, v in (("overhead_s", overhead_s), ("latency_s", latency_s), ("restart_s", restart_s)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ConfigError(f"advise_interval: {name}={v!r} must be a number of seconds >= 0")
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        raise ConfigError(f"advise_interval: nodes={nodes!r} must be an int >= 1")
    m = mtbf_node_s / nodes
    tau = daly_optimum(overhead_s, m)

    def w(k: int) -> float:
        return lost_fraction(k * step_time_s, overhead_s, m, latency_s, restart_s)

    lo = max(1, math.floor(tau / step_time_s))
    k = min((lo, lo + 1), key=w)
    return IntervalAdvice(interval_steps=k, interval_s=k * step_time_s, optimum_s=tau, job_mtbf_s=m,
                          overhead_s=overhead_s, step_time_s=step_time_s, latency_s=latency_s, restart_s=restart_s,
                          lost_fraction=w(k), lost_fraction_every_step=w(1))


class SaveCosts:
    """What a job's own saves cost, measured as it runs (the engine records every save() call): the inputs of
    :func:`advise_interval` a user does not have to guess. Bounded to the newest ``keep`` saves."""

    def __init__(self, keep: int = 256) -> None:
        self._saves: deque[tuple[int, float, float]] = deque(maxlen=keep)  # (step, call start, call seconds)
        self._lock = threading.Lock()

    def record(self, step: int, started: float, call_s: float) -> None:
        """One save() call of ``step`` that started at ``started`` (``time.monotonic()``) and blocked ``call_s``."""
        with self._lock:
            self._saves.append((step, started, call_s))

    def measured(self, decided: Mapping[int, tuple[float, float]]) -> dict[str, float]:
        """Medians over the recorded saves: ``overhead_s`` (what save() blocked the caller), ``step_time_s`` (time
        per step between save() calls, less that overhead) and ``latency_s`` (save() called -> committed, from
        ``decided``: step -> (local done, decided) on ``time.monotonic()``); keys missing when not measurable."""
        import statistics  # here: only an advice needs it (2 ms of every process's import of the engine otherwise)

        with self._lock:
            saves = list(self._saves)
        out: dict[str, float] = {}
        if saves:
            out["overhead_s"] = statistics.median(c for _, _, c in saves)
        per_step = [(t1 - t0) / (s1 - s0) for (s0, t0, _), (s1, t1, _) in zip(saves, saves[1:]) if s1 > s0]
        if per_step:
            out["step_time_s"] = max(statistics.median(per_step) - out["overhead_s"], 1e-9)
        lat = [decided[s][1] - t for s, t, _ in saves if s in decided]
        if lat:
            out["latency_s"] = max(statistics.median(lat), 0.0)
        return out

    def advise(self, decided: Mapping[int, tuple[float, float]], *, mtbf_node_s: float, nodes: int,
               step_time_s: float | None = None, overhead_s: float | None = None, latency_s: float | None = None,
               restart_s: float = 0.0) -> IntervalAdvice:
        """:func:`advise_interval` with what was not given taken from the measured saves (``ConfigError`` when a
        value is neither given nor measurable yet: at least two saves of different steps are needed)."""
        m = self.measured(decided)
        given = {"step_time_s": step_time_s, "overhead_s": overhead_s, "latency_s": latency_s}
        args = {k: (v if v is not None else m.get(k)) for k, v in given.items()}
        missing = [k for k in ("step_time_s", "overhead_s") if args[k] is None]
        if missing:
            raise ConfigError(f"advise_interval: {', '.join(missing)} not measured yet (save at least two steps "
                              f"first) and not given")
        return advise_interval(mtbf_node_s=mtbf_node_s, nodes=nodes, step_time_s=args["step_time_s"],
                               overhead_s=args["overhead_s"], latency_s=args["latency_s"] or 0.0, restart_s=restart_s)
