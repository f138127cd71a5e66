"""DCP's non-tensor values through jaxckpt's stores: stored as msgpack, never as the pickle DCP makes of them.

Every type the codec holds comes back through ``dcp.save`` / ``dcp.load`` with its exact type and value (an
optimizer's ``param_groups`` with their tuples among them); a value of the user's own class is refused at save
(nothing committed, the earlier checkpoint kept) unless the writer stores it pickled and the reader trusts that;
bytes in the store are never handed to an unpickler (a planted pickle that would write a file is refused and
writes nothing); version 1 metadata (pickled values) still reads, as pickled."""
import collections
import io
import math
import os

import msgpack
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex

from jaxckpt import Config
from jaxckpt.errors import ManifestError, UnsupportedTypeError
from jaxckpt.torch import JaxckptReader, JaxckptWriter
from jaxckpt.torch import dcp_metadata, dcp_values

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")]


def assert_identical(got, want, where="value"):
    """Same types all the way down (a tuple is not a list), same values, tensors bit for bit."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape, got.device, got.requires_grad) == \
            (want.dtype, want.shape, want.device, want.requires_grad), where
        a, b = (t.detach().contiguous().reshape(-1) for t in (got, want))
        assert bytes(a.view(torch.uint8).numpy()) == bytes(b.view(torch.uint8).numpy()), f"{where}: bytes differ"
    elif isinstance(want, dict):  # OrderedDict and Counter too: keys in order
        assert list(got) == list(want), where
        for k in want:
            assert_identical(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_identical(a, b, f"{where}[{i}]")
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), where
    else:
        assert got == want, where


def every_value():
    """One of each type the codec holds, with the corners: big ints, NaN, a lone surrogate, a strided bf16 view."""
    return {
        "none": None, "flag": True, "epoch": 7, "neg": -(1 << 63), "top": (1 << 64) - 1, "big": 1 << 80,
        "minus_big": -(1 << 90), "lr": 3e-4, "nan": float("nan"), "inf": float("-inf"), "z": 1.5 - 2j,
        "name": "run-ä", "surrogate": "\udc80", "blob": b"\x00\xff", "buf": bytearray(b"ab"),
        "betas": (0.9, 0.999), "nested": ({(1, 2): "tuple key", 5: [None, ()]}, collections.OrderedDict(z=1, a=2),
                                          collections.Counter("aab"), {3, 1}),
        "size": torch.Size([2, 3]), "dtype": torch.bfloat16, "device": torch.device("cpu"),
        "ragged": [torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t(), 4],  # a view, beside a plain value
        "param": (torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.zeros(1), requires_grad=False)),
        "grad": (torch.tensor(1.0, requires_grad=True), torch.empty(0, 3, dtype=torch.float8_e4m3fn)),
    }


def blank(x):
    """``x`` with every non-tensor leaf None and every tensor zero (dicts and lists kept: DCP flattens them)."""
    if type(x) is dict:
        return {k: blank(v) for k, v in x.items()}
    if type(x) is list:
        return [blank(v) for v in x]
    if isinstance(x, torch.Tensor):
        return torch.zeros_like(x.detach())
    return None


# ------------------------------------------------------------------------------------------------ the codec
def test_codec_round_trips_every_type_exactly():
    value = every_value()
    assert_identical(dcp_values.decode(dcp_values.encode(value, "v"), "v"), value)
    # What torch's restricted loader gives back for DCP's bytes of the value encodes too (the writer's path).
    buf = io.BytesIO()
    torch.save(value, buf)
    stored, encoding = dcp_values.stored(buf, "v", pickle_values=False)
    assert encoding == "msgpack" and not bytes(stored).startswith(b"PK")  # not torch.save's zip
    assert_identical(dcp_values.decode(bytes(stored), "v"), value)


class Schedule:
    """A value of the user's own class: only a full unpickling can rebuild it."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schedule) and other.warmup == self.warmup


