"""PyTorch DCP through jaxckpt's stores: ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` with JaxckptWriter and
JaxckptReader, unchanged DCP code on top. Single process: every dtype bit for bit, non-tensor values (their codec:
tests/test_torch_dcp_values.py), async_save, checkpoint ids, a corrupted chunk, the metadata codec that replaces
DCP's pickle, snapshots that outlive their process (store="shm"). Real gloo processes: a DTensor-sharded model and its AdamW state saved on 2 ranks and
loaded resharded (Shard(0) -> Replicate, -> another mesh), a corrupted chunk raising on every rank, and 2 ranks'
shm snapshots loaded by one process after they exited."""
import datetime
import os
import shutil
import signal
import re
import subprocess
import sys
import uuid

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from jaxckpt import Config
from jaxckpt.backends.agent import protocol as proto
from jaxckpt.torch import JaxckptReader, JaxckptWriter
from jaxckpt.torch import dcp_metadata
from jaxckpt.torch.dcp import checkpoint_step
from jaxckpt.torch.dcp_metadata import Locator, StorageIndex
from jaxckpt.torch.dtypes import DTYPE_NAMES
from jaxckpt.errors import (ChecksumError, ConfigError, CoordinationError, ManifestError, PlanError, StepError,
                            StepNotFoundError)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def raw(t: torch.Tensor) -> bytes:
    """The bytes of a tensor's values (sign bits and NaN payloads included)."""
    t = t.detach().contiguous().reshape(-1)
    return bytes(t.view(torch.uint8).numpy()) if t.numel() else b""


def assert_same(got, want, where=""):
    if isinstance(want, dict):
        assert set(got) == set(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}/{i}")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, where
        assert raw(got) == raw(want), f"{where}: bytes differ"
    else:
        assert got == want and type(got) is type(want), where


def random_tensor(shape, dtype, gen):
    n = int(torch.Size(shape).numel())
    if dtype == torch.bool:  # a bool byte other than 0/1 is not a bool torch keeps as is
        return torch.randint(0, 2, shape, generator=gen).bool()
    bits = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=gen)
    return bits.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


def zeros_like_tree(x):
    if isinstance(x, dict):
        return {k: zeros_like_tree(v) for k, v in x.items()}
    if isinstance(x, list):
        return [zeros_like_tree(v) for v in x]
    if isinstance(x, torch.Tensor):
        return torch.zeros_like(x.detach().contiguous())
    return x


def every_dtype_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    tensors = {f"t_{str(d).split('.')[-1]}": random_tensor((3, 5), d, g) for d in DTYPE_NAMES}
    base = random_tensor((4, 6), torch.float32, g)
    return {"model": {**tensors, "transposed": base.t(), "strided": base[::2, 1::2], "scalar": torch.tensor(-0.0),
                      "empty": torch.empty(0, 3), "grad": torch.ones(2, requires_grad=True)},
            "extra": {"epoch": 4, "name": "run-a", "betas": [0.9, 0.999]}}


# ---------------------------------------------------------------------------------------------- single process
def test_save_load_every_dtype_bit_for_bit():
    state = every_dtype_state()
    with JaxckptWriter(config=Config(job_id="dcp-dtypes")) as w:
        dcp.save(state, storage_writer=w, checkpoint_id=3)
        assert w.store.steps() == [3]
        target = zeros_like_tree(state)
        target["extra"] = {"epoch": 0, "name": "", "betas": [0.0, 0.0]}
        dcp.load(target, storage_reader=JaxckptReader(store=w.store), checkpoint_id="step_3")
        assert_same(target, state)


