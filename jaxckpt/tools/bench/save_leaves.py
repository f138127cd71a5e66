"""The leaf-count sweep of ``jaxckpt bench save``: save() call time against the number of leaves, same total bytes.

For each leaf count (a dict of float32 arrays, same total bytes, shardings rotating over ``save.SPECS`` on the
2x4 mesh of 8 CPU devices) it measures, in one run: jaxckpt's plain ``save()`` call; ``wrap_step``: the wrapped
step's call with and without ``save_step`` and the part of the call spent in the save (``last_save``'s
``save_call_seconds``: the calling thread's time outside the compiled program; ``copy="in_program"``, the way
an accelerator takes, on these CPU devices too); Orbax ``AsyncCheckpointer``'s save
call (StandardSave to tmpfs); and the cost of one zero-copy host view of a device buffer (what a plain save must
take per shard read before it returns, so that a donating next step leaves the buffer alone); and restore time
onto the saved shardings, jaxckpt from memory against Orbax ``StandardRestore`` from tmpfs.
jax is imported inside the functions: the caller (``save.measure``) has configured 8 CPU devices first.
"""
from __future__ import annotations

import gc
import logging
import os
import shutil
import time
from typing import Any, Mapping

from jaxckpt.tools.bench import report

log = logging.getLogger("jaxckpt.tools.bench")

FULL = {"leaf_counts": "8,128,1024,4096", "leaf_total": "64M", "leaf_repeats": 5}
# The mixed layout (issue 26): a 4x2 mesh whose shardings alternate fully sharded, split over one axis and
# replicated over the other, and fully replicated, so that most local buffers are replicas a save reads once.
MIXED_MESH = (4, 2)
MIXED_SPECS = (("data", "model"), (None, "model"), ("data", None), ())
# Fresh saves run on these layouts: the sweep's own, the mixed one, and every leaf fully replicated (P() on the
# mixed mesh: one shard saved per leaf), which shows what a replicated leaf costs against the shards it saves.
LAYOUTS = ("sharded", "mixed", "replicated")
QUICK = {"leaf_counts": "8,64", "leaf_total": "1M", "leaf_repeats": 3}


def make_state(n_leaves: int, total_bytes: int, layout: str = "sharded") -> dict[str, Any]:
    """``n_leaves`` float32 arrays of about ``total_bytes`` together, each sharded over all 8 devices (or on
    the ``mixed`` layout: ``MIXED_MESH``, ``MIXED_SPECS``, or ``replicated`` on every device of it)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxckpt.tools.bench.state import DEVICES, MESH, SPECS

    shape, specs = {"sharded": (MESH, SPECS), "mixed": (MIXED_MESH, MIXED_SPECS), "replicated": (MIXED_MESH, ((),))}[layout]
    mesh = Mesh(np.array(jax.devices()[:DEVICES]).reshape(shape), ("data", "model"))
    per_leaf = max(DEVICES * DEVICES, total_bytes // 4 // n_leaves)
    cols = 64 if per_leaf >= 64 * 64 else DEVICES
    rows = max(DEVICES, per_leaf // cols // DEVICES * DEVICES)
    host = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    state = {f"layer{i:05d}/w": jax.device_put(host + np.float32(i), NamedSharding(mesh, P(*specs[i % len(specs)])))
             for i in range(n_leaves)}
    return jax.block_until_ready(state)


def bench_fresh(state: dict[str, Any], repeats: int, warmup: int) -> dict[str, Any]:
    """save() of the arrays a donating step just made, as in training (JAX has built no per-device arrays of
    them yet): the call's seconds, and in the same run the floor of what it takes: a zero-copy view of each
    shard it saves, first views of fresh buffers (``view_s``: ``np.asarray`` of the per-device array, the
    buffer-protocol view save() takes of float32; ``direct_view_s``: jaxlib's direct view, the one save()
    takes of bfloat16), and JAX's cost of exposing an array's local buffers (``expose_s``: ``_arrays`` of
    every local buffer, or the one buffer of a fully replicated array)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxckpt.jax.snapshot import fast_view

    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 0.5 + 1.0, s), donate_argnums=0)
    state = jax.tree.map(jnp.copy, state)
    call, state, devices = _save_calls(state, repeats, warmup, step)
    saved = 0
    views = fast_view()
    expose, view, direct = [], [], []
    for i in range(4):  # the two views alternate between first and second half of the shards
        state = jax.block_until_ready(step(state))
        gc.collect()
        gc.disable()  # as save() takes its views
        t0 = time.perf_counter()
        taken = [[x._fully_replicated_shard()] if x.is_fully_replicated else x._arrays for x in state.values()]
        t1 = time.perf_counter()
        order = [[d.id for d in x.sharding._addressable_device_assignment] for x in state.values()]
        picked = [a if len(a) == 1 else [b for b, d in zip(a, o) if d in devs]
                  for a, o, devs in zip(taken, order, devices)]
        saved = sum(map(len, picked))
        half = len(picked) // 2
        first, second = (picked[:half], picked[half:]) if i % 2 else (picked[half:], picked[:half])
        if not half:  # one leaf: both views of its shards
            first = second = picked
        t2 = time.perf_counter()
        got = [list(map(np.asarray, a)) for a in first]
        t3 = time.perf_counter()
        got2 = [views(a) for a in second]
        t4 = time.perf_counter()
        gc.enable()
        expose.append(t1 - t0)
        n1, n2 = sum(map(len, first)), sum(map(len, second))
        view.append((t3 - t2) / max(n1, 1) * saved)  # per shard, scaled to all saved shards
        direct.append((t4 - t3) / max(n2, 1) * saved)
        del got, got2, taken, picked, first, second
    del state
    med = report.summarize(call)["median"]
    view_s, expose_s = min(view), min(expose)
    return {"fresh_save_call_s": report.summarize(call), "saved_shards": saved, "view_s": view_s,
            "direct_view_s": min(direct), "expose_s": expose_s, "save_s_per_saved_shard": med / saved,
            "over_views": med / view_s, "over_views_and_expose": med / (view_s + expose_s)}


