"""The launched processes of ``jaxckpt bench cluster`` (see :mod:`jaxckpt.tools.bench.cluster` for the run as a whole).

Every function here runs inside a JAX process started by ``jaxckpt.testing`` (a simulated node of the job). The
state is a dict of float32 arrays on a ``(processes, devices per process)`` mesh with axes ``data`` (across
processes, i.e. nodes) and ``model`` (within a process): ``dp*`` arrays are split over ``model`` and replicated
over ``data`` (data-parallel: one copy per node, REFT's parity case), ``fsdp*`` arrays are split over both (held
once: copies or an XOR group protect them). Element ``k`` of array ``i`` at step ``s`` is
``(k % 4093) / 2 + 4096 i + s``: exact in float32, so a training step ``x + 1`` keeps every state a known
function of its step and any shard on any mesh is checked bit for bit against numbers computed from its index.

Results travel as JSON files in the run's results directory (``<phase>-p<process>.json``), written before a
process does anything that may kill it (a node loss, Orbax's emergency restore), so the driver has them whatever
happens next.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import numpy as np

log = logging.getLogger("jaxckpt.tools.bench")

COLS = 1024
PERIOD = 4093


# ----------------------------------------------------------------------------------------------- the state
def array_specs(n_arrays: int) -> dict[str, tuple]:
    """Array name -> PartitionSpec entries: half data-parallel (replicated over 'data'), half fully sharded."""
    out = {}
    for i in range(n_arrays):
        out[f"dp{i}" if i % 2 == 0 else f"fsdp{i}"] = (None, "model") if i % 2 == 0 else ("data", "model")
    return out


def rows_for(size: int, n_arrays: int) -> int:
    """Rows of each (rows, COLS) float32 array so that the arrays total about ``size`` bytes; a multiple of 8."""
    return max(8, size // (n_arrays * COLS * 4) // 8 * 8)


def expected(i: int, index: tuple, rows: int, step: int) -> np.ndarray:
    """The values of array ``i`` at ``step`` in the box ``index`` (a tuple of slices)."""
    r = np.arange(rows, dtype=np.int64)[index[0]]
    c = np.arange(COLS, dtype=np.int64)[index[1]]
    lin = (r[:, None] * COLS + c[None, :]) % PERIOD
    return (lin.astype(np.float32) * np.float32(0.5) + np.float32(4096 * i + step)).astype(np.float32)


def make_mesh(shape: tuple[int, int]) -> Any:
    import jax
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return jax.sharding.Mesh(np.array(devices).reshape(shape), ("data", "model"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)


def target(mesh: Any, spec: dict, subset: str = "all") -> dict[str, Any]:
    """The state's abstract pytree (shapes, dtype, shardings on ``mesh``); ``subset="dp"``: the data-parallel
    arrays only."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    rows = rows_for(spec["size"], spec["arrays"])
    return {k: jax.ShapeDtypeStruct((rows, COLS), np.float32, sharding=NamedSharding(mesh, P(*s)))
            for k, s in array_specs(spec["arrays"]).items() if subset == "all" or k.startswith(subset)}


def make_state(mesh: Any, spec: dict, step: int) -> dict[str, Any]:
    import jax
    out = {}
    for i, (k, t) in enumerate(target(mesh, spec).items()):
        out[k] = jax.make_array_from_callback(t.shape, t.sharding,
                                              lambda idx, i=i, r=t.shape[0]: expected(i, idx, r, step))
    return out


