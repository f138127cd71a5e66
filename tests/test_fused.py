"""``wrap_step``: the compiled step returns a pinned-host copy of its incoming state (``copy="in_program"``), or
a save() is waited for before the plain program (``"before_step"``, what ``"auto"`` takes on CPU devices)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt


def _state(axis_type=jax.sharding.AxisType.Explicit):
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type, axis_type))
    w = jax.device_put(jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8), NamedSharding(mesh, P("data", "model")))
    b = jax.device_put(jnp.ones((8,), jnp.bfloat16), NamedSharding(mesh, P()))
    m = jax.device_put(jnp.arange(16.0).reshape(2, 8), NamedSharding(mesh, P(None, "model")))  # partly replicated
    # big enough to be copied in pieces on an accelerator (jaxckpt.jax.shards.local_pieces)
    e = jax.device_put(jnp.arange(1024 * 128, dtype=jnp.float32).reshape(1024, 128), NamedSharding(mesh, P(None, "model")))
    f = jax.device_put(jnp.arange(2048 * 64, dtype=jnp.int32).reshape(2048, 64), NamedSharding(mesh, P()))
    return {"w": w, "b": b, "m": m, "e": e, "f": f, "step": 0, "key": jax.random.key(1)}


def _train_step(state, lr):
    w = state["w"] * 0.5 + lr
    return {"w": w, "b": state["b"] + 1, "m": state["m"] * 3, "e": state["e"] - lr, "f": state["f"] * 3,
            "step": state["step"] + 1, "key": jax.random.split(state["key"])[0]}, w.sum()


@pytest.mark.parametrize("copy", ["in_program", "before_step"])
@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto])
def test_fused_snapshots_equal_the_incoming_state_under_donation(axis_type, copy):
    state = _state(axis_type)
    expected = {}
    with jaxckpt.Checkpointer(jaxckpt.Config(keep=4)) as ck:
        step_fn = ck.wrap_step(_train_step, copy=copy)
        for k in range(4):
            expected[k] = {n: np.asarray(state[n]).copy() for n in ("w", "b", "m", "e", "f")}
            expected[k]["key"] = np.asarray(jax.random.key_data(state["key"])).copy()
            incoming = state
            state, _ = step_fn(state, 1.0, save_step=k)  # donates the incoming state
            if k:  # the first call's state came from outside jit: its python step counter is no array
                kept = [n for n, v in incoming.items() if isinstance(v, jax.Array) and not v.is_deleted()]
                assert not kept, f"step {k}: the snapshot held back the donation of {kept}"
        state, _ = step_fn(state, 1.0)  # plain step, no snapshot
        ck.wait()
        assert ck.all_steps() == [0, 1, 2, 3]
        # On CPU the copies are not cut into pieces (tests/test_pinned_path.py: an accelerator's are): each box
        # saved whole, once.
        with ck.engine.open(3) as (_, manifests, _reader):
            chunks = {a.path: sorted((c.box.start, c.box.stop) for c in a.chunks) for a in manifests[0].arrays}
        assert chunks["e"] == [((0, 0), (1024, 64)), ((0, 64), (1024, 128))], chunks["e"]
        assert chunks["f"] == [((0, 0), (2048, 64))], chunks["f"]
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                              if isinstance(x, jax.Array) else x, _state(axis_type))
        # jit turns the python step counter into an int32 array after the first step; steps saved later hold that.
        target["step"] = jax.ShapeDtypeStruct((), jnp.int32)
        for k in range(4):
            got = ck.restore(target, step=k)
            np.testing.assert_array_equal(np.asarray(got["w"]), expected[k]["w"])
            for n in ("m", "e", "f"):
                np.testing.assert_array_equal(np.asarray(got[n]), expected[k][n])
                assert got[n].sharding == target[n].sharding
            np.testing.assert_array_equal(np.asarray(got["b"]).view(np.uint16), expected[k]["b"].view(np.uint16))
            assert got["w"].sharding == target["w"].sharding
            assert int(got["step"]) == k
            np.testing.assert_array_equal(jax.random.key_data(got["key"]), expected[k]["key"])


# A refused save must leave the caller with a usable state. Run in a child process: on 2+ CPU devices a donating
# step on a donated (deleted) state can segfault inside JAX, which must show as an exit code, not kill pytest.
# The routes run one after the other in one child (each its own Checkpointer and state): one JAX start-up.
_REFUSAL_CHILD = r'''
import sys
import jax
jax.config.update("jax_num_cpu_devices", 4)
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxckpt
from jaxckpt import errors


def run(route, copy):
    mesh = jax.make_mesh((4,), ("d",))

    def make():
        s = {"w": jax.device_put(jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8), NamedSharding(mesh, P("d"))),
             "b": jax.device_put(jnp.ones(8, jnp.float32), NamedSharding(mesh, P()))}
        if route == "leaf":
            s["c"] = 1j  # jit takes a complex scalar; jaxckpt cannot hold one
        return s

    def raw(s):
        out = {"w": s["w"] * 0.5 + s["b"], "b": s["b"] + 1}
        if "c" in s:
            out["c"] = s["c"] * 2
        return out

    step = jax.jit(raw, donate_argnums=0)
    ref = make()
    for _ in range(3):
        ref = step(ref)
    want = {k: np.asarray(v).copy() for k, v in ref.items()}

    config = jaxckpt.Config(keep=1)
    if route == "budget":
        with jaxckpt.Checkpointer(jaxckpt.Config()) as probe:
            nbytes = probe.save(1, make()).nbytes
        config = jaxckpt.Config(keep=1, memory_budget_bytes=nbytes * 3 // 2)
    ck = jaxckpt.Checkpointer(config)
    fused = ck.wrap_step(raw, copy=copy)
    s = step(make())  # one warm donating step
    expected, save_step = {"step": errors.StepError, "closed": errors.ClosedError,
                           "leaf": errors.UnsupportedLeafError, "budget": errors.BudgetExceededError}[route], 1
    if route == "step":
        ck.save(5, s)
        ck.wait()
    elif route == "closed":
        ck.close()
    elif route == "budget":
        ck.save(1, s).result()
        save_step = 2
    elif route == "leaf":
        s["c"] = complex(s["c"])  # the step returned an array; a python complex is what jaxckpt refuses
    try:
        fused(s, save_step=save_step)
    except expected as e:
        print("refused:", type(e).__name__, e)
    else:
        raise SystemExit(f"fused(save_step={save_step}) did not raise {expected.__name__}")
    deleted = [k for k, v in s.items() if isinstance(v, jax.Array) and v.is_deleted()]
    assert not deleted, f"the refused save donated {deleted}"
    s = step(s)  # the next warm donating steps run on the caller's state
    s = step(s)
    for k, v in want.items():
        got = np.asarray(s[k]).reshape(-1).view(np.uint8)
        assert np.array_equal(got, v.reshape(-1).view(np.uint8)), f"{k} differs from the unwrapped run"
    if route == "step":
        fused(s, save_step=save_step + 10)  # the checkpointer still works after a refusal
        ck.wait()
        assert ck.latest_step() == save_step + 10, ck.latest_step()
        ck.close()
    if route in ("leaf", "budget"):
        ck.close()  # the next route's Checkpointer is its own


for copy in ("in_program", "before_step"):
    for route in sys.argv[1:]:
        print("route:", route, copy, flush=True)
        run(route, copy)
        print("OK", route, copy, flush=True)
'''


REFUSALS = {"step": "StepError", "closed": "ClosedError", "leaf": "UnsupportedLeafError",
            "budget": "BudgetExceededError"}


@pytest.fixture(scope="module")
def refusals() -> dict:
    """Every route of _REFUSAL_CHILD, one after the other in one child process (a Checkpointer and a state each):
    its exit code, its stderr and each route's output (a route the child did not reach has none)."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", _REFUSAL_CHILD, *REFUSALS], capture_output=True, text=True,
                          timeout=240)
    parts = proc.stdout.split("route: ")
    return {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr,
            "routes": {p.split("\n", 1)[0]: p for p in parts[1:]}}


