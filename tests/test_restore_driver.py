"""The one restore driver (jaxckpt.core.restore) that both front ends run. What users rely on: any front end's
boxes come back bit for bit, every array is planned exactly once, the first bad leaf raises before bytes are
fetched, and the report's per-phase timeline accounts for every byte read, by where it came from."""
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt
import jaxckpt.torch.restore as torch_restore
import jaxckpt.core.restore as driver
import jaxckpt.jax.restore as jax_restore
from jaxckpt import Config
from jaxckpt.torch import Checkpointer as TorchCheckpointer
from jaxckpt.core import plan as core_plan
from jaxckpt.core.box import Box
from jaxckpt.core.checksum import crc32c
from jaxckpt.core.fetch import ChunkReader, Source
from jaxckpt.core.manifest import ArrayMeta, ChunkMeta, merge_chunks
from jaxckpt.core.restore import ArrayRequest, restore_leaves
from jaxckpt.core.timeline import PHASES, READ_PHASES
from jaxckpt.errors import PeerError, PlanError, TargetMismatchError

AUTO = jax.sharding.AxisType.Auto


# --------------------------------------------------------------------------- a tiny numpy front end
def row_blocks(shape: tuple, k: int) -> list[Box]:
    """``k`` row blocks of uneven size (they cross the saved chunks' edges)."""
    edges = sorted({0, shape[0]} | {shape[0] * i // k + (i % 2) for i in range(1, k)})
    return [Box((a,) + (0,) * (len(shape) - 1), (b,) + tuple(shape[1:])) for a, b in zip(edges, edges[1:])]


def numpy_request(meta: ArrayMeta, k: int = 3, out: np.ndarray | None = None) -> ArrayRequest:
    """A numpy front end: this process needs ``k`` row blocks and makes one array of them (or fills ``out``)."""
    boxes = row_blocks(meta.shape, k) if meta.shape and meta.shape[0] >= k else [Box.full(meta.shape)]

    def make(hosts: dict) -> np.ndarray:
        if out is not None:
            return out
        whole = np.empty(meta.shape, hosts[boxes[0]].dtype)
        for b, h in hosts.items():
            whole[b.slices()] = h
        return whole
    views = None if out is None else {b: out[b.slices()] for b in boxes}
    return ArrayRequest(meta, {b: [core_plan.HOST] for b in boxes}, make, private=True, out=views)


def same_bits(got, want, what: str = "") -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, what
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=what)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AUTO, AUTO))


def jax_state(mesh) -> dict:
    return {"w": jax.device_put(jnp.arange(64 * 96, dtype=jnp.float32).reshape(64, 96) / 7,
                                NamedSharding(mesh, P("data", "model"))),
            "b": jax.device_put(jnp.arange(40, dtype=jnp.bfloat16) - 3, NamedSharding(mesh, P())),
            "i": jax.device_put(jnp.arange(12 * 8, dtype=jnp.int32).reshape(12, 8), NamedSharding(mesh, P("data"))),
            "n": 7}


def test_numpy_front_end_gets_its_boxes_bit_for_bit_and_the_phases_add_up(mesh):
    state = jax_state(mesh)
    want = {k: np.asarray(v) for k, v in state.items() if k != "n"}
    with jaxckpt.Checkpointer(Config(keep=1, chunk_bytes=4096)) as ck:
        ck.save(3, state).result()
        with ck.engine.open(None) as (step, manifests, reader):
            arrays = merge_chunks(manifests)
            into = np.zeros((12, 8), np.int32)
            items = [numpy_request(arrays["w"], 5), numpy_request(arrays["b"], 3), "a plain value",
                     numpy_request(arrays["i"], 4, out=into)]
            got = restore_leaves(iter(items), reader, step=step, process=0)
            distinct = {(c.process, c.offset): c.nbytes for p in ("w", "b", "i") for c in arrays[p].chunks}
        report = ck.engine.last_restore_report
    assert step == 3 and got[2] == "a plain value" and got[3] is into
    for k, v in zip(("w", "b", "i"), (got[0], got[1], got[3])):
        same_bits(v, want[k], k)
    t = report.timeline
    requested = sum(a.nbytes for a in want.values())
    assert report.chunks == len(distinct) and report.nbytes == sum(distinct.values())
    assert sum(t[name].nbytes for name in READ_PHASES) == t.read_bytes == report.nbytes == t["local_reads"].nbytes
    assert t["local_reads"].count == report.chunks and t["peer_fetches"].nbytes == t["rebuild"].nbytes == 0
    assert t["plan"].count == 3 and t["plan"].nbytes == requested
    assert t["assemble"].nbytes == requested and t["assemble"].count == 5 + 3 + 4
    assert t["device_put"].count == 3 and t["device_put"].nbytes == requested
    assert t["discover"].count == 1
    d = report.to_dict()["timeline"]
    assert list(d) == list(PHASES) and d["local_reads"]["nbytes"] == report.nbytes
    assert all(p["seconds"] >= 0 and p["busy_s"] >= 0 for p in d.values())
    assert "local_reads" in report.summary()