def check(state: dict[str, Any], spec: dict, step: int, what: str) -> None:
    """Every local shard of ``state`` equals the state of ``step`` bit for bit (AssertionError naming it)."""
    names = list(array_specs(spec["arrays"]))
    if sorted(state) != sorted(k for k in names if k in state) or not state:
        raise AssertionError(f"{what}: restored arrays {sorted(state)}, saved {names}")
    for i, k in enumerate(names):
        if k not in state:
            continue
        x = state[k]
        for shard in x.addressable_shards:
            got = np.asarray(shard.data).view(np.uint32)
            want = expected(i, shard.index, x.shape[0], step).view(np.uint32)
            if not np.array_equal(got, want):
                bad = int(np.count_nonzero(got != want))
                raise AssertionError(f"{what}: {k} step {step}: {bad} of {got.size} elements of shard {shard.index} "
                                     f"differ from the saved state")


def train_step() -> Any:
    import jax
    return jax.jit(lambda s: jax.tree.map(lambda x: x + np.float32(1), s), donate_argnums=0)


def state_bytes(spec: dict) -> int:
    return rows_for(spec["size"], spec["arrays"]) * COLS * 4 * spec["arrays"]


# ---------------------------------------------------------------------------------------------- plumbing
def setup() -> tuple[Any, Any]:
    """This process's NodeInfo and jax, quiet Orbax logging (the launcher already initialized JAX)."""
    import jax

    from jaxckpt.testing import node_info
    logging.getLogger("absl").setLevel(logging.WARNING)
    for name in ("jaxckpt.jax.checkpointer", "jaxckpt.persistent.writer", "jaxckpt.protection.runtime",
                 "jaxckpt.core.catalog"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return node_info(), jax


def config(spec: dict, job: str, node: int, protection: str, persistent: bool = False) -> Any:
    from jaxckpt import Config
    base = spec["base"]
    # keep=2 for the training jobs: a restart can always find the newest committed step and the one before.
    return Config(store="shm", job_id=f"{spec['job']}-{job}", shm_dir=f"{base}/{job}-node{node}",
                  agent_dirs=f"{base}/{job}-node*", keep=2 if persistent else 1, protection=protection,
                  commit_timeout_s=300.0, peer_timeout_s=120.0,
                  persistent_dir=spec["persistent_dir"] if persistent else "",
                  persistent_interval=spec["persist_interval"] if persistent else 0, persistent_keep=2,
                  restore_collective=spec.get("restore_collective", False), replicas=spec.get("replicas", "split"))


def start_agent(spec: dict) -> None:
    """Before JAX (the launcher calls it first, as a training script's first line would): start this node's agent
    unless one serves (``jaxckpt.start_agent``), so that a replacement node's agent starts, and recovers its
    share, while the trainer imports and joins JAX."""
    import jaxckpt
    from jaxckpt.testing import node_info

    info = node_info()
    # the phases' jobs, by phase: the restarted ones restore the kept policy's job (see _recovered)
    jaxckpt.start_agent(config(spec, spec["keep_policy"], info.node, spec["keep_policy"], persistent=True))


def write_result(spec: dict, name: str, value: dict) -> None:
    path = os.path.join(spec["results"], f"{name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


def barrier(name: str) -> None:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def agent_pages(directory: str) -> dict[str, int]:
    """Pages the node agent's segments occupy on tmpfs, snapshot data and protection apart: everything held
    (committed, being written, pooled for reuse) and one snapshot's worth (the largest segment of each process)."""
    from jaxckpt.backends.agent.protocol import PROTECT_BASE, SEG_RE
    held = {"data": 0, "protect": 0}
    largest: dict[int, int] = {}
    segments = 0
    for name in os.listdir(directory):
        m = SEG_RE.match(name)
        if not m:
            continue
        pages = os.lstat(os.path.join(directory, name)).st_blocks * 512
        proc = int(m.group(1))
        held["protect" if proc >= PROTECT_BASE else "data"] += pages
        largest[proc] = max(largest.get(proc, 0), pages)
        segments += 1
    return {"data_held_bytes": held["data"], "protect_held_bytes": held["protect"], "segments": segments,
            "data_snapshot_bytes": sum(v for p, v in largest.items() if p < PROTECT_BASE),
            "protect_snapshot_bytes": sum(v for p, v in largest.items() if p >= PROTECT_BASE)}


def _orbax_multihost() -> Any:
    """Orbax's emergency manager needs its process-id tables and parsed absl flags (its own launcher does this)."""
    from absl import flags
    from orbax.checkpoint._src.multihost import multihost
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    if not multihost.is_runtime_to_distributed_ids_initialized():
        multihost.initialize_runtime_to_distributed_ids()
    multihost.initialize_distributed_to_device_ids()
    return multihost


def emergency_manager(spec: dict, mesh: Any, node: int, subset: str) -> Any:
    """Orbax's emergency CheckpointManager of the state (or of ``subset``): local checkpoints every step on this
    node's RAM disk directory."""
    from orbax.checkpoint.experimental.emergency import checkpoint_manager as em
    _orbax_multihost()
    local = os.path.join(spec["base"], f"orbax-local-{subset}", f"node{node}")
    os.makedirs(local, exist_ok=True)
    opts = em.CheckpointManagerOptions(
        local=em.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=1),
        # The persistent tier of the comparison is measured apart (StandardSave/Restore on disk).
        persistent=em.PersistentCheckpointOptions(save_interval_steps=1 << 30, max_to_keep=1),
        multiprocessing_options=em.MultiprocessingOptions(coordination_timeout_secs=120))
    return em.CheckpointManager(local, os.path.join(spec["orbax_em_persistent"], subset), mesh,
                                target(mesh, spec, subset), options=opts)


# -------------------------------------------------------------------------------------- phase 1: the saves
def save_phase(spec: dict) -> dict:
    """Per policy: save() call, step overhead, time to protected, memory per node; then Orbax's saves."""
    info, jax = setup()
    import orbax.checkpoint as ocp

    from jaxckpt import Checkpointer
    from jaxckpt.backends.agent import protocol as proto
    mesh = make_mesh(tuple(spec["mesh"]))
    train = train_step()
    st, step = make_state(mesh, spec, 0), 0
    st = jax.block_until_ready(train(st))  # compile once, outside every timing
    step = 1
    policies: dict[str, Any] = {}
    for policy in spec["policies"]:
        cfg = config(spec, policy, info.node, policy)
        row: dict[str, Any] = {}
        with Checkpointer(cfg) as ck:
            for _ in range(spec["warmup"]):
                st, step = train(st), step + 1
                ck.save(step, st)
                ck.wait()
            base = []
            for _ in range(spec["steps"]):
                t0 = time.perf_counter()
                st, step = jax.block_until_ready(train(st)), step + 1
                base.append(time.perf_counter() - t0)
            loop, calls = [], []
            for _ in range(spec["steps"]):
                t0 = time.perf_counter()
                st, step = jax.block_until_ready(train(st)), step + 1
                t1 = time.perf_counter()
                ck.save(step, st)
                t2 = time.perf_counter()
                loop.append(t2 - t0)
                calls.append(t2 - t1)
            ck.wait()
            lags, commits, pulls = [], [], []  # pulls: this node agent's pull of the step (0: it pulled nothing)
            prot = ck.engine.protection
            for _ in range(spec["repeats"] if prot is not None else 0):
                st, step = jax.block_until_ready(train(st)), step + 1
                t0 = time.perf_counter()
                ck.save(step, st).result()
                t1 = time.perf_counter()
                prot.wait(step)
                if step not in prot.protected_steps():
                    raise RuntimeError(f"bench cluster: step {step} was not protected under {policy!r}")
                lags.append(time.perf_counter() - t1)
                commits.append(t1 - t0)
                pulls.append(float((prot.last_pull.get("times") or {}).get("pull_s", 0.0)))
            ck.wait()
            row.update(base_step_s=base, save_step_s=loop, save_call_s=calls, protect_lag_s=lags,
                       commit_s=commits, pull_s=pulls, last_step=step)
            if prot is not None:
                plan = next(iter(prot.plans().values()))  # the plan this run used (one layout)
                me = plan.nodes[info.process_id]
                row["planned"] = {
                    "data_bytes": plan.data_bytes()[me], "extra_bytes": plan.extra_bytes()[me],
                    "sent_bytes_total": sum(plan.sent_bytes().values()),
                    "parity_data_bytes": sum(c.nbytes for c in plan.chunks if c.policy == "parity" and c.node == me),
                    "parity_extra_bytes": sum(s.nbytes for s in plan.stripes if s.kind == "parity" and s.node == me),
                    "policies": sorted({c.policy for c in plan.chunks}),
                    "replica_nodes": len(plan.node_ids)}
            barrier(f"cluster-{policy}-saved")
            if info.local_rank == 0:
                row["pages"] = agent_pages(cfg.shm_dir)
        barrier(f"cluster-{policy}-closed")
        if policy != spec["keep_policy"] and info.local_rank == 0:
            proto.stop_agent(cfg.shm_dir, cfg.job_id, timeout_s=120)  # frees its memory for the next policy
        policies[policy] = row
    # Orbax, same state: StandardSave to a plain directory on disk, then the emergency manager's local saves.
    orbax: dict[str, Any] = {}
    st, step = jax.block_until_ready(train(st)), step + 1
    t0 = time.perf_counter()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(spec["orbax_std"], "ckpt"), st)
        t1 = time.perf_counter()
        ckptr.wait_until_finished()
    orbax["standard"] = {"save_call_s": [t1 - t0], "total_s": [time.perf_counter() - t0], "step": step}
    # The emergency manager: the whole state, and (to show what it can do) the data-parallel half alone.
    for subset in ("dp", "all"):
        em_row: dict[str, Any] = {"save_call_s": [], "total_s": []}
        try:
            mgr = emergency_manager(spec, mesh, info.node, subset)
            for _ in range(spec["repeats"]):
                st, step = jax.block_until_ready(train(st)), step + 1
                part = {k: v for k, v in st.items() if subset == "all" or k.startswith(subset)}
                t0 = time.perf_counter()
                mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(part)))
                t1 = time.perf_counter()
                mgr.wait_until_finished()
                em_row["save_call_s"].append(t1 - t0)
                em_row["total_s"].append(time.perf_counter() - t0)
            em_row["step"] = step
            mgr.close()
        except Exception as e:  # noqa: BLE001 - recorded as the finding, in place of a number
            em_row.update(error=f"{type(e).__name__}: {e}", t=time.time())
            log.warning("bench cluster: Orbax emergency save (%s) failed: %s", subset, em_row["error"])
        orbax["emergency" if subset == "all" else "emergency_dp"] = em_row
    out = {"process": info.process_id, "node": info.node, "policies": policies, "orbax": orbax,
           "state_bytes": state_bytes(spec)}
    write_result(spec, f"save-p{info.process_id}", out)
    return out


