"""In one process: train a Flax GPT on 8 CPU devices with a snapshot every step in the in-process memory store,
lose the state's arrays, restore, and prove that the run is bit-identical to one that never failed.

The README's main job, examples/train_flax.py, kills a real training process instead and restores from the node
agent's shared memory; this smaller example shows only the API, with no second process.

    python examples/train_flax_inprocess.py                      # defaults: under a minute on 2 CPU cores
    python examples/train_flax_inprocess.py --steps 20 --fail-at 7 --d-model 64 --layers 2

1. Interrupted run: a jitted step that donates the state, on a data x model mesh (4 x 2), with
   ``ckpt.save(step, state)`` after every step. At ``--fail-at`` the process "fails": every array of the
   training state is deleted and the references dropped. The state comes back from the newest committed
   in-memory snapshot with ``ckpt.restore(target)`` (target: ShapeDtypeStructs with the training shardings),
   and training continues from the step it holds.
2. Reference run: same seed, same data, no checkpointing, no failure.
3. Checks: the per-step losses and the final parameters (and optimizer state) of both runs are compared byte for
   byte. Exit status 1 if anything differs.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

# Before jax is imported anywhere: 8 host-platform devices, so a data x model mesh exists on one CPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt.tools.bench import gpt  # noqa: E402

# A snapshot's zero-copy views keep the next step from reusing those buffers (jaxckpt relies on that for
# consistency); JAX reports each skipped donation, which is expected here and not worth a line per step.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=50, help="training steps (default 50)")
    p.add_argument("--fail-at", type=int, default=None, help="step at which the state is lost (default steps//2)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="global batch, split over the data axis")
    p.add_argument("--model-parallel", type=int, default=2, help="size of the mesh's model axis (default 2)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.fail_at is None:
        args.fail_at = args.steps // 2
    if not 1 <= args.fail_at < args.steps:
        p.error(f"--fail-at must be in [1, {args.steps - 1}], got {args.fail_at}")
    return args


def leaf_bytes(tree) -> list[bytes]:
    """Every array leaf's raw bytes, gathered to the host: the unit of 'bit-identical'."""
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def lose(state) -> None:
    """Simulate the process failing: the device arrays are gone."""
    for x in jax.tree.leaves(state):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


def interrupted_run(args, cfg, mesh, step_fn, target) -> dict:
    losses: dict[int, bytes] = {}
    save_calls, handles, out = [], [], {}
    with jaxckpt.Checkpointer(jaxckpt.Config()) as ckpt:
        state = gpt.init_state(cfg, mesh, args.seed)
        out["state_bytes"] = gpt.state_bytes(state)
        ckpt.save(0, state)  # so a failure before the first step's snapshot still has somewhere to go back to
        step, failed, newest_saved = 0, False, 0
        while step < args.steps:
            if step == args.fail_at and not failed:
                failed = True
                lose(state)
                del state
                t0 = time.perf_counter()
                # The newest step every process committed; saves still in flight may or may not have made it.
                state = ckpt.restore(target)
                jax.block_until_ready(state)
                out["restore_s"] = time.perf_counter() - t0
                out["restored_step"] = step = int(state.step)
                continue
            state, loss = step_fn(state, gpt.device_batch(cfg, mesh, step, args.batch, args.seed))
            # Reading the loss (as any logging loop does) first makes the timing below the save call's own
            # cost, not the wait for the step that was just dispatched.
            losses[step] = np.asarray(loss).tobytes()
            step += 1
            # Step k's snapshot holds the state after k steps. Saves in flight at the failure may have committed
            # after the restore began: those steps are held already and are not saved again.
            if step > newest_saved:
                t0 = time.perf_counter()
                handles.append(ckpt.save(step, state))
                save_calls.append(time.perf_counter() - t0)
                newest_saved = step
        ckpt.wait()
        out["committed"] = len(ckpt.all_steps())
    out.update(losses=[losses[i] for i in range(args.steps)], save_calls=save_calls,
               snapshot_s=[h.snapshot_seconds for h in handles if h.snapshot_seconds is not None],
               final=leaf_bytes(state), final_params=leaf_bytes(state.params))
    return out


def reference_run(args, cfg, mesh, step_fn) -> dict:
    state = gpt.init_state(cfg, mesh, args.seed)
    losses = []
    for _, batch in gpt.batches(cfg, mesh, args.batch, args.seed, stop=args.steps):
        state, loss = step_fn(state, batch)
        losses.append(np.asarray(loss).tobytes())
    return {"losses": losses, "final": leaf_bytes(state), "final_params": leaf_bytes(state.params)}


def out_ms(seconds: list[float]) -> np.ndarray:
    return np.array(seconds or [np.nan]) * 1e3


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = gpt.GPTConfig(vocab=args.vocab, seq_len=args.seq_len, d_model=args.d_model, layers=args.layers,
                        heads=args.heads)
    mesh = gpt.make_mesh(model=args.model_parallel)
    step_fn = gpt.make_train_step(cfg, mesh)
    target = gpt.abstract_state(cfg, mesh)
    mesh_desc = " x ".join(f"{k}={v}" for k, v in mesh.shape.items())
    print(f"GPT: d_model={cfg.d_model} layers={cfg.layers} heads={cfg.heads} vocab={cfg.vocab} "
          f"seq_len={cfg.seq_len}, {gpt.param_count(cfg):,} params; mesh {mesh_desc}; batch {args.batch}",
          flush=True)

    t0 = time.perf_counter()
    run = interrupted_run(args, cfg, mesh, step_fn, target)
    t1 = time.perf_counter()
    ref = reference_run(args, cfg, mesh, step_fn)
    t2 = time.perf_counter()

    loss_ok = run["losses"] == ref["losses"]
    params_ok = run["final_params"] == ref["final_params"]
    state_ok = run["final"] == ref["final"]
    calls = np.array(run["save_calls"]) * 1e3
    yes = {True: "yes", False: "NO"}
    print("summary")
    print(f"  steps:                     {args.steps} (state lost at step {args.fail_at}, "
          f"restored step {run['restored_step']}, {run['committed']} snapshot(s) kept)")
    print(f"  state bytes:               {run['state_bytes']:,} ({run['state_bytes'] / 2**20:.1f} MiB, "
          f"params + AdamW moments)")
    print(f"  save() call:               median {np.median(calls):.2f} ms, max {calls.max():.2f} ms "
          f"over {len(calls)} saves")
    print(f"  snapshot (background):     median {np.median(out_ms(run['snapshot_s'])):.1f} ms per step")
    print(f"  restore:                   {run['restore_s'] * 1e3:.1f} ms")
    first, last = (float(np.frombuffer(run["losses"][i], np.float32)[0]) for i in (0, -1))
    print(f"  loss:                      {first:.4f} -> {last:.4f}")
    print(f"  time:                      interrupted run {t1 - t0:.1f} s, reference run {t2 - t1:.1f} s")
    print(f"  loss curve bit-identical:  {yes[loss_ok]}")
    print(f"  final params bit-identical: {yes[params_ok]}")
    print(f"  final state bit-identical: {yes[state_ok]}")
    if not (loss_ok and params_ok and state_ok):
        bad = [i for i, (a, b) in enumerate(zip(run["losses"], ref["losses"])) if a != b]
        print(f"MISMATCH: first differing loss at step {bad[0] if bad else None}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
