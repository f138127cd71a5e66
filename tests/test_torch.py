"""The PyTorch front end on the jaxckpt core: every leaf type and dtype bit for bit, model + optimizer round
trips, in-place and new-tensor restore, RNG state, snapshot consistency under in-place updates, errors, the
DTensor box arithmetic against torch's own, the torch.distributed store coordinator, and DTensor state saved
and restored by 2 real gloo processes (started by jaxckpt.testing's launcher, which always reaps them)."""
import datetime
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from jaxckpt import Config
from jaxckpt.torch import Checkpointer, PerRank, TorchStoreCoordinator
from jaxckpt.torch import dtensor as dt
from jaxckpt.torch.dtypes import DTYPE_NAMES, numpy_view
from jaxckpt.errors import ClosedError, ConfigError, StepError, StepNotFoundError, TargetMismatchError, UnsupportedLeafError


def bits(x) -> np.ndarray:
    """The raw bytes of a tensor or array (NaN payloads, -0.0 and all), for bitwise comparison."""
    a = numpy_view(x.detach().cpu()) if isinstance(x, torch.Tensor) else np.asarray(x)
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def assert_same(a, b) -> None:
    assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), (a.dtype, b.dtype, a.shape, b.shape)
    np.testing.assert_array_equal(bits(a), bits(b))


def random_tensor(shape, dtype, gen) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs with payloads, infinities, subnormals) of ``dtype``."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, tuple(shape) + (item,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape) if len(shape) else raw.view(dtype).reshape(())


def manifest_of(ck, step=None):
    with ck.engine.open(step) as (_, manifests, _reader):
        return manifests[0]


# ------------------------------------------------------------------------------------------ leaves, dtypes
@pytest.mark.parametrize("dtype", list(DTYPE_NAMES), ids=str)
def test_every_dtype_round_trips_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(7)
    state = {"m": random_tensor((3, 5), dtype, g), "s": random_tensor((), dtype, g),
             "e": torch.empty((0, 4), dtype=dtype)}
    with Checkpointer() as ck:
        ck.save(1, state)
        ck.wait()
        out = ck.restore(state)
        for k in state:
            assert_same(out[k], state[k])
            assert out[k] is not state[k]
        assert out["m"].data_ptr() != state["m"].data_ptr()
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        back = ck.restore(target, in_place=True)
        for k in state:
            assert back[k] is target[k]
            assert_same(target[k], state[k])


def test_strided_expanded_conjugated_and_grad_tensors():
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    p = torch.nn.Parameter(torch.randn(3, 3))
    state = {"t": base.t(), "x": torch.tensor([1.0, 2.0]).expand(3, 2), "c": torch.tensor([1 + 2j, 3 - 1j]).conj(),
             "slice": base[1:3, ::2], "p": p}
    with Checkpointer() as ck:
        ck.save(1, state)
        ck.wait()
        out = ck.restore(state)
    assert_same(out["t"], base.t().contiguous())
    assert_same(out["x"], torch.tensor([[1.0, 2.0]] * 3))
    assert_same(out["c"], torch.tensor([1 - 2j, 3 + 1j]))
    assert_same(out["slice"], base[1:3, ::2].contiguous())
    assert isinstance(out["p"], torch.nn.Parameter) and out["p"].requires_grad
    assert_same(out["p"], p)


def test_numpy_leaves_and_values():
    state = {"a": np.arange(6, dtype=np.int16).reshape(2, 3), "s": np.float32(2.5),
             "v": [1, 2.5, True, None, "x", b"y"], "big": (1 << 64) - 1}
    with Checkpointer() as ck:
        ck.save(1, state)
        ck.wait()
        out = ck.restore(state)
        np.testing.assert_array_equal(out["a"], state["a"])
        assert out["a"].dtype == np.int16 and out["s"] == np.float32(2.5) and out["s"].dtype == np.float32
        assert out["v"] == [1, 2.5, True, None, "x", b"y"] and out["big"] == (1 << 64) - 1
        zero = {"a": np.zeros((2, 3), np.int16), "s": np.float32(0), "v": [0, 0.0, False, None, "", b""], "big": 0}
        back = ck.restore(zero, in_place=True)
        assert back["a"] is zero["a"] and zero["a"][1, 2] == 5


