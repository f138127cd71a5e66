"""The interval advisor (Young/Daly) against hand-worked cases, its errors, and ``jaxckpt advise``."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from jaxckpt.core.advise import advise_interval, daly_optimum, lost_fraction
from jaxckpt.errors import ConfigError


def test_hand_worked_case():
    # 100 nodes of MTBF 1e5 s: the job fails every M = 1000 s. A snapshot costs 10 ms, a step takes 0.5 s.
    # Young: sqrt(2 * 0.01 * 1000) = sqrt(20) = 4.47214 s. Daly: r = 0.01 / 2000 = 5e-6,
    # 4.47214 * (1 + sqrt(5e-6) / 3 + 5e-6 / 9) - 0.01 = 4.47214 * 1.000746 - 0.01 = 4.46548 s.
    a = advise_interval(mtbf_node_s=1e5, nodes=100, step_time_s=0.5, overhead_s=0.01)
    assert a.job_mtbf_s == 1000.0
    assert a.optimum_s == pytest.approx(4.46548, abs=1e-4)
    # Between 8 steps (4 s: W = 0.01/4 + 2/1000 = 0.0045) and 9 (4.5 s: W = 0.01/4.5 + 2.25/1000 = 0.0044722),
    # 9 loses less.
    assert a.interval_steps == 9 and a.interval_s == 4.5
    assert a.lost_fraction == pytest.approx(0.01 / 4.5 + 2.25 / 1000)
    assert a.lost_fraction_every_step == pytest.approx(0.01 / 0.5 + 0.25 / 1000)


def test_latency_and_restart_add_to_the_loss_but_do_not_move_the_optimum():
    base = advise_interval(mtbf_node_s=1e5, nodes=100, step_time_s=0.5, overhead_s=0.01)
    slow = advise_interval(mtbf_node_s=1e5, nodes=100, step_time_s=0.5, overhead_s=0.01, latency_s=1.0,
                           restart_s=59.0)
    assert slow.interval_steps == base.interval_steps
    assert slow.lost_fraction == pytest.approx(base.lost_fraction + 60.0 / 1000)


def test_a_free_snapshot_is_taken_every_step():
    a = advise_interval(mtbf_node_s=3600, nodes=8, step_time_s=0.3, overhead_s=0.0)
    assert a.interval_steps == 1 and a.optimum_s == 0.0


def test_overhead_beyond_twice_the_mtbf_gives_the_mtbf():
    assert daly_optimum(overhead_s=300.0, job_mtbf_s=100.0) == 100.0
    assert lost_fraction(10.0, 1.0, 100.0) == pytest.approx(0.1 + 0.05)


@pytest.mark.parametrize("kwargs, match", [
    (dict(mtbf_node_s=0.0), r"mtbf_node_s=0\.0 must be a positive number"),
    (dict(nodes=0), r"nodes=0 must be an int >= 1"),
    (dict(step_time_s=math.nan), r"step_time_s=nan must be a positive number"),
    (dict(overhead_s=-1.0), r"overhead_s=-1\.0 must be a number of seconds >= 0"),
])
def test_bad_input_raises_config_error_naming_the_argument(kwargs, match):
    args = dict(mtbf_node_s=1e5, nodes=4, step_time_s=0.5, overhead_s=0.01) | kwargs
    with pytest.raises(ConfigError, match=match):
        advise_interval(**args)


def test_cli_prints_the_same_advice_and_refuses_bad_durations():
    r = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "advise", "--mtbf-node", "100000", "--nodes", "100",
                        "--step-time", "500ms", "--overhead", "10ms", "--json"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["interval_steps"] == 9 and out["optimum_s"] == pytest.approx(4.46548, abs=1e-4)
    r = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "advise", "--mtbf-node", "soon", "--nodes", "1",
                        "--step-time", "1", "--overhead", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "'soon' is not a duration" in r.stderr
    r = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "advise", "--mtbf-node", "1d", "--nodes", "0",
                        "--step-time", "1", "--overhead", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "nodes=0 must be an int >= 1" in r.stderr


def test_checkpointer_advises_from_its_own_measured_saves():
    import numpy as np

    import jaxckpt
    from jaxckpt.core.advise import advise_interval as formula

    with jaxckpt.Checkpointer(jaxckpt.Config(keep=2)) as ck:
        with pytest.raises(ConfigError, match=r"step_time_s, overhead_s not measured yet"):
            ck.advise_interval(mtbf_node_s=86400.0, nodes=64)
        state = {"w": np.arange(1 << 16, dtype=np.float32)}
        for step in range(6):
            ck.save(step, state)
            ck.wait()
        m = ck.engine.costs.measured(ck.engine.commit_times())
        assert {"overhead_s", "step_time_s", "latency_s"} <= set(m)
        assert m["overhead_s"] > 0 and m["step_time_s"] > 0 and m["latency_s"] >= 0
        a = ck.advise_interval(mtbf_node_s=86400.0, nodes=64, restart_s=30.0)
        # The same numbers through the formula: the advice is the formula of what was measured.
        assert a == formula(mtbf_node_s=86400.0, nodes=64, restart_s=30.0, **m)
        given = ck.advise_interval(mtbf_node_s=1e5, nodes=100, step_time_s=0.5, overhead_s=0.01, latency_s=0.0)
        assert given.interval_steps == 9  # the hand-worked case above, whatever this job measured
