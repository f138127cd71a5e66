"""The persistent tier lists its steps as Orbax does without importing Orbax: a Checkpointer with a persistent
directory whose restore memory serves imports neither Orbax nor TensorStore; writing a step or reading one from
disk does (and works bit for bit)."""
import json
import os
import subprocess
import sys
import uuid

import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxckpt.persistent import TMP_SUFFIX, persisted_steps
from jaxckpt.persistent.directory import COMMIT_SUCCESS
from jaxckpt.testing import remove_agents

HERE = os.path.dirname(os.path.abspath(__file__))
TRAINER = os.path.join(HERE, "persist_relaunch.py")


def _orbax_steps(d) -> list[int]:
    return sorted(ocp.path.step.checkpoint_steps(d))


def _save(directory, steps, **options) -> None:
    opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, **options)
    with ocp.CheckpointManager(directory, options=opts) as mngr:
        for s in steps:
            mngr.save(s, args=ocp.args.StandardSave({"a": np.arange(4) + s}))


def test_orbaxs_names_are_ours():
    assert TMP_SUFFIX == ocp.path.step.TMP_DIR_SUFFIX
    assert COMMIT_SUCCESS == ocp.path.atomicity_types.COMMIT_SUCCESS_FILE


def test_listing_equals_orbaxs_on_real_directories(tmp_path):
    d = tmp_path / "persist"
    assert persisted_steps(d) == _orbax_steps(d) == []  # no directory yet
    _save(d, [1, 3, 10])
    _save(d, [5], step_prefix="ckpt")  # <prefix>_<step>: Orbax lists it as step 5
    assert persisted_steps(d) == _orbax_steps(d) == [1, 3, 5, 10]

    # What a crash leaves: a whole step not yet renamed, a half-written one; and what else a directory may hold.
    os.rename(d / "10", d / f"10{TMP_SUFFIX}-1733")
    (d / f"12{TMP_SUFFIX}" / "default").mkdir(parents=True)
    (d / f"12{TMP_SUFFIX}" / "default" / "junk").write_bytes(b"\0" * 100)
    (d / "7").write_text("a file named like a step")
    (d / "30").mkdir()  # an empty directory named by a step: Orbax lists it (only a rename marks a local step)
    (d / "notes").mkdir()
    (d / "ckpt_abc").mkdir()
    os.symlink(d / "3", d / "20")  # a link to a step directory is one
    os.symlink(d / "gone", d / "21")  # a dangling link is not
    assert persisted_steps(d) == _orbax_steps(d) == [1, 3, 5, 20, 30]

    # The one difference: a name Orbax cannot parse makes its listing raise; jaxckpt skips it.
    (d / "_12").mkdir()
    with pytest.raises(ValueError, match="Unrecognized name format"):
        ocp.path.step.checkpoint_steps(d)
    assert persisted_steps(d) == [1, 3, 5, 20, 30]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TRAINER, *args], capture_output=True, text=True, timeout=300)


def test_relaunched_trainer_served_from_memory_imports_no_orbax(tmp_path):
    base = f"/dev/shm/jaxckpt-persistlisting-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.makedirs(base, mode=0o700)
    job, persistent = "relaunch", str(tmp_path / "persist")
    shm = os.path.join(base, f"{job}@node0")
    try:
        r = _run("train", job, shm, persistent)
        assert r.returncode == -9 and "trained" in r.stdout, r.stderr
        assert persisted_steps(persistent) == [0, 2]
        r = _run("relaunch", job, shm, persistent)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        assert remove_agents(base) == []
    # Constructed, listed (memory and disk), restored from memory: neither Orbax nor TensorStore imported.
    assert got["constructed"] == [] and got["after_memory_restore"] == [], got
    assert got["latest"] == 3 and got["persisted"] == [0, 2] and got["memory"] == ["memory", True], got
    # A step only on disk: read bit for bit, through Orbax's arrays; and the tier persists the next step.
    assert got["disk"] == ["persistent", True], got
    assert got["after_disk_restore"] == ["orbax.checkpoint", "tensorstore"], got
    assert got["persisted_now"] == [4] and got["listed"] == [0, 2, 4], got
    assert persisted_steps(persistent) == _orbax_steps(persistent) == [0, 2, 4]