# ---------------------------------------------------------------------------------------- restore helpers
def _timed_restores(ck: Any, tgt: Any, n: int, step: int | None, before: Any = None) -> tuple[list[float], Any]:
    import jax
    times, last = [], None
    for _ in range(n):
        if before is not None:
            before()
        last = None
        t0 = time.perf_counter()
        last = jax.block_until_ready(ck.restore(tgt, step=step))
        times.append(time.perf_counter() - t0)
    return times, last


def _sources(ck: Any) -> dict[str, int]:
    """Bytes read by source kind, and the bytes the collective brought (as "collective")."""
    rep = ck.last_restore_report
    if rep is None:
        return {}
    out = dict(rep.bytes_by_kind)
    if rep.collective_bytes:
        out["collective"] = rep.collective_bytes
    return out


def _timeline(ck: Any) -> dict[str, Any]:
    """The last restore's timeline (bytes and seconds per phase), host-transport bytes and its routes."""
    rep = ck.last_restore_report
    if rep is None:
        return {}
    routes: dict[str, int] = {}
    for r in rep.routes.values():
        routes[r] = routes.get(r, 0) + 1
    return {"phases": rep.timeline.to_dict(), "transport_bytes": rep.transport_bytes,
            "collective_bytes": rep.collective_bytes, "routes": routes, "seconds": rep.seconds,
            "peer_span": rep.timeline["peer_fetches"].span,  # every process's on one host's monotonic clock
            "manifests": dict(rep.manifests_by_kind), "widened": 1 if rep.widened else 0}


