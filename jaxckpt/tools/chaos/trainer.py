"""One trainer process of a ``jaxckpt chaos`` job: ``python -m jaxckpt.tools.chaos.trainer SPEC.json``.

Numpy trainers (the default) use the shared ``Checkpointer`` face (``jaxckpt.frontend``) with a front end of
their own (:class:`NumpyFrontend`), ``store="shm"``, across real processes: the commit, adoption and peer
protocols run for real (coordination through :class:`~jaxckpt.tools.filecoord.FileCoordinator`), and so do
the node agents. The training state is a pure function of (seed, step) (:func:`state`), replicated,
sharded and single-owner arrays across the job's processes, NaN payloads included; the chaos driver computes the
same function to check every restore bit for bit, outside the system under test.

Call order of one incarnation (every process):
  0) adoption: the engine agrees with the other processes on the steps every process still holds;
  1) restore the newest agreed step: every array whole (other processes' chunks through the peer transport),
     reported as a digest; the processes check that they all restored the same step. A step whose bytes
     cannot be had (checksum, manifest, a holder gone) is passed over inside the same restore, for the newest
     older step every process holds (jaxckpt.core.fallback). Only when none is left is the step deleted once
     every process is done reading, and the incarnation ends with exit code RESTART; so does any other
     failure. The driver starts a new one, which agrees on what is left;
  2) train: step after step, a snapshot every ``interval`` steps, until killed.
Events go to stdout as JSON lines. ``fault`` makes the process act at a phase of a save or of the restore
(SIGKILL itself, or SIGKILL its node's agent, with or without its memory): points no outside timer can hit.
``mode="jax"`` runs a single-process ``jaxckpt.Checkpointer`` trainer instead (restore onto another mesh).
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from typing import Any

import numpy as np

from jaxckpt.core import manifest as mf
from jaxckpt.backends.agent import protocol as proto
from jaxckpt.backends.agent import heap
from jaxckpt.backends.shm import ShmStore
from jaxckpt.core.box import Box
from jaxckpt.config import Config
from jaxckpt.core.dtypes import dtype_name
from jaxckpt.errors import ChecksumError, JaxckptError, ManifestError, NoCheckpointError, PlanError
from jaxckpt.core.plan import ArrayLayout, Placement
from jaxckpt.registry import register_store

RESTART = 3  # exit code: this incarnation cannot go on; start a new one
INTEGRITY = (ChecksumError, ManifestError, PlanError)  # the step's bytes are bad: never use it again
SHARD = 1024  # rows of the sharded array per process
CHUNK_BYTES = 16 << 10  # small chunks: several per array, so a kill "mid-copy" lands between two of them


# ------------------------------------------------------------------------------------------------ the state
def state(seed: int, step: int, processes: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The global training state at ``step``: arrays (global shapes) and plain values."""
    rng = np.random.default_rng([seed, step])
    w = rng.standard_normal((128, 256)).astype(np.float32)
    w.reshape(-1)[[3, 999, 4097]] = np.array([0x7FC00001, 0xFFA00002, 0x7F800000], np.uint32).view(np.float32)
    arrays = {"w": w, "b": rng.standard_normal(500),
              "s": rng.integers(-2**31, 2**31 - 1, processes * SHARD, dtype=np.int32),
              "h": rng.integers(0, 2**16, (7, 33), dtype=np.uint16), "c": np.array(step, dtype=np.int64)}
    return arrays, {"lr": 0.125 * step, "tag": f"step-{step}"}


def placements(path: str, shape: tuple[int, ...], processes: int) -> tuple[Placement, ...]:
    """Where each process holds ``path``: replicated everywhere, sharded by rows (``s``), or on process 0 (``h``).
    Device id = process index (one "device" per process; ids must be unique across the job)."""
    if path == "s":
        return tuple(Placement(Box((q * SHARD,), ((q + 1) * SHARD,)), q, q) for q in range(processes))
    if path == "h":
        return (Placement(Box.full(shape), 0, 0),)
    return tuple(Placement(Box.full(shape), q, q) for q in range(processes))