def test_numpy_big_endian_and_fixed_width_text_leaves_and_structured_refused():
    be = np.arange(6, dtype=">f4").reshape(2, 3)
    be.reshape(-1)[1] = np.array(0x7FC00001, ">u4").view(">f4")  # a NaN payload survives the byte swap
    state = {"be": be, "u": np.array(["ab", "c"]), "b": np.array([b"xy", b"z"]), "sc": np.dtype(">f8").type(2.5)}

    def zeros():
        return {"be": np.zeros((2, 3), ">f4"), "u": np.zeros(2, "<U2"), "b": np.zeros(2, "S2"), "sc": np.float64(0)}
    with Checkpointer() as ck:
        ck.save(1, state)
        ck.wait()
        out = ck.restore(zeros())
        assert out["be"].dtype == np.dtype(">f4") and out["be"].tobytes() == be.tobytes()  # the target's byte order
        assert out["u"].tolist() == ["ab", "c"] and out["b"].tolist() == [b"xy", b"z"] and out["sc"] == 2.5
        plain = ck.restore(None)  # untargeted: native order, same values
        assert plain["be"].dtype == np.float32 and plain["be"].view(np.uint32).tolist() == \
            be.astype("<f4").view(np.uint32).tolist()
        into = zeros()
        ck.restore(into, in_place=True)
        assert into["be"].tobytes() == be.tobytes() and into["u"].tolist() == ["ab", "c"]
        with pytest.raises(UnsupportedLeafError, match=r"s: numpy structured or sub-array dtype"):
            ck.save(2, {"s": np.zeros(2, dtype=[("a", "<i4"), ("f", "<f4")])})
        with pytest.raises(TargetMismatchError, match=r"u: saved numpy array str\[2\]\[2\], target is ndarray <U1"):
            ck.restore({**zeros(), "u": np.zeros(2, "<U1")})
        assert ck.latest_step() == 1

# ----------------------------------------------------------------------------------- models and optimizers
def make_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 3))
    model[3].to(torch.bfloat16)
    model.register_buffer("counter", torch.tensor(0, dtype=torch.int64))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, opt, x):
    h = model[2](model[1](model[0](x)))
    loss = model[3](h.to(torch.bfloat16)).float().square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        model.counter.add_(1)


