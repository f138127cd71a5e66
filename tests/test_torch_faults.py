"""The torch front end under real failures: real gloo processes, real node agents, real SIGKILL.

1. A killed rank restores from shared memory: 2 ranks on one simulated node train a model (a bfloat16 layer
   included) with AdamW and data-parallel gradients, saving every step with ``store="shm"``; rank 1 SIGKILLs
   itself right after ``save()`` returned (its snapshot still in flight), the job is torn down and relaunched,
   and every rank restores the newest committed step from the node agent's memory, bit for bit equal to a
   reference recomputed from scratch, then trains on identically to it.
2. A lost node restores from peers: 2 simulated nodes x 1 rank (2 x 2 with TORCH_FAULTS_PROCS_PER_NODE=2) with
   ``protection="hybrid"`` (replicated parameters: parity; a DTensor sharded per rank: a copy on the other
   node) train until a step is protected; node 1 is then SIGKILLed with its agent and its memory; the relaunched
   job (a fresh agent on node 1) restores the newest step every rank can obtain, rebuilding node 1's chunks
   from node 0, bit for bit, and trains on identically. The protected step's parity thread is kept busy until
   after the next in-place update was allowed (``wait_for_reads``): the parity must not see that update.
The reference is computed in the relaunched processes by training from scratch with the same seeds (the
training is deterministic: gloo sums of 2 float32 values are exact and symmetric). Agents are stopped and
/dev/shm cleaned by the module fixture.
"""
import datetime
import os
import shutil
import signal
import time
import uuid

import numpy as np
import pytest

from jaxckpt.backends.agent import protocol as proto
from jaxckpt.testing import expect_ok, launch, node_info, remove_agents, start

BASE = f"/dev/shm/jaxckpt-tfault-{os.getpid()}-{uuid.uuid4().hex[:8]}"
ENV = {"JAXCKPT_LOG_LEVEL": "WARNING"}
PROCS = int(os.environ.get("TORCH_FAULTS_PROCS_PER_NODE", "1"))  # scenario 2's ranks per node
CHUNK = 512  # small: every array is cut into several chunks per rank
CONTINUE = 2  # steps trained after the restore, compared with the reference


@pytest.fixture(scope="module", autouse=True)
def base_dir():
    os.makedirs(BASE, mode=0o700)
    yield BASE
    remove_agents(BASE)


# ---------------------------------------------------------------------------- runs in the launched processes
def _init():
    import torch.distributed as dist

    info = node_info()
    dist.init_process_group("gloo", init_method=f"tcp://{info.coordinator}", rank=info.process_id,
                            world_size=info.process_count, timeout=datetime.timedelta(seconds=60))
    return info


def _config(base: str, job: str, protection: str = "none"):
    from jaxckpt import Config

    return Config(store="shm", job_id=job, shm_dir=f"{base}/{job}-node{node_info().node}", keep=2,
                  chunk_bytes=CHUNK, agent_dirs=f"{base}/{job}-node*", commit_timeout_s=60.0, peer_timeout_s=20.0,
                  protection=protection)


