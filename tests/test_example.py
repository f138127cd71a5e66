"""The README's main job (examples/train_flax.py: a trainer SIGKILLed mid-snapshot, relaunched, restored from its
node agent) and the in-process example (examples/train_flax_inprocess.py) end to end, and the GPT module they and
the benchmarks share."""
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.testing import agent_processes
from jaxckpt.tools.bench import gpt

ROOT = Path(__file__).resolve().parents[1]
TINY = gpt.GPTConfig(vocab=64, seq_len=16, d_model=32, layers=2, heads=2)
BATCH = 8


def _bytes(tree) -> list[np.ndarray]:
    return [np.asarray(x).reshape(-1).view(np.uint8) for x in jax.tree.leaves(tree)]


def _assert_bitwise_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(_bytes(a), _bytes(b)):
        np.testing.assert_array_equal(x, y)


MAIN_TINY = ["--steps", "8", "--kill-at", "5", "--d-model", "32", "--layers", "2", "--heads", "2", "--vocab", "64",
             "--seq-len", "16", "--batch", "8", "--timing-steps", "4", "--timing-block", "2", "--restore-reps", "2",
             "--timeout", "400"]


def _run_main(*flags: str) -> tuple[subprocess.CompletedProcess, str, str]:
    """Run the main job; return the process, its output, and the working directory it announced."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXCKPT_")}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_flax.py"), *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    m = re.search(r"working directory (\S+) \(", out)
    assert m, out
    return proc, out, m.group(1)


def _assert_cleaned_up(base: str, out: str) -> None:
    assert not os.path.exists(base), f"{base} left behind\n{out}"
    assert agent_processes(base) == [], f"agent processes of {base} still run\n{out}"


def test_main_job_killed_mid_snapshot_relaunches_and_matches_uninterrupted_run():
    proc, out, base = _run_main(*MAIN_TINY)
    assert proc.returncode == 0, out
    # The kill was real: a SIGKILL (exit status -9) that landed while step 5's snapshot was being written.
    m = re.search(r"run 1:\s+trained steps 0\.\.4, save\(\) after every step \(newest committed step it saw: (\d+)\); "
                  r"SIGKILLed right after save\(5\) returned; exit status -9", out)
    assert m, out
    seen = int(m.group(1))
    m = re.search(r"kill landed mid-snapshot:\s+yes \(the agent discarded step\(s\) \[([\d, ]+)\] as written mid-way",
                  out)
    assert m and 5 in [int(x) for x in m.group(1).split(",")], out
    # The relaunched process restored, from the agent, a step the killed one had saved (and seen committed, or
    # a newer one that committed after it looked), older than the one in flight.
    m = re.search(r"run 2 \(relaunched\):\s+restored step (\d+) from the node agent's shared memory", out)
    assert m, out
    restored = int(m.group(1))
    assert seen <= restored < 5, out
    assert re.search(r"loss curve bit-identical:\s+yes \(8 steps", out), out
    assert re.search(rf"restored state bit-identical:\s+yes \(the uninterrupted run's state after {restored} steps\)",
                     out), out
    assert re.search(r"final state bit-identical:\s+yes", out), out
    assert re.search(r"restores equal saved state:\s+yes", out), out
    assert re.search(r"step time, warm:\s+without a snapshot [0-9.]+ ms, with a snapshot every step [0-9.]+ ms: "
                     r"x[0-9.]+, [0-9.]+ ms per snapshot \(medians of 4 and 4 steps", out), out
    assert re.search(r"restore, same state:\s+jaxckpt from its agent's shared memory median [0-9.]+ ms \([0-9.]+, "
                     r"[0-9.]+\); Orbax StandardCheckpointer from tmpfs median [0-9.]+ ms \([0-9.]+, [0-9.]+\)",
                     out), out
    assert re.search(r"kill -> first trained step:\s+[0-9.]+ s = relaunch .* \+ Checkpointer\(\) [0-9.]+ s \+ restore "
                     r"[0-9.]+ s \+ first step [0-9.]+ s", out), out
    assert re.search(r"interval advice:\s+snapshot every \d+ step\(s\)", out), out
    assert "MISMATCH" not in out and "FAILED" not in out
    _assert_cleaned_up(base, out)


def test_main_job_cleans_up_agent_when_a_trainer_fails():
    # A batch of 6 cannot be split over the mesh's data axis of 4: run 1 fails at its first step, after its
    # Checkpointer has started the node agent.
    proc, out, base = _run_main(*MAIN_TINY, "--batch", "6")
    assert proc.returncode == 1, out
    assert re.search(r"FAILED: process \d+ \(--role trainer\) exited with 1, expected 0", out), out
    assert "connected to the node agent" in out, out  # the agent was running when the trainer failed
    _assert_cleaned_up(base, out)


def test_main_job_rejects_kill_step_outside_run():
    cmd = [sys.executable, str(ROOT / "examples" / "train_flax.py"), "--steps", "4", "--kill-at", "4"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--kill-at must be in [1, 3], got 4" in proc.stderr


def test_example_restores_and_matches_uninterrupted_run():
    cmd = [sys.executable, str(ROOT / "examples" / "train_flax_inprocess.py"), "--steps", "8", "--fail-at", "5",
           "--d-model", "32", "--layers", "2", "--heads", "2", "--vocab", "64", "--seq-len", "16", "--batch", "8"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXCKPT_")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"steps:\s+8 \(state lost at step 5, restored step [0-5],", out), out
    assert re.search(r"loss curve bit-identical:\s+yes", out), out
    assert re.search(r"final params bit-identical:\s+yes", out), out
    assert re.search(r"final state bit-identical:\s+yes", out), out
    assert re.search(r"save\(\) call:\s+median [0-9.]+ ms", out), out
    assert re.search(r"restore:\s+[0-9.]+ ms", out), out


def test_example_rejects_fail_step_outside_run():
    cmd = [sys.executable, str(ROOT / "examples" / "train_flax_inprocess.py"), "--steps", "4", "--fail-at", "4"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--fail-at must be in [1, 3], got 4" in proc.stderr


def test_make_mesh_shapes():
    assert dict(gpt.make_mesh().shape) == {"data": 4, "model": 2}
    assert dict(gpt.make_mesh(model=4).shape) == {"data": 2, "model": 4}
    assert dict(gpt.make_mesh(model=1, devices=jax.devices()[:1]).shape) == {"data": 1, "model": 1}
    with pytest.raises(ValueError, match="model axis 3 does not divide 8 devices"):
        gpt.make_mesh(model=3)
    with pytest.raises(ValueError, match=r"heads=2 is not divisible by the mesh's model axis \(4\)"):
        gpt.state_shardings(TINY, gpt.make_mesh(model=4))
    with pytest.raises(ValueError, match="d_model=30 is not a multiple of heads=4"):
        gpt.GPTConfig(d_model=30, heads=4)


def test_state_layout_matches_abstract_target():
    mesh = gpt.make_mesh()
    state = gpt.init_state(TINY, mesh, seed=0)
    target = gpt.abstract_state(TINY, mesh)
    assert jax.tree.structure(state) == jax.tree.structure(target)
    for x, t in zip(jax.tree.leaves(state), jax.tree.leaves(target)):
        assert (x.shape, x.dtype, x.sharding) == (t.shape, t.dtype, t.sharding)
    blk = state.params["block_0"]
    assert blk["qkv"]["kernel"].sharding.spec == P(None, None, "model", None)
    assert blk["proj"]["kernel"].sharding.spec == P("model", None, None)
    assert blk["fc_in"]["kernel"].sharding.spec == P(None, "model")
    assert blk["fc_out"]["kernel"].sharding.spec == P("model", None)
    assert state.params["wte"]["embedding"].sharding.spec == P("model", None)
    assert state.params["wpe"].sharding.spec == P()
    # AdamW moments are laid out like the params they follow.
    adam = next(s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu"))
    assert adam.mu["block_1"]["qkv"]["kernel"].sharding.spec == P(None, None, "model", None)
    assert gpt.state_bytes(state) == gpt.state_bytes(target) == sum(x.nbytes for x in jax.tree.leaves(state))
    # params, mu, nu; TrainState.step, AdamW's count, the schedule's count.
    assert gpt.state_bytes(state) == 4 * (3 * gpt.param_count(TINY) + 3)


def test_data_is_a_function_of_seed_and_step():
    a = gpt.batch_at(TINY, 3, BATCH, seed=1)
    assert a.shape == (BATCH, TINY.seq_len + 1) and a.dtype == np.int32
    assert a.min() >= 0 and a.max() < TINY.vocab
    np.testing.assert_array_equal(a, gpt.batch_at(TINY, 3, BATCH, seed=1))
    assert not np.array_equal(a, gpt.batch_at(TINY, 4, BATCH, seed=1))
    assert not np.array_equal(a, gpt.batch_at(TINY, 3, BATCH, seed=2))
    mesh = gpt.make_mesh()
    step, b = next(gpt.batches(TINY, mesh, BATCH, seed=1, start=3))
    assert step == 3 and b.sharding == gpt.batch_sharding(mesh)
    np.testing.assert_array_equal(np.asarray(b), a)
    with pytest.raises(ValueError, match=r"batch size 6 is not divisible by the mesh's data axis \(4\)"):
        next(gpt.batches(TINY, mesh, 6))


@pytest.fixture(scope="module")
def tiny_step():
    """The mesh and the TINY GPT's jitted train step, compiled once for the tests that train it."""
    mesh = gpt.make_mesh()
    return mesh, gpt.make_train_step(TINY, mesh)


