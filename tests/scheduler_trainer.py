"""A trainer started by real schedulers and launchers (srun, mpirun, mpiexec, torchrun), as a user would write one.

``jax`` mode: ``jax.distributed.initialize()`` with no arguments (JAX's own detection of SLURM or Open MPI; with
``--coordinator HOST:PORT``, as MPICH's users call it: that address and the ranks PMI_RANK/PMI_SIZE say), a
small state sharded over every process's CPU device (one per process) plus a replicated vector, a jitted step
whose all-reduce crosses processes (gloo), a snapshot every step to the node agent (``store="shm"``, the default
agent directory: the node is the scheduler's). ``torch`` mode (torchrun): a small model and SGD with momentum,
snapshots through jaxckpt's torch front end and, beside them, ``torch.distributed.checkpoint`` on jaxckpt's
storage (``JaxckptWriter``/``JaxckptReader``), both in the agent's shared memory.

Either way a run restores the newest step it finds, trains to ``--steps``, checks its final state bit for bit
against an uninterrupted run computed here from the start, and writes ``<out>/result-<rank>-<attempt>.json``
(attempt ``first`` when it found nothing to restore, else ``relaunch``). ``--fail-rank R --fail-at S``: on the
first attempt, rank R SIGKILLs itself once step S is committed (and
protected); ``--fail-rank -2``: every rank waits there to be killed from outside. ``--linger``: after writing
its result the process waits to be killed (the allocation's end). ``--early-agent TAG``: the script's first act,
before importing its framework, is ``jaxckpt.start_agent()`` (as the README advises a relaunched job), and the
process writes ``<out>/early-TAG-<pid>.json`` saying whether that call started the node's agent.
``--agent-ports NODE=PORT,...``: this node's ``JAXCKPT_AGENT_PORT`` (SLURMD_NODENAME's entry): emulated nodes
share one machine's addresses, so each serves its peers on a port of its own (real nodes would share one port).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time

import numpy as np

ROWS, COLS = 8, 16


def _write(out: str, rank: int, attempt: str, doc: dict) -> None:
    path = os.path.join(out, f"result-{rank}-{attempt}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)


def results(out: str, attempt: str, ranks: int) -> list[dict]:
    """The result documents ranks 0..ranks-1 wrote for ``attempt`` (for the tests that start this trainer)."""
    docs = []
    for r in range(ranks):
        with open(os.path.join(out, f"result-{r}-{attempt}.json")) as f:
            docs.append(json.load(f))
    return docs


def live_pids(*words: str) -> list[int]:
    """Live processes (not zombies) whose command line has every one of ``words`` as an argument (for the tests:
    a job's trainers or agents, wherever a launcher put them)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if not zombie and all(w.encode() in argv for w in words):
            pids.append(int(entry))
    return pids


def _die_if(args: argparse.Namespace, rank: int, step: int, first: bool) -> None:
    if first and step == args.fail_at and args.fail_rank in (rank, -2):
        with open(os.path.join(args.out, f"failed-{rank}"), "w") as f:
            f.write(str(step))
        if args.fail_rank == -2:  # every rank waits there to be killed from outside (a step cancelled)
            while True:
                time.sleep(1)
        os.kill(os.getpid(), signal.SIGKILL)


def _where(config) -> dict:
    """Where this process ran as jaxckpt sees it: the node and where its name came from, the scheduler, the
    agent's directory and pid (the same pid across a relaunch: the memory outlived the trainers), this pid."""
    from jaxckpt.backends.agent.protocol import agent_dir, read_pid_file
    from jaxckpt.node_identity import detect_scheduler, local_process_count, node_identity

    ident, directory = node_identity(config), agent_dir(config)
    info = read_pid_file(directory)
    return {"node": ident.name, "source": ident.source, "scheduler": detect_scheduler().name,
            "scheduler_details": dict(detect_scheduler().details), "processes_on_node": local_process_count(),
            "agent_dir": directory, "agent_pid": info[0] if info else None, "pid": os.getpid()}


def _linger(args: argparse.Namespace) -> None:
    if args.linger:
        while True:
            time.sleep(1)


# ------------------------------------------------------------------------------------------------------ jax
def jax_main(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    jax.config.update("jax_num_cpu_devices", 1)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.coordinator:  # MPICH / Intel MPI (Hydra): JAX detects neither, the ranks come from PMI's variables
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=int(os.environ["PMI_SIZE"]),
                                   process_id=int(os.environ["PMI_RANK"]))
    else:
        jax.distributed.initialize()  # JAX detects SLURM (srun) or Open MPI (mpirun) by itself
    import jaxckpt

    rank, n = jax.process_index(), jax.process_count()
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    w_sh, b_sh = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())

    def init():
        w = np.arange(n * ROWS * COLS, dtype=np.float32).reshape(n * ROWS, COLS) / 7.0
        b = np.linspace(-1, 1, COLS, dtype=np.float32)
        return {"w": jax.make_array_from_callback(w.shape, w_sh, lambda i: w[i]),
                "b": jax.make_array_from_callback(b.shape, b_sh, lambda i: b[i])}

    @jax.jit
    def step_fn(s):
        w = s["w"] * 0.875 + jnp.sin(s["b"])[None, :]
        return {"w": w, "b": s["b"] * 0.5 + jnp.mean(w, axis=0)}  # the mean all-reduces over processes

    config = jaxckpt.Config(store="shm", job_id=args.job, keep=2, protection=args.protection, chunk_bytes=256,
                            commit_timeout_s=60.0, peer_timeout_s=20.0)
    ckpt = jaxckpt.Checkpointer(config)
    first = ckpt.latest_step() is None
    state, restored, kinds = init(), None, {}
    if ckpt.latest_step() is not None:
        target = {"w": jax.ShapeDtypeStruct((n * ROWS, COLS), jnp.float32, sharding=w_sh),
                  "b": jax.ShapeDtypeStruct((COLS,), jnp.float32, sharding=b_sh)}
        restored = ckpt.latest_step()
        state = ckpt.restore(target)
        kinds = ckpt.last_restore_report.to_dict()["bytes_by_kind"]
    for s in range((restored or 0) + 1, args.steps + 1):
        state = step_fn(state)
        ckpt.save(s, state)
        if first and s == args.fail_at:
            ckpt.wait()  # committed and protected everywhere before the failure
        _die_if(args, rank, s, first)
    ckpt.wait()
    ref = init()
    for _ in range(args.steps):
        ref = step_fn(ref)
    same = all(np.array_equal(np.asarray(a.data).view(np.uint32), np.asarray(b.data).view(np.uint32))
               for k in ("w", "b") for a, b in zip(state[k].addressable_shards, ref[k].addressable_shards))
    doc = {"rank": rank, "processes": n, "restored": restored, "kinds": kinds, "bitwise": same,
           "latest": ckpt.latest_step(),
           "protected": ckpt.engine.protection.protected_steps() if ckpt.engine.protection else [],
           # what this node's agent said at the hello: its recovery of the node's share (a spare's agent), as the
           # trainer saw it (that agent may not outlive this step: backends/agent/lifetime.py's srun race)
           "agent_recovery": getattr(ckpt.engine.store, "agent", {}).get("recovery"),
           **_where(ckpt.config)}
    ckpt.close()
    _write(args.out, rank, "first" if first else "relaunch", doc)
    _linger(args)
    jax.distributed.shutdown()


