"""The persistent tier: committed snapshots in the standard Orbax format, read by plain Orbax and by restore."""
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt
from jaxckpt.core import manifest as mf
from jaxckpt.errors import StepNotFoundError, TargetMismatchError, UnsupportedLeafError
from jaxckpt.persistent import TMP_SUFFIX, persisted_steps
from jaxckpt.testing import expect_ok, launch, start

AUTO = jax.sharding.AxisType.Auto
NAN_BITS = np.array([0x7FC00001, 0xFFA00002], dtype=np.uint32)  # NaNs with payloads must survive


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))


def _host(step: int) -> dict:
    rng = np.random.default_rng(step)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    w.reshape(-1)[[3, 77]] = NAN_BITS.view(np.float32)
    return {"w": w, "b": rng.standard_normal(8).astype(jnp.bfloat16), "ids": rng.integers(-99, 99, (8, 16), np.int32)}


def _state(step: int, mesh) -> dict:
    h = _host(step)
    return {"params": {"w": jax.device_put(h["w"], NamedSharding(mesh, P("data", None))),
                       "b": jax.device_put(h["b"], NamedSharding(mesh, P())),
                       "ids": jax.device_put(h["ids"], NamedSharding(mesh, P(None, "data")))},
            "key": jax.random.key(step), "host": np.arange(5, dtype=np.float64) * step, "count": np.int32(step),
            "step": step}


def _target(mesh, spec_w=P("data", None), spec_ids=P(None, "data")) -> dict:
    return {"params": {"w": jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(mesh, spec_w)),
                       "b": jax.ShapeDtypeStruct((8,), jnp.bfloat16, sharding=NamedSharding(mesh, P())),
                       "ids": jax.ShapeDtypeStruct((8, 16), jnp.int32, sharding=NamedSharding(mesh, spec_ids))},
            "key": jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, P())),
            "host": np.zeros(5), "count": np.int32(0), "step": 0}


def _bits(x) -> np.ndarray:
    a = np.ascontiguousarray(np.asarray(x))
    return a.view(np.uint8)


def _assert_state(out: dict, step: int, target: dict | None = None) -> None:
    h = _host(step)
    for k in ("w", "b", "ids"):
        np.testing.assert_array_equal(_bits(out["params"][k]), _bits(h[k]), err_msg=f"step {step} params/{k}")
        if target is not None:
            assert out["params"][k].sharding == target["params"][k].sharding
    np.testing.assert_array_equal(jax.random.key_data(out["key"]), jax.random.key_data(jax.random.key(step)))
    np.testing.assert_array_equal(np.asarray(out["host"]), np.arange(5, dtype=np.float64) * step)
    assert int(np.asarray(out["count"])) == step and int(out["step"]) == step


def _saved(ck, mesh, steps) -> None:
    for s in steps:  # waiting after each save makes which steps are persisted deterministic
        ck.save(s, _state(s, mesh))
        ck.wait()
        ck.persister.wait()


def test_persisted_steps_are_standard_orbax(tmp_path):
    mesh = _mesh((8,), ("data",))
    d = tmp_path / "persist"
    cfg = jaxckpt.Config(persistent_dir=str(d), persistent_interval=2, persistent_keep=2, job_id="persist-std")
    with jaxckpt.Checkpointer(cfg) as ck:
        _saved(ck, mesh, range(7))
        assert ck.persister.persisted == [0, 2, 4, 6] and ck.persister.skipped == []
    assert persisted_steps(d) == [4, 6]  # persistent_keep=2: Orbax's max_to_keep deleted 0 and 2
    assert sorted(os.listdir(d)) == ["4", "6"]
    assert {"default", "_CHECKPOINT_METADATA"} <= set(os.listdir(d / "6"))

    # A plain Orbax program: StandardCheckpointer on the item directory, onto the saved and another sharding.
    mesh2 = _mesh((2, 4), ("data", "model"))
    for tgt in (_target(mesh), _target(mesh2, P(None, "model"), P("data", "model"))):
        plain = {**tgt, "count": np.zeros((), np.int32)}  # Orbax takes no numpy-scalar targets
        out = ocp.StandardCheckpointer().restore(d / "6" / "default", plain)
        _assert_state(out, 6, tgt)
    # ... and a CheckpointManager over the directory.
    mngr = ocp.CheckpointManager(d)
    assert mngr.all_steps() == [4, 6] and mngr.latest_step() == 6
    tgt = _target(mesh2, P("model", "data"), P())
    out = mngr.restore(4, args=ocp.args.StandardRestore({**tgt, "count": np.zeros((), np.int32)}))
    _assert_state(out, 4, tgt)
    mngr.close()