def _copies_at_once(nbytes: int, n: int) -> list[float]:
    """Seconds of ``n`` copies of ``nbytes`` (what this process restored) between two buffers of its own, its
    pages faulted in first, every process of the job copying at once (a barrier before each): the memory copy
    the restores of all the job's processes need together on this machine's cores, measured beside them."""
    from jaxckpt.tools.bench.memcpy import memcpy_seconds

    if nbytes <= 0:
        return []
    return memcpy_seconds(nbytes, n, before=lambda k: barrier(f"cluster-copies-at-once-{k}"))


def _made_from_host(jax: Any, st: Any, n: int) -> list[float]:
    """Seconds JAX takes to make the restored arrays again from host copies of this process's shards (each on its
    sharding, one ``make_array_from_callback`` an array, as a restore hands them over), every process at once:
    the framework's own part of any restore, measured beside it (a many-array state pays JAX per array)."""
    arrays = [a for a in jax.tree.leaves(st) if isinstance(a, jax.Array)]
    where = lambda idx: tuple((s.start, s.stop) for s in idx)  # noqa: E731 - slices are not hashable
    pieces = [{where(s.index): np.array(s.data) for s in a.addressable_shards} for a in arrays]
    out = []
    for k in range(n):
        barrier(f"cluster-made-from-host-{k}")
        t0 = time.perf_counter()
        made = [jax.make_array_from_callback(a.shape, a.sharding, lambda idx, p=p: p[where(idx)])
                for a, p in zip(arrays, pieces)]
        jax.block_until_ready(made)
        out.append(time.perf_counter() - t0)
        del made
    return out