class Trainer:
    """A deterministic data-parallel training run of one rank: same seeds, same steps, same bits."""

    def __init__(self, rank: int, world: int, table: bool) -> None:
        import torch
        import torch.distributed as dist

        self.rank, self.world = rank, world
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
                                         torch.nn.Dropout(0.2), torch.nn.Linear(16, 4))
        self.model[4].to(torch.bfloat16)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.data = torch.Generator().manual_seed(200 + rank)  # this rank's position in its data
        torch.manual_seed(100 + rank)  # dropout draws from the global RNG, per rank
        self.table = None
        if table:  # a DTensor sharded per rank (its rows differ per rank), updated in place every step
            from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("x",))
            self.table = distribute_tensor(torch.zeros(3 * world + 1, 5), mesh, [Shard(0)], src_data_rank=None)
        self.step = 0
        self._dist = dist

    def train(self) -> None:
        import torch

        x = torch.randn(6, 8, generator=self.data)
        h = self.model[3](self.model[2](self.model[1](self.model[0](x))))
        loss = self.model[4](h.to(torch.bfloat16)).float().square().mean()
        self.opt.zero_grad()
        loss.backward()
        for p in self.model.parameters():  # data parallelism: identical parameters on every rank
            g = p.grad.float()
            self._dist.all_reduce(g)
            p.grad.copy_(g / self.world)
        self.opt.step()
        if self.table is not None:
            with torch.no_grad():
                local = self.table.to_local()
                local.mul_(0.5).add_(torch.randn(local.shape, generator=self.data))
        self.step += 1

    def state(self) -> dict:
        import torch
        from jaxckpt.torch import PerRank

        out = {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "data": self.data,
               "rng": PerRank(torch.get_rng_state()), "step": self.step}
        if self.table is not None:
            out["table"] = self.table
        return out

    def blank(self) -> dict:
        """A restore target shaped like :meth:`state`, holding none of its values."""
        import torch
        from torch.distributed.tensor import distribute_tensor
        from jaxckpt.torch import PerRank

        def zeros(v):
            if isinstance(v, dict):
                return {k: zeros(x) for k, x in v.items()}
            if isinstance(v, list):
                return [zeros(x) for x in v]
            return torch.zeros_like(v) if isinstance(v, torch.Tensor) else v

        out = {"model": zeros(self.model.state_dict()), "optim": zeros(self.opt.state_dict()),
               "data": torch.Generator(), "rng": PerRank(torch.zeros_like(torch.get_rng_state())), "step": 0}
        if self.table is not None:
            out["table"] = distribute_tensor(torch.zeros(self.table.shape), self.table.device_mesh,
                                             self.table.placements, src_data_rank=None)
        return out

    def bits(self) -> dict:
        """Every tensor of the training state (and the RNG streams' positions) as raw bytes, by path."""
        import torch
        from jaxckpt.torch.dtypes import numpy_view

        def raw(t):
            return numpy_view(t.detach().contiguous()).reshape(-1).view(np.uint8).tobytes()

        out = {f"model/{k}": raw(v) for k, v in self.model.state_dict().items()}
        for i, s in self.opt.state_dict()["state"].items():
            out.update({f"optim/{i}/{k}": raw(v) for k, v in s.items()})
        out["data"], out["rng"] = raw(self.data.get_state()), raw(torch.get_rng_state())
        if self.table is not None:
            out["table"] = raw(self.table.to_local())
        return out

    def load(self, out: dict) -> None:
        import torch

        self.model.load_state_dict(out["model"])
        self.opt.load_state_dict(out["optim"])
        self.data.set_state(out["data"].get_state())
        torch.set_rng_state(out["rng"])
        if self.table is not None:
            with torch.no_grad():
                self.table.to_local().copy_(out["table"].to_local())
        self.step = out["step"]


def _mark(name: str) -> None:
    open(os.path.join(node_info().launch_dir, name), "w").close()


def train_job(base: str, job: str, protection: str, kill_rank: int, kill_step: int, protected: int):
    """Train and save every step until killed. ``kill_rank`` SIGKILLs itself right after ``save(kill_step)``
    returned (the snapshot still in flight). With ``protected``, the parity of that step is computed late (its
    thread busy for a moment), after the next step's in-place update was allowed to start; once that step is
    protected, rank 0 leaves a marker (the test then kills a node from outside)."""
    from jaxckpt.torch import Checkpointer

    info = _init()
    t = Trainer(info.process_id, info.process_count, table=protection != "none")
    with Checkpointer(_config(base, job, protection), defer_reads=True) as ck:
        while True:
            t.train()  # after wait_for_reads() below: see the defer_reads contract
            if protected and t.step == protected + 1:
                ck.wait()
                assert protected in ck.engine.protection.protected_steps(), ck.engine.protection.failures()
                _mark(f"protected-{info.process_id}")
            if protected and t.step == protected:
                ck.engine.protection._parity_pool.submit(time.sleep, 0.5)  # a slow parity thread
            ck.save(t.step, t.state())
            if t.step == kill_step - 1:
                ck.wait()  # at least kill_step - 1 is committed everywhere
            if info.process_id == kill_rank and t.step == kill_step:
                _mark(f"killed-{os.getpid()}")
                os.kill(os.getpid(), signal.SIGKILL)
            ck.wait_for_reads()  # the next in-place update must wait for every read of the snapshot
            if t.step > 200:
                raise AssertionError("never killed")


def resume_job(base: str, job: str, protection: str):
    """Restore the newest step into a fresh model, compare it with a reference trained from scratch, train both
    on and compare again; then save a new step."""
    import torch
    import torch.distributed as dist
    from jaxckpt.torch import Checkpointer

    info = _init()
    table = protection != "none"
    with Checkpointer(_config(base, job, protection)) as ck:
        latest = ck.latest_step()
        ref = Trainer(info.process_id, info.process_count, table)
        for _ in range(latest):
            ref.train()
        ref_rng = torch.get_rng_state()
        want = ref.bits()

        torch.manual_seed(12345)  # the relaunched process's own RNG, overwritten by the restore
        got = Trainer(info.process_id, info.process_count, table)
        with torch.no_grad():
            for p in got.model.parameters():
                p.add_(1.0)  # a different starting point: nothing restored may be left from the init
        target = ref.blank()
        out = ck.restore(target)
        report = ck.engine.last_restore_report.to_dict()
        got.load(out)
        have = got.bits()
        assert sorted(have) == sorted(want), (sorted(have), sorted(want))
        differ = [k for k in want if have[k] != want[k]]
        assert not differ, f"step {latest}: restored state differs from the reference at {differ}"
        assert got.step == latest

        for _ in range(CONTINUE):  # both go on: the restored run first, then the reference on its own RNG
            got.train()
        after = got.bits()
        torch.set_rng_state(ref_rng)
        for _ in range(CONTINUE):
            ref.train()
        ref_after = ref.bits()
        differ = [k for k in ref_after if after[k] != ref_after[k]]
        assert not differ, f"continuation from step {latest} differs from the reference at {differ}"

        ck.save(got.step, got.state())  # saving goes on after the restart
        ck.wait()
        saved = ck.all_steps()
        protected = ck.engine.protection.protected_steps() if ck.engine.protection is not None else []
        dist.barrier()
    dist.destroy_process_group()
    return {"latest": latest, "report": report, "saved": saved, "protected": protected}