def _counting(monkeypatch) -> dict:
    calls: dict[str, int] = {}
    real = core_plan.plan_restore

    def counted(meta, needed, **kw):
        calls[meta.path] = calls.get(meta.path, 0) + 1
        return real(meta, needed, **kw)
    monkeypatch.setattr(core_plan, "plan_restore", counted)
    return calls


def test_every_array_is_planned_exactly_once_in_both_front_ends(mesh, monkeypatch):
    # Neither front end holds a planner of its own that the count could miss.
    assert not hasattr(jax_restore, "plan_restore") and not hasattr(torch_restore, "plan_restore")
    state = jax_state(mesh)
    with jaxckpt.Checkpointer(Config(keep=1, chunk_bytes=4096)) as ck:
        ck.save(1, state).result()
        calls = _counting(monkeypatch)
        other = NamedSharding(mesh, P("model", "data"))  # resharded: many boxes per array, each array planned once
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=other if v.ndim == 2 else v.sharding)
                  for k, v in state.items() if k != "n"} | {"n": 0}
        out = ck.restore(target)
        assert calls == {"w": 1, "b": 1, "i": 1}
        for k in ("w", "b", "i"):
            same_bits(out[k], np.asarray(state[k]), k)
            assert out[k].sharding == target[k].sharding
        calls.clear()
        untargeted = ck.restore()
        assert calls == {"w": 1, "b": 1, "i": 1} and untargeted["n"] == 7
    monkeypatch.undo()

    gen = torch.Generator().manual_seed(5)
    tstate = {"w": torch.randn(33, 17, generator=gen), "h": torch.arange(10, dtype=torch.bfloat16), "g": gen}
    with TorchCheckpointer(Config(keep=1, chunk_bytes=512)) as tck:
        tck.save(2, tstate).result()
        calls = _counting(monkeypatch)
        target = {"w": torch.zeros(33, 17), "h": torch.zeros(10, dtype=torch.bfloat16),
                  "g": torch.Generator()}
        back = tck.restore(target)
        assert calls == {"w": 1, "h": 1, "g": 1}
        same_bits(back["w"].numpy(), tstate["w"].numpy(), "w")
        assert torch.equal(back["h"], tstate["h"]) and torch.equal(back["g"].get_state(), gen.get_state())
        calls.clear()
        ptr, version = target["w"].data_ptr(), target["w"]._version
        tck.restore(target, in_place=True)  # many saved chunks per tensor, assembled into the tensor itself
        assert calls == {"w": 1, "h": 1, "g": 1} and target["w"].data_ptr() == ptr
        assert target["w"]._version > version  # autograd sees the write, as it would an in-place copy_
        same_bits(target["w"].numpy(), tstate["w"].numpy(), "w in place")
        report = tck.last_restore_report
    assert report.timeline["plan"].count == 3 and report.timeline["local_reads"].nbytes == report.nbytes


# --------------------------------------------------------------------------- hand-built sources
def three_process_snapshot():
    """One (24, 8) float64 array saved as three 8-row chunks by processes 0, 1 and 2 (each its own buffer)."""
    full = np.arange(24 * 8, dtype=np.float64).reshape(24, 8) * 1.5
    bufs, chunks = {}, []
    for p in range(3):
        part = np.ascontiguousarray(full[8 * p:8 * p + 8])
        bufs[p] = np.frombuffer(part.tobytes(), np.uint8)
        chunks.append(ChunkMeta(Box((8 * p, 0), (8 * p + 8, 8)), 0, part.nbytes, crc32c(bufs[p]), p))
    meta = ArrayMeta("w", (), (24, 8), "float64", "numpy", chunks=tuple(chunks))
    return full, bufs, meta


def src(kind: str, name: str, node: str, buf: np.ndarray, fail: bool = False) -> Source:
    def read(offset: int, nbytes: int) -> memoryview:
        if fail:
            raise PeerError(f"{name} hung up")
        return memoryview(buf)[offset:offset + nbytes]
    return Source(kind, name, node, read)


