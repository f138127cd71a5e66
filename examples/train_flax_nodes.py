"""Train the Flax GPT on 2 simulated nodes x 2 processes, lose node 1 mid-training (its trainers, its agent and
its shared memory), relaunch the job on a replacement node, restore from the surviving node's memory and check
that the run continues bit for bit.

    python examples/train_flax_nodes.py                  # defaults: about a minute on 2 CPU cores
    python examples/train_flax_nodes.py --no-lose-memory # only node 1's trainers die; its agent keeps the memory
    python examples/train_flax_nodes.py --steps 16 --fail-at 9 --d-model 128 --layers 2

1. Job 1 (launched with ``jaxckpt.testing``: 4 JAX processes, 2 CPU devices each, nodes of 2 processes, mesh
   data=4 x model=2) trains with ``store="shm"``, ``protection="hybrid"`` and ``ckpt.save(step, state)`` after
   every step: each node's agent (spawned by the first trainer on it) holds the node's snapshots in shared
   memory, and after each commit the trainers build the step's redundancy in the background (a step is
   *protected* once it is complete). When the trainers reach ``--fail-at``, this driver SIGKILLs node 1's
   trainers (a save may be in flight); node 0's trainers block on the next collective and the job is torn down,
   as a scheduler would. With ``--lose-memory`` (the default) node 1 is lost for good: its agent is SIGKILLed and
   its shared memory and directory removed, so the replacement node starts empty.
2. Job 2, a fresh launch (new processes, new JAX coordination service, a fresh agent on the replacement node 1),
   builds a Checkpointer on the node directories: every process agrees on the newest step that is fully
   recoverable, restores it from its own memory, its node's agent and the other node's agent (with
   ``--replicas split``, the chunks that died with node 1 are rebuilt from the protection data node 0 holds;
   bytes per source kind are printed), and trains on. Then, in the same processes and with no checkpointer, it trains the same steps from scratch
   without checkpointing or failure: the reference. Per-step losses and the final state of every process's shards
   must be bit-identical to jobs 1+2. Exit status 1 otherwise. Agents and memory are removed.

Why ``hybrid``: every array of this GPT (tensor-parallel on ``model`` inside a process, replicated over ``data``)
has device copies on both nodes. With ``Config.replicas="whole"`` (the default) each node keeps a whole copy of
it, shared by its 2 processes: the other node's copy is its protection, no parity is needed, and the replacement
node reads node 0's copy. With ``--replicas split`` plan.py saves each replicated box once, cut into pieces over
the 4 data replicas, so half of every box dies with a node. ``hybrid`` picks ``parity`` (REFT) for a box whose copies span
two or more nodes: with 2 nodes each node computes, from its own device copy and with no bytes sent, the other
node's share, so either node alone can rebuild the step. ``replica`` also survives (each chunk copied to the
other node through the agents' peer transport) but sends every byte at save time; ``parity`` alone behaves like
``hybrid`` here. ``--protection`` chooses.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = "flax-nodes"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="training steps (default 12)")
    p.add_argument("--fail-at", type=int, default=6, help="step at which node 1's trainers are killed (default 6)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="global batch, split over the data axis")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lose-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="lose node 1's agent and shared memory too, not only its trainers (default: yes)")
    p.add_argument("--protection", choices=("hybrid", "parity", "replica", "none"), default="hybrid",
                   help="Config.protection (default hybrid; 'none' cannot survive --lose-memory)")
    p.add_argument("--replicas", choices=("whole", "split"), default="whole",
                   help="Config.replicas (default whole: each node keeps a whole copy; split: 1/R per replica)")
    p.add_argument("--timeout", type=float, default=600.0, help="time-out of each job in seconds")
    args = p.parse_args(argv)
    if args.lose_memory and args.protection == "none":
        p.error("--protection none cannot survive losing a node's memory; add --no-lose-memory")
    if not 1 <= args.fail_at < args.steps:
        p.error(f"--fail-at must be in [1, {args.steps - 1}], got {args.fail_at}")
    return args


# ------------------------------------------------------------------------------ runs in every launched process
def _setup(opts: dict):
    import warnings

    from jaxckpt.tools.bench import gpt

    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    cfg = gpt.GPTConfig(vocab=opts["vocab"], seq_len=opts["seq_len"], d_model=opts["d_model"],
                        layers=opts["layers"], heads=opts["heads"])
    mesh = gpt.make_mesh(model=2)
    return gpt, cfg, mesh, gpt.make_train_step(cfg, mesh)


def _config(opts: dict):
    import jaxckpt
    from jaxckpt.testing import node_info

    base = opts["base"]
    return jaxckpt.Config(store="shm", job_id=JOB, shm_dir=f"{base}/node{node_info().node}", keep=2,
                          agent_dirs=f"{base}/node*", commit_timeout_s=60.0, peer_timeout_s=30.0,
                          protection=opts["protection"], replicas=opts["replicas"])


def _loss(loss) -> str:
    return loss.addressable_data(0).__array__().tobytes().hex()  # replicated: every process has it


def _digest(state) -> str:
    """A digest of this process's shards of every array of the state (the unit of 'bit-identical')."""
    import jax
    import numpy as np

    h = hashlib.sha256()
    for x in jax.tree.leaves(state):
        for s in sorted(x.addressable_shards, key=lambda s: s.device.id):
            h.update(repr(s.index).encode())
            h.update(np.ascontiguousarray(np.asarray(s.data)).tobytes())
    return h.hexdigest()