@pytest.mark.parametrize("copy", ["in_program", "before_step"])
@pytest.mark.parametrize("route,error", list(REFUSALS.items()))
def test_refused_fused_save_leaves_the_caller_a_usable_state(route, error, copy, refusals):
    out = refusals["routes"].get(f"{route} {copy}", "")
    assert out.rstrip().endswith(f"OK {route} {copy}"), \
        f"child exited {refusals['returncode']} (-11: segfault)\n{refusals['stdout']}\n{refusals['stderr'][-3000:]}"
    assert f"refused: {error}" in out, out
    assert refusals["returncode"] == 0, f"child exited {refusals['returncode']}\n{refusals['stderr'][-3000:]}"


def test_a_fused_save_of_many_shards_sets_off_no_collection_while_its_reads_are_built(monkeypatch):
    """The fused path views its host copies on the dispatcher thread while the training loop runs: JAX's Python
    array and sharding of every local buffer and the reads per shard, thousands of tracked objects per save.
    With the collector running, as in training, they set off young collections that promoted them (and whatever
    the loop held then) towards the oldest generation, and so full collections every few saves; built with the
    collector paused, no collection runs while they are, and what the save copied is the incoming state, bit for
    bit, though the step donated it.

    The collections are counted over the building of the reads itself (``snapshot._owned_views``, on the
    dispatcher): the training thread's own objects (the step's outputs) may set off a young collection before
    or after it, which is the collector doing its work, not the save's."""
    import gc

    from jaxckpt.jax import snapshot

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    state = {f"p{i:03d}": jax.device_put(jnp.full((8, 4), float(i), jnp.float32), NamedSharding(mesh, P("data", "model")))
             for i in range(128)}  # 1,024 shards
    built, views = [], snapshot._owned_views

    def counted(*args):
        before = [g["collections"] for g in gc.get_stats()]
        out = views(*args)
        built.append(([g["collections"] for g in gc.get_stats()], before, sum(len(r) for r in out)))
        return out

    with jaxckpt.Checkpointer(jaxckpt.Config(keep=2)) as ck:
        step_fn = ck.wrap_step(lambda s: (jax.tree.map(lambda x: x * 2.0 + 1.0, s), 0.0), copy="in_program")
        state, _ = step_fn(state, save_step=1)  # compiles, plans: the next save of this layout is the steady one
        ck.wait()
        state = jax.block_until_ready(state)
        expected = {k: np.asarray(v).copy() for k, v in state.items()}
        monkeypatch.setattr(snapshot, "_owned_views", counted)
        assert gc.isenabled()  # the collector runs, as in training
        state, _ = step_fn(state, save_step=2)
        ck.wait()
        monkeypatch.setattr(snapshot, "_owned_views", views)
        assert gc.isenabled()  # and runs again after the save
        assert len(built) == 1, built
        after, before, shards = built[0]
        assert shards == 1024, shards  # every shard's read was built in the counted span
        ran = [a - b for a, b in zip(after, before)]
        assert ran == [0, 0, 0], f"collections per generation while the fused save's reads were built: {ran}"
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}
        got = ck.restore(target, step=2)
        for k, want in expected.items():
            np.testing.assert_array_equal(np.asarray(got[k]).view(np.uint32), want.view(np.uint32), err_msg=k)