def test_model_and_optimizer_round_trip_and_bit_identical_continuation():
    model, opt = make_model(0)
    xs = torch.randn(4, 8, 6, generator=torch.Generator().manual_seed(1))
    for x in xs[:2]:
        train_step(model, opt, x)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 2}
    with Checkpointer() as ck:
        ck.save(2, state)
        ck.wait()
        m = manifest_of(ck)
        paths = [a.path for a in m.arrays]
        assert "model/0.weight" in paths and "model/counter" in paths and "optim/state/0/exp_avg" in paths
        assert m.framework == "torch"
        # a fresh model and optimizer (different init, one step so the optimizer has state) as the target
        model2, opt2 = make_model(99)
        train_step(model2, opt2, xs[3])
        out = ck.restore({"model": model2.state_dict(), "optim": opt2.state_dict(), "epoch": 0})
    model2.load_state_dict(out["model"])
    opt2.load_state_dict(out["optim"])
    assert out["epoch"] == 2
    assert out["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)  # tuples stay tuples under a target
    for x in xs[2:]:
        train_step(model, opt, x)
        train_step(model2, opt2, x)
    for (k, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert_same(a, b)
    for a, b in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values()):
        for k in a:
            assert_same(a[k], b[k])


def test_in_place_restore_updates_the_model_itself():
    model, opt = make_model(0)
    train_step(model, opt, torch.randn(8, 6))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer() as ck:
        ck.save(1, {"model": model.state_dict()})
        ck.wait()
        train_step(model, opt, torch.randn(8, 6))
        ptr = model[0].weight.data_ptr()
        target = {"model": model.state_dict()}
        out = ck.restore(target, in_place=True)
    assert model[0].weight.data_ptr() == ptr and out["model"]["0.weight"] is target["model"]["0.weight"]
    for k, v in model.state_dict().items():
        assert_same(v, saved[k])


def test_restore_without_target_loads_into_fresh_objects():
    model, opt = make_model(0)
    train_step(model, opt, torch.randn(8, 6))
    with Checkpointer() as ck:
        ck.save(1, {"model": model.state_dict(), "optim": opt.state_dict(), "ints": {3: 1, 1: 2}})
        ck.wait()
        out = ck.restore()
    assert list(out["optim"]["state"]) == [0, 1, 2, 3, 4, 5] and out["ints"] == {3: 1, 1: 2}
    assert out["optim"]["param_groups"][0]["params"] == [0, 1, 2, 3, 4, 5]
    model2, opt2 = make_model(5)
    model2.load_state_dict(out["model"])
    opt2.load_state_dict(out["optim"])
    for (k, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert_same(a, b)


def test_meta_device_target_gives_new_cpu_tensors():
    state = {"w": torch.randn(4, 4, dtype=torch.float64), "b": torch.arange(3, dtype=torch.int32)}
    with Checkpointer() as ck:
        ck.save(1, state)
        ck.wait()
        target = {k: torch.empty_like(v, device="meta") for k, v in state.items()}
        out = ck.restore(target, in_place=True)
    for k in state:
        assert out[k].device.type == "cpu"
        assert_same(out[k], state[k])


# ----------------------------------------------------------------------------------------------- RNG state
def test_generators_and_rng_states_resume_the_same_stream():
    g = torch.Generator().manual_seed(5)
    torch.rand(10, generator=g)
    torch.manual_seed(11)
    state = {"gen": g, "rng": PerRank(torch.get_rng_state()), "plain_rng": torch.get_rng_state()}
    with Checkpointer() as ck:
        ck.save(1, state)
        ck.wait()
        expect_g, expect_global = torch.rand(5, generator=g), torch.rand(5)
        torch.rand(100, generator=g)
        m = manifest_of(ck)
        assert {a.path: (a.kind, a.shape) for a in m.arrays} == {
            "gen": ("torch_rng", (1, 5056)), "rng": ("per_rank", (1, 5056)), "plain_rng": ("torch", (5056,))}
        out = ck.restore({"gen": g, "rng": PerRank(torch.empty(5056, dtype=torch.uint8)),
                          "plain_rng": torch.empty(5056, dtype=torch.uint8)})
        assert out["gen"] is g
        assert_same(torch.rand(5, generator=g), expect_g)
        torch.set_rng_state(out["rng"])
        assert_same(torch.rand(5), expect_global)
        assert_same(out["plain_rng"], state["plain_rng"])
        untargeted = ck.restore()
        assert_same(untargeted["rng"], state["rng"].tensor)


# --------------------------------------------------------------------------- consistency under in-place updates
def big_state():
    torch.manual_seed(3)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])  # 8 MiB of parameters
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    return model, opt


def snapshot_of(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()})


def check_restored(ck, model, opt, expected):
    out = ck.restore({"model": model.state_dict(), "optim": opt.state_dict()})
    for k, v in expected[0].items():
        assert_same(out["model"][k], v)
    for i, s in expected[1].items():
        for k, v in s.items():
            assert_same(out["optim"]["state"][i][k], v)


def test_default_save_is_not_torn_by_an_optimizer_step_right_after_it():
    model, opt = big_state()
    with Checkpointer(Config(workers=2, chunk_bytes=1 << 20)) as ck:
        for step in range(3):
            expected = snapshot_of(model, opt)
            h = ck.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
            assert h.local_done()  # safe by default: save() returned after the host copy
            model(torch.randn(4, 512)).sum().backward()
            opt.step()  # mutates every saved parameter and moment in place
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-1)
            ck.wait()
            check_restored(ck, model, opt, expected)