def test_async_save_is_the_state_at_the_call():
    state = every_dtype_state(1)
    expected = zeros_like_tree(state)
    for k, v in state["model"].items():
        expected["model"][k].copy_(v.detach())
    with JaxckptWriter(config=Config(job_id="dcp-async", keep=2)) as w:
        future = dcp.async_save(state, storage_writer=w, checkpoint_id="jaxckpt://7")
        with torch.no_grad():
            state["model"]["t_float32"].add_(1.0)  # right after the call: DCP's stager copied already
        future.result(timeout=60)
        assert w.store.steps() == [7]
        target = zeros_like_tree(expected)
        dcp.load(target, storage_reader=JaxckptReader(store=w.store))  # no id: the newest checkpoint
        assert_same(target["model"], expected["model"])
        assert target["extra"] == expected["extra"]


def test_checkpoint_ids():
    assert [checkpoint_step(x) for x in (0, 12, "12", "step_12", "step-12", "jaxckpt://12")] == [0, 12, 12, 12, 12, 12]
    for bad in (-1, True, "/ckpt/step_1", "step_", "12a", None, 1.0):
        with pytest.raises(StepError, match="is not a jaxckpt checkpoint id"):
            checkpoint_step(bad)
    assert JaxckptWriter.validate_checkpoint_id("step_4") and not JaxckptReader.validate_checkpoint_id("/tmp/x")
    state = {"w": torch.ones(3)}
    with JaxckptWriter(config=Config(job_id="dcp-ids")) as w:
        # DCP passes the id to reset() before anything else: the error is ours, unwrapped
        with pytest.raises(StepError, match=r"checkpoint_id '/ckpt/run1' is not a jaxckpt checkpoint id"):
            dcp.save(state, storage_writer=w, checkpoint_id="/ckpt/run1")
        with pytest.raises(CheckpointException) as e:
            dcp.save(state, storage_writer=w)  # no id at all: a step must be named
        err = e.value.failures[0][0]
        assert isinstance(err, StepError) and "needs a checkpoint_id" in str(err)
        assert w.store.steps() == []
        dcp.save(state, storage_writer=w, checkpoint_id=1)
        with pytest.raises(CheckpointException) as e:
            dcp.load({"w": torch.zeros(3)}, storage_reader=JaxckptReader(store=w.store), checkpoint_id=9)
        assert "checkpoint '9' (step 9) is not held by the memory store of rank 0" in str(e.value.failures[0][0])
        assert "it holds steps [1]" in str(e.value.failures[0][0])


def test_protection_and_the_persistent_tier_are_refused_not_ignored(tmp_path):
    """A DCP checkpoint lives in the store only: asking for protection or a persistent directory is an error at
    construction (before any save), with a config or through a given store, for the writer and the reader."""
    from jaxckpt.backends.memory import MemoryStore

    for cfg, what in ((Config(job_id="dcp-tiers", protection="xor-group"), "Config.protection='xor-group'"),
                      (Config(job_id="dcp-tiers", persistent_dir=str(tmp_path)),
                       f"Config.persistent_dir={str(tmp_path)!r}")):
        for make in (lambda: JaxckptWriter(config=cfg), lambda: JaxckptReader(config=cfg),
                     lambda: JaxckptWriter(store=MemoryStore(cfg))):
            with pytest.raises(ConfigError, match=re.escape(what) + ": DCP checkpoints"):
                make()
    assert not any(tmp_path.iterdir())  # nothing was written there


def test_saving_an_id_again_replaces_it_and_keep_bounds_the_store():
    with JaxckptWriter(config=Config(job_id="dcp-keep", keep=2)) as w:
        r = JaxckptReader(store=w.store)
        for step, value in ((1, 1.0), (1, 2.0), (2, 3.0), (3, 4.0)):
            dcp.save({"w": torch.full((4,), value)}, storage_writer=w, checkpoint_id=step)
        assert w.store.steps() == [2, 3]
        for step, value in ((2, 3.0), (3, 4.0)):
            target = {"w": torch.zeros(4)}
            dcp.load(target, storage_reader=r, checkpoint_id=step)
            assert_same(target["w"], torch.full((4,), value))