# ---------------------------------------------------------------------------------------------------- torch
def torch_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # Plain, as a user writes it. The launchers of the tests run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    # (docs/deploy.md says why: torchelastic's shared store keeps the last round's gloo addresses).
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    import jaxckpt
    from jaxckpt.backends.torch import Checkpointer as TorchCheckpointer
    from jaxckpt.torch.dcp import JaxckptReader, JaxckptWriter

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(COLS, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def train_step(model, opt, step):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(4, COLS, generator=g), torch.randn(4, 2, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():  # data parallel: average the gradients over the ranks
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()

    def state(model, opt):
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    model, opt = make()
    train_step(model, opt, 0)  # the optimizer has momentum buffers before the first snapshot
    cfg = jaxckpt.Config(store="shm", job_id=args.job, keep=2, commit_timeout_s=60.0, peer_timeout_s=20.0)
    dcp_cfg = cfg.replace(job_id=f"{args.job}-dcp")
    ckpt = TorchCheckpointer(cfg)
    restored = ckpt.latest_step()
    first = restored is None  # a run that finds nothing to restore is the first, however the launcher counts
    dcp_restored = None
    if restored is not None:
        ckpt.restore(state(model, opt), in_place=True)
        # DCP's own load, from jaxckpt's storage: the newest checkpoint the agent holds, into a fresh model
        m2, o2 = make()
        train_step(m2, o2, 0)
        sd = state(m2, o2)
        dcp.load(sd, storage_reader=JaxckptReader(config=dcp_cfg))
        m2.load_state_dict(sd["model"])
        o2.load_state_dict(sd["optim"])
        dcp_restored = all(torch.equal(a, b) for a, b in zip(m2.state_dict().values(), model.state_dict().values()))
    for s in range((restored or 0) + 1, args.steps + 1):
        train_step(model, opt, s)
        ckpt.save(s, state(model, opt))
        dcp.save(state(model, opt), storage_writer=JaxckptWriter(s, config=dcp_cfg))
        if first and s == args.fail_at:
            ckpt.wait()
            dist.barrier()  # every rank's DCP checkpoint of this step is in before the failure
        _die_if(args, rank, s, first)
    ckpt.wait()
    ref, ref_opt = make()
    for s in range(0, args.steps + 1):
        train_step(ref, ref_opt, s)
    got, want = state(model, opt), state(ref, ref_opt)
    same = all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"]) and all(
        torch.equal(got["optim"]["state"][i]["momentum_buffer"], want["optim"]["state"][i]["momentum_buffer"])
        for i in want["optim"]["state"])
    kinds = ckpt.last_restore_report.to_dict()["bytes_by_kind"] if restored is not None else {}
    doc = {"rank": rank, "attempt": attempt, "restored": restored, "kinds": kinds,
           "dcp_matches_restore": dcp_restored, "bitwise": same, "latest": ckpt.latest_step(),
           **_where(ckpt.config)}
    ckpt.close()
    _write(args.out, rank, "first" if first else "relaunch", doc)
    dist.destroy_process_group()


def _start_agent_early(args: argparse.Namespace) -> None:
    import jaxckpt  # before jax: the document says whether jax was imported by then

    started = jaxckpt.start_agent(jaxckpt.Config(store="shm", job_id=args.job))
    doc = {"started": started, "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
           "jax_imported": "jax" in sys.modules}
    with open(os.path.join(args.out, f"early-{args.early_agent}-{os.getpid()}.json"), "w") as f:
        json.dump(doc, f)


def early_agent_calls(out: str, tag: str) -> list[dict]:
    """What each process's ``jaxckpt.start_agent()`` said under ``--early-agent tag`` (for the tests)."""
    docs = []
    for name in sorted(os.listdir(out)):
        if name.startswith(f"early-{tag}-"):
            with open(os.path.join(out, name)) as f:
                docs.append(json.load(f))
    return docs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("mode", choices=("jax", "torch"))
    p.add_argument("--out", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-at", type=int, default=-1)
    p.add_argument("--protection", default="none")
    p.add_argument("--linger", action="store_true")
    p.add_argument("--early-agent", metavar="TAG", default=None)
    p.add_argument("--agent-ports", default="")
    p.add_argument("--coordinator", default="", help="HOST:PORT of JAX's coordinator, ranks from PMI_RANK/PMI_SIZE")
    args = p.parse_args(argv)
    if args.agent_ports:
        os.environ["JAXCKPT_AGENT_PORT"] = dict(e.split("=") for e in args.agent_ports.split(","))[
            os.environ["SLURMD_NODENAME"]]
    if args.early_agent is not None:
        _start_agent_early(args)
    faulthandler.register(signal.SIGUSR1)  # a test that times out dumps every thread's stack (kill -USR1)
    (jax_main if args.mode == "jax" else torch_main)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