def drop_cache(root: str) -> None:
    from jaxckpt.tools.bench.restore import drop_cache as drop, sync_tree
    sync_tree(root)
    drop(root)


# ----------------------------------------------------------------------------- phase 2: resharded restore
def reshard_phase(spec: dict) -> dict:
    """A job of another size and mesh restores the saved step from the saving job's node agents."""
    info, jax = setup()
    from jaxckpt import Checkpointer
    mesh = make_mesh(tuple(spec["reshard_mesh"]))
    tgt = target(mesh, spec)
    with Checkpointer(config(spec, spec["keep_policy"], info.node, spec["keep_policy"])) as ck:
        step = ck.latest_step()
        times, got = _timed_restores(ck, tgt, spec["repeats"], None)
        check(got, spec, step, "resharded restore")
        out = {"process": info.process_id, "step": step, "restore_s": times, "sources": _sources(ck),
               "timeline": _timeline(ck)}
        del got
        barrier("cluster-resharded")
    write_result(spec, f"reshard-p{info.process_id}", out)
    return out


# ----------------------------------------------------------------- phase 3: restore, train, wait for the kill
def local_phase(spec: dict) -> dict:
    """All trainers restarted, agents alive: restore from them; Orbax StandardRestore from disk; then train."""
    info, jax = setup()
    import orbax.checkpoint as ocp

    from jaxckpt import Checkpointer
    mesh = make_mesh(tuple(spec["mesh"]))
    tgt = target(mesh, spec)
    ck = Checkpointer(config(spec, spec["keep_policy"], info.node, spec["keep_policy"], persistent=True))
    step = ck.latest_step()
    times, st = _timed_restores(ck, tgt, spec["repeats"], step)
    check(st, spec, step, "local restore")
    sources, timeline = _sources(ck), _timeline(ck)
    std_path = os.path.join(spec["orbax_std"], "ckpt")
    std = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    std_times, got = [], None
    for _ in range(spec["repeats"]):
        drop_cache(spec["orbax_std"])
        got = None
        t0 = time.perf_counter()
        got = jax.block_until_ready(std.restore(std_path, args=ocp.args.StandardRestore(tgt)))
        std_times.append(time.perf_counter() - t0)
    check(got, spec, spec["orbax_std_step"], "Orbax StandardRestore")
    del got
    copies = _copies_at_once(sum(sources.values()), spec["repeats"])
    made = _made_from_host(jax, st, spec["repeats"])
    barrier("cluster-local-restored")
    write_result(spec, f"local-p{info.process_id}", {
        "process": info.process_id, "step": step, "restore_s": times, "sources": sources, "timeline": timeline,
        "orbax_standard_restore_s": std_times, "copy_at_once_s": copies, "made_from_host_s": made})
    train_until_killed(spec, ck, st, step, "local", info)
    return {}