def test_the_persist_thread_starts_with_the_first_persist_not_in_the_checkpointers_start_up(tmp_path):
    """Checkpointer() of a relaunched trainer starts no persist thread (a start waits for the new thread to run:
    tens of ms on busy cores); the first step the tier persists starts it, and close() stops it."""
    import threading

    def persist_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "jaxckpt-persist"]

    assert persist_threads() == []
    mesh = _mesh((8,), ("data",))
    d = tmp_path / "persist"
    cfg = jaxckpt.Config(persistent_dir=str(d), persistent_interval=2, job_id="persist-lazy")
    with jaxckpt.Checkpointer(cfg) as ck:
        assert persist_threads() == []
        _saved(ck, mesh, [1])  # not a multiple of persistent_interval
        assert persist_threads() == [] and ck.persister.persisted == []
        _saved(ck, mesh, [2, 3, 4])
        assert len(persist_threads()) == 1 and ck.persister.persisted == [2, 4]
        thread = persist_threads()[0]
    assert not thread.is_alive() and persist_threads() == []
    assert persisted_steps(d) == [2, 4]
    cfg = jaxckpt.Config(persistent_dir=str(d), persistent_interval=0, job_id="persist-lazy-read")
    with jaxckpt.Checkpointer(cfg) as ck:  # reads only: never a persist thread
        _assert_state(ck.restore(_target(mesh), step=4), 4, _target(mesh))
        assert persist_threads() == []


def test_restore_reads_persisted_steps(tmp_path):
    mesh = _mesh((8,), ("data",))
    mesh2 = _mesh((2, 4), ("data", "model"))
    other = _target(mesh2, P(None, "model"), P("model", None))
    d = str(tmp_path / "persist")
    cfg = jaxckpt.Config(persistent_dir=d, persistent_interval=2, keep=1, job_id="persist-fallback")
    with jaxckpt.Checkpointer(cfg) as ck:
        _saved(ck, mesh, range(6))
        assert ck.all_steps() == [5] and ck.persister.steps() == [0, 2, 4]
        assert ck.store.steps() == [5]  # steps held for their persist were freed once on disk
        # held in memory: memory serves it
        assert ck.restore_with_extra(other, None).source == "memory"
        # evicted from memory (keep=1): the persistent tier serves it, bit for bit onto another sharding
        r = ck.restore_with_extra(other, 4)
        assert r.source == "persistent" and r.step == 4
        assert set(r.report.bytes_by_kind) == {"persistent"} and r.report.bytes_by_node == {"persistent": r.report.nbytes}
        _assert_state(r.state, 4, other)
        _assert_state(ck.restore(other, step=2), 2, other)
        assert type(ck.restore(other, step=2)["count"]) is np.int32
        # held in memory but a chunk is corrupt: that chunk comes from the persisted copy, verified, reported
        ck.save(6, _state(6, mesh))
        ck.wait()
        ck.persister.wait()
        ck.store.slot_bytes(6)[0] ^= 0xFF
        r = ck.restore_with_extra(other, 6)
        assert r.source == "memory+persistent"
        assert any("failed its crc32c check" in f and "persistent source" in f for f in r.report.fallbacks), \
            r.report.fallbacks
        _assert_state(r.state, 6, other)
        with pytest.raises(StepNotFoundError, match=r"step 3 is not held .* \(asked: persistent directory "):
            ck.restore(other, step=3)  # neither in memory nor persisted
        with pytest.raises(TargetMismatchError, match=r"params/ids: saved shape \(8, 16\), target shape \(8, 17\)"):
            bad = _target(mesh)
            bad["params"]["ids"] = jax.ShapeDtypeStruct((8, 17), jnp.int32, sharding=NamedSharding(mesh, P()))
            ck.restore(bad, step=4)
        with pytest.raises(TargetMismatchError, match="params/w: saved dtype float32, target dtype float16"):
            bad = _target(mesh)
            bad["params"]["w"] = jax.ShapeDtypeStruct((16, 8), jnp.float16, sharding=NamedSharding(mesh, P()))
            ck.restore(bad, step=4)

    # A new process after a restart: nothing in memory, latest_step() and restore() use the directory.
    with jaxckpt.Checkpointer(jaxckpt.Config(persistent_dir=d, job_id="persist-fresh")) as fresh:
        assert fresh.all_steps() == [] and fresh.latest_step() == 6
        r = fresh.restore_with_extra(other, None)
        assert (r.source, r.step) == ("persistent", 6)
        _assert_state(r.state, 6, other)
        host = fresh.restore(None, step=4)  # no target: numpy arrays
        assert isinstance(host["params"]["w"], np.ndarray)
        np.testing.assert_array_equal(_bits(host["params"]["w"]), _bits(_host(4)["w"]))


