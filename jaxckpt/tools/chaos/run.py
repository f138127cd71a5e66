"""``jaxckpt chaos``: a seeded fault injector over a real multi-process training job on simulated nodes.

Each simulated node has a node agent (``store="shm"``, started and restarted by this driver as a launcher
would, with a node memory budget) and runs trainer processes (:mod:`jaxckpt.tools.chaos.trainer`). A trial
is one incarnation of the job:

  0) start every trainer: the engine agrees on the steps the processes hold, each process restores the newest
     one whole (other processes' chunks through the peer transport) and reports a digest, checked here against
     the state recomputed outside the system from (seed, step). A wrong digest, or processes that restored
     different steps, is a **wrong restore**; a committed step lost although no fault destroyed data (or a
     protected one where a node's memory was lost, or an agent killed within the restore) is an **unexpected
     loss**. An incarnation that cannot restore (a step failed its integrity checks and was
     dropped, a process died) is stopped and relaunched, at most MAX_RELAUNCH times;
  1) train, a snapshot every ``interval`` steps, until one fault strikes at a random point of a save, a commit
     or the restore (jaxckpt/tools/chaos/faults.py): trainers SIGKILLed by a timer or by themselves at an exact
     phase, agents SIGKILLed with or without their memory, a whole node lost (its trainers, agent and memory at
     once), bits of stored chunks or of commit records flipped, the node's memory budget filled, one node's peer
     traffic delayed or dropped by a proxy (jaxckpt/tools/chaos/proxy.py). The job recovers (agents restarted;
     that saves resume is checked). With ``--protection``, losing a node's memory must keep the newest step
     reported protected before the loss, by this incarnation or an earlier one since the last fault that
     destroyed data. The failure model is one failure at a time: a fault that takes a node's memory strikes
     once a step of the running incarnation is protected (a bounded wait, then anyway);
  2) the job is stopped (SIGKILL, at a random point too); the next trial's restore checks what the fault left.
A fault at the restore is checked within its own trial (after a clean incarnation checked the previous one).
The kinds come in seeded random order, every kind once in each round of as many trials as there are kinds (so
a run of that many trials exercises each exactly once: tests/test_chaos.py).
Every wait has a time-out; one that expires is a **hang** (everything is killed and the run goes on). Steps of
work lost = steps trained before the job was stopped minus the step restored. A few trials use a JAX trainer
(``jaxckpt.Checkpointer``, every restore onto another mesh).

    jaxckpt chaos --profile quick [--seed 0] [--json]      # 50 trials + 2 JAX trials
    jaxckpt chaos --profile long --seed 1 --update-md BENCHMARKS.md   # 500 + 20: the RELIABILITY section
    jaxckpt chaos --protection none [--faults corrupt-chunk,kill-agent-wipe]   # without protection
"""
from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Sequence

from jaxckpt.backends.agent import protocol as proto
from jaxckpt.backends.agent.daemon import EXIT_ALREADY_RUNNING
from jaxckpt.tools.chaos.lag import lag_summary, protection_lags
from jaxckpt.tools.chaos.faults import DESTRUCTIVE, FAULTS, JAX_KINDS, NODE_LOSS, end_trial, wait_protected
from jaxckpt.errors import JaxckptError
from jaxckpt.tools import deathsig
from jaxckpt.tools.chaos import hang
from jaxckpt.tools.chaos import trainer as ct
from jaxckpt.tools.chaos.incarnation import Incarnation, TrialResult

log = logging.getLogger("jaxckpt.tools.chaos.run")

MAX_RELAUNCH = 3


@dataclass(frozen=True)
class Profile:
    trials: int
    jax_trials: int
    nodes: int
    procs_per_node: int
    interval: int = 1  # a snapshot every this many steps
    step_time_s: float = 0.01
    protection: str = "none"  # Config.protection of the numpy trainers (then node loss must keep protected steps)
    timeout_s: float = 60.0  # every wait of the driver, and the trainers' commit time-out
    peer_timeout_s: float = 5.0  # the trainers' Config.peer_timeout_s (a dead agent costs this much per request)
    # Config.peer_security of the trainers and agents: "curve" runs every peer connection (restores, protection
    # pulls, the peer faults' proxy) through ZeroMQ CURVE, as a job bound off loopback does
    peer_security: str = "auto"