def test_codec_refuses_what_it_cannot_hold_naming_the_place():
    where = "DCP checkpoint step 4, item 'extra.x'"
    cycle: list = [1]
    cycle.append(cycle)
    for bad, says in ((Schedule(1), f"{where}: a {__name__}.Schedule has no encoding without pickle"),
                      ([1, {"s": Schedule(1)}], f"{where}, at value[1]['s']: a {__name__}.Schedule"),
                      ((torch.zeros(3).to_sparse(),), f"{where}, at value[0]: a torch.sparse_coo tensor"),
                      (torch.zeros(2, device="meta"), f"{where}: a meta tensor"),
                      (torch.zeros(2, dtype=torch.complex32), "torch dtype torch.complex32 cannot be snapshotted"),
                      (cycle, f"{where}, at value[1]: the value contains itself")):
        with pytest.raises(UnsupportedTypeError) as e:
            dcp_values.encode(bad, where)
        assert says in str(e.value), (says, str(e.value))


def test_codec_refuses_malformed_bytes_with_manifest_error():
    good = dcp_values.encode({"t": torch.ones(3)}, "v")
    int_grad = msgpack.packb(msgpack.ExtType(11, msgpack.packb(["int64", [1], "cpu", True, False, bytes(8)])))
    short = msgpack.packb(msgpack.ExtType(11, msgpack.packb(["float32", [2], "cpu", False, False, bytes(4)])))
    for data, says in ((good[:-1], "not a jaxckpt DCP value"), (b"\xd4\x63\x00", "unknown value type code 99"),
                       (int_grad, "a int64 tensor that requires grad"),
                       (short, "a float32[2] tensor with 4 bytes of values"),
                       (msgpack.packb(msgpack.ExtType(9, msgpack.packb("torch.nothing"))), "unknown torch dtype")):
        with pytest.raises(ManifestError, match="^v: ") as e:
            dcp_values.decode(data, "v")
        assert says in str(e.value), (says, str(e.value))


# ---------------------------------------------------------------------------------------------- through DCP
def test_every_value_type_and_an_optimizer_state_round_trip_through_dcp():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.95))
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": every_value()}
    with JaxckptWriter(config=Config(job_id="dcp-values")) as w:
        dcp.save(state, storage_writer=w, checkpoint_id=3)
        md = JaxckptReader(store=w.store, checkpoint_id=3).read_metadata()
        encodings = {mi.fqn: loc.encoding for mi, loc in md.storage_data.locators.items()}
        assert encodings["extra.betas"] == encodings["optim.param_groups.0.betas"] == "msgpack"
        assert encodings["extra.param"] == "msgpack"  # a tuple of Parameters is one value to DCP
        assert encodings["model.weight"] == "raw" and set(encodings.values()) == {"raw", "msgpack"}
        fresh = torch.nn.Linear(3, 2)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
        target = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict(), "extra": blank(state["extra"])}
        target["optim"]["state"] = {k: {n: torch.zeros_like(v) for n, v in s.items()}
                                    for k, s in state["optim"]["state"].items()}  # DCP loads into existing tensors
        dcp.load(target, storage_reader=JaxckptReader(store=w.store), checkpoint_id=3)
    assert_identical(target["extra"], state["extra"], "extra")
    assert_identical(target["optim"]["param_groups"], state["optim"]["param_groups"], "param_groups")
    fresh_opt.load_state_dict(target["optim"])
    assert fresh_opt.param_groups[0]["betas"] == (0.8, 0.95) and fresh_opt.param_groups[0]["lr"] == 1e-3
    for k in state["model"]:
        assert_identical(target["model"][k], state["model"][k], k)


class _OwnBytesPlanner(DefaultSavePlanner):
    """A planner with its own transform_object (here DCP's torch.save): the writer takes its bytes, not the object."""

    def transform_object(self, write_item, object):
        return super().transform_object(write_item, object)