def _flip(ck, step: int, path: str = "params/w") -> None:
    """Flip a bit of the first chunk of ``path`` saved at ``step`` in this process's memory store."""
    with ck.store.open(step) as view:
        chunk = mf.decode(view.manifest).array(path).chunks[0]
    ck.store.slot_bytes(step)[chunk.offset + 5] ^= 0x10


def test_a_newest_step_corrupt_in_memory_comes_from_disk_in_the_same_restore(tmp_path):
    mesh = _mesh((8,), ("data",))
    other = _target(_mesh((2, 4), ("data", "model")), P(None, "model"), P("model", None))
    cfg = jaxckpt.Config(persistent_dir=str(tmp_path), persistent_interval=2, keep=3, job_id="persist-corrupt")
    with jaxckpt.Checkpointer(cfg) as ck:
        _saved(ck, mesh, range(5))
        assert ck.all_steps() == [2, 3, 4] and ck.persister.steps() == [0, 2, 4]
        _flip(ck, 4)
        r = ck.restore_with_extra(other)  # the newest step: the corrupt chunk comes from disk, nothing is skipped
        _assert_state(r.state, 4, other)
        rep = ck.last_restore_report
        assert (r.step, r.source, rep.skipped) == (4, "memory+persistent", [])
        assert 0 < rep.bytes_by_kind["persistent"] < rep.nbytes and rep.bytes_by_kind["local"] > 0
        assert len(rep.fallbacks) == 1 and "params/w: step 4" in rep.fallbacks[0], rep.fallbacks
        assert "local source own memory of process 0 failed (ChecksumError" in rep.fallbacks[0], rep.fallbacks
        assert "read from persistent source persistent directory" in rep.fallbacks[0], rep.fallbacks
        assert (ck.latest_step(), ck.all_steps()) == (4, [2, 3, 4])  # nothing forgotten


def test_a_newest_step_corrupt_in_memory_and_not_persisted_falls_back_in_the_same_restore(tmp_path):
    mesh = _mesh((8,), ("data",))
    target = _target(mesh)
    cfg = jaxckpt.Config(persistent_dir=str(tmp_path), persistent_interval=2, keep=2, job_id="persist-older")
    with jaxckpt.Checkpointer(cfg) as ck:
        _saved(ck, mesh, range(6))
        assert ck.all_steps() == [4, 5] and ck.persister.steps() == [0, 2, 4]
        _flip(ck, 5)
        _flip(ck, 4)  # step 4's memory copy is bad too: its persisted copy is read instead
        r = ck.restore_with_extra(target)
        _assert_state(r.state, 4, target)
        rep = ck.last_restore_report
        assert (r.step, r.source) == (4, "memory+persistent") and len(rep.skipped) == 1, rep.skipped
        assert rep.skipped[0].startswith("step 5: process 0 could not read it (ChecksumError: params/w: step 5")
        assert rep.skipped[0].endswith("fell back to step 4")
        assert (ck.latest_step(), ck.all_steps()) == (4, [4])  # step 5 forgotten: its number may be saved again
        # a step only the directory holds is a fallback too: memory holds 6 and 7, both corrupt, 6 persisted
        _saved(ck, mesh, [6, 7])
        _flip(ck, 7)
        ck.store.slot_bytes(6)[:] = 0  # step 6 in memory: every chunk bad, its manifest still good
        r = ck.restore_with_extra(target)
        _assert_state(r.state, 6, target)
        assert (r.step, r.source) == (6, "persistent") and ck.last_restore_report.skipped[0].startswith("step 7:")