def first_job(opts: dict):
    """Train from scratch with a snapshot after every step; node 1 is killed by the driver at ``fail_at``."""
    import jaxckpt
    from jaxckpt.testing import node_info

    gpt, cfg, mesh, step_fn = _setup(opts)
    info = node_info()
    log = open(os.path.join(opts["base"], f"losses-{info.process_id}.jsonl"), "a")
    with jaxckpt.Checkpointer(_config(opts)) as ckpt:
        state = gpt.init_state(cfg, mesh, opts["seed"])
        ckpt.save(0, state)
        for step, batch in gpt.batches(cfg, mesh, opts["batch"], opts["seed"], stop=opts["steps"]):
            if step == opts["fail_at"]:
                open(os.path.join(info.launch_dir, f"reached-{info.process_id}"), "w").close()
            state, loss = step_fn(state, batch)
            prot = ckpt.engine.protection
            protected = prot.protected_steps() if prot is not None else []
            log.write(json.dumps([step, _loss(loss), protected[-1] if protected else None]) + "\n")
            log.flush()
            ckpt.save(step + 1, state)  # snapshot k holds the state after k steps
    return "finished without being killed"


def resume_job(opts: dict):
    """A new job: agree on the newest step in the agents' memory, restore it, train to the end; then the
    reference, with no checkpointer, in the same processes."""
    import jaxckpt

    gpt, cfg, mesh, step_fn = _setup(opts)
    with jaxckpt.Checkpointer(_config(opts)) as ckpt:
        target = gpt.abstract_state(cfg, mesh)  # tracing the model's init: not part of the restore's time
        t0 = time.perf_counter()
        state = ckpt.restore(target)
        seconds = time.perf_counter() - t0
        report = ckpt.last_restore_report.to_dict()
        start = int(state.step.addressable_data(0).__array__())
        losses = {}
        for step, batch in gpt.batches(cfg, mesh, opts["batch"], opts["seed"], start=start, stop=opts["steps"]):
            state, loss = step_fn(state, batch)
            losses[step] = _loss(loss)
            ckpt.save(step + 1, state)
        ckpt.wait()
    return {"restored": start, "latest": ckpt.latest_step(), "losses": losses, "digest": _digest(state),
            "restore_s": seconds, "report": report, "reference": reference(opts, gpt, cfg, mesh, step_fn)}


def reference(opts: dict, gpt, cfg, mesh, step_fn) -> dict:
    """The same training without checkpointing or failure."""
    state = gpt.init_state(cfg, mesh, opts["seed"])
    losses = {}
    for step, batch in gpt.batches(cfg, mesh, opts["batch"], opts["seed"], stop=opts["steps"]):
        state, loss = step_fn(state, batch)
        losses[step] = _loss(loss)
    return {"losses": losses, "digest": _digest(state)}


# ------------------------------------------------------------------------------------------------ the driver
def _kill_node_one(job, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(job.launch_dir, f"reached-{i}")) for i in range(job.size)):
        if time.monotonic() > deadline or None not in job.poll():
            raise RuntimeError("job 1 did not reach the failure step")
        time.sleep(0.01)
    job.kill_node(1)  # SIGKILL node 1's trainers: a step and a save may be in flight
    print("job 1: SIGKILLed node 1's trainers; tearing the job down", flush=True)
    job.close()  # at once, as a scheduler does: node 0's trainers would block on the next collective


