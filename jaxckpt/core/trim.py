"""Per-step records kept bounded: a job that runs a million steps must not keep a million outcomes.

Records of decided steps (commit outcomes, protection results, which agent held a step) are trimmed to the
newest :data:`STEPS_KEPT` steps once they hold twice that, so the cost is amortised O(1) per step and memory
stays flat (``jaxckpt chaos --profile soak`` measures it). :data:`STEPS_KEPT` is far more steps than any
retention (``Config.keep``) or protection lag leaves restorable, so nothing a restore or a wait can still ask
about is dropped.
"""
from __future__ import annotations

from typing import MutableMapping, MutableSet

STEPS_KEPT = 1024


def trim(records: MutableMapping[int, object] | MutableSet[int] | list[int], keep: int = STEPS_KEPT) -> list[int]:
    """Drop all but the newest ``keep`` steps of ``records`` (keyed or valued by step) once it holds ``2 * keep``;
    the steps dropped, ascending (empty when nothing was). A list must be sorted ascending, and stays so."""
    if len(records) < 2 * keep:
        return []
    if isinstance(records, list):
        dropped = records[:-keep]
        del records[:-keep]
        return dropped
    dropped = sorted(records)[:-keep]
    for s in dropped:
        if isinstance(records, MutableMapping):
            del records[s]
        else:
            records.discard(s)
    return dropped