# ----------------------------------------------------------------------------------------------- helpers
def node_dir(job: str, node: int) -> str:
    return f"{BASE}/{job}-node{node}"


def lose_node_memory(job: str, node: int) -> None:
    """The node's agent SIGKILLed and its shared memory removed: the replacement node starts empty."""
    d = node_dir(job, node)
    proto.kill_agent(d, remove_memory=True)
    shutil.rmtree(d, ignore_errors=True)


def wait_for(job, what, seconds: float = 150.0) -> None:
    """Until ``what()``; fails with the trainers' output if one of them exits first or time runs out."""
    deadline = time.monotonic() + seconds
    while not what():
        if time.monotonic() > deadline or any(c is not None for c in job.poll()):
            job.close()
            raise AssertionError("the trainers did not get there: " + "\n".join(
                f"--- process {r.process_id} rc {r.returncode}: {r.error}\n{r.output[-1500:]}" for r in job.results()))
        time.sleep(0.01)


# ----------------------------------------------------------------------------------------------- tests
def test_killed_rank_restores_from_node_memory():
    job, kill_step = "kill-rank", 4
    with start(train_job, nodes=1, procs_per_node=2, args=(BASE, job, "none", 1, kill_step, 0), env=ENV,
               distributed=False, fail_fast_grace=None) as run:
        wait_for(run, lambda: run.poll()[1] is not None)
        run.kill_process(0, reason="the job is torn down after rank 1 died")  # as an elastic launcher would
        assert run.wait(30)
    first = run.results()
    assert first[1].returncode == -signal.SIGKILL and not first[1].reported, first[1].output[-2000:]
    assert not first[0].ok, "rank 0 cannot finish without rank 1"

    values = expect_ok(launch(resume_job, nodes=1, procs_per_node=2, args=(BASE, job, "none"), env=ENV,
                              distributed=False, timeout=150))
    latest = values[0]["latest"]
    assert latest in (kill_step - 1, kill_step) and all(v["latest"] == latest for v in values), values
    for v in values:
        kinds = v["report"]["bytes_by_kind"]
        assert v["report"]["step"] == latest and sum(kinds.values()) > 0, v["report"]
        assert set(kinds) <= {"local", "node"}, kinds  # the node agent's memory, nothing else
        assert v["saved"][-1] == latest + CONTINUE, v


def test_lost_node_restores_from_peers_with_protection():
    job, protected = "lose-node", 3
    with start(train_job, nodes=2, procs_per_node=PROCS, args=(BASE, job, "hybrid", -1, -1, protected), env=ENV,
               distributed=False, fail_fast_grace=None) as run:
        wait_for(run, lambda: os.path.exists(os.path.join(run.launch_dir, "protected-0")))
        run.kill_node(1)
        lose_node_memory(job, 1)
        for i in range(PROCS):  # node 0's ranks cannot go on without node 1: the job is torn down
            run.kill_process(i, reason="the job is torn down after node 1 was lost")
        assert run.wait(30)
    first = run.results()
    assert all(r.returncode == -signal.SIGKILL and not r.reported for r in first[PROCS:]), first
    assert not os.path.exists(node_dir(job, 1))

    values = expect_ok(launch(resume_job, nodes=2, procs_per_node=PROCS, args=(BASE, job, "hybrid"), env=ENV,
                              distributed=False, timeout=150))
    latest = values[0]["latest"]
    assert latest >= protected and all(v["latest"] == latest for v in values), values
    rebuilt = sum(v["report"]["bytes_by_kind"].get("rebuild", 0) for v in values)
    assert rebuilt > 0, [v["report"] for v in values]
    for v in values[PROCS:]:  # the replacement node holds nothing: node 0's agent and the rebuild serve it all
        assert set(v["report"]["bytes_by_kind"]) <= {"remote", "rebuild"}, v["report"]
    for v in values:
        assert v["saved"][-1] == latest + CONTINUE and latest + CONTINUE in v["protected"], v