def _lose_node_memory(node_dir: str) -> None:
    """Node 1 is gone for good: its agent SIGKILLed, its segments, records and directory removed."""
    from jaxckpt.backends.agent import protocol as proto

    pid = proto.kill_agent(node_dir, remove_memory=True)
    shutil.rmtree(node_dir, ignore_errors=True)
    print(f"job 1: SIGKILLed node 1's agent (pid {pid}) and removed its shared memory; node 1 is replaced "
          f"by an empty one", flush=True)


def main(argv: list[str] | None = None) -> int:
    from jaxckpt.backends.agent import protocol as proto
    from jaxckpt.testing import expect_ok, launch, start

    args = parse_args(argv)
    base = f"/dev/shm/jaxckpt-example-{os.getpid()}" if os.path.isdir("/dev/shm") else \
        f"/tmp/jaxckpt-example-{os.getpid()}"
    os.makedirs(base, mode=0o700)
    opts = {k: getattr(args, k) for k in ("steps", "fail_at", "d_model", "layers", "heads", "vocab", "seq_len",
                                          "batch", "seed", "protection", "replicas")}
    opts["base"] = base
    layout = dict(nodes=2, procs_per_node=2, devices_per_proc=2, env={"JAXCKPT_LOG_LEVEL": "WARNING"})
    try:
        t0 = time.perf_counter()
        with start(first_job, args=(opts,), **layout) as job:
            _kill_node_one(job, args.timeout)
        if args.lose_memory:
            _lose_node_memory(os.path.join(base, "node1"))
        t1 = time.perf_counter()
        resumed = expect_ok(launch(resume_job, args=(opts,), timeout=args.timeout, **layout))
        t2 = time.perf_counter()
        ref = [r["reference"] for r in resumed]
        with open(os.path.join(base, "losses-0.jsonl")) as f:
            logged = [json.loads(line) for line in f if line.strip()]
        first = {step: loss for step, loss, _ in logged}
        protected_at_loss = logged[-1][2] if logged else None
    finally:
        for name in sorted(os.listdir(base)):
            d = os.path.join(base, name)
            if os.path.isdir(d):
                proto.stop_agent(d, JOB, timeout_s=30)
                try:
                    os.unlink(proto.default_log_path(d))
                except FileNotFoundError:
                    pass
        shutil.rmtree(base, ignore_errors=True)

    r0 = resumed[0]
    restored = r0["restored"]
    losses = [first[s] if s < restored else r0["losses"][str(s)] for s in range(args.steps)]
    loss_ok = losses == [ref[0]["losses"][str(s)] for s in range(args.steps)]
    agree = all(r["restored"] == restored for r in resumed)
    state_ok = [r["digest"] for r in resumed] == [r["digest"] for r in ref]
    yes = {True: "yes", False: "NO"}
    kinds: dict[str, int] = {}
    for r in resumed:
        for k, v in r["report"]["bytes_by_kind"].items():
            kinds[k] = kinds.get(k, 0) + v
    lost = "trainers, agent and shared memory" if args.lose_memory else "trainers (its agent kept the memory)"
    print("summary")
    print(f"  steps:                      {args.steps} (protection {args.protection!r})")
    print(f"  replicas:                   {args.replicas}")
    print(f"  lost node 1 at step:        {args.fail_at}: {lost} (job 1 logged losses up to step {max(first)})")
    print(f"  restored step:              {restored} (all 4 processes agree: {yes[agree]}; newest protected step "
          f"process 0 had seen: {protected_at_loss})")
    for i, r in enumerate(resumed):
        rep = r["report"]
        print(f"  process {i} restore:          {r['restore_s'] * 1e3:.0f} ms, {rep['nbytes']:,} bytes by source "
              f"kind {rep['bytes_by_kind']}")
    print(f"  restore bytes by kind:      {', '.join(f'{k} {v:,}' for k, v in sorted(kinds.items()))} (all processes)")
    print(f"  time:                       job 1 {t1 - t0:.1f} s, job 2 (with the reference) {t2 - t1:.1f} s")
    print(f"  loss curve bit-identical:   {yes[loss_ok]}")
    print(f"  final state bit-identical:  {yes[state_ok]} (every process's shards)")
    if not (loss_ok and agree and state_ok):
        print("MISMATCH", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