def test_corrupted_chunk_raises_checksum_error():
    state = {"a": torch.arange(16, dtype=torch.float32), "b": torch.arange(8, dtype=torch.int64)}
    for verify in (True, False):
        with JaxckptWriter(config=Config(job_id="dcp-corrupt", verify_on_restore=verify)) as w:
            dcp.save(state, storage_writer=w, checkpoint_id=5)
            md = JaxckptReader(store=w.store, checkpoint_id=5).read_metadata()
            loc = md.storage_data.locators[MetadataIndex("b", [0])]
            w.store.slot_bytes(5)[loc.offset + 3] ^= 0x40  # one bit of b's chunk in the store's memory
            target = {"a": torch.zeros(16), "b": torch.zeros(8, dtype=torch.int64)}
            if verify:
                with pytest.raises(CheckpointException) as e:
                    dcp.load(target, storage_reader=JaxckptReader(store=w.store), checkpoint_id=5)
                err = e.value.failures[0][0]
                assert isinstance(err, ChecksumError)
                assert f"b: chunk at byte {loc.offset} of rank 0's slot of checkpoint step 5 fails its crc32c" in \
                    str(err)
            else:  # without the check the damaged bytes come through: the check is what caught it
                dcp.load(target, storage_reader=JaxckptReader(store=w.store), checkpoint_id=5)
                assert raw(target["a"]) == raw(state["a"]) and raw(target["b"]) != raw(state["b"])


def test_metadata_codec_round_trip_and_refusals():
    props = TensorProperties(dtype=torch.bfloat16, requires_grad=True, memory_format=torch.channels_last)
    md = Metadata(
        state_dict_metadata={
            "m.w": TensorStorageMetadata(props, torch.Size([4, 6]),
                                         [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 6])),
                                          ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 6]))]),
            "extra.epoch": BytesStorageMetadata()},
        planner_data={"m.w": ("m", "w"), "extra.epoch": ("extra", "epoch"), "o.0": ("o", 0)},
        storage_meta=StorageMeta(checkpoint_id="step_3", save_id="s", modules=["a"]), version="1.0.0")
    index = StorageIndex("abc", 3, 2, {MetadataIndex("m.w", [0, 0], 0): Locator(0, 0, 24, 7),
                                       MetadataIndex("m.w", [2, 0], 1): Locator(1, 64, 24, 8),
                                       MetadataIndex("extra.epoch"): Locator(0, 128, 10, 9, "msgpack")})
    import msgpack
    back = dcp_metadata.decode(msgpack.unpackb(msgpack.packb(dcp_metadata.encode(md, index))), "test")
    assert back.state_dict_metadata == md.state_dict_metadata and back.planner_data == md.planner_data
    assert back.planner_data["o.0"] == ("o", 0) and back.storage_meta == md.storage_meta and back.version == "1.0.0"
    assert back.storage_data == index
    for bad, match in (
            ({"planner_data": {"x": object()}}, r"planner_data\['x'\] = <object .*only a tuple of str and int keys"),
            ({"planner_data": [1]}, r"planner_data is a builtins.list"),
            ({"state_dict_metadata": {"z": object()}}, r"z: DCP storage metadata a builtins.object cannot be stored "
                                                      r"without pickle")):
        with pytest.raises(ManifestError, match=match):
            dcp_metadata.encode(Metadata(**{**md.__dict__, **bad}), index)
    sparse = TensorStorageMetadata(TensorProperties(layout=torch.sparse_coo), torch.Size([2]), [])
    with pytest.raises(ManifestError, match="s: tensor layout torch.sparse_coo cannot be stored"):
        dcp_metadata.encode(Metadata({"s": sparse}), index)
    wire = dcp_metadata.encode(md, index)
    wire["storage"]["chunks"][0][3] = 5
    with pytest.raises(ManifestError, match=r"chunk of 'm.w': rank 5 is outside the 2 ranks that saved"):
        dcp_metadata.decode(wire, "test")
    for row, encoding, says in ((0, "msgpack", "encoding 'msgpack' for a tensor"),
                                (2, "raw", "encoding 'raw' for a non-tensor value")):
        wire = dcp_metadata.encode(md, index)
        wire["storage"]["chunks"][row][7] = encoding  # a value's bytes read as a tensor's, or the other way
        with pytest.raises(ManifestError, match=says):
            dcp_metadata.decode(wire, "test")