def _step(state: dict[str, Any]) -> dict[str, Any]:
    import jax
    return jax.tree.map(lambda x: x * 0.5 + 1.0, state)


def bench_plain(state: dict[str, Any], repeats: int, warmup: int) -> dict[str, Any]:
    """jaxckpt ``save()`` call seconds, the state unchanged between saves."""
    return report.summarize(_save_calls(state, repeats, warmup)[0])


def _save_calls(state: dict[str, Any], repeats: int, warmup: int, step: Any = None) -> tuple[list[float], Any, Any]:
    """save() call seconds of ``repeats`` saves after the warm-up ones (each of ``step(state)`` when a step is
    given), the last state and the devices the save read of each array."""
    import jax

    from jaxckpt import Checkpointer, Config

    call = []
    with Checkpointer(Config()) as ck:
        for i in range(max(warmup, 2) + repeats):
            if step is not None:
                state = jax.block_until_ready(step(state))
            t0 = time.perf_counter()
            ck.save(i + 1, state)
            t1 = time.perf_counter()
            ck.wait()
            if i >= max(warmup, 2):
                call.append(t1 - t0)
        devices = ck.engine.last_devices()
    return call, state, devices


def bench_wrap_step(state: dict[str, Any], repeats: int, warmup: int) -> dict[str, Any]:
    """The wrapped (donating) step: plain call, call with ``save_step``, and the save's part of the latter."""
    import jax
    import jax.numpy as jnp
    from jaxckpt import Checkpointer, Config

    state = jax.tree.map(jnp.copy, state)  # donated below: the caller's state stays
    plain, fused, save = [], [], []
    with Checkpointer(Config()) as ck:
        step = ck.wrap_step(_step, copy="in_program")  # the program's copy, as on an accelerator
        for i in range(max(warmup, 2) + repeats):
            t0 = time.perf_counter()
            state = step(state)
            t1 = time.perf_counter()
            jax.block_until_ready(state)
            t2 = time.perf_counter()
            state = step(state, save_step=i + 1)
            t3 = time.perf_counter()
            jax.block_until_ready(state)
            ck.wait()
            if i >= max(warmup, 2):
                plain.append(t1 - t0)
                fused.append(t3 - t2)
                save.append(step.last_save.save_call_seconds)
    del state
    return {"plain_step_call_s": report.summarize(plain), "wrap_step_call_s": report.summarize(fused),
            "wrap_step_save_s": report.summarize(save)}


def bench_orbax_call(state: dict[str, Any], repeats: int, warmup: int) -> dict[str, Any]:
    """Orbax AsyncCheckpointer save() call seconds (StandardSave to tmpfs)."""
    import orbax.checkpoint as ocp


    call = []
    root = report.tmpfs_dir("jaxckpt-bench-orbax-", "Orbax")
    ckptr = ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())
    try:
        for i in range(warmup + repeats):
            path = os.path.join(root, f"r{i}")
            t0 = time.perf_counter()
            ckptr.save(path, args=ocp.args.StandardSave(state))
            t1 = time.perf_counter()
            ckptr.wait_until_finished()
            shutil.rmtree(path)
            if i >= warmup:
                call.append(t1 - t0)
    finally:
        ckptr.close()
        shutil.rmtree(root, ignore_errors=True)
    return report.summarize(call)