def test_loss_falls(tiny_step):
    mesh, step_fn = tiny_step
    state = gpt.init_state(TINY, mesh, seed=0)
    losses = []
    for _, batch in gpt.batches(TINY, mesh, BATCH, seed=0, stop=25):
        state, loss = step_fn(state, batch)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.5, losses


def test_restored_state_continues_identically_after_donating_step(tiny_step):
    mesh, step_fn = tiny_step
    data = dict(gpt.batches(TINY, mesh, BATCH, seed=0, stop=5))

    state = gpt.init_state(TINY, mesh, seed=0)
    for s in range(2):
        state, _ = step_fn(state, data[s])
    with jaxckpt.Checkpointer(jaxckpt.Config()) as ckpt:
        ckpt.save(2, state)
        # The next step donates the buffers just snapshotted, while the snapshot may still be copying them.
        losses = []
        for s in range(2, 5):
            state, loss = step_fn(state, data[s])
            losses.append(np.asarray(loss))
        ckpt.wait()
        target = gpt.abstract_state(TINY, mesh)
        restored = ckpt.restore(target)

    assert int(restored.step) == 2
    for x, t in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
        assert x.sharding == t.sharding
    again = []
    for s in range(2, 5):
        restored, loss = step_fn(restored, data[s])
        again.append(np.asarray(loss))
    np.testing.assert_array_equal(np.array(again).view(np.uint8), np.array(losses).view(np.uint8))
    assert step_fn._cache_size() == 1  # the restored state is laid out and typed exactly like the trained one
    _assert_bitwise_equal(restored, state)

    # And both equal a run that never saved at all.
    ref = gpt.init_state(TINY, mesh, seed=0)
    for s in range(5):
        ref, _ = step_fn(ref, data[s])
    _assert_bitwise_equal(ref, state)