def test_a_planner_making_its_own_bytes_gets_the_same_values():
    state = {"w": torch.ones(2), "extra": every_value()}
    with JaxckptWriter(config=Config(job_id="dcp-own-bytes")) as w:
        dcp.save(state, storage_writer=w, checkpoint_id=1, planner=_OwnBytesPlanner())
        target = {"w": torch.zeros(2), "extra": blank(state["extra"])}
        dcp.load(target, storage_reader=JaxckptReader(store=w.store), checkpoint_id=1)
    assert_identical(target["extra"], state["extra"], "extra")


def test_a_value_of_the_users_class_is_refused_at_save_unless_pickled_on_both_ends():
    with JaxckptWriter(config=Config(job_id="dcp-pickled")) as w:
        dcp.save({"w": torch.arange(6.0), "extra": {"epoch": 2}}, storage_writer=w, checkpoint_id=1)
        state = {"w": torch.arange(6.0) + 1, "extra": {"schedule": Schedule(7), "epoch": 3}}
        # DCP's own planner (the writer encodes the object it looks up) and one that makes the bytes its own way
        # (the writer reads them back with torch's restricted loader): the same refusal.
        for planner, says in ((None, f"a {__name__}.Schedule has no encoding without pickle"),
                              (_OwnBytesPlanner(), f"its value has no encoding without pickle (it holds a "
                                                   f"{__name__}.Schedule)")):
            with pytest.raises(CheckpointException) as e:  # DCP wraps what its storage raises, per rank
                dcp.save(state, storage_writer=w, checkpoint_id=2, planner=planner)
            err = e.value.failures[0][0]
            assert isinstance(err, UnsupportedTypeError), err
            assert str(err).startswith(f"DCP checkpoint step 2, item 'extra.schedule': {says}"), err
            assert "pickle_values=True" in str(err) and "trust_pickled_values=True" in str(err), err
            assert w.store.steps() == [1]  # nothing of step 2 committed, step 1 kept

    with JaxckptWriter(config=Config(job_id="dcp-pickled"), pickle_values=True) as w:
        dcp.save(state, storage_writer=w, checkpoint_id=2)
        md = JaxckptReader(store=w.store, checkpoint_id=2).read_metadata()
        locators = md.storage_data.locators
        assert locators[MetadataIndex("extra.schedule")].encoding == "pickle"
        assert locators[MetadataIndex("extra.epoch")].encoding == "msgpack"  # only what has no other encoding
        target = {"w": torch.zeros(6), "extra": {"schedule": None, "epoch": 0}}
        with pytest.raises(CheckpointException) as e:
            dcp.load(target, storage_reader=JaxckptReader(store=w.store))
        err = e.value.failures[0][0]
        assert isinstance(err, UnsupportedTypeError), err
        assert str(err).startswith("DCP checkpoint step 2, item 'extra.schedule': its non-tensor value was stored "
                                   "pickled (with pickle_values=True)"), err
        assert "trust_pickled_values=True" in str(err), err
        assert target["extra"]["schedule"] is None  # nothing of the refused value was loaded
        dcp.load(target, storage_reader=JaxckptReader(store=w.store, trust_pickled_values=True))
        assert target["extra"] == {"schedule": Schedule(7), "epoch": 3}
        assert torch.equal(target["w"], state["w"])


