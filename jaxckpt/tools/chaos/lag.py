"""Protection lag of a chaos run: from a step's commit until it (or a newer step) is reported protected."""
from __future__ import annotations

__all__ = ["lag_summary", "protection_lags"]


def protection_lags(events: list[dict]) -> list[tuple[int, float]]:
    """For each step reported protected: (newest step committed by then - the step, seconds from its last
    process's commit to the first protected report covering it). Events carry the host's time.monotonic()."""
    committed: dict[int, float] = {}  # step -> time the last process reported it committed
    newest, out, covered = 0, [], 0
    for e in sorted((e for e in events if "t" in e), key=lambda e: e["t"]):
        if e["ev"] == "committed":
            committed[e["step"]] = e["t"]
            newest = max(newest, e["step"])
        elif e["ev"] == "protected" and e["step"] > covered:
            for s in sorted(s for s in committed if covered < s <= e["step"]):
                out.append((newest - s, round(e["t"] - committed[s], 4)))
            covered = e["step"]
    return out


def lag_summary(lags: list[tuple[int, float]], interval: int) -> dict:
    if not lags:
        return {"steps": 0}
    steps, secs = sorted(s for s, _ in lags), sorted(t for _, t in lags)
    pick = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"steps": len(lags), "median_s": pick(secs, 0.5), "p90_s": pick(secs, 0.9), "max_s": secs[-1],
            "median_steps_behind": pick(steps, 0.5), "max_steps_behind": steps[-1],
            "within_one_interval": sum(1 for s in steps if s <= interval) / len(steps)}