def digest(arrays: dict[str, np.ndarray], values: dict[str, Any]) -> str:
    """Bit-exact fingerprint of a state (dtype, shape and every byte of every array, and the values)."""
    h = hashlib.sha256()
    for path in sorted(arrays):
        a = np.ascontiguousarray(arrays[path])
        h.update(f"{path}|{dtype_name(a.dtype)}|{a.shape}|".encode())
        h.update(a.view(np.uint8).reshape(-1).tobytes())
    for path in sorted(values):
        h.update(f"{path}={values[path]!r}|{type(values[path]).__name__}".encode())
    return h.hexdigest()


def records(arrays: dict[str, np.ndarray], process: int, processes: int, hook) -> list:
    """The engine's ArrayRecords of this process's part of ``arrays`` (with their shard reads, for
    ``CheckpointEngine.save``)."""
    from jaxckpt.core.engine import ArrayRecord

    out = []
    for (path, arr), reads in zip(arrays.items(), shard_reads(arrays, process, processes, hook)):
        places = placements(path, arr.shape, processes)
        layout = ArrayLayout(path, arr.shape, dtype_name(arr.dtype), arr.dtype.itemsize, places)
        meta = mf.ArrayMeta(path, (("key", path),), arr.shape, dtype_name(arr.dtype), "numpy")
        out.append(ArrayRecord(path, ("chaos", path, arr.shape, arr.dtype.str), lambda lay=layout: lay,
                               lambda m=meta: m, lambda devs, r=reads: r if devs else {}))
    return out


def shard_reads(arrays: dict[str, np.ndarray], process: int, processes: int, hook) -> list[dict]:
    """Per array, this process's shard read (its box of the array; the hook fires when the third of the arrays
    this process holds is read: counted over its own, so that every process reaches the phase whatever the
    arrays' order)."""
    out, held = [], 0
    for path, arr in arrays.items():
        mine = next((p.box for p in placements(path, arr.shape, processes) if p.process == process), None)
        if mine is None:
            out.append({})
            continue
        local = arr[tuple(slice(lo, hi) for lo, hi in zip(mine.start, mine.stop))]

        def fetch(local=local, k=held):
            if k == 2:
                hook("copy")  # earlier arrays' chunks are copied by now, later ones not yet
            return local
        out.append({process: (fetch, None)})
        held += 1
    return out


class NumpyLayout:
    """The layout of a state ``(arrays, values)``: array paths, shapes and dtypes, and value paths."""

    def __init__(self, key: tuple, order: tuple[str, ...], frontend: "NumpyFrontend") -> None:
        self.key, self.order, self._frontend = key, order, frontend

    def records(self, leaves: list) -> list:
        arrays, _ = leaves
        f = self._frontend
        return records(arrays, f.process, f.processes, f.hook)

    def value_metas(self, leaves: list) -> list[mf.LeafMeta]:
        _, values = leaves
        return [mf.LeafMeta(k, (("key", k),), v) for k, v in sorted(values.items())]