class _WritesAFile:
    """Unpickling this creates a file: what a planted pickle could do instead."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_bytes_in_the_store_are_never_unpickled(tmp_path):
    """A pickle planted in the store where a value's msgpack was (crc32c checks off, so only the encoding stands
    between it and DCP's full unpickler) is refused, and its side effect never happens; a pickled value is handed
    over only to a trusting reader."""
    marker = str(tmp_path / "ran")
    planted = io.BytesIO()
    torch.save(_WritesAFile(marker), planted)
    payload = planted.getvalue()
    filler = b"\0" * (len(payload) - 3)  # msgpack bin 16: 3 header bytes, so the value's bytes are as long
    with JaxckptWriter(config=Config(job_id="dcp-planted", verify_on_restore=False)) as w:
        dcp.save({"w": torch.ones(2), "extra": {"note": filler}}, storage_writer=w, checkpoint_id=1)
        md = JaxckptReader(store=w.store, checkpoint_id=1).read_metadata()
        loc = md.storage_data.locators[MetadataIndex("extra.note")]
        assert loc.encoding == "msgpack" and loc.nbytes == len(payload)
        w.store.slot_bytes(1)[loc.offset:loc.offset + loc.nbytes] = np.frombuffer(payload, np.uint8)
        target = {"w": torch.zeros(2), "extra": {"note": None}}
        with pytest.raises(CheckpointException) as e:
            dcp.load(target, storage_reader=JaxckptReader(store=w.store, trust_pickled_values=True))
        err = e.value.failures[0][0]
        assert isinstance(err, ManifestError) and "step 1, item 'extra.note': not a jaxckpt DCP value" in str(err)
    assert not os.path.exists(marker) and target["extra"]["note"] is None
    for encoding in ("pickle", None):
        with pytest.raises(UnsupportedTypeError, match="trust_pickled_values=True"):
            dcp_values.loadable(payload, encoding, "item", trust_pickled_values=False)
    assert not os.path.exists(marker)


def test_version_1_metadata_still_reads_and_its_values_count_as_pickled():
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
    index = dcp_metadata.StorageIndex("s", 4, 1, {MetadataIndex("extra.epoch"): dcp_metadata.Locator(0, 0, 9, 1,
                                                                                                     "msgpack")})
    wire = dcp_metadata.encode(Metadata({"extra.epoch": BytesStorageMetadata()}), index)
    assert wire["version"] == 2 and wire["storage"]["chunks"][0][-1] == "msgpack"
    assert dcp_metadata.decode(wire, "test").storage_data == index
    wire["version"] = 1  # as a jaxckpt before the value codec wrote it: rows without the encoding
    wire["storage"]["chunks"] = [row[:7] for row in wire["storage"]["chunks"]]
    old = dcp_metadata.decode(wire, "test").storage_data.locators[MetadataIndex("extra.epoch")]
    assert old.encoding is None
    with pytest.raises(UnsupportedTypeError, match="stored pickled \\(by a jaxckpt before DCP metadata version 2\\)"):
        dcp_values.loadable(b"", old.encoding, "item", trust_pickled_values=False)
    wire["version"] = 2  # a version 2 record must say each row's encoding
    with pytest.raises(ManifestError, match="a chunk row of 7 fields in a version 2 record"):
        dcp_metadata.decode(wire, "test")


README_PRELUDE = """
import torch, jaxckpt
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optim = torch.optim.AdamW(model.parameters(), betas=(0.8, 0.95))
model(torch.ones(3, 4)).sum().backward()
optim.step()
step = 7
saved = {k: v.clone() for k, v in model.state_dict().items()}
"""
README_CHECK = """
assert all(torch.equal(state["model"][k], v) for k, v in saved.items())
assert state["optim"]["param_groups"][0]["betas"] == (0.8, 0.95)
print("README DCP OK", type(state["optim"]["param_groups"][0]["betas"]).__name__)
"""


def test_the_readmes_dcp_example_runs_as_written(tmp_path):
    """The README's DCP block, as written, after a model and optimizer are made: it saves to the node agent's
    shared memory and loads the newest checkpoint back (tuples still tuples)."""
    import re
    import subprocess
    import sys

    from jaxckpt.testing import remove_agents

    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    block = re.search(r"PyTorch DCP, unchanged.*?```python\n(.*?)```", readme, re.S).group(1)
    root = tmp_path / "shm"
    root.mkdir()
    try:
        done = subprocess.run([sys.executable, "-c", README_PRELUDE + block + README_CHECK], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "JAXCKPT_SHM_ROOT": str(root)})
        assert done.returncode == 0 and "README DCP OK tuple" in done.stdout, (done.stdout + done.stderr)[-3000:]
    finally:
        remove_agents(str(root))