def train_until_killed(spec: dict, ck: Any, st: Any, step: int, role: str, info: Any) -> None:
    """Train with a save every step; once a persisted step and a newer protected one exist, and protection has
    run for ``settle_steps`` steps (the first protection also agrees on the nodes and plans), say so; go on until
    killed."""
    import jax
    train = train_step()
    ready, first_protected = False, None
    prog = os.path.join(spec["results"], f"progress-{role}")
    for _ in range(spec["max_train_steps"]):
        st, step = jax.block_until_ready(train(st)), step + 1
        ck.save(step, st)
        persisted = ck.persister.steps() if ck.persister is not None else []
        protected = ck.engine.protection.protected_steps() if ck.engine.protection is not None else []
        if info.process_id == 0:  # what a restart could restore from, as this process knew it after each step
            with open(prog + ".tmp", "w") as f:
                json.dump({"step": step, "protected": max(protected, default=0),
                           "persisted": max(persisted, default=0)}, f)
            os.replace(prog + ".tmp", prog)
        if protected and first_protected is None:
            first_protected = step
        if not ready and first_protected is not None and step >= first_protected + spec["settle_steps"]:
            if persisted and max(protected) > max(persisted):
                ready = True
                open(os.path.join(spec["results"], f"ready-{role}-p{info.process_id}"), "w").close()
    raise RuntimeError(f"bench cluster: {role} job trained {spec['max_train_steps']} steps without being killed "
                       f"(ready: {ready})")


