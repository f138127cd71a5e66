"""Torch restore through the collective (jaxckpt/torch/gather.py) with two real ranks on gloo.

Plain tensors are replicated on every rank; each rank saved half of each. On restore each rank reads only its
own half and one ``all_gather_into_tensor`` forms the tensors: bit for bit (NaN payloads, bfloat16, int, bool),
new tensors and in place, nothing over the host transport; with ``restore_collective=False`` each rank fetches
the other's half from its peer server.
"""
import datetime

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from jaxckpt.testing import expect_ok, launch, node_info  # noqa: E402


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    w = torch.randn(18, 7, generator=g)
    w.view(-1)[[3, 50]] = torch.tensor([0x7FC00001, 0x7FA00002], dtype=torch.int32).view(torch.float32)
    return {"model": {"w": w, "emb": torch.randn(10, 4, generator=g).to(torch.bfloat16),
                      "ids": torch.randint(-2**31, 2**31 - 1, (5, 6), generator=g, dtype=torch.int32),
                      "mask": torch.rand(9, generator=g) > 0.5},
            "epoch": step}


def _same(a, b) -> bool:
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    itemsize = a.element_size()
    kind = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]
    return a.shape == b.shape and torch.equal(a.contiguous().view(kind), b.contiguous().view(kind))


def ranks_job(job_id: str) -> dict:
    from jaxckpt import Config
    from jaxckpt.torch import Checkpointer

    info = node_info()
    rank, world = info.process_id, info.process_count
    dist.init_process_group("gloo", init_method=f"tcp://{info.coordinator}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    out = {}
    try:
        for name, on in (("collective", True), ("fetch", False)):
            cfg = Config(job_id=f"{job_id}-{name}", keep=2, commit_timeout_s=30.0, peer_timeout_s=20.0,
                         chunk_bytes=128, restore_collective=on)
            with Checkpointer(cfg) as ck:
                ck.save(1, _state(1)).result()
                want = _state(1)
                got = ck.restore({"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "epoch": 0})
                new_ok = all(_same(got["model"][k], want["model"][k]) for k in want["model"]) and got["epoch"] == 1
                report = ck.last_restore_report
                dest = {k: torch.zeros_like(v) for k, v in want["model"].items()}
                got = ck.restore({"model": dest, "epoch": 0}, in_place=True)
                in_place_ok = all(got["model"][k] is dest[k] and _same(dest[k], want["model"][k]) for k in dest)
                own = sum(c.nbytes for c in _own_chunks(ck))
                out[name] = {"ok": new_ok and in_place_ok, "routes": dict(report.routes),
                             "kinds": dict(report.bytes_by_kind), "transport": report.transport_bytes,
                             "collective": report.collective_bytes, "own": own,
                             "timeline": report.timeline.to_dict()["collective"]}
                dist.barrier()  # every rank has read what it needs from the others
    finally:
        dist.destroy_process_group()
    return out


def _own_chunks(ck):
    with ck.engine.open(None) as (_, manifests, _reader):
        m = next(m for m in manifests if m.process == ck.engine.process_index)
        return [c for a in m.arrays for c in a.chunks]


def test_two_ranks_restore_plain_tensors_through_all_gather():
    values = expect_ok(launch(ranks_job, nodes=1, procs_per_node=2, distributed=False, args=["torch-coll"],
                              timeout=180))
    total = sum(v.numel() * v.element_size() for v in _state(1)["model"].values())
    for v in values:
        c, f = v["collective"], v["fetch"]
        assert c["ok"] and f["ok"]
        assert set(c["routes"].values()) == {"collective"} and len(c["routes"]) == 4, c["routes"]
        assert c["transport"] == 0 and set(c["kinds"]) == {"local"}, c["kinds"]
        # each rank read its own half; the all-gather brought the rest of every tensor
        assert c["kinds"]["local"] == c["own"] and c["collective"] == total - c["own"] > 0
        assert c["timeline"]["nbytes"] == c["collective"] and c["timeline"]["count"] == 4
        assert f["routes"] == {} and f["transport"] == total - f["own"] > 0


def backends_job(job_id: str, scratch: str) -> dict:
    """Per process-group backend: the device jaxckpt's collectives use on it, or the error making a Checkpointer
    there raises (every rank alike)."""
    from jaxckpt import Config
    from jaxckpt.errors import ConfigError
    from jaxckpt.torch import Checkpointer
    from jaxckpt.torch.coordination import collective_device

    info = node_info()
    rank, world = info.process_id, info.process_count
    out = {}
    for i, backend in enumerate(("gloo", "cpu:gloo,cuda:gloo", "cuda:gloo")):
        dist.init_process_group(backend, store=dist.FileStore(f"{scratch}/store{i}", world), rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        try:
            try:
                device = str(collective_device())
            except ConfigError:
                device = None
            try:
                with Checkpointer(Config(job_id=f"{job_id}-{i}", commit_timeout_s=30.0, restore_collective=True)) as ck:
                    ck.save(1, _state(1)).result()
                    got = ck.restore({"model": {k: torch.zeros_like(v) for k, v in _state(1)["model"].items()},
                                      "epoch": 0})
                    made = all(_same(got["model"][k], v) for k, v in _state(1)["model"].items())
                    error = None
            except ConfigError as e:
                made, error = False, str(e)
        finally:
            dist.destroy_process_group()
        out[backend] = {"device": device, "restored": made, "error": error}
    return {"gpu": torch.cuda.is_available(), **out}


def test_collectives_use_the_device_the_groups_backend_serves(tmp_path):
    # gloo (and a backend string giving the CPU one) carries CPU tensors: the run token and the collective
    # restore go there. A group with a backend for GPU tensors only ("nccl"; here "cuda:gloo", which this
    # machine can make) would take this rank's GPU; where the process sees none, making the Checkpointer is a
    # ConfigError that says what the group needs, on every rank, where torch's broadcast raised its own error.
    values = expect_ok(launch(backends_job, nodes=1, procs_per_node=2, distributed=False,
                              args=["torch-backends", str(tmp_path)], timeout=180))
    for v in values:
        for backend in ("gloo", "cpu:gloo,cuda:gloo"):
            assert v[backend] == {"device": "cpu", "restored": True, "error": None}, v
        gpu_only = v["cuda:gloo"]
        if v["gpu"]:  # the token and the collective restore go through this rank's GPU
            assert gpu_only["device"].startswith("cuda") and gpu_only["restored"], gpu_only
            continue
        assert gpu_only["device"] is None and not gpu_only["restored"], gpu_only
        assert "'cuda:gloo' has no backend for CPU tensors and this process sees no GPU" in gpu_only["error"]
        assert 'init_process_group("cpu:gloo,cuda:nccl")' in gpu_only["error"], gpu_only
