"""Train a small PyTorch model with AdamW and a snapshot every step, lose the state, restore, and prove that
the run is bit-identical to one that never failed.

    python examples/train_torch.py                  # defaults: a few seconds on 2 CPU cores
    python examples/train_torch.py --steps 60 --fail-at 25 --hidden 512

1. Interrupted run: an MLP with dropout (so the global RNG matters) on batches drawn from a data
   ``torch.Generator`` (the data loader's position). After every step, ``ckpt.save(step, state)`` snapshots
   the model, the optimizer, the RNG state and the data generator. The checkpointer runs with
   ``defer_reads=True``: ``save()`` returns at once and the host copy overlaps the next forward/backward;
   ``ckpt.wait_for_reads()`` right before ``optimizer.step()`` keeps the in-place update out of the copy.
   At ``--fail-at`` the process "fails": model, optimizer and generator are thrown away and the RNG is
   scrambled. A fresh model and optimizer are built and loaded from the newest committed snapshot, and
   training continues from the step it holds.
2. Reference run: same seed, same data, no checkpointing, no failure.
3. Checks: per-step losses, final parameters and optimizer state of both runs compared byte for byte.
   Exit status 1 if anything differs.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

import jaxckpt
from jaxckpt.torch import Checkpointer, PerRank


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    p.add_argument("--fail-at", type=int, default=None, help="step at which the state is lost (default steps//2)")
    p.add_argument("--hidden", type=int, default=256, help="hidden width of the MLP (default 256)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--safe-save", action="store_true",
                   help="defer_reads=False: save() itself waits for the host copy (no wait_for_reads needed)")
    args = p.parse_args(argv)
    if args.fail_at is None:
        args.fail_at = args.steps // 2
    if not 1 <= args.fail_at < args.steps:
        p.error(f"--fail-at must be in [1, {args.steps - 1}], got {args.fail_at}")
    return args


IN, OUT = 32, 10
# A fixed random teacher labels the inputs, so there is something to learn (it is data, not training state).
TEACHER = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(7))


def build(args, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Generator]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(IN, args.hidden), torch.nn.LayerNorm(args.hidden), torch.nn.GELU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(args.hidden, OUT))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    return model, opt, torch.Generator().manual_seed(seed + 1)


def forward_backward(model, opt, data: torch.Generator, batch: int) -> torch.Tensor:
    x = torch.randn(batch, IN, generator=data)
    y = (x @ TEACHER).argmax(dim=1)
    loss = torch.nn.functional.cross_entropy(model(x), y)  # dropout draws from the global RNG
    opt.zero_grad(set_to_none=True)
    loss.backward()
    return loss.detach()


def state_of(model, opt, data, step: int) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "rng": PerRank(torch.get_rng_state()),
            "data": data, "step": step}


def state_bytes(model, opt) -> list[bytes]:
    """Every parameter and optimizer-state tensor's raw bytes: the unit of 'bit-identical'."""
    out = [v.detach().numpy().tobytes() for v in model.state_dict().values()]
    for s in opt.state_dict()["state"].values():
        out += [v.numpy().tobytes() for v in s.values()]
    return out


def interrupted_run(args) -> dict:
    out: dict = {}
    losses: dict[int, bytes] = {}
    save_calls, handles = [], []
    config = jaxckpt.Config(keep=2)
    with Checkpointer(config, defer_reads=not args.safe_save) as ckpt:
        model, opt, data = build(args, args.seed)
        out["state_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
        ckpt.save(0, state_of(model, opt, data, 0))
        step, failed, newest_saved = 0, False, 0
        while step < args.steps:
            if step == args.fail_at and not failed:
                failed = True
                del model, opt, data  # the process "dies": its training state is gone
                torch.manual_seed(987654321)  # and so is its RNG stream
                t0 = time.perf_counter()
                model, opt, data = build(args, seed=args.seed + 1000)  # a restarted process: fresh objects
                restored = ckpt.restore()  # newest committed step; no target: nested dicts of CPU tensors
                model.load_state_dict(restored["model"])
                opt.load_state_dict(restored["optim"])
                torch.set_rng_state(restored["rng"])
                data.set_state(restored["data"])
                out["restore_s"] = time.perf_counter() - t0
                out["restored_step"] = step = restored["step"]
                continue
            model.train()
            loss = forward_backward(model, opt, data, args.batch)
            ckpt.wait_for_reads()  # the previous snapshot's copy must not see this in-place update
            opt.step()
            losses[step] = loss.numpy().tobytes()
            step += 1
            # Step k's snapshot holds the state after k steps; steps re-run after a restore are held already.
            if step > newest_saved:
                t0 = time.perf_counter()
                handles.append(ckpt.save(step, state_of(model, opt, data, step)))
                save_calls.append(time.perf_counter() - t0)
                newest_saved = step
        ckpt.wait()
        out["committed"] = ckpt.all_steps()
    out.update(losses=[losses[i] for i in range(args.steps)], save_calls=save_calls, final=state_bytes(model, opt),
               snapshot_s=[h.snapshot_seconds for h in handles if h.snapshot_seconds is not None])
    return out


def reference_run(args) -> dict:
    model, opt, data = build(args, args.seed)
    losses = []
    for _ in range(args.steps):
        model.train()
        loss = forward_backward(model, opt, data, args.batch)
        opt.step()
        losses.append(loss.numpy().tobytes())
    return {"losses": losses, "final": state_bytes(model, opt)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"MLP {IN}-{args.hidden}-{args.hidden}-{OUT} with dropout, AdamW, batch {args.batch}, "
          f"{'defer_reads=False' if args.safe_save else 'defer_reads=True + wait_for_reads()'}", flush=True)
    t0 = time.perf_counter()
    run = interrupted_run(args)
    t1 = time.perf_counter()
    ref = reference_run(args)
    t2 = time.perf_counter()

    loss_ok = run["losses"] == ref["losses"]
    state_ok = run["final"] == ref["final"]
    calls = np.array(run["save_calls"]) * 1e3
    snaps = np.array(run["snapshot_s"] or [np.nan]) * 1e3
    yes = {True: "yes", False: "NO"}
    first, last = (float(np.frombuffer(run["losses"][i], np.float32)[0]) for i in (0, -1))
    print("summary")
    print(f"  steps:                     {args.steps} (state lost at step {args.fail_at}, restored step "
          f"{run['restored_step']}, snapshots kept {run['committed']})")
    print(f"  state bytes:               {run['state_bytes']:,} (params + AdamW moments)")
    print(f"  save() call:               median {np.median(calls):.2f} ms, max {calls.max():.2f} ms "
          f"over {len(calls)} saves")
    print(f"  snapshot (background):     median {np.median(snaps):.2f} ms per step")
    print(f"  restore + load_state_dict: {run['restore_s'] * 1e3:.1f} ms")
    print(f"  loss:                      {first:.4f} -> {last:.4f}")
    print(f"  time:                      interrupted run {t1 - t0:.1f} s, reference run {t2 - t1:.1f} s")
    print(f"  loss curve bit-identical:  {yes[loss_ok]}")
    print(f"  final state bit-identical: {yes[state_ok]}")
    if not (loss_ok and state_ok):
        bad = [i for i, (a, b) in enumerate(zip(run["losses"], ref["losses"])) if a != b]
        print(f"MISMATCH: first differing loss at step {bad[0] if bad else None}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
