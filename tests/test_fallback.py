"""A restore of the newest step whose bytes cannot be had falls back to an older step in the same call
(jaxckpt.core.fallback): one process, and real JAX processes where only one of them holds bad bytes.

Each test asserts what a user relies on: the older step comes back bit for bit, the report names the step
passed over, the process and the error, the bad step is forgotten (its number can be saved again), and a
restore of an explicit step still raises the step's own error.
"""
import numpy as np
import pytest

import jaxckpt
from jaxckpt.core import manifest as mf
from jaxckpt.errors import ChecksumError
from jaxckpt.testing import expect_ok, launch

NODES = 2


def host_state(step: int) -> dict:
    rng = np.random.default_rng([23, step])
    w = rng.standard_normal((32, 8)).astype(np.float32)
    w.reshape(-1)[[1, 77]] = np.array([0x7FC00001, 0xFFA00002], np.uint32).view(np.float32)  # NaN payloads
    return {"w": w, "b": rng.integers(-9, 9, (40,)).astype(np.int32)}


def flip(ck: jaxckpt.Checkpointer, step: int, path: str = "w") -> None:
    """Flip a bit of the first chunk of ``path`` that this process saved at ``step``, in its memory store."""
    with ck.store.open(step) as view:
        chunk = mf.decode(view.manifest).array(path).chunks[0]
    ck.store.slot_bytes(step)[chunk.offset + 3] ^= 0x04


def bitwise(got: dict, want: dict) -> None:
    for k, h in want.items():
        np.testing.assert_array_equal(np.asarray(got[k]).view(np.uint8), h.view(np.uint8), err_msg=k)


# ------------------------------------------------------------------------------------------ one process
def test_a_corrupt_newest_step_falls_back_to_the_older_one_in_the_same_restore():
    with jaxckpt.Checkpointer(jaxckpt.Config(keep=3, chunk_bytes=256)) as ck:
        for s in (1, 2, 3):
            ck.save(s, host_state(s))
        ck.wait()
        flip(ck, 3)
        with pytest.raises(ChecksumError, match=r"w: step 3 chunk .* of process 0 failed its crc32c check"):
            ck.restore(host_state(0), step=3)  # an explicit step never falls back
        assert ck.all_steps() == [1, 2, 3]
        got = ck.restore(host_state(0))
        bitwise(got, host_state(2))
        rep = ck.last_restore_report
        assert rep.step == 2 and len(rep.skipped) == 1, rep.skipped
        assert "step 3: process 0 could not read it (ChecksumError: w: step 3" in rep.skipped[0], rep.skipped
        assert rep.skipped[0].endswith("fell back to step 2")
        assert "passed over 1 newer step(s)" in rep.summary()
        # Step 3 is forgotten everywhere: the job saves it again and restores the new one.
        assert (ck.latest_step(), ck.all_steps()) == (2, [1, 2])
        ck.save(3, host_state(33)).result()
        bitwise(ck.restore(host_state(0)), host_state(33))
        assert ck.last_restore_report.skipped == []


def test_two_bad_steps_are_passed_over_and_the_last_one_raises_its_own_error():
    with jaxckpt.Checkpointer(jaxckpt.Config(keep=3, chunk_bytes=256)) as ck:
        for s in (1, 2, 3):
            ck.save(s, host_state(s))
        ck.wait()
        flip(ck, 3)
        flip(ck, 2, "b")
        bitwise(ck.restore(host_state(0)), host_state(1))
        skipped = ck.last_restore_report.skipped
        assert [ln.split(":")[0] for ln in skipped] == ["step 3", "step 2"], skipped
        assert "(ChecksumError: b: step 2" in skipped[1], skipped
        flip(ck, 1)
        with pytest.raises(ChecksumError, match=r"w: step 1 chunk"):
            ck.restore(host_state(0))
        assert ck.all_steps() == [1]  # with nothing older to fall back to, nothing is forgotten


# ------------------------------------------------------------------------------- real JAX processes
def fallback_job(bad_process: int):
    """Save steps 1 and 2 (memory store, chunks of other processes through the peer transport), flip a bit of
    step 2 in ``bad_process``'s memory only, restore the newest step on every process."""
    import jax
    import sharded_state

    mesh = sharded_state.node_mesh(NODES)
    specs = {"w": (("data", "model"),), "b": ()}
    target = {k: jax.ShapeDtypeStruct(h.shape, h.dtype, sharding=sharded_state.sharding(mesh, specs[k]))
              for k, h in host_state(0).items()} | {"step": 0}
    cfg = jaxckpt.Config(keep=2, chunk_bytes=256, commit_timeout_s=60.0, peer_timeout_s=20.0)
    with jaxckpt.Checkpointer(cfg) as ck:
        for s in (1, 2):
            ck.save(s, sharded_state.device_state(mesh, host_state(s), specs, s))
        ck.wait()
        if ck.engine.process_index == bad_process:
            flip(ck, 2)
        ck.engine.collective.channel("main").barrier("corrupted")  # nobody reads before the bit is flipped
        got = ck.restore(target)
        sharded_state.check_bitwise(got, host_state(1), 1)
        skipped = list(ck.last_restore_report.skipped)
        after = (ck.latest_step(), ck.all_steps())
        ck.save(2, sharded_state.device_state(mesh, host_state(22), specs, 2)).result()
        sharded_state.check_bitwise(ck.restore(target), host_state(22), 2)
    return {"skipped": skipped, "after": after}


@pytest.mark.parametrize("bad_process", [0, 1])
def test_one_process_with_bad_bytes_makes_every_process_fall_back_in_one_round(bad_process):
    out = expect_ok(launch(fallback_job, nodes=NODES, procs_per_node=1, devices_per_proc=2, args=(bad_process,),
                           env={"JAXCKPT_LOG_LEVEL": "ERROR"}, timeout=180))
    for r in out:
        assert r["after"] == [1, [1]], r
        assert len(r["skipped"]) == 1 and r["skipped"][0].endswith("fell back to step 1"), r
        assert "ChecksumError" in r["skipped"][0] and "step 2" in r["skipped"][0], r
    assert out[0]["skipped"] == out[1]["skipped"]  # every process decided alike, from the same round