class _OpaquePlanner(DefaultSavePlanner):
    """A custom planner putting an object DCP would pickle into the metadata."""

    def create_global_plan(self, all_plans):
        plans, md = super().create_global_plan(all_plans)
        md.planner_data = {"model.w": object()}
        return plans, md


def test_metadata_that_needs_pickle_is_refused_and_nothing_is_committed():
    with JaxckptWriter(config=Config(job_id="dcp-opaque")) as w:
        with pytest.raises(CheckpointException) as e:
            dcp.save({"model": {"w": torch.ones(2)}}, storage_writer=w, checkpoint_id=1, planner=_OpaquePlanner())
        err = e.value.failures[0][0]
        assert isinstance(err, ManifestError) and "planner_data['model.w']" in str(err)
        assert w.store.steps() == []  # the coordinator's slot was aborted: no checkpoint without metadata


def _stop_agent(config: Config) -> None:
    d = proto.agent_dir(config)
    if not proto.stop_agent(d, config.job_id, timeout_s=20):
        pid = proto.read_pid_file(d)
        if pid is not None:
            try:
                os.kill(pid[0], signal.SIGKILL)
            except ProcessLookupError:
                pass
    shutil.rmtree(d, ignore_errors=True)


SAVE_IN_CHILD = """
import sys, torch, warnings
warnings.filterwarnings("ignore")
import torch.distributed.checkpoint as dcp
from jaxckpt import Config
from jaxckpt.torch import JaxckptWriter
sys.path.insert(0, sys.argv[3])
from test_torch_dcp import every_dtype_state
with JaxckptWriter(config=Config(store="shm", job_id=sys.argv[1], shm_dir=sys.argv[2])) as w:
    dcp.save(every_dtype_state(5), storage_writer=w, checkpoint_id=11)
"""


def test_shm_snapshot_outlives_the_saving_process():
    config = Config(store="shm", job_id=f"dcp-shm-{uuid.uuid4().hex[:6]}",
                    shm_dir=f"/dev/shm/jaxckpt-test-dcp-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    try:
        subprocess.run([sys.executable, "-c", SAVE_IN_CHILD, config.job_id, config.shm_dir,
                        os.path.dirname(__file__)], check=True, timeout=120)
        state = every_dtype_state(5)
        target = zeros_like_tree(state)
        target["extra"] = {}
        with JaxckptReader(config=config) as r:
            dcp.load(target, storage_reader=r, checkpoint_id=11)
        assert_same(target["model"], state["model"])
    finally:
        _stop_agent(config)


def test_the_environment_reaches_a_dcp_store(tmp_path, monkeypatch):
    """A writer or reader made from a Config takes the JAXCKPT_* environment as a Checkpointer does: a site's
    JAXCKPT_SHM_ROOT puts the DCP job's agent under that root (it went to /dev/shm), JAXCKPT_KEEP bounds it."""
    job = f"dcp-env-{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv("JAXCKPT_SHM_ROOT", str(tmp_path))
    monkeypatch.setenv("JAXCKPT_KEEP", "1")
    config = Config(store="shm", job_id=job)
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "n": torch.arange(5, dtype=torch.int64)}
    try:
        with JaxckptWriter(config=config) as w:
            assert w.config.shm_root == str(tmp_path) and w.config.keep == 1, w.config
            assert os.path.dirname(w.store.directory) == str(tmp_path), w.store.directory
            for step in (1, 2):
                dcp.save(state, storage_writer=w, checkpoint_id=step)
            assert w.store.steps() == [2]
        target = {"w": torch.zeros(3, 4), "n": torch.zeros(5, dtype=torch.int64)}
        with JaxckptReader(config=config) as r:
            assert os.path.dirname(r.store.directory) == str(tmp_path), r.store.directory
            dcp.load(target, storage_reader=r, checkpoint_id=2)
        assert_same(target, state)
    finally:
        _stop_agent(config.with_env())
    assert not any(p.name.startswith("jaxckpt-") for p in tmp_path.iterdir())


