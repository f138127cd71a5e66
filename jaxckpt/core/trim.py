"""Per-step records kept bounded: a job that runs a million steps must not keep a million outcomes.

Records of decided steps (commit outcomes, protection results, which agent held a step) are trimmed to the
newest :data:`STEPS_KEPT` steps once they hold twice that, so the cost is amortised O(1) per step and memory
stays flat (``jaxckpt chaos --profile soak`` measures it). :data:`STEPS_KEPT` is far more steps than any
retention (``Config.keep``) or protection lag leaves restorable, so nothing a restore or a wait can still ask
about is dropped.

``JAXCKPT_STEPS_KEPT`` (read once, at import) sets a smaller bound for a short soak (``jaxckpt chaos --profile
soak-quick``): there the records reach their bound within the warm-up, so its 100-step fits see the steady
level a long job has after 2,048 steps, not the records filling up, which a 150-step run cannot tell from a
leak. The engine refuses a ``Config.keep`` the bound would not cover.
"""
from __future__ import annotations

import os
from typing import MutableMapping, MutableSet

from jaxckpt.errors import ConfigError

ENV_STEPS_KEPT = "JAXCKPT_STEPS_KEPT"
DEFAULT_STEPS_KEPT = 1024
MIN_STEPS_KEPT = 16


def steps_kept_from_env(environ: "os._Environ[str] | dict[str, str] | None" = None) -> int:
    """The bound ``JAXCKPT_STEPS_KEPT`` asks for (an integer of at least 16), or the default 1,024."""
    raw = (os.environ if environ is None else environ).get(ENV_STEPS_KEPT, "").strip()
    if not raw:
        return DEFAULT_STEPS_KEPT
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < MIN_STEPS_KEPT:
        raise ConfigError(f"{ENV_STEPS_KEPT}={raw!r}: expected an integer of at least {MIN_STEPS_KEPT} (the newest "
                          f"steps whose records are kept; default {DEFAULT_STEPS_KEPT})")
    return n


STEPS_KEPT = steps_kept_from_env()


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
