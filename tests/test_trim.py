"""Per-step records stay bounded over a long job (jaxckpt.core.trim), and what they answer stays right."""
from __future__ import annotations

from jaxckpt.core.collective import Collective
from jaxckpt.core.coordination import CommitTracker, LocalCoordinator
from jaxckpt.core.trim import STEPS_KEPT, trim


def test_trim_keeps_the_newest_steps_once_twice_as_many_are_held():
    d = {s: str(s) for s in range(2 * STEPS_KEPT - 1)}
    assert trim(d) == [] and len(d) == 2 * STEPS_KEPT - 1
    d[2 * STEPS_KEPT - 1] = "x"
    assert trim(d) == list(range(STEPS_KEPT)) and sorted(d) == list(range(STEPS_KEPT, 2 * STEPS_KEPT))
    s, lst = set(range(10)), list(range(10))
    assert trim(s, keep=4) == [0, 1, 2, 3, 4, 5] and s == {6, 7, 8, 9}
    assert trim(lst, keep=4) == [0, 1, 2, 3, 4, 5] and lst == [6, 7, 8, 9]


def test_a_commit_tracker_over_many_steps_stays_bounded_and_still_answers_old_steps():
    # What the soak run found growing: one outcome per step, forever. Every 7th step fails here.
    steps = 5 * STEPS_KEPT
    tracker = CommitTracker(Collective(LocalCoordinator(), "jaxckpt/h/0", 5.0).channel("commit"), 5.0)
    try:
        for s in range(steps):
            tracker.local_done(s, s % 7 != 3)
        assert tracker.wait(steps - 1, timeout_s=120) is True
        # Private sizes on purpose: the bound is the point of the test.
        assert len(tracker._settled) < 2 * STEPS_KEPT and len(tracker._outcome) < 2 * STEPS_KEPT
        assert len(tracker._times) <= STEPS_KEPT
        for s in (0, 3, 10, 17, STEPS_KEPT + 3, steps - 5, steps - 4):  # trimmed long ago, and recent ones
            assert tracker.decided(s)
            assert tracker.wait(s, timeout_s=1) is (s % 7 != 3), s
        assert tracker.latest() == steps - 1
    finally:
        tracker.close()


def test_the_bound_from_the_environment_is_checked_and_covers_every_kept_step():
    """JAXCKPT_STEPS_KEPT (a short soak's bound): a bad value is a ConfigError naming it; an engine whose
    Config.keep and pending saves the bound would not cover refuses to start, before it touches a store."""
    import os
    import subprocess
    import sys

    import pytest

    from jaxckpt.core.trim import DEFAULT_STEPS_KEPT, steps_kept_from_env
    from jaxckpt.errors import ConfigError

    assert steps_kept_from_env({}) == DEFAULT_STEPS_KEPT and steps_kept_from_env({"JAXCKPT_STEPS_KEPT": "64"}) == 64
    for bad in ("8", "x", "-1"):
        with pytest.raises(ConfigError, match=f"JAXCKPT_STEPS_KEPT='{bad}': expected an integer of at least 16"):
            steps_kept_from_env({"JAXCKPT_STEPS_KEPT": bad})
    code = ("from jaxckpt.config import Config\n"
            "from jaxckpt.core.coordination import LocalCoordinator\n"
            "from jaxckpt.core.engine import CheckpointEngine\n"
            "from jaxckpt.errors import ConfigError\n"
            "try:\n"
            "    CheckpointEngine(Config(store='shm', job_id='trim-bound', keep=8, max_pending_saves=1),\n"
            "                     LocalCoordinator(), framework='numpy')\n"
            "except ConfigError as e:\n"
            "    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAXCKPT_STEPS_KEPT": "16"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert ("refused: Config.keep=8 with max_pending_saves=1: more steps than the per-step records keep (8 at most; "
            "JAXCKPT_STEPS_KEPT=16, jaxckpt.core.trim)") in out.stdout, out.stdout + out.stderr[-2000:]