# ------------------------------------------------------------------------------ 2 ranks, gloo, DTensor state
def _init(rank_world_coord):
    rank, world, coord = rank_world_coord
    dist.init_process_group("gloo", init_method=f"tcp://{coord}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def _model(mesh, placements_of, seed=0):
    """Two Linear layers whose parameters are DTensors on ``mesh`` (placements by ndim), and AdamW."""
    from torch.distributed.tensor import distribute_tensor
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))
    for mod in model:
        for name, p in list(mod.named_parameters(recurse=False)):
            dt = distribute_tensor(p.detach(), mesh, placements_of(p.ndim), src_data_rank=None)
            mod.register_parameter(name, torch.nn.Parameter(dt))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _train_step(model, seed):
    from torch.distributed.tensor import distribute_tensor
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        full = torch.randn(p.shape, generator=g)  # the same on every rank
        p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)


def _full(sd):
    """Flat {fqn: full tensor or value} of a DCP state dict (DTensors gathered: a collective)."""
    from torch.distributed.tensor import DTensor
    out = {}

    def walk(x, path):
        if isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k], f"{path}.{k}" if path else str(k))
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, f"{path}.{i}")
        elif isinstance(x, DTensor):
            out[path] = (x.full_tensor(), tuple(x.placements), x.device_mesh.shape)
        elif isinstance(x, torch.Tensor):
            out[path] = (x.detach().clone(), None, None)
        else:
            out[path] = (x, None, None)
    walk(sd, "")
    return out


def _check_loaded(got, want, placements_of, mesh):
    assert set(got) == set(want)
    for k, (t, pl, mshape) in want.items():
        g, gpl, gmesh = got[k]
        if isinstance(t, torch.Tensor):
            assert g.dtype == t.dtype and g.shape == t.shape and raw(g) == raw(t), f"{k}: bytes differ"
            if pl is not None:
                assert gpl == tuple(placements_of(t.ndim)) and gmesh == mesh.shape, k
        else:
            assert g == t, k


class _FailOnRank1(DefaultSavePlanner):
    def resolve_data(self, write_item):
        if dist.get_rank() == 1:
            raise RuntimeError("rank 1 cannot read its state")
        return super().resolve_data(write_item)