def test_deferred_reads_with_wait_for_reads_before_the_update():
    model, opt = big_state()
    with Checkpointer(Config(chunk_bytes=1 << 20), defer_reads=True) as ck:
        ck.wait_for_reads()  # nothing pending: a no-op
        for step in range(3):
            expected = snapshot_of(model, opt)
            ck.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
            model(torch.randn(4, 512)).sum().backward()  # forward/backward overlap the copy: they write no state
            ck.wait_for_reads()
            opt.step()
            ck.wait()
            check_restored(ck, model, opt, expected)


# ------------------------------------------------------------------------------------------------- errors
def test_target_mismatches_name_the_path():
    state = {"model": {"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}, "n": 1,
             "rng": PerRank(torch.zeros(4, dtype=torch.uint8))}
    with Checkpointer() as ck:
        ck.save(1, state)
        ck.wait()

        def bad(**change):
            t = {"model": dict(state["model"]), "n": 1, "rng": PerRank(torch.zeros(4, dtype=torch.uint8))}
            for k, v in change.items():
                if v is None:
                    t["model"].pop(k)
                else:
                    t["model"][k] = v
            return t

        with pytest.raises(TargetMismatchError, match=r"model/w: saved shape \(2, 3\), target shape \(3, 2\)"):
            ck.restore(bad(w=torch.zeros(3, 2)))
        with pytest.raises(TargetMismatchError, match="model/b: saved dtype bfloat16, target dtype float16"):
            ck.restore(bad(b=torch.zeros(3, dtype=torch.float16)))
        with pytest.raises(TargetMismatchError, match="model/w: saved in step 1 but missing from the target"):
            ck.restore(bad(w=None))
        with pytest.raises(TargetMismatchError, match="model/extra: in the target but not in step 1"):
            ck.restore(bad(extra=torch.zeros(1)))
        with pytest.raises(TargetMismatchError, match=r"model/w: saved torch array float32\[2, 3\], target is a float"):
            ck.restore(bad(w=3.0))
        t = bad()
        t["n"] = torch.zeros(2)
        with pytest.raises(TargetMismatchError, match="n: saved the value 1"):
            ck.restore(t)
        t = bad()
        t["rng"] = torch.zeros(4, dtype=torch.uint8)
        with pytest.raises(TargetMismatchError, match="rng: saved a per-process per_rank array"):
            ck.restore(t)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_unsupported_leaves_name_the_path():
    with Checkpointer() as ck:
        with pytest.raises(UnsupportedLeafError, match=r"a/b: leaf of type builtins.object"):
            ck.save(1, {"a": {"b": object()}})
        with pytest.raises(UnsupportedLeafError, match=r"h: torch dtype torch.complex32"):
            ck.save(1, {"h": torch.zeros(2, dtype=torch.complex32)})
        with pytest.raises(UnsupportedLeafError, match=r"d: dict key \(1, 2\)"):
            ck.save(1, {"d": {(1, 2): 3}})
        with pytest.raises(UnsupportedLeafError, match="s: "):
            ck.save(1, {"s": torch.zeros(3, 3).to_sparse()})
        ck.save(1, {"ok": torch.zeros(1)})  # the failed calls reserved nothing
        ck.wait()
        assert ck.all_steps() == [1]


def test_steps_retention_and_close():
    with Checkpointer(Config(keep=2)) as ck:
        assert ck.latest_step() is None
        for s in (1, 2, 5):
            ck.save(s, {"x": torch.full((2,), float(s))})
        ck.wait()
        assert ck.latest_step() == 5 and ck.all_steps() == [2, 5]
        assert_same(ck.restore({"x": torch.zeros(2)}, step=2)["x"], torch.full((2,), 2.0))
        with pytest.raises(StepError, match="step 5 is not newer"):
            ck.save(5, {"x": torch.zeros(2)})
        with pytest.raises(StepNotFoundError, match="step 1 is not held"):
            ck.restore({"x": torch.zeros(2)}, step=1)
    with pytest.raises(ClosedError):
        ck.save(9, {"x": torch.zeros(2)})


def test_persistent_dir_is_refused_at_construction(tmp_path):
    d = tmp_path / "persistent"
    with pytest.raises(ConfigError, match=r"Config.persistent_dir=.*the torch front end has no persistent tier"):
        Checkpointer(Config(persistent_dir=str(d), persistent_interval=1))
    import jaxckpt
    with jaxckpt.Checkpointer(Config(persistent_dir=str(d))) as jck:  # sharing a JAX engine that has one: refused too
        with pytest.raises(ConfigError, match="the torch front end has no persistent tier"):
            Checkpointer(engine=jck.engine)
    assert not d.exists()


def test_jaxckpt_imports_no_torch():
    code = "import sys, jaxckpt, jaxckpt.backends, jaxckpt.backends.memory; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ------------------------------------------------------------------------------------------- DTensor boxes
def test_shard_box_matches_torch_for_every_coordinate():
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset  # torch's own arithmetic

    cases = [((8, 6), (2,), [Shard(0)]), ((5, 7), (2,), [Shard(1)]), ((9, 4), (4,), [Shard(0)]),
             ((3, 2), (4,), [Shard(0)]), ((10, 6), (2, 3), [Shard(0), Shard(1)]),
             ((10, 6), (2, 3), [Shard(0), Shard(0)]), ((7, 5), (3, 2), [Shard(1), Shard(1)]),
             ((6,), (2, 2), [Replicate(), Shard(0)]), ((4, 4), (2, 2), [Replicate(), Replicate()]),
             ((5, 3, 2), (2, 2, 2), [Shard(2), Shard(0), Shard(2)]), ((), (2,), [Replicate()])]
    for shape, mesh_shape, placements in cases:
        for coord in np.ndindex(*mesh_shape):
            local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
            box = dt.shard_box(shape, mesh_shape, coord, placements)
            assert box.shape == tuple(local), (shape, mesh_shape, placements, coord)
            if box.size:
                assert box.start == tuple(offset), (shape, mesh_shape, placements, coord)


# --------------------------------------------------------------------------------------- store coordinator
def test_torch_store_coordinator_set_get_timeout_and_prefixes():
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30),
                           wait_for_workers=False)
    a = TorchStoreCoordinator(server, 0, 2, prefix="g1")
    b = TorchStoreCoordinator(server, 1, 2, prefix="g1")
    other = TorchStoreCoordinator(server, 1, 2, prefix="g2")
    assert a.try_get("k") is None
    a.set("k", b"v1")
    assert b.get("k", 5.0) == b"v1" and b.try_get("k") == b"v1"
    assert other.try_get("k") is None
    with pytest.raises(TimeoutError, match="'missing' not set within"):
        b.get("missing", 0.2)