def test_timeline_splits_bytes_by_source_kind_and_counts_a_failed_source_time_not_bytes():
    full, bufs, meta = three_process_snapshot()
    sources = {0: [src("local", "own store", "n0", bufs[0])],
               1: [src("peer", "process 1", "n1", bufs[1], fail=True), src("remote", "agent n1", "n1", bufs[1])],
               2: [src("rebuild", "parity of n2", "n3", bufs[2])]}
    reader = ChunkReader(sources, 4, workers=3, process=0)
    inner = Box((4, 2), (20, 6))  # crosses all three chunks
    got = restore_leaves([ArrayRequest.whole(meta, lambda h: h.copy()),
                          ArrayRequest.whole(meta, lambda h: h.copy(), box=inner, private=True)],
                         reader, step=4, process=0)
    report = reader.finish()
    same_bits(got[0], full)
    same_bits(got[1], full[4:20, 2:6])
    t, per = report.timeline, full.nbytes // 3
    assert (t["local_reads"].nbytes, t["peer_fetches"].nbytes, t["rebuild"].nbytes) == (per, per, per)
    assert t["local_reads"].count == t["peer_fetches"].count == t["rebuild"].count == 1  # failed tries: no count
    assert t.read_bytes == report.nbytes == full.nbytes and report.chunks == 3
    assert t["peer_fetches"].busy_s > 0 and len(report.fallbacks) == 1 and "process 1 failed" in report.fallbacks[0]
    assert t["plan"].count == 2 and t["plan"].nbytes == full.nbytes + inner.size * 8


def test_first_bad_leaf_raises_before_any_byte_is_fetched():
    full, bufs, meta = three_process_snapshot()
    reads: list[int] = []

    def counted(p):
        def read(offset, nbytes):
            reads.append(p)
            return memoryview(bufs[p])[offset:offset + nbytes]
        return [Source("local", f"p{p}", "n0", read)]
    reader = ChunkReader({p: counted(p) for p in range(3)}, 4)
    outside = ArrayRequest(meta, {Box((20, 0), (30, 8)): [core_plan.HOST]}, lambda h: h)
    with pytest.raises(PlanError, match=r"w: step 4 has no saved bytes for box \(20, 0\)\.\.\(30, 8\)"):
        restore_leaves([ArrayRequest.whole(meta, lambda h: h.copy()), outside], reader, step=4, process=0)
    assert reads == [] and reader.report.chunks == 0

    def leaves():
        yield ArrayRequest.whole(meta, lambda h: h.copy())
        raise TargetMismatchError("x: saved shape (24, 8), target shape (3,)")
    with pytest.raises(TargetMismatchError, match=r"x: saved shape \(24, 8\), target shape \(3,\)"):
        restore_leaves(leaves(), reader, step=4, process=0)
    assert reads == []


def test_big_boxes_are_assembled_ahead_on_the_pool_and_an_error_in_make_waits_for_them(monkeypatch):
    n = 6
    rng = np.random.default_rng(0)
    full = rng.standard_normal((n, 512, 1024)).astype(np.float32)  # 2 MiB per array row: over PARALLEL_BYTES
    raw = np.frombuffer(full.tobytes(), np.uint8)
    metas, offset = [], 0
    for i in range(n):
        part = raw[i * full[i].nbytes:(i + 1) * full[i].nbytes]
        half = part.nbytes // 2  # two chunks per array: every box is a copy (not one chunk's view)
        chunks = (ChunkMeta(Box((0, 0), (256, 1024)), offset, half, crc32c(part[:half]), 0),
                  ChunkMeta(Box((256, 0), (512, 1024)), offset + half, half, crc32c(part[half:]), 0))
        metas.append(ArrayMeta(f"a{i}", (), (512, 1024), "float32", "numpy", chunks=chunks))
        offset += part.nbytes
    threads: list[str] = []
    real = driver.assemble

    def where(*a, **kw):
        threads.append(threading.current_thread().name)
        return real(*a, **kw)
    monkeypatch.setattr(driver, "assemble", where)
    monkeypatch.setattr(driver, "LOOKAHEAD_BYTES", 5 << 20)  # two or three arrays ahead, not all
    box = Box((100, 0), (400, 1024))
    reader = ChunkReader({0: [src("local", "own", "n0", raw)]}, 1)
    got = restore_leaves([ArrayRequest.whole(m, lambda h: h, private=True, box=box) for m in metas], reader,
                         step=1, process=0)
    for i, g in enumerate(got):
        same_bits(g, full[i, 100:400], f"a{i}")
    assert len(threads) == n and sum(t.startswith("jaxckpt-restore") for t in threads) >= n - 1, threads

    made: list[int] = []

    def boom(i):
        def make(h):
            made.append(i)
            if i == 1:
                raise RuntimeError("the front end refused a1")
            return h
        return make
    reader = ChunkReader({0: [src("local", "own", "n0", raw)]}, 1)
    with pytest.raises(RuntimeError, match="the front end refused a1"):
        restore_leaves([ArrayRequest.whole(m, boom(i), private=True, box=box) for i, m in enumerate(metas)],
                       reader, step=1, process=0)
    assert made == [0, 1]
    assert not [t for t in threading.enumerate() if t.name.startswith("jaxckpt-restore") and _busy(t)]