PROFILES = {"quick": Profile(trials=50, jax_trials=2, nodes=2, procs_per_node=1, protection="hybrid",
                             peer_security="curve"),
            "long": Profile(trials=500, jax_trials=20, nodes=3, procs_per_node=1, interval=2, protection="hybrid")}


class _AlreadyServed(Exception):
    """Another agent holds the directory's lock."""


# ------------------------------------------------------------------------------------------------ the run
class ChaosRun:
    """A seeded sequence of trials over one job on ``profile.nodes`` simulated nodes (see the module doc)."""

    def __init__(self, profile: Profile, seed: int, trials: int | None = None, jax_trials: int | None = None,
                 faults: list[str] | None = None, keep_hangs: str = "") -> None:
        unknown = sorted(set(faults or ()) - set(FAULTS))
        if unknown:
            raise ValueError(f"unknown fault kind(s) {unknown}; known: {sorted(FAULTS)}")
        self.profile, self.seed = profile, seed
        self.keep_hangs = keep_hangs  # where each hang's logs, events and stacks are kept (jaxckpt.tools.chaos.hang)
        self.hung = 0
        self.trials = profile.trials if trials is None else trials
        self.jax_trials = profile.jax_trials if jax_trials is None else jax_trials
        self.rng = random.Random(seed)
        self.kinds = [k for k in (faults or FAULTS) if FAULTS[k].inject is not None]
        self.job = f"chaos-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.base = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(), self.job)
        self.tmp = tempfile.mkdtemp(prefix="jaxckpt-chaos-")
        self.n = profile.nodes * profile.procs_per_node
        self.node_dirs = [os.path.join(self.base, f"node{k}") for k in range(profile.nodes)]
        self.jax_dir = os.path.join(self.base, "jax")
        self.agents: dict[str, subprocess.Popen] = {}
        self.epoch = 0
        self.fired: list[dict] = []  # phase faults that went off in an incarnation that was then relaunched
        self.results: list[TrialResult] = []
        self.trained_max = 0  # the newest step any incarnation of the current job trained
        # The newest step reported protected since the last fault that destroyed data: it has its full redundancy,
        # so one node's memory lost later must not take it, whichever incarnation protected it.
        self.safe_protected = 0
        self.protection_lags: list[tuple[int, float]] = []  # (steps, seconds) from commit to protected, per step
        self.lags_by_kind: dict[str, list[tuple[int, float]]] = {}  # the same, by the fault of the trial it ran in
        self._kind = ""  # the fault kind of the trial being run ("" before the first, "end" for the last check)
        self.unattributed = Counter()  # wrong restores and hangs of the first incarnation (no fault before it)
        self.budget = self._node_budget()
        self.peer_proxy = None  # (proxy, node dir, its peer info, node) while a peer fault's trial runs
        self.agent_keys = Counter()  # agents started, by whether their peer.addr published a CURVE key

    def _node_budget(self) -> int:
        """Room for keep + pending + three spare snapshots of every process of a node: ample unless filled. The
        snapshots as the trainers save them, whole replicas (``Config.replicas``' default): sized for split ones,
        the budget held about four and a half, and a peer fault that held protection's pins back refused saves
        for seconds (work lost up to 200 steps a peer fault, 3 before whole replicas)."""
        from jaxckpt.core.plan import ArrayLayout, plan_save

        arrays, _ = ct.state(0, 1, self.n)
        layouts = [ArrayLayout(p, a.shape, a.dtype.name, a.dtype.itemsize, ct.placements(p, a.shape, self.n))
                   for p, a in arrays.items()]
        nodes = [q // self.profile.procs_per_node for q in range(self.n)]
        biggest = max(pl.nbytes for pl in plan_save(layouts, self.n, ct.CHUNK_BYTES, nodes=nodes))
        slots = 6 * (2 if self.profile.protection != "none" else 1)  # a protection slot per step too
        return slots * proto.round_to_pages(biggest) * self.profile.procs_per_node

    # ----------------------------------------------------------------------------------------- agents
    def start_agent(self, d: str, trainers: Sequence[subprocess.Popen] = ()) -> None:
        """Start (or restart) the agent of node directory ``d`` with the node budget; wait until it listens.

        An agent a trainer's store started meanwhile (protection's store spawns one when ours is down) is
        replaced: SIGKILLed, its memory kept for ours to adopt, so that the node keeps its budget. The running
        ``trainers`` are stopped (SIGSTOP) while it is: their stores spawn a missing agent again every 2 s, and on
        a loaded machine one starts faster than ours and takes the directory's lock, round after round."""
        deadline = time.monotonic() + self.profile.timeout_s
        held: list[int] = []
        try:
            while True:
                try:
                    return self._start_agent(d)
                except _AlreadyServed:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"another agent kept serving {d} for {self.profile.timeout_s:.0f} s") \
                            from None
                    for p in trainers if not held else ():
                        if p.poll() is None:
                            os.killpg(p.pid, signal.SIGSTOP)  # each trainer leads its own session (Incarnation)
                            held.append(p.pid)
                    self._kill_server(d, deadline)
        finally:
            for pid in held:
                try:
                    os.killpg(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass

    @staticmethod
    def _kill_server(d: str, deadline: float) -> None:
        """SIGKILL the agent that holds ``d``'s lock. It takes the lock before it writes its pid file, so the
        file may still name the dead agent it replaces: wait until it names a live process."""
        while time.monotonic() < deadline:
            info = proto.read_pid_file(d)
            if info is not None and ct.proc_state(info[0]) not in ("Z", "X"):
                ct.kill_agent(d, wipe=False)
                return
            time.sleep(0.005)

    def _start_agent(self, d: str) -> None:
        old = self.agents.pop(d, None)
        if old is not None:
            if old.poll() is None:
                ct.kill_agent(d, wipe=False)
                old.kill()  # its pid file may be gone with its directory; unreaped, the pid is still its own
            old.wait()
        proto.ensure_private_dir(d, create=True)
        job = self.job + "-jax" if d == self.jax_dir else self.job
        log_path = self.agent_log(d)
        p = self.agents[d] = subprocess.Popen(
            deathsig.command([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", job, "--dir", d, "--log",
                              log_path, "--budget-bytes", str(self.budget), "--node", os.path.basename(d),
                              "--peer-security", self.profile.peer_security]),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        # Listening means its pid file and peer file are written (in that order, before the socket); the socket
        # file of the agent it replaces may still be there, so only a connection tells.
        deadline = time.monotonic() + self.profile.timeout_s
        while not self._listening(d, p.pid):
            if p.poll() == EXIT_ALREADY_RUNNING:
                raise _AlreadyServed(d)
            if p.poll() is not None or time.monotonic() > deadline:
                try:
                    with open(log_path, "rb") as f:
                        tail = f.read()[-2000:].decode(errors="replace")
                except OSError:
                    tail = ""
                raise RuntimeError(f"the agent of {d} did not start (exit code {p.poll()}); its log ends:\n{tail}")
            time.sleep(0.005)
        from jaxckpt.backends.agent import peer_files

        info = peer_files.read_peer_info(d) or {}
        self.agent_keys["curve" if info.get("server_key") else "token"] += 1

    @staticmethod
    def _listening(d: str, pid: int) -> bool:
        if (proto.read_pid_file(d) or (None,))[0] != pid:
            return False
        try:
            proto.AgentConnection(d, timeout_s=5).close()
            return True
        except JaxckptError:
            return False

    # ----------------------------------------------------------------------------------------- trainers
    def specs(self, mode: str, fault: dict | None, target: int) -> list[dict]:
        self.epoch += 1
        base = {"job": self.job, "seed": self.seed, "steps": 10**6, "interval": self.profile.interval,
                "step_time_s": self.profile.step_time_s, "timeout_s": self.profile.timeout_s,
                "coord_dir": os.path.join(self.tmp, f"coord-{self.epoch}"), "process_count": self.n, "mode": mode,
                "protection": self.profile.protection, "agent_dirs": os.path.join(self.base, "node*"),
                "peer_timeout_s": self.profile.peer_timeout_s, "peer_security": self.profile.peer_security}
        if mode == "jax":  # every incarnation restores onto another mesh than the last one saved from
            return [{**base, "job": self.job + "-jax", "node_dir": self.jax_dir, "process": 0, "process_count": 1,
                     "devices": (4, 2)[self.epoch % 2], "fault": fault}]
        return [{**base, "process": q, "node_dir": self.node_dirs[q // self.profile.procs_per_node],
                 "fault": fault if q == target else None} for q in range(self.n)]

    def reference(self, step: int, mode: str) -> str:
        """The digest of the state at ``step``, recomputed here: the system under test never touches it."""
        return ct.digest(*(ct.jax_host(self.seed, step) if mode == "jax" else ct.state(self.seed, step, self.n)))

    def launch(self, prev: TrialResult | None, mode: str, fault: dict | None = None,
               target: int = -1) -> Incarnation | None:
        """Start an incarnation whose restore checks ``prev``'s fault; relaunch while it cannot restore. ``fault``
        goes to each attempt until it has gone off."""
        for _ in range(MAX_RELAUNCH + 1):
            for d, p in list(self.agents.items()):
                # Killed earlier (or its node's directory wiped): restart it first, as a launcher would. Not
                # only by its exit: a killed agent may still be tearing down, and a wiped one listens nowhere.
                if p.poll() is not None or not self._listening(d, p.pid):
                    self.start_agent(d)
            specs = self.specs(mode, None if self.fired else fault, target)
            inc = Incarnation(self.tmp, self.epoch, specs)
            ids = [s["process"] for s in specs]
            trained = lambda: all(inc.of("trained", q) for q in ids)  # noqa: E731 - restored (or fresh) and on
            if not inc.wait(lambda: trained() or inc.of("restart") or inc.exited(), self.profile.timeout_s * 3):
                self.hang(inc, prev, "did not get through its restore in time")
            elif trained():
                self._check(inc, prev, mode)
                return inc
            elif inc.of("restart") and all(p.poll() in (None, ct.RESTART) for p in inc.procs):
                # A restart agreed by all: each process ends on its own, after dropping steps with bad bytes.
                inc.wait(lambda: all(p.poll() is not None for p in inc.procs), min(10.0, self.profile.timeout_s))
            self.stop(inc)
            self.fired += inc.of("phase-fault")
            if prev is not None:
                prev.relaunches += 1
                prev.relaunches_bad_bytes += any(e.get("integrity") for e in inc.of("restore-failed"))
        return None

    def _check(self, inc: Incarnation, prev: TrialResult | None, mode: str) -> None:
        restored = {e["step"] for e in inc.of("restored")}
        wrong = [e for e in inc.of("restored") if e["digest"] != self.reference(e["step"], mode)]
        if len(restored) > 1:  # processes that restored different steps: a torn job
            wrong.append({"steps": sorted(restored)})
        step = max(restored) if restored else None
        if step is not None and step > self.trained_max:
            wrong.append({"never trained": step})
        if wrong:
            log.error("WRONG restore after %s: %s", prev and prev.kind, wrong)
        if prev is None:
            self.unattributed["wrong"] += len(wrong)
            return
        prev.restored, prev.checks = step, prev.checks + 1
        prev.fell_back += len({e["why"] for e in inc.of("restore-fell-back")})  # the same line on every process
        prev.wrong += len(wrong)
        prev.recovered = prev.checks > 0 and prev.wrong == 0
        prev.lost = max(prev.lost, prev.trained - (step or 0))
        # What no fault of this kind may take: the committed step, or (data destroyed) the protected one. An
        # agent killed within the restore itself takes its memory from that restore as a node loss would, kept
        # or not: a chunk no other source holds makes the step lost to the job (jaxckpt.core.fallback), and only
        # protection covers it.
        gone = prev.kind in NODE_LOSS or (prev.kind.startswith("kill-agent-phase") and " at restore " in prev.detail
                                          and any(e["phase"] == "restore" for e in inc.of("phase-fault")))
        floor = prev.committed if prev.kind not in DESTRUCTIVE and not gone else \
            prev.protected if gone and self.profile.protection != "none" else 0
        if (step or 0) < floor:
            prev.unexpected_loss = True
            log.error("trial %d (%s): step %d lost, restored %s", prev.trial, prev.kind, floor, step)

    def stop(self, inc: Incarnation) -> None:
        """SIGKILL the incarnation (the job is stopped at a random point too) and note how far it trained."""
        inc.stop()
        self.trained_max = max(self.trained_max, inc.last("trained"))
        self.safe_protected = max(self.safe_protected, inc.last("protected"))
        lags = protection_lags(inc.events)
        self.protection_lags += lags
        self.lags_by_kind.setdefault(self._kind, []).extend(lags)

    def warm_up(self, inc: Incarnation, res: TrialResult) -> bool:
        """Let the job commit a random 1..3 more snapshots; False if it ended, or stalled (a hang)."""
        want = inc.last("committed") + self.rng.randint(1, 3) * self.profile.interval
        ok = inc.wait(lambda: inc.last("committed") >= want or inc.exited(), self.profile.timeout_s)
        if not ok:
            self.hang(inc, res, f"committed no step past {want - 1} in {self.profile.timeout_s:g} s")
        return ok and not inc.exited()

    def hang(self, inc: Incarnation, res: TrialResult | None, what: str) -> None:
        """A wait expired: count the hang (against ``res``'s trial, else the first incarnation), say why the job
        stopped, and keep what explains it (``keep_hangs``; jaxckpt.tools.chaos.hang)."""
        if res is not None:
            res.hang = True
        else:
            self.unattributed["hangs"] += 1
        self.hung += 1
        log.error("hang: incarnation %d %s", self.epoch, what)
        for line in hang.why_stalled(inc.events):
            log.error("hang: %s", line)
        if self.keep_hangs:
            hang.dump_stacks([p.pid for p in inc.procs if p.poll() is None] +
                             [p.pid for p in self.agents.values() if p.poll() is None])
            dest = os.path.join(self.keep_hangs, f"hang-{self.hung}-trial-{res.trial if res else 0}-{self._kind}")
            hang.keep(dest, [*inc.logs, *(self.agent_log(d) for d in self.agents)], list(inc.events),
                      os.path.join(self.tmp, f"coord-{self.epoch}"))
            log.error("hang: logs, events and every thread's stack kept in %s", dest)

    def agent_log(self, d: str) -> str:
        """The log of the agent the driver runs for node directory ``d``."""
        return os.path.join(self.tmp, f"agent-{os.path.basename(d)}.log")

    # --------------------------------------------------------------------------------------------- trials
    def run(self) -> dict:
        """Every trial, then the report; agents, processes and directories are gone afterwards."""
        t0 = time.monotonic()
        try:
            for d in self.node_dirs:
                self.start_agent(d)
            self._trials("numpy", self.trials)
            kinds = [k for k in JAX_KINDS if k in self.kinds]
            if self.jax_trials and kinds:
                self.start_agent(self.jax_dir)
                self._trials("jax", self.jax_trials, kinds)
        finally:
            self.close()
        return report(self, time.monotonic() - t0)

    def _trials(self, mode: str, count: int, kinds: list[str] | None = None) -> None:
        prev, self.trained_max = None, 0
        left: list[str] = []  # the kinds not yet drawn in this round
        for i in range(count + 1):  # the last incarnation only checks the last fault
            t0 = time.monotonic()
            kind = None
            if i < count:  # every kind once in each round of len(kinds) trials, each drawn at random from the rest
                left = left or list(kinds or self.kinds)
                kind = self.rng.choice(left)
                left.remove(kind)
            res = TrialResult(len(self.results), kind, mode) if kind else None
            self._kind = (kind or "end") + (" (jax)" if mode == "jax" else "")
            fault, target = FAULTS[kind].prepare(self, res) if kind else (None, -1)
            self.fired = []
            if fault is not None and fault["phase"] == "restore":
                # Its own restore is what this fault hits: check the previous fault on a clean incarnation first.
                inc = self.launch(prev, mode)
                if inc is not None:
                    if self.warm_up(inc, res) and fault["action"] == "kill-agent-wipe":
                        wait_protected(self, inc)
                    self.stop(inc)
                    res.trained, res.committed = inc.last("trained"), inc.last("committed")
                    res.protected = inc.last("protected")  # what a memory wipe in the restore must not take
                prev = res
            floor = self.safe_protected
            inc = self.launch(prev, mode, fault, target)
            if inc is not None and res is not None:
                try:
                    FAULTS[kind].inject(self, inc, res)
                finally:
                    self.stop(inc)
                res.trained, res.committed = max(res.trained, inc.last("trained")), inc.last("committed")
                if FAULTS[kind].after is not None:
                    FAULTS[kind].after(self, res)
            elif inc is not None:
                self.stop(inc)
            elif res is not None:
                res.detail += " (no incarnation could restore before it)"
            if res is not None and kind in NODE_LOSS:
                res.protected = max(res.protected, floor)
            if kind in DESTRUCTIVE:  # what was protected before may have lost a part: only newer steps count
                self.safe_protected = 0
            end_trial(self)
            if res is not None:
                res.seconds = round(time.monotonic() - t0, 2)
                self.results.append(res)
            prev = res

    def close(self) -> None:
        end_trial(self)
        for d, p in list(self.agents.items()):
            try:
                proto.stop_agent(d, self.job + "-jax" if d == self.jax_dir else self.job, timeout_s=30)
            except Exception:  # noqa: BLE001 - a wrecked directory: killed and removed below
                pass
            if p.poll() is None:
                p.kill()
            p.wait()
        for d in [*self.node_dirs, self.jax_dir]:
            proto.kill_agent(d)
            try:  # the log of an agent a JAX trainer's store started itself while ours was down
                os.unlink(proto.default_log_path(d))
            except FileNotFoundError:
                pass
        shutil.rmtree(self.base, ignore_errors=True)
        shutil.rmtree(self.tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------------- report
def report(run: ChaosRun, seconds: float) -> dict:
    """Totals and per-kind rows of a finished run: what ``--json`` prints."""
    rows: dict[str, Counter] = {}
    for r in run.results:
        row = rows.setdefault(r.kind + (" (jax)" if r.mode == "jax" else ""), Counter())
        row.update({k: int(v) for k, v in dict(
            trials=1, recovered=r.recovered, wrong=r.wrong, hangs=r.hang, unexpected_loss=r.unexpected_loss,
            lost=r.lost, relaunches=r.relaunches, relaunches_bad_bytes=r.relaunches_bad_bytes, fell_back=r.fell_back, saves_not_resumed=r.saves_resumed is False,
            jax=r.mode == "jax").items()})
        row["max_lost"] = max(row["max_lost"], r.lost)
    total = Counter()
    for row in rows.values():
        total.update({k: v for k, v in row.items() if k != "max_lost"})
        total["max_lost"] = max(total["max_lost"], row["max_lost"])
    wrong, hangs = total["wrong"] + run.unattributed["wrong"], total["hangs"] + run.unattributed["hangs"]
    return {"profile": asdict(run.profile), "seed": run.seed, "seconds": round(seconds, 1),
            "trials": len(run.results), "jax_trials": total["jax"],
            "faults": {k: dict(v) for k, v in sorted(rows.items())},
            "recoveries": total["recovered"], "wrong_restores": wrong, "hangs": hangs,
            "unexpected_losses": total["unexpected_loss"], "steps_lost": total["lost"],
            "max_steps_lost": total["max_lost"], "relaunches": total["relaunches"],
            "relaunches_bad_bytes": total["relaunches_bad_bytes"],
            "fell_back_in_restore": total["fell_back"],
            "protection_lag": lag_summary(run.protection_lags, run.profile.interval),
            "protection_lag_by_kind": {k: lag_summary(v, run.profile.interval)
                                       for k, v in sorted(run.lags_by_kind.items()) if v},
            "saves_not_resumed": total["saves_not_resumed"], "agents_by_peer_security": dict(run.agent_keys),
            "unavailable": {k: f.unavailable for k, f in FAULTS.items() if f.inject is None},
            "results": [asdict(r) for r in run.results]}


def ok(rep: dict) -> bool:
    """No wrong restore, no hang, no unexpected loss, every fault recovered from."""
    return not (rep["wrong_restores"] or rep["hangs"] or rep["unexpected_losses"]) and \
        rep["recoveries"] == rep["trials"]