def bench_restore(state: dict[str, Any], repeats: int, warmup: int) -> dict[str, Any]:
    """Restore seconds onto the saved shardings: jaxckpt from memory, Orbax ``StandardRestore`` from tmpfs (the
    same process; each checked bit for bit once)."""
    import jax
    import orbax.checkpoint as ocp

    from jaxckpt import Checkpointer, Config
    from jaxckpt.tools.bench.state import check_equal, restore_target

    target = restore_target(state)
    out: dict[str, Any] = {}
    with Checkpointer(Config()) as ck:
        ck.save(1, state)
        ck.wait()
        times = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            got = jax.block_until_ready(ck.restore(target))
            times.append(time.perf_counter() - t0)
            if i == 0:
                check_equal("jaxckpt restore", got, state)
            del got
        out["jaxckpt_restore_s"] = report.summarize(times[warmup:])
    gc.collect()
    root = report.tmpfs_dir("jaxckpt-bench-orbax-", "Orbax")
    ckptr = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    try:
        path = os.path.join(root, "r")
        ckptr.save(path, args=ocp.args.StandardSave(state))
        times = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            got = jax.block_until_ready(ckptr.restore(path, args=ocp.args.StandardRestore(target)))
            times.append(time.perf_counter() - t0)
            if i == 0:
                check_equal("Orbax restore", got, state)
            del got
        out["orbax_restore_s"] = report.summarize(times[warmup:])
    finally:
        ckptr.close()
        shutil.rmtree(root, ignore_errors=True)
    out["restore_orbax_over_jaxckpt"] = out["orbax_restore_s"]["median"] / out["jaxckpt_restore_s"]["median"]
    return out


def view_seconds_per_shard(state: dict[str, Any], repeats: int = 3) -> float:
    """Seconds per zero-copy host view of one local device buffer (best of ``repeats`` passes over the state)."""
    import numpy as np

    from jaxckpt.jax.snapshot import fast_view

    views = fast_view()
    arrays = [x._arrays for x in state.values()]
    n = sum(len(a) for a in arrays)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        taken = [views(arrs) for arrs in arrays]
        best = min(best, time.perf_counter() - t0)
        del taken
    return best / max(n, 1) if n else float(np.nan)


def measure(opts: Mapping[str, Any], warmup: int) -> dict[str, Any]:
    """The sweep's result object (``leaf_sweep`` in the ``bench save`` JSON)."""
    rows = []
    for n in opts["leaf_counts"]:
        state = make_state(n, opts["leaf_total"])
        nbytes = sum(x.nbytes for x in state.values())
        shards = sum(len(x.sharding.addressable_devices) for x in state.values())
        reps = opts["leaf_repeats"]
        plain = bench_plain(state, reps, warmup)
        gc.collect()
        wrapped = bench_wrap_step(state, reps, warmup)
        gc.collect()
        orbax = bench_orbax_call(state, reps, warmup)
        gc.collect()
        restored = bench_restore(state, reps, warmup)
        view = view_seconds_per_shard(state)
        del state
        gc.collect()
        fresh = {}
        for name in LAYOUTS:
            other = make_state(n, opts["leaf_total"], name)
            fresh[name] = bench_fresh(other, reps, warmup)
            if name != "sharded":
                fresh[name]["shards"] = sum(len(x.sharding.addressable_devices) for x in other.values())
            del other
            gc.collect()
        for name, f in fresh.items():
            log.info("%d leaves, %s layout, fresh state: save() %.1f ms for %d saved shards (%.2f us each); their "
                     "views %.1f ms (direct views %.1f ms), JAX exposing the buffers %.1f ms: %.2fx the views, "
                     "%.2fx views + exposing", n, name, f["fresh_save_call_s"]["median"] * 1e3, f["saved_shards"],
                     f["save_s_per_saved_shard"] * 1e6, f["view_s"] * 1e3, f["direct_view_s"] * 1e3,
                     f["expose_s"] * 1e3, f["over_views"], f["over_views_and_expose"])
        row = {"leaves": n, "shards": shards, "size_bytes": nbytes, "jaxckpt_save_call_s": plain, **wrapped,
               "orbax_save_call_s": orbax, "view_s_per_shard": view, "fresh": fresh, **restored,
               "orbax_over_jaxckpt": orbax["median"] / plain["median"],
               "orbax_over_wrap_step_save": orbax["median"] / wrapped["wrap_step_save_s"]["median"]}
        rows.append(row)
        log.info("%d leaves (%d shards, %s): save() %.2f ms, wrap_step save %.2f ms (step %.1f ms, with save %.1f "
                 "ms), Orbax save() %.1f ms; one shard view %.2f us; restore %.1f ms, Orbax's %.1f ms", n, shards,
                 report.fmt_size(nbytes), plain["median"] * 1e3, wrapped["wrap_step_save_s"]["median"] * 1e3,
                 wrapped["plain_step_call_s"]["median"] * 1e3, wrapped["wrap_step_call_s"]["median"] * 1e3,
                 orbax["median"] * 1e3, view * 1e6, restored["jaxckpt_restore_s"]["median"] * 1e3,
                 restored["orbax_restore_s"]["median"] * 1e3)
    return {"total_bytes": opts["leaf_total"], "repeats": opts["leaf_repeats"], "rows": rows}