def _busy(t: threading.Thread) -> bool:
    """Whether a pool thread is running a task (idle workers wait on the pool's queue)."""
    import sys
    frame = sys._current_frames().get(t.ident)
    while frame is not None:
        if frame.f_code.co_name == "_assemble":
            return True
        frame = frame.f_back
    return False


def test_arrays_are_made_while_the_last_chunks_are_still_being_fetched():
    """The prefetch runs behind the assembly: array ``a`` is made while the chunk of ``b`` is still on its way
    (here: its source answers only once ``a`` exists), and each chunk is still read once."""
    rng = np.random.default_rng(3)
    want = {name: rng.standard_normal((16, 8)) for name in ("a", "b")}
    bufs = {p: np.frombuffer(want[name].tobytes(), np.uint8) for p, name in ((1, "a"), (0, "b"))}
    metas = {name: ArrayMeta(name, (), (16, 8), "float64", "numpy",
                             chunks=(ChunkMeta(Box((0, 0), (16, 8)), 0, bufs[p].nbytes, crc32c(bufs[p]), p),))
             for p, name in ((1, "a"), (0, "b"))}
    a_made, reads = threading.Event(), {0: 0, 1: 0}

    def source(p: int):
        def read(offset: int, nbytes: int) -> memoryview:
            reads[p] += 1
            if p == 0 and not a_made.wait(30):  # the prefetch reads process 0 first (plan order)
                raise PeerError("b's holder was asked before a was made: the prefetch ran ahead of nothing")
            return memoryview(bufs[p])[offset:offset + nbytes]
        return [Source("remote", f"agent {p}", f"n{p}", read)]

    def make_a(h):
        a_made.set()
        return h.copy()
    reader = ChunkReader({p: source(p) for p in (0, 1)}, 2, workers=1, process=0)
    got = restore_leaves([ArrayRequest.whole(metas["a"], make_a), ArrayRequest.whole(metas["b"], lambda h: h.copy())],
                         reader, step=2, process=0)
    same_bits(got[0], want["a"], "a")
    same_bits(got[1], want["b"], "b")
    assert reads == {0: 1, 1: 1}


def test_a_stopwatch_times_stages_in_the_order_they_ran_and_adds_work_timed_outside_a_block():
    """``Checkpointer.startup``'s stages: wall and CPU per stage, repeated stages added; work timed before the
    watch began (the protection runtime's import) recorded as the first stage, never as negative time."""
    from jaxckpt.core.timeline import Stopwatch

    w = Stopwatch()
    with w.stage("scan"):
        sum(range(200_000))  # CPU: counted in both
    with w.stage("round"):
        time.sleep(0.02)  # waiting: wall, hardly any CPU
    with w.stage("scan"):
        pass
    w.record("import", 0.5, 0.25, first=True)
    w.record("clock step", -1.0, -1.0)
    d = w.to_dict()
    assert list(d) == ["import", "scan", "round", "clock step"], d
    assert d["import"] == {"seconds": 0.5, "cpu_s": 0.25}
    assert d["clock step"] == {"seconds": 0.0, "cpu_s": 0.0}
    assert d["scan"]["cpu_s"] > 0 and d["scan"]["seconds"] > 0, d
    assert d["round"]["seconds"] >= 0.02 and d["round"]["cpu_s"] < d["round"]["seconds"], d
    w.record("import", 0.5, 0.25, first=True)  # an existing stage keeps its place and adds up
    assert list(w.to_dict()) == ["import", "scan", "round", "clock step"]
    assert w.to_dict()["import"] == {"seconds": 1.0, "cpu_s": 0.5}