def test_leaf_orbax_cannot_write_fails_that_persist_only(tmp_path):
    mesh = _mesh((8,), ("data",))
    cfg = jaxckpt.Config(persistent_dir=str(tmp_path), persistent_interval=1, job_id="persist-str")
    with jaxckpt.Checkpointer(cfg) as ck:
        ck.save(1, {**_state(1, mesh), "name": "run-1"})
        ck.wait()
        with pytest.raises(UnsupportedLeafError, match="name: a str leaf cannot be written in the Orbax format"):
            ck.persister.wait()
        assert ck.persister.steps() == [] and ck.all_steps() == [1]
        assert ck.restore({**_target(mesh), "name": ""})["name"] == "run-1"  # memory still has it


def test_persists_never_queue_more_than_two_and_never_block_saves(tmp_path):
    mesh = _mesh((8,), ("data",))
    cfg = jaxckpt.Config(persistent_dir=str(tmp_path), persistent_interval=1, job_id="persist-skip")
    with jaxckpt.Checkpointer(cfg) as ck:
        for s in range(12):  # no waiting: persists fall behind, and the tier skips steps instead of queueing
            ck.save(s, _state(s, mesh))
        ck.wait()
        ck.persister.wait()
        persisted, skipped = ck.persister.persisted, ck.persister.skipped
        assert sorted(persisted + skipped) == list(range(12)) and persisted[0] == 0
        assert ck.persister.steps() == persisted[-3:]  # persistent_keep=3
        assert ck.store.steps() == [11]  # every hold released
    for s in persisted[-3:]:
        _assert_state(ocp.StandardCheckpointer().restore(tmp_path / str(s) / "default"), s)


# ------------------------------------------------------------------------------------ crash mid-persist
def _persist_forever(directory: str) -> None:
    """A trainer that persists every other step of a ~24 MB state until it is killed."""
    import jaxckpt as jc

    rng = np.random.default_rng(0)
    state = {f"layer{i}": rng.standard_normal((512, 256)).astype(np.float32) for i in range(48)}
    with jc.Checkpointer(jc.Config(persistent_dir=directory, persistent_interval=2, persistent_keep=2)) as ck:
        step = 0
        while True:
            ck.save(step, {k: jax.numpy.asarray(v + step) for k, v in state.items()})
            ck.wait()
            ck.persister.wait()
            step += 1


def _in_flight(d) -> bool:
    """A persist under way (its temporary is there) after one that finished."""
    return d.exists() and any(TMP_SUFFIX in p for p in os.listdir(d)) and bool(persisted_steps(d))