def test_auto_waits_for_a_save_before_the_step_on_cpu_devices(caplog):
    """On CPU devices a save() reads the buffers in place: ``copy="auto"`` saves, waits until this process's bytes
    are in host memory, then runs the plain program, which donates the state (nothing holds it back). The
    snapshot is the incoming state, and the wrong way named raises ConfigError with the value."""
    import logging

    with pytest.raises(jaxckpt.errors.ConfigError, match="copy='pinned'.*auto, in_program, before_step"):
        jaxckpt.Checkpointer.wrap_step(None, _train_step, copy="pinned")
    state = _state()
    with jaxckpt.Checkpointer(jaxckpt.Config(keep=2)) as ck, caplog.at_level(logging.INFO, "jaxckpt.jax.fused"):
        step_fn = ck.wrap_step(_train_step)
        state, _ = step_fn(state, 1.0, save_step=0)
        expected = {n: np.asarray(state[n]).copy() for n in ("w", "e", "f")}
        incoming = state
        state, loss = step_fn(state, 1.0, save_step=1)
        assert step_fn.last_save.local_done()  # the call returned once the copy was taken
        kept = [n for n, v in incoming.items() if isinstance(v, jax.Array) and not v.is_deleted()]
        assert not kept, f"the waited save held back the donation of {kept}"
        ck.wait()
        said = [r.getMessage() for r in caplog.records if r.name == "jaxckpt.jax.fused"]
        assert said == ["wrap_step: snapshots taken before step"], said
        got = ck.restore(step=1)
        for n, want in expected.items():
            np.testing.assert_array_equal(got[n].view(np.uint8), want.view(np.uint8), err_msg=n)