class NumpyFrontend:
    """The chaos trainer's front end (``jaxckpt.frontend.protocol.Frontend``): a state is ``(arrays, values)``,
    each array placed by :func:`placements`; restored whole, every array, through the restore driver."""

    framework = "numpy"
    persists = False

    def __init__(self, process: int, processes: int, hook, coordinator) -> None:
        self.process, self.processes, self.hook, self._coordinator = process, processes, hook, coordinator
        self._layouts: dict[tuple, NumpyLayout] = {}

    def coordinator(self):
        return self._coordinator

    def layout(self, state: tuple) -> tuple[NumpyLayout, list]:
        arrays, values = state
        arrays = dict(sorted(arrays.items()))
        key = (tuple((p, a.shape, a.dtype.str) for p, a in arrays.items()), tuple(sorted(values)))
        got = self._layouts.get(key)
        if got is None:
            got = self._layouts[key] = NumpyLayout(key, tuple(arrays) + tuple(sorted(values)), self)
        return got, [arrays, values]

    def take(self, layout: NumpyLayout, devices: list, leaves: list, owned: bool):
        reads = shard_reads(leaves[0], self.process, self.processes, self.hook)
        return lambda: [r if devs else {} for r, devs in zip(reads, devices)]

    def build(self, target, manifests: list, reader, *, step: int, process: int, gather) -> tuple[dict, dict]:
        """Every array whole (other processes' chunks through the peer transport), and the values."""
        from jaxckpt.core.restore import ArrayRequest, restore_leaves

        own = next(m for m in manifests if m.process == process)
        merged = sorted(mf.merge_chunks(manifests).items())

        def whole(i: int, meta):
            def make(host: np.ndarray) -> np.ndarray:
                if i == 1:
                    self.hook("restore")
                return host.copy()
            return ArrayRequest.whole(meta, make)
        got = restore_leaves([whole(i, a) for i, (_, a) in enumerate(merged)], reader, step=step, process=process)
        return {p: arr for (p, _), arr in zip(merged, got)}, {v.path: v.value for v in own.leaves}

    def gather(self, engine, target, config):
        return None


# ----------------------------------------------------------------------------------------------- the trainer

def node_name(spec: dict) -> str:
    """The simulated node a trainer runs on, named after its agent directory (as the chaos run names its agents)."""
    return os.path.basename(spec["node_dir"])