def _stopped(pid: int, timeout: float = 20.0) -> None:
    """Until every thread of ``pid`` is stopped (SIGSTOP delivered), or fail saying so."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
                continue
        if states and all(st in ("T", "t") for st in states):
            return
        time.sleep(0.005)
    pytest.fail(f"process {pid} did not stop within {timeout}s of SIGSTOP")


def test_kill_during_persist_leaves_no_visible_step(tmp_path):
    d = tmp_path / "persist"
    with start(_persist_forever, nodes=1, procs_per_node=1, distributed=False, args=[str(d)]) as job:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if job.poll()[0] is not None:
                pytest.fail(f"the trainer exited: {job.results()[0].error}")
            if _in_flight(d):
                # Frozen first, then looked at again: a persist seen in flight may finish before a kill lands
                # (under load it did), and then nothing half-written would be left to check.
                job.kill_process(0, signal.SIGSTOP, reason="killed mid-persist")
                _stopped(job.pids()[0])
                if _in_flight(d):
                    job.kill_process(0)
                    break
                job.kill_process(0, signal.SIGCONT)  # it finished meanwhile: wait for the next one
            time.sleep(0.002)
        else:
            pytest.fail("no persist was caught in flight")
        job.wait(30)
    left = sorted(os.listdir(d))
    assert any(TMP_SUFFIX in p for p in left), left  # killed mid-persist: the half-written step is there...
    steps = persisted_steps(d)
    assert steps and all(str(s) in left for s in steps)
    assert ocp.CheckpointManager(d).all_steps() == steps  # ...and neither jaxckpt nor Orbax lists it
    assert sorted(ocp.path.step.checkpoint_steps(d)) == steps  # jaxckpt's own listing is Orbax's
    target = {f"layer{i}": np.zeros((512, 256), np.float32) for i in range(48)}
    newest = steps[-1]
    with jaxckpt.Checkpointer(jaxckpt.Config(persistent_dir=str(d), persistent_interval=2)) as ck:
        out = ck.restore(target, step=newest)
        want = np.random.default_rng(0).standard_normal((512, 256)).astype(np.float32) + newest
        np.testing.assert_array_equal(out["layer0"], want)
        ck.save(newest + 2, out)  # the next run's first persist cleans up (its start-up reads no disk)
        ck.wait()
        ck.persister.wait()
        assert not any(TMP_SUFFIX in p for p in os.listdir(d)), os.listdir(d)
        assert persisted_steps(d)[-1] == newest + 2


def test_simulated_leftover_temporary_is_ignored_and_cleaned(tmp_path):
    d = tmp_path / "persist"
    mesh = _mesh((8,), ("data",))
    cfg = jaxckpt.Config(persistent_dir=str(d), persistent_interval=2, job_id="persist-tmp")
    with jaxckpt.Checkpointer(cfg) as ck:
        _saved(ck, mesh, [2])
    half = d / f"4{TMP_SUFFIX}"
    (half / "default").mkdir(parents=True)
    (half / "default" / "junk").write_bytes(b"\0" * 100)
    assert persisted_steps(d) == [2] and ocp.CheckpointManager(d).all_steps() == [2]
    with jaxckpt.Checkpointer(jaxckpt.Config(persistent_dir=str(d), job_id="persist-read")) as reader:
        assert reader.latest_step() == 2  # a reader (no interval) leaves the directory alone
        assert half.exists()
    with jaxckpt.Checkpointer(cfg.replace(job_id="persist-tmp2")) as ck:
        assert half.exists()  # a writer's start-up reads nothing from the disk: its first persist cleans up
        assert persisted_steps(d) == [2] and ck.latest_step() == 2
        _saved(ck, mesh, [6])
        assert not half.exists() and persisted_steps(d) == [2, 6]


# ------------------------------------------------------------------------------------------ multi-process
def _mp_persist(directory: str) -> dict:
    from jax.sharding import Mesh

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices).reshape(2, 2), ("data", "model"))
    host = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    repl = np.arange(6, dtype=np.float32)

    def state(s):
        return {"w": jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("data", "model")),
                                                  lambda i: host[i] + s),
                "r": jax.make_array_from_callback(repl.shape, NamedSharding(mesh, P()), lambda i: repl[i] * s),
                "step": s}

    cfg = jaxckpt.Config(persistent_dir=directory, persistent_interval=2, job_id="mp-persist", commit_timeout_s=60.0)
    with jaxckpt.Checkpointer(cfg) as ck:
        for s in range(5):
            ck.save(s, state(s))
            ck.wait()
            ck.persister.wait()
        persisted = list(ck.persister.persisted)
    target = {"w": jax.ShapeDtypeStruct(host.shape, jnp.float32, sharding=NamedSharding(mesh, P("model", None))),
              "r": jax.ShapeDtypeStruct(repl.shape, jnp.float32, sharding=NamedSharding(mesh, P("data"))),
              "step": 0}
    with jaxckpt.Checkpointer(jaxckpt.Config(persistent_dir=directory, job_id="mp-fresh")) as fresh:
        r = fresh.restore_with_extra(target, None)
        for shard in r.state["w"].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), (host + 4)[shard.index])
        for shard in r.state["r"].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), (repl * 4)[shard.index])
    return {"persisted": persisted, "source": r.source, "step": r.step}


def test_multiprocess_persist_is_collective_and_standard(tmp_path):
    d = str(tmp_path / "persist")
    values = expect_ok(launch(_mp_persist, nodes=2, procs_per_node=1, devices_per_proc=2, args=[d], timeout=120))
    assert all(v == {"persisted": [0, 2, 4], "source": "persistent", "step": 4} for v in values), values
    # Written by 2 processes, read by this single 8-device process with plain Orbax.
    mesh = _mesh((8,), ("x",))
    tgt = {"w": jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(mesh, P("x"))),
           "r": jax.ShapeDtypeStruct((6,), jnp.float32, sharding=NamedSharding(mesh, P())), "step": 0}
    out = ocp.CheckpointManager(d).restore(4, args=ocp.args.StandardRestore(tgt))
    np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(128, dtype=np.float32).reshape(16, 8) + 4)
    np.testing.assert_array_equal(np.asarray(out["r"]), np.arange(6, dtype=np.float32) * 4)
    assert out["step"] == 4