# ------------------------------------------------------------------------------ 2 ranks, gloo, DTensor state
def full_tensors(step: int) -> dict[str, torch.Tensor]:
    """The global tensors of the 2-rank test, identical on every rank; step 2 is step 1 with every bit pattern
    incremented (so NaN payloads change too)."""
    g = torch.Generator().manual_seed(1234)
    out = {"w": random_tensor((8, 6), torch.float32, g), "u": random_tensor((4, 5), torch.bfloat16, g),
           "m": random_tensor((9, 3), torch.float64, g), "r": random_tensor((6, 4), torch.float16, g),
           "x2d": random_tensor((4, 7), torch.int32, g), "plain": random_tensor((7,), torch.int64, g),
           "mu": random_tensor((9, 3), torch.float32, g)}
    if step == 2:
        out = {k: bump(v.clone()) for k, v in out.items()}
    return out


def bump(t: torch.Tensor) -> torch.Tensor:
    """Add one to every element's bit pattern, in place."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    t.view(ints).add_(1)
    return t


def two_rank_worker(job_id: str) -> dict:
    """One rank of the 2-rank DTensor test (runs in a process started by jaxckpt.testing.launch)."""
    from torch.distributed.tensor import DTensor, distribute_tensor, init_device_mesh
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from jaxckpt.tools.node import node_info

    info = node_info()
    rank, world = info.process_id, info.process_count
    dist.init_process_group("gloo", init_method=f"tcp://{info.coordinator}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    done: list[str] = []
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("x",))
        mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
        where = {"w": (mesh, [Shard(0)]), "u": (mesh, [Shard(1)]), "m": (mesh, [Shard(0)]),
                 "r": (mesh, [Replicate()]), "x2d": (mesh2, [Replicate(), Shard(1)]), "mu": (mesh, [Shard(0)])}

        def state_of(full: dict, layout: dict) -> dict:
            d = {k: distribute_tensor(full[k], *layout[k], src_data_rank=None) for k in layout}
            return {"model": {"w": d["w"], "u": d["u"], "m": d["m"], "r": d["r"], "x2d": d["x2d"],
                              "plain": full["plain"]},
                    "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": d["mu"]}}},
                    "gen": torch.Generator().manual_seed(100 + rank), "rng": PerRank(torch.full((5,), rank)),
                    "epoch": 4, "who": f"rank{rank}"}

        def check(out: dict, full: dict, layout: dict, gen_seed: int) -> None:
            for k, v in list(out["model"].items()) + [("mu", out["optim"]["state"][0]["exp_avg"])]:
                want = full[k]
                if isinstance(v, DTensor):
                    shape, offset = compute_local_shape_and_global_offset(want.shape, v.device_mesh, v.placements)
                    assert dt.local_tensor(k, v)[0].start == tuple(offset) or not np.prod(shape), k
                    sl = tuple(slice(o, o + s) for o, s in zip(offset, shape))
                    assert_same(v.to_local(), want[sl].contiguous())
                    assert v.placements == tuple(layout[k][1]) and v.device_mesh is layout[k][0], k
                else:
                    assert_same(v, want)
            assert_same(out["rng"], torch.full((5,), rank))
            fresh = torch.Generator().manual_seed(gen_seed)
            assert_same(torch.rand(4, generator=out["gen"]), torch.rand(4, generator=fresh))
            assert out["epoch"] == 4 and out["who"] == f"rank{rank}"

        cfg = Config(job_id=job_id, keep=2, commit_timeout_s=30.0, peer_timeout_s=20.0)
        with Checkpointer(cfg) as ck:
            assert (ck.process_index, ck.process_count) == (rank, world)
            s1 = state_of(full_tensors(1), where)
            ck.save(1, s1)
            # in-place updates right after save(): the snapshot must not see them
            for k in ("w", "u", "m", "r", "x2d"):
                bump(s1["model"][k].to_local())
            bump(s1["optim"]["state"][0]["exp_avg"].to_local())
            bump(s1["model"]["plain"])
            ck.save(2, s1)
            ck.wait()
            assert ck.latest_step() == 2 and ck.all_steps() == [1, 2]
            done.append("commit")

            # same placements, new tensors, step 1
            out = ck.restore(state_of({k: torch.zeros_like(v) for k, v in full_tensors(1).items()}, where), step=1)
            check(out, full_tensors(1), where, 100 + rank)
            done.append("restore-new")

            # same placements, in place, step 2
            target = state_of({k: torch.zeros_like(v) for k, v in full_tensors(1).items()}, where)
            out = ck.restore(target, in_place=True)
            assert out["model"]["w"] is target["model"]["w"]
            check(out, full_tensors(2), where, 100 + rank)
            done.append("restore-in-place")

            # other placements: the planner reshards, reading the other rank's chunks from its peer server
            where_t = {"w": (mesh, [Shard(1)]), "u": (mesh, [Replicate()]), "m": (mesh2, [Replicate(), Shard(0)]),
                       "r": (mesh, [Shard(0)]), "x2d": (mesh, [Shard(0)]), "mu": (mesh, [Replicate()])}
            out = ck.restore(state_of({k: torch.zeros_like(v) for k, v in full_tensors(1).items()}, where_t), step=1)
            check(out, full_tensors(1), where_t, 100 + rank)
            done.append("restore-resharded")
            dist.barrier()  # keep serving snapshots until every rank has finished reading
        return {"rank": rank, "done": done}
    finally:
        dist.destroy_process_group()


def test_two_ranks_dtensor_save_restore_and_reshard():
    from jaxckpt.tools.launcher import expect_ok, launch

    results = launch(two_rank_worker, nodes=1, procs_per_node=2, distributed=False, args=["torch-2r"], timeout=120)
    values = expect_ok(results)
    for rank, v in enumerate(values):
        assert v == {"rank": rank, "done": ["commit", "restore-new", "restore-in-place", "restore-resharded"]}


def four_to_two_worker(job_id: str) -> dict:
    """4 ranks save DTensors on a 2x2 mesh; ranks 0-1 restore them onto a 1-d mesh of their own, reading the
    chunks ranks 2-3 hold from their peer servers (ranks 2-3 hold nothing of the new layout and only serve)."""
    from torch.distributed.tensor import DeviceMesh, distribute_tensor, init_device_mesh
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from jaxckpt.tools.node import node_info

    info = node_info()
    rank, world = info.process_id, info.process_count
    dist.init_process_group("gloo", init_method=f"tcp://{info.coordinator}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        mesh4 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        mesh2 = DeviceMesh("cpu", [0, 1], mesh_dim_names=("x",))  # every rank builds it; ranks 2-3 are outside
        full = full_tensors(1)
        saved = {"w": [Shard(0), Shard(1)], "m": [Replicate(), Shard(0)], "u": [Shard(1), Replicate()],
                 "x2d": [Shard(1), Shard(0)]}
        wanted = {"w": [Shard(1)], "m": [Replicate()], "u": [Shard(0)], "x2d": [Shard(1)]}
        with Checkpointer(Config(job_id=job_id, commit_timeout_s=30.0, peer_timeout_s=20.0)) as ck:
            ck.save(7, {k: distribute_tensor(full[k], mesh4, pl, src_data_rank=None) for k, pl in saved.items()})
            ck.wait()
            target = {k: distribute_tensor(torch.zeros_like(full[k]), mesh2, pl, src_data_rank=None)
                      for k, pl in wanted.items()}
            out = ck.restore(target)
            held = 0
            for k, v in out.items():
                if mesh2.get_coordinate() is None:
                    continue
                shape, offset = compute_local_shape_and_global_offset(full[k].shape, mesh2, v.placements)
                sl = tuple(slice(o, o + s) for o, s in zip(offset, shape))
                assert_same(v.to_local(), full[k][sl].contiguous())
                held += v.to_local().numel()
            dist.barrier()  # ranks 2-3 keep serving until 0-1 are done
        return {"rank": rank, "elements": held}
    finally:
        dist.destroy_process_group()


def test_four_ranks_save_two_rank_mesh_restores_resharded():
    from jaxckpt.tools.launcher import expect_ok, launch

    values = expect_ok(launch(four_to_two_worker, nodes=2, procs_per_node=2, distributed=False, args=["torch-4to2"],
                              timeout=150))
    # every element of the 4 arrays is restored on the 2-rank mesh: w (8,6) and x2d (4,7) split by columns
    # (x2d 4+3), u (4,5) by rows, m (9,3) whole on both; ranks 2-3 are outside it
    assert [v["elements"] for v in values] == [24 + 16 + 10 + 27, 24 + 12 + 10 + 27, 0, 0]


def test_example_recovers_bit_identically():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXCKPT_")}
    proc = subprocess.run([sys.executable, os.path.join(root, "examples", "train_torch.py"), "--steps", "12",
                           "--fail-at", "5", "--hidden", "64"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "loss curve bit-identical:  yes" in out and "final state bit-identical: yes" in out, out