def dcp_two_rank_worker(job_id: str) -> dict:
    """One rank: save a DTensor model + AdamW state sharded Shard(0), load it as Replicate, onto a 2-d mesh,
    async_save a later step and load the newest, then a corrupted chunk of rank 0 raises on both ranks."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import Replicate, Shard, init_device_mesh

    from jaxckpt.tools.node import node_info

    info = node_info()
    rank = info.process_id
    _init((rank, info.process_count, info.coordinator))
    done = []
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
        mesh2 = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        shard0 = lambda ndim: [Shard(0)]  # noqa: E731
        replicate = lambda ndim: [Replicate()]  # noqa: E731
        other = lambda ndim: [Replicate(), Shard(ndim - 1)]  # noqa: E731
        model, opt = _model(mesh, shard0)
        _train_step(model, 1)
        opt.step()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "extra": {"epoch": 4, "tag": "run"}}
        want = _full(state)
        assert any(v[1] == (Shard(0),) for v in want.values())
        writer = JaxckptWriter(config=Config(job_id=job_id, keep=3))
        dcp.save(state, storage_writer=writer, checkpoint_id=1)
        assert writer.store.steps() == [1]
        try:  # rank-local plans have no global save id nor coordinator metadata: refused on each rank
            dcp.save(state, storage_writer=writer, checkpoint_id=9, use_collectives=False)
            raise AssertionError("a save without DCP's global plan was accepted")
        except PlanError as e:
            assert "use_collectives=False" in str(e), e
        assert writer.store.steps() == [1]
        # Rank 1 fails while rank 0 (the coordinator) has written its slot: every rank hears of it (the write's
        # agreement), no finish(), no checkpoint; the same id saves fine next time (rank 0's written slot is freed,
        # not left holding the step).
        try:
            dcp.save(state, storage_writer=writer, checkpoint_id=0, planner=_FailOnRank1())
            raise AssertionError("a save that failed on rank 1 succeeded")
        except CheckpointException as e:
            assert set(e.failures) == {0, 1} and "rank 1 cannot read its state" in str(e.failures[1][0]), e
            assert isinstance(e.failures[0][0], CoordinationError), e
            assert str(e.failures[0][0]) == "process 1 failed in writing DCP checkpoint step 0: rank 1 cannot read " \
                                            "its state", e
        assert writer.store.steps() == [1]
        dcp.save(state, storage_writer=writer)  # no id given: the writer keeps id 0 (reset() is not called)
        assert writer.store.steps() == [0, 1]
        done.append("save")

        for name, mesh_, placements_of in (("replicate", mesh, replicate), ("mesh2", mesh2, other)):
            m2, o2 = _model(mesh_, placements_of, seed=7)
            _train_step(m2, 9)
            o2.step()  # optimizer state exists (other values): the load overwrites all of it
            msd2, osd2 = get_state_dict(m2, o2)
            target = {"model": msd2, "optim": osd2, "extra": {"epoch": 0, "tag": ""}}
            dcp.load(target, storage_reader=JaxckptReader(store=writer.store), checkpoint_id=1)
            set_state_dict(m2, o2, model_state_dict=target["model"], optim_state_dict=target["optim"])
            _check_loaded(_full(target), want, placements_of, mesh_)
            _check_loaded(_full({"model": get_state_dict(m2, o2)[0]}),
                          {k: v for k, v in want.items() if k.startswith("model.")}, placements_of, mesh_)
            done.append(name)

        _train_step(model, 2)
        opt.step()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "extra": {"epoch": 5, "tag": "run"}}
        want2 = _full(state)
        dcp.async_save(state, storage_writer=writer, checkpoint_id=2).result(timeout=60)
        m3, o3 = _model(mesh, replicate, seed=3)
        _train_step(m3, 4)
        o3.step()
        msd3, osd3 = get_state_dict(m3, o3)
        target = {"model": msd3, "optim": osd3, "extra": {"epoch": 0, "tag": ""}}
        dcp.load(target, storage_reader=JaxckptReader(store=writer.store))  # newest: step 2
        _check_loaded(_full(target), want2, replicate, mesh)
        assert want2 != want
        done.append("async-newest")

        # One flipped bit in rank 0's slot: rank 1 needs that chunk for Replicate, so both ranks raise.
        if rank == 0:
            writer.store.slot_bytes(1)[0] ^= 0x01
        dist.barrier()
        m4, o4 = _model(mesh, replicate, seed=5)
        _train_step(m4, 6)
        o4.step()
        msd4, osd4 = get_state_dict(m4, o4)
        try:
            dcp.load({"model": msd4, "optim": osd4, "extra": {"epoch": 0, "tag": ""}},
                     storage_reader=JaxckptReader(store=writer.store), checkpoint_id=1)
            raise AssertionError("a corrupted chunk was loaded")
        except CheckpointException as e:
            errs = {r: (type(f[0]).__name__, str(f[0])) for r, f in e.failures.items()}
        assert set(errs) == {0, 1} and all(name == "ChecksumError" for name, _ in errs.values()), errs
        assert "of rank 0's slot of checkpoint step 1 fails its crc32c" in errs[0][1], errs
        assert errs[1][1].startswith("process 0 failed in reading DCP checkpoint step 1: "), errs
        done.append("corrupt")

        # A group of rank 0 alone: rank 1's shards of step 2 are in rank 1's memory store, out of its reach.
        alone = dist.new_group([0])
        if rank == 0:
            try:
                dcp.load({"model": {"0.weight": torch.zeros(6, 8)}},
                         storage_reader=JaxckptReader(store=writer.store, process_group=alone), process_group=alone,
                         checkpoint_id=2)
                raise AssertionError("rank 1's chunks were read from outside the group")
            except CheckpointException as e:
                err = e.failures[0][0]
            assert isinstance(err, StepNotFoundError), err
            assert "checkpoint step 2 has chunks saved by rank 1, which this process group of 1 rank(s) does " \
                   "not have; a memory store holds only its own process's snapshots" in str(err), err
        done.append("outside-group")
        dist.barrier()
        writer.close()
        return {"rank": rank, "done": done}
    finally:
        dist.destroy_process_group()


def test_two_ranks_dtensor_model_and_optimizer_save_and_load_resharded():
    from jaxckpt.tools.launcher import expect_ok, launch

    values = expect_ok(launch(dcp_two_rank_worker, nodes=1, procs_per_node=2, distributed=False,
                              args=[f"dcp-2r-{uuid.uuid4().hex[:6]}"], timeout=180))
    for rank, v in enumerate(values):
        assert v == {"rank": rank, "done": ["save", "replicate", "mesh2", "async-newest", "corrupt", "outside-group"]}


def dcp_slot_failure_worker(job_id: str) -> dict:
    """One rank of 2: checkpoint 1 saved (keep=1), then checkpoint 2 does not fit the memory budget of one rank's
    store, first the coordinator's (rank 0), then rank 1's: every rank raises one BudgetExceededError naming the
    failing rank, no rank commits or trims anything, and checkpoint 1 loads bit for bit, resharded."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    from jaxckpt.tools.node import node_info

    info = node_info()
    rank = info.process_id
    _init((rank, info.process_count, info.coordinator))
    out = {"rank": rank}
    try:
        mesh = init_device_mesh("cpu", (2,))
        g = torch.Generator().manual_seed(11)
        full = {"w": random_tensor((64, 16), torch.float32, g), "b": random_tensor((30,), torch.bfloat16, g)}
        small = {k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in full.items()}
        big = dict(small, big=distribute_tensor(torch.ones(256, 256, dtype=torch.uint8), mesh, [Shard(0)],
                                                src_data_rank=None))
        for failing in (0, 1):
            budget = 16 << 10 if rank == failing else 0  # checkpoint 1 fits (2 KiB a rank), 2 does not (34 KiB)
            with JaxckptWriter(config=Config(job_id=f"{job_id}-{failing}", keep=1, memory_budget_bytes=budget)) as w:
                dcp.save(small, storage_writer=w, checkpoint_id=1)
                try:
                    dcp.save(big, storage_writer=w, checkpoint_id=2)
                    raise AssertionError(f"a save that does not fit rank {failing}'s budget succeeded")
                except CheckpointException as e:
                    errs = {r: (type(f[0]).__name__, str(f[0])) for r, f in e.failures.items()}
                assert set(errs) == {0, 1} and {n for n, _ in errs.values()} == {"BudgetExceededError"}, errs
                mine = errs[rank][1]
                said = re.escape("step 2: snapshot of ") + r"\d+" + re.escape(
                    f" bytes does not fit the memory budget of {16 << 10} bytes")
                if rank == failing:
                    assert re.match(said, mine), errs
                else:
                    assert re.match(re.escape(f"process {failing} failed in writing DCP checkpoint step 2: ") + said,
                                    mine), errs
                assert w.store.steps() == [1], (failing, w.store.steps())  # nothing committed, nothing trimmed
                target = {k: distribute_tensor(torch.zeros_like(v), mesh, [Replicate()], src_data_rank=None)
                          for k, v in full.items()}
                dcp.load(target, storage_reader=JaxckptReader(store=w.store))  # the newest: checkpoint 1
                for k, v in full.items():
                    assert raw(target[k].to_local()) == raw(v), (failing, k)
                dcp.save(small, storage_writer=w, checkpoint_id=3)  # the next save commits and trims as usual
                assert w.store.steps() == [3], (failing, w.store.steps())
                dist.barrier()
            out[f"failing-{failing}"] = "ok"
        return out
    finally:
        dist.destroy_process_group()