def render(sweep: Mapping[str, Any]) -> str:
    """The sweep's table and its reading, for the ``bench save`` section."""
    rows = []
    for r in sweep["rows"]:
        rows.append([str(r["leaves"]), str(r["shards"]), report.fmt_ms(r["jaxckpt_save_call_s"]),
                     report.fmt_ms(r["wrap_step_save_s"]), report.fmt_ms(r["plain_step_call_s"]),
                     report.fmt_ms(r["wrap_step_call_s"]), report.fmt_ms(r["orbax_save_call_s"]),
                     f"{report.fmt_num(r['orbax_over_jaxckpt'])}x", f"{report.fmt_num(r['orbax_over_wrap_step_save'])}x",
                     report.fmt_num(r["view_s_per_shard"] * 1e6)]
                    + ([report.fmt_ms(r["jaxckpt_restore_s"]), report.fmt_ms(r["orbax_restore_s"]),
                        f"{report.fmt_num(r['restore_orbax_over_jaxckpt'])}x"] if "jaxckpt_restore_s" in r else []))
    restores = all("jaxckpt_restore_s" in r for r in sweep["rows"])
    return "\n".join([
        f"#### save() against the number of leaves ({report.fmt_size(sweep['total_bytes'])} in total, "
        f"median (min–max) of {sweep['repeats']} repeats)", "",
        report.table(["leaves", "local shards", "jaxckpt save() ms", "wrap_step save ms", "step ms",
                      "step with save_step ms", "Orbax save() ms", "Orbax/save()", "Orbax/wrap_step save",
                      "us per shard view"] + (["jaxckpt restore ms", "Orbax restore ms", "restore Orbax/jaxckpt"]
                                              if restores else []), rows), "",
        "wrap_step save: the calling thread's time in the save during a call with `save_step` (the compiled "
        "program excluded; `copy=\"in_program\"`, the way an accelerator takes); step / step with save_step: "
        "the wrapped donating step's call without and with it. "
        "A plain save() must take one zero-copy view of each shard it reads before it returns (so that a "
        "donating next step leaves the buffer alone): the column \"us per shard view\" is that cost, measured in "
        "the same run." + (" Restore: onto the saved shardings in the same process, jaxckpt from memory "
                           "(`store=\"memory\"`), Orbax `StandardRestore` from tmpfs; each checked bit for bit once."
                           if restores else ""),
    ] + _render_fresh(sweep))


def _render_fresh(sweep: Mapping[str, Any]) -> list[str]:
    rows = []
    for r in sweep["rows"]:
        for name, f in r.get("fresh", {}).items():
            rows.append([str(r["leaves"]), name, str(f.get("shards", r["shards"])), str(f["saved_shards"]),
                         report.fmt_ms(f["fresh_save_call_s"]), report.fmt_num(f["save_s_per_saved_shard"] * 1e6),
                         f"{f['view_s'] * 1e3:.1f}", f"{f['direct_view_s'] * 1e3:.1f}",
                         f"{f['expose_s'] * 1e3:.1f}", f"{report.fmt_num(f['over_views'])}x",
                         f"{report.fmt_num(f['over_views_and_expose'])}x"])
    if not rows:
        return []
    return ["", "#### save() of the state a donating step just made, against its floor in the same run", "",
            report.table(["leaves", "layout", "local shards", "shards saved", "save() ms", "save() us per shard saved",
                          "views ms", "direct views ms", "JAX exposing ms", "save()/views",
                          "save()/(views + exposing)"], rows), "",
            "As in training, every save sees the arrays a donating step just made. Layouts: sharded (the sweep's "
            "own), mixed (4x2 mesh, shardings alternating P('data','model'), P(None,'model'), P('data',None), "
            "P()) and replicated (every leaf P() on that mesh: one shard saved per leaf). Views: a first zero-copy "
            "view of each shard the save reads, through the buffer protocol (`np.asarray` of the per-device array, "
            "the view save() takes of float32); direct views: jaxlib's own (`__array__`'s, the one save() takes of "
            "bfloat16), each timed on half the shards and scaled to all (the column \"us per shard view\" above "
            "re-views buffers already viewed, which JAX caches); JAX exposing: building the Python arrays of an "
            "array's local buffers (`_arrays`, or the one buffer of a fully replicated array), which JAX does for "
            "every local buffer before any one can be viewed."]
