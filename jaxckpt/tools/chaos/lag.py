"""Protection lag of a chaos run: from a step's commit until it (or a newer step) is protected.

A trainer reports a commit and a protection when it looks, between its steps; the events also carry ``at``, the
time the commit was decided (``engine.commit_times``) and the time the step was announced protected
(``Protector.protected_times``), so the lag measured is the system's, not the polling's. Events without ``at``
(older records) count at the time they were reported.
"""
from __future__ import annotations

__all__ = ["lag_summary", "protection_lags"]


def _at(e: dict) -> float:
    at = e.get("at")
    return float(at) if isinstance(at, (int, float)) else float(e["t"])


def protection_lags(events: list[dict]) -> list[tuple[int, float]]:
    """For each step committed and then covered by a protected step: (steps committed after it by the time it was
    covered, seconds from its commit on the last process to the first protection covering it). Events carry the
    host's time.monotonic()."""
    committed: dict[int, float] = {}  # step -> when the last process had it committed
    protected: list[tuple[float, int]] = []
    for e in events:
        if "t" not in e:
            continue
        if e["ev"] == "committed":
            committed[e["step"]] = max(committed.get(e["step"], float("-inf")), _at(e))
        elif e["ev"] == "protected":
            protected.append((_at(e), e["step"]))
    protected.sort()
    out = []
    for s, t in sorted(committed.items()):
        cover = next((at for at, p in protected if p >= s and at >= t), None)
        if cover is None:
            continue
        newest = max((c for c, ct in committed.items() if ct <= cover), default=s)
        out.append((max(0, newest - s), round(cover - t, 4)))
    return out


def lag_summary(lags: list[tuple[int, float]], interval: int) -> dict:
    if not lags:
        return {"steps": 0}
    steps, secs = sorted(s for s, _ in lags), sorted(t for _, t in lags)
    pick = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"steps": len(lags), "median_s": pick(secs, 0.5), "p90_s": pick(secs, 0.9), "max_s": secs[-1],
            "median_steps_behind": pick(steps, 0.5), "max_steps_behind": steps[-1],
            "within_one_interval": sum(1 for s in steps if s <= interval) / len(steps)}