def test_a_slot_failure_on_one_rank_raises_on_every_rank_and_keeps_the_previous_checkpoint():
    """DCP's storage writes through the slot path and agrees its outcome through the collective wrapper: a rank
    whose slot cannot be written fails the save on every rank before any rank commits, so retention (keep=1)
    never trims the checkpoint saved before."""
    from jaxckpt.tools.launcher import expect_ok, launch

    values = expect_ok(launch(dcp_slot_failure_worker, nodes=1, procs_per_node=2, distributed=False,
                              args=[f"dcp-slotfail-{uuid.uuid4().hex[:6]}"], timeout=180))
    assert values == [{"rank": r, "failing-0": "ok", "failing-1": "ok"} for r in range(2)]


def dcp_shm_save_worker(job_id: str, shm_dir: str) -> dict:
    """One rank: save a Shard(0) DTensor state to the node agent (store="shm") and exit."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from jaxckpt.tools.node import node_info

    info = node_info()
    _init((info.process_id, info.process_count, info.coordinator))
    try:
        mesh = init_device_mesh("cpu", (2,))
        g = torch.Generator().manual_seed(42)
        full = {"w": random_tensor((6, 4), torch.float32, g), "v": random_tensor((10,), torch.bfloat16, g)}
        state = {k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in full.items()}
        with JaxckptWriter(config=Config(store="shm", job_id=job_id, shm_dir=shm_dir)) as w:
            dcp.save(state, storage_writer=w, checkpoint_id=21)
        return {"rank": info.process_id}
    finally:
        dist.destroy_process_group()


def test_two_ranks_shm_snapshots_load_in_one_process_after_they_exited():
    from jaxckpt.tools.launcher import expect_ok, launch

    config = Config(store="shm", job_id=f"dcp-2r-shm-{uuid.uuid4().hex[:6]}",
                    shm_dir=f"/dev/shm/jaxckpt-test-dcp-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    try:
        expect_ok(launch(dcp_shm_save_worker, nodes=1, procs_per_node=2, distributed=False,
                         args=[config.job_id, config.shm_dir], timeout=120))
        g = torch.Generator().manual_seed(42)
        full = {"w": random_tensor((6, 4), torch.float32, g), "v": random_tensor((10,), torch.bfloat16, g)}
        target = {k: torch.zeros_like(v) for k, v in full.items()}
        with JaxckptReader(config=config) as r:  # rank 1's half comes from its slot at the node agent
            dcp.load(target, storage_reader=r, checkpoint_id=21)
        assert_same(target, full)
    finally:
        _stop_agent(config)


def test_the_earlier_module_names_still_import_the_same_classes():
    """Code written against ``jaxckpt.backends.torch`` (the README's earlier import) and its ``dcp`` module keeps
    working: the names are the front end's own classes, not copies."""
    import jaxckpt.backends.torch as old
    import jaxckpt.backends.torch.dcp as old_dcp
    import jaxckpt.torch as new

    assert old.Checkpointer is new.Checkpointer and old.restore_state is new.restore_state
    assert (old_dcp.JaxckptWriter, old_dcp.JaxckptReader) == (JaxckptWriter, JaxckptReader)
    assert old_dcp.checkpoint_step is checkpoint_step