def _recovered(spec: dict, role: str, persistent: bool) -> tuple[Any, Any, Any, int, dict]:
    """Restore after a node loss and train one step; timestamps of every stage (seconds since the epoch)."""
    t_entry = time.time()
    info, jax = setup()
    mesh = make_mesh(tuple(spec["mesh"]))
    tgt = target(mesh, spec)  # the training script's own work (its model), on either path: not Checkpointer()'s
    t_target = time.time()
    cpu = [time.thread_time()]  # this thread's CPU at each stage's end: work, where the wall clock also waits
    pcpu = [time.process_time()]  # and every thread's of the process (a restore's readers among them)
    from jaxckpt import Checkpointer  # what jaxckpt.start_agent() did not import yet: the front end, the engine
    t_imported, cpu_imported = time.time(), time.thread_time()
    ck = Checkpointer(config(spec, spec["keep_policy"], info.node, spec["keep_policy"], persistent=True))
    t_created = time.time()
    cpu.append(time.thread_time())
    pcpu.append(time.process_time())
    step = ck.latest_step()
    t_open = time.time()
    cpu.append(time.thread_time())
    pcpu.append(time.process_time())
    t0 = time.perf_counter()
    got = jax.block_until_ready(ck.restore(tgt, step=step))
    first = time.perf_counter() - t0
    t_restored = time.time()
    cpu.append(time.thread_time())
    pcpu.append(time.process_time())
    sources, timeline = _sources(ck), _timeline(ck)
    st = jax.block_until_ready(train_step()(got))
    t_step = time.time()
    cpu.append(time.thread_time())
    pcpu.append(time.process_time())
    hello = ck.store.agent  # the node agent's hello reply: how long it waited for the node's recovery
    startup = {"stages": {"import": {"seconds": t_imported - t_target, "cpu_s": cpu_imported - cpu[0]}, **ck.startup},
               "recovery_wait_s": hello.get("recovery_wait_s"),
               "agent_recovery": hello.get("recovery") or {},
               "cpu_s": {k: cpu[i + 1] - cpu[i] for i, k in enumerate(("create", "latest", "restore", "first_step"))},
               "process_cpu_s": {k: pcpu[i + 1] - pcpu[i] for i, k in enumerate(("create", "latest", "restore"))}}
    check(st, spec, step + 1, f"{role} restore (checked after one step: x + 1 is exact)")
    before = (lambda: drop_cache(spec["persistent_dir"])) if persistent else None
    later, got = _timed_restores(ck, tgt, spec["repeats"] - 1, step, before)
    del got
    stamps = {"entry": t_entry, "target": t_target, "created": t_created, "opened": t_open, "restored": t_restored,
              "first_step": t_step}
    out = {"process": info.process_id, "node": info.node, "step": step, "restore_s": [first] + later, "sources": sources,
           "timeline": timeline, "stamps": stamps, "startup": startup}
    return info, ck, st, step + 1, out


def peer_phase(spec: dict) -> dict:
    """After a node loss (its memory with it): restore from the other nodes' agents, train; wait for the kill."""
    info, ck, st, step, out = _recovered(spec, "peers", persistent=False)
    barrier("cluster-peers-restored")
    write_result(spec, f"peers{spec['cycle']}-p{info.process_id}", out)
    train_until_killed(spec, ck, st, step, f"peers{spec['cycle']}", info)
    return {}


def persist_phase(spec: dict) -> dict:
    """After every agent's memory is gone: restore from the persistent tier, train; the last one also tries
    Orbax's emergency restore (which may fail, or hang the others: the launcher then reaps them)."""
    info, ck, st, step, out = _recovered(spec, "persistent", persistent=True)
    barrier("cluster-persistent-restored")
    write_result(spec, f"persistent{spec['cycle']}-p{info.process_id}", out)
    if not spec["last"]:
        train_until_killed(spec, ck, st, step, f"persistent{spec['cycle']}", info)
    ck.close()
    del st
    emergency_restore(spec, info)
    return {}


def emergency_restore(spec: dict, info: Any) -> None:
    """Orbax's emergency restore of the steps its managers saved, in this restarted job: the data-parallel half
    alone, then the whole state. Where it cannot, the exception is the result, raised again so that the launcher
    reaps the processes it leaves waiting in a collective."""
    import jax
    mesh = make_mesh(tuple(spec["mesh"]))
    for subset in ("dp", "all"):
        name = f"emergency{'' if subset == 'all' else '_dp'}-p{info.process_id}"
        step = spec["orbax_em_step" if subset == "all" else "orbax_em_dp_step"]
        times: list[float] = []
        try:
            for _ in range(spec["repeats"]):
                mgr = emergency_manager(spec, mesh, info.node, subset)
                t0 = time.perf_counter()
                state = jax.block_until_ready(mgr.restore(step).state)
                times.append(time.perf_counter() - t0)
                mgr.close()
            check(dict(state), spec, step, f"Orbax emergency restore ({subset})")
        except Exception as e:
            write_result(spec, name, {"process": info.process_id, "error": f"{type(e).__name__}: {e}",
                                      "t": time.time(), "restore_s": times})
            raise
        write_result(spec, name, {"process": info.process_id, "restore_s": times})