class Trainer:
    """One numpy trainer process (see the module docstring)."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.p, self.n = spec["process"], spec["process_count"]
        self.step = 0
        self.fault = dict(spec.get("fault") or {})

    def emit(self, ev: str, **fields: Any) -> None:
        # t: time.monotonic(), which every process of the host shares (the driver measures protection lag by it)
        sys.stdout.write(json.dumps({"ev": ev, "p": self.p, "t": round(time.monotonic(), 4), **fields}) + "\n")
        sys.stdout.flush()

    def hook(self, phase: str) -> None:
        """Act on ``fault`` when the process reaches ``phase`` of the save of its step (or of the restore)."""
        f = self.fault
        if not f or f.get("phase") != phase or (phase != "restore" and self.step < f.get("step", 1 << 62)):
            return
        if f["action"] == "kill-agent-wipe" and phase != "restore" and self.spec.get("protection", "none") != "none" \
                and getattr(self, "_protected", 0) < getattr(self, "first", 0) and \
                self.step < f["step"] + 50 * self.spec["interval"]:
            return  # one failure at a time: a step saved by this incarnation is protected first (bounded wait)
        self.fault = {}
        self.emit("phase-fault", phase=phase, step=self.step, action=f["action"])
        if f["action"] == "kill-self":
            os.kill(os.getpid(), signal.SIGKILL)
        kill_agent(self.spec["node_dir"], wipe=f["action"] == "kill-agent-wipe")

    def config(self) -> Config:
        s = self.spec
        # node_name: each simulated node is a failure domain of its own (jaxckpt.node_identity)
        return Config(store="shm-chaos", job_id=s["job"], shm_dir=s["node_dir"], node_name=node_name(s),
                      keep=s.get("keep", 2),
                      max_pending_saves=1, workers=1, chunk_bytes=CHUNK_BYTES, commit_timeout_s=s["timeout_s"],
                      peer_timeout_s=s.get("peer_timeout_s", s["timeout_s"]), peer_token=s.get("token", ""),
                      protection=s.get("protection", "none"), agent_dirs=s.get("agent_dirs", ""),
                      peer_security=s.get("peer_security", "auto"))

    def run(self) -> int:
        from jaxckpt.frontend import Checkpointer
        from jaxckpt.tools.filecoord import FileCoordinator

        _ChaosStore.trainer = self
        coord = FileCoordinator(self.spec["coord_dir"], self.p, self.n)
        try:
            ck = Checkpointer(NumpyFrontend(self.p, self.n, self.hook, coord), self.config())
        except JaxckptError as e:
            self.emit("restart", reason=f"recovery: {type(e).__name__}: {e}")
            return RESTART
        self.emit("held", steps=ck.all_steps())
        restored = self.restore(ck)
        verdict = self.agree(ck, restored)
        if verdict != "ok":
            if isinstance(restored, tuple):  # bad bytes: every process is done reading, the step goes for good
                ck.store.delete(restored[1])
            self.emit("restart", reason=verdict)
            return RESTART
        first = self.first = (restored or 0) + 1
        if "after" in self.fault:  # the after-th snapshot step from here on
            span = (self.fault["after"] + 100) * self.spec["interval"]  # a soak pushes "after" past its segment
            saves = [s for s in range(first, first + span) if s % self.spec["interval"] == 0]
            self.fault["step"] = saves[self.fault["after"] - 1]
        self.train(ck, first)
        ck.close()
        return 0

    def restore(self, ck) -> int | None | str | tuple:
        """The newest agreed step, restored (a step whose bytes cannot be had falls back inside the restore,
        ``jaxckpt.core.fallback``); None if there is none; ("integrity", step) if no step's bytes are good
        (deleted after the agreement, so that the next incarnation falls back past it); "failed" otherwise."""
        step = ck.latest_step()
        try:  # every process takes part in the restore's outcome round, one with nothing committed too
            arrays, values = ck.restore()
            step = ck.last_restore_report.step
        except NoCheckpointError:  # every process has nothing (a partial "nothing" is a CoordinationError)
            self.emit("fresh")
            return None
        except INTEGRITY as e:  # no older step to fall back to: the one that failed last is the newest left
            step = ck.latest_step() if ck.latest_step() is not None else step
            self.emit("restore-failed", step=step, error=f"{type(e).__name__}: {e}", integrity=True)
            return ("integrity", step)
        except JaxckptError as e:  # unreachable peer or agent: try again in a new incarnation
            self.emit("restore-failed", step=step, error=f"{type(e).__name__}: {e}", integrity=False)
            return "failed"
        for line in ck.last_restore_report.skipped:
            self.emit("restore-fell-back", why=line)
        self.emit("restored", step=step, digest=digest(arrays, values))
        return step

    def agree(self, ck, restored) -> str:
        """Every process restored the same step (a ``reduce`` round of the engine's ``main`` channel)."""
        def verdict(got: list) -> str:
            same = len(set(map(str, got))) == 1 and (got[0] is None or isinstance(got[0], int))
            return "ok" if same else f"restored {got}"
        try:
            return ck.engine.collective.channel("main").reduce("chaos restored", restored, verdict,
                                                         timeout_s=self.spec["timeout_s"])
        except JaxckptError as e:  # CoordinationError: a process did not report its restore in time
            return f"no agreement on the restored step: {e}"

    def train(self, ck, first: int) -> None:
        s = self.spec
        pending = []
        for step in range(first, s["steps"] + 1):
            self.step = step
            arrays, values = state(s["seed"], step, self.n)  # the step's work
            time.sleep(s["step_time_s"])
            if s.get("test_leak"):
                self.test_leak(s["test_leak"])
            self.emit("trained", step=step)
            if step % s["interval"] == 0:
                try:
                    pending.append(ck.save(step, (arrays, values)))
                except JaxckptError as e:  # over budget: the committed steps are kept, training goes on
                    self.emit("save-failed", step=step, error=f"{type(e).__name__}: {e}")
            pending = self.drain(pending, ck)
            self.report_protected(ck)
            self.hook("idle")
        for h in pending:
            h.wait_local(s["timeout_s"])
        self.drain(pending, ck, wait=True)
        self.emit("done", step=self.step)

    def test_leak(self, leak: dict) -> None:
        """A TEST FAULT, for tests/test_soak.py only: leak ``per_step`` open fds (kind "fds") or ``kib`` KiB of
        written memory (kind "memory") every step, so that the soak's growth detector has a real leak to find."""
        held = self.__dict__.setdefault("_test_leaked", [])
        for _ in range(int(leak.get("per_step", 1))):
            if leak["kind"] == "fds":
                held.append(os.open(os.devnull, os.O_RDONLY))
            else:  # written, not zero-filled: calloc'd pages would never become resident
                held.append(bytearray(b"\x5a") * (int(leak.get("kib", 64)) << 10))

    def report_protected(self, ck) -> None:
        """Emit the newest step whose redundancy is in place on every node, when it changes."""
        prot = ck.engine.protection
        done = prot.protected_steps() if prot is not None else []
        if done and done[-1] != getattr(self, "_protected", None):
            self._protected = done[-1]
            at = prot.protected_times().get(done[-1])
            self.emit("protected", step=done[-1], **({"at": round(at, 4)} if at is not None else {}))

    def drain(self, pending: list, ck, wait: bool = False) -> list:
        left = []
        for h in pending:
            if not wait and not h.done():
                left.append(h)
                continue
            try:
                h.result(self.spec["timeout_s"] * 2 if wait else 0)
                decided = ck.engine.commit_times().get(h.step)  # the commit's own time, not this look's
                self.emit("committed", step=h.step, **({"at": round(decided[1], 4)} if decided else {}))
            except JaxckptError as e:
                self.emit("save-failed", step=h.step, error=f"{type(e).__name__}: {e}")
        return left


class _ChaosStore(ShmStore):
    """The real shm store, with the trainer's fault hook at each phase of a save."""

    trainer: Trainer | None = None

    def _maybe_spawn(self) -> None:
        """Never: the chaos driver supervises the node agents (with the node's memory budget), as a launcher
        would; a trainer waits for the agent to come back (test_agent.py covers self-spawning)."""

    def _hook(self, phase: str) -> None:
        if self.trainer is not None:
            self.trainer.hook(phase)

    def reserve(self, step, nbytes):
        self._hook("reserve")
        slot = super().reserve(step, nbytes)
        self._hook("reserved")
        return slot

    def commit(self, slot, manifest):
        self._hook("commit")
        super().commit(slot, manifest)
        self._hook("committed")

    def delete(self, step):
        self._hook("delete")
        super().delete(step)


register_store("shm-chaos", _ChaosStore)


def kill_agent(directory: str, *, wipe: bool) -> int | None:
    """SIGKILL the agent of ``directory`` and wait until it is dead; with ``wipe`` its memory goes too."""
    pid = proto.kill_agent(directory)
    if pid is not None:
        deadline = time.monotonic() + 10
        while not proc_dead(pid) and time.monotonic() < deadline:
            time.sleep(0.002)
    if wipe:
        proto.kill_agent(directory, remove_memory=True)
    return pid


def proc_dead(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie with every thread ended. A killed multithreaded process
    shows its leader as a zombie while its other threads still tear down: its parent cannot reap it yet."""
    state = proc_state(pid)
    if state != "Z":
        return state == "X"
    try:
        return len(os.listdir(f"/proc/{pid}/task")) <= 1
    except FileNotFoundError:
        return True


def proc_state(pid: int) -> str:
    """The state letter /proc gives process ``pid`` ("R", "S", ...); "X" when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return "X"


# ------------------------------------------------------------------------------------------ the JAX trainer
def jax_host(seed: int, step: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The JAX trainer's state as host arrays (the reference): sharded, replicated, bf16, key data, NaNs."""
    import ml_dtypes

    rng = np.random.default_rng([seed, step, 7])
    w = rng.standard_normal((16, 24)).astype(np.float32)
    w.reshape(-1)[[1, 100]] = np.array([0x7FC00001, 0xFFA00002], np.uint32).view(np.float32)
    return ({"w": w, "b": rng.standard_normal(40).astype(np.float32),
             "e": rng.standard_normal((8, 8)).astype(ml_dtypes.bfloat16),
             "key": rng.integers(0, 2**32, 2, dtype=np.uint32)},
            {"count": step, "lr": 0.5})


def jax_run(spec: dict) -> int:
    """Restore the newest step onto ``devices`` devices (other shardings than it was saved with), then train."""
    import jax

    jax.config.update("jax_num_cpu_devices", spec["devices"])
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxckpt

    emit = Trainer(spec).emit
    devs = np.array(jax.devices())
    mesh = jax.sharding.Mesh(devs, ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    flip = spec["devices"] % 4 == 0  # one mesh saves rows-sharded, the other restores columns-sharded
    specs = {"w": P("x", None) if flip else P(None, "x"), "b": P(), "e": P(None, "x") if flip else P("x", None)}

    def on_mesh(host):
        arrays, values = host
        st = {k: jax.device_put(arrays[k], NamedSharding(mesh, specs[k])) for k in specs}
        st["key"] = jax.random.wrap_key_data(arrays["key"])
        return {**st, **values}

    def to_host(st):
        arrays = {k: np.asarray(st[k]) for k in specs}
        arrays["key"] = np.asarray(jax.random.key_data(st["key"]))
        return arrays, {k: st[k] for k in ("count", "lr")}

    cfg = Config(store="shm", job_id=spec["job"], shm_dir=spec["node_dir"], node_name=node_name(spec), keep=2,
                 commit_timeout_s=spec["timeout_s"], peer_security=spec.get("peer_security", "auto"))
    ckpt = jaxckpt.Checkpointer(cfg)
    step = ckpt.latest_step()
    first = 1
    if step is not None:
        target = on_mesh(jax_host(spec["seed"], step))
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) if k in specs else v
                  for k, v in target.items()}
        try:
            got = ckpt.restore(target)  # the newest: bad bytes fall back to an older step inside the call
        except JaxckptError as e:
            step = ckpt.latest_step() if ckpt.latest_step() is not None else step
            emit("restore-failed", step=step, error=f"{type(e).__name__}: {e}", integrity=isinstance(e, INTEGRITY))
            if isinstance(e, INTEGRITY):
                ckpt.store.delete(step)  # bad bytes and nothing older: the next incarnation starts over
            return RESTART
        step = ckpt.last_restore_report.step
        for line in ckpt.last_restore_report.skipped:
            emit("restore-fell-back", why=line)
        ok = all(got[k].sharding == target[k].sharding for k in specs)
        emit("restored", step=step, digest=digest(*to_host(got)) if ok else "wrong shardings")
        first = step + 1
    else:
        emit("fresh")
    for step in range(first, spec["steps"] + 1):
        st = on_mesh(jax_host(spec["seed"], step))
        time.sleep(spec["step_time_s"])
        emit("trained", step=step)
        h = ckpt.save(step, st)
        try:
            h.result(spec["timeout_s"])
            emit("committed", step=step)
        except JaxckptError as e:
            emit("save-failed", step=step, error=f"{type(e).__name__}: {e}")
    ckpt.close()
    return 0


def main(argv: list[str]) -> int:
    import logging

    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # every thread's stack to the log: a hang's report
    with open(argv[0]) as f:
        spec = json.load(f)
    logging.basicConfig(level=os.environ.get("JAXCKPT_LOG_LEVEL", "WARNING").upper(),
                        format=f"%(asctime)s trainer {spec['process']} (pid {os.getpid()}) %(name)s %(levelname)s "
                               f"%(message)s")
    if spec.get("mode") == "jax":
        return jax_run(spec)
    # This trainer's own math frees a few 128-256 KiB arrays a step; left to glibc's dynamic mmap threshold they
    # fragment its heap like the agent's (jaxckpt.backends.agent.heap), which a soak would take for growth.
    heap.fix_mmap_threshold()
    return Trainer(spec).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
