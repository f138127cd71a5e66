"""The fault kinds of ``jaxckpt chaos`` (jaxckpt/tools/chaos/run.py): how each is prepared, injected and finished.

``FAULTS[kind] = Fault(prepare, inject, after, unavailable)``:
  prepare(run, res) -> (spec, process)  a fault a trainer acts on itself at an exact phase (or (None, -1));
  inject(run, inc, res)                 while the incarnation trains: wait for a random point, strike, and let
                                        the job recover as it must (agents restarted, saves checked to resume);
  after(run, res)                       once the job is stopped: damage to data at rest (chunks, records).
A kind whose ``inject`` is None is a hook for a fault that needs machinery not wired yet (``unavailable`` says
what); the driver lists it and skips it. :func:`end_trial` undoes what a trial's fault set up (the peer proxy),
whether or not an incarnation ran.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import msgpack

from jaxckpt.core import manifest as mf
from jaxckpt.backends.agent import protocol as proto
from jaxckpt.backends.agent import peer_files
from jaxckpt.tools.chaos.proxy import PeerProxy
from jaxckpt.errors import BudgetExceededError
from jaxckpt.tools.chaos import trainer as ct

from jaxckpt.tools.chaos.incarnation import Incarnation, TrialResult


class ChaosRun(Protocol):
    """What a fault uses of the run that injects it (jaxckpt/tools/chaos/run.py's ChaosRun)."""

    rng: random.Random
    profile: Any  # run.Profile
    n: int
    job: str
    node_dirs: list[str]
    jax_dir: str
    fired: list[dict]
    peer_proxy: tuple | None

    def start_agent(self, d: str, trainers: Sequence[subprocess.Popen] = ()) -> None: ...

    def warm_up(self, inc: Incarnation, res: TrialResult) -> bool: ...

SAVE_PHASES = ("reserve", "reserved", "copy", "commit", "committed", "delete", "idle")


class Fault(NamedTuple):
    prepare: Callable
    inject: Callable | None
    after: Callable | None = None
    unavailable: str = ""


def _no_prep(run: "ChaosRun", res: "TrialResult") -> tuple[None, int]:
    return None, -1


def _phase_prep(action: str, phases: tuple[str, ...]) -> Callable:
    def prep(run: "ChaosRun", res: "TrialResult") -> tuple[dict, int]:
        phase = run.rng.choice(phases)
        target = run.rng.randrange(run.n) if res.mode == "numpy" else 0
        res.detail = f"{action} at {phase} on process {target}"
        return {"phase": phase, "after": run.rng.randint(1, 3), "action": action}, target
    return prep


def _node_dir(run: "ChaosRun", res: "TrialResult", node: int) -> str:
    return run.node_dirs[node] if res.mode == "numpy" else run.jax_dir


# ------------------------------------------------------------------------------------------------ inject
def _kill_trainer(run: "ChaosRun", inc: "Incarnation", res: "TrialResult") -> None:
    """SIGKILL one trainer at a random instant (mid-step, mid-save or mid-commit: wherever it is)."""
    if not run.warm_up(inc, res):
        return
    q = run.rng.randrange(len(inc.procs))
    time.sleep(run.rng.uniform(0, 2 * run.profile.step_time_s * run.profile.interval))
    res.detail = f"SIGKILL process {q} at a random time"
    os.killpg(inc.procs[q].pid, signal.SIGKILL)


def _wait_phase(run: "ChaosRun", inc: "Incarnation", res: "TrialResult") -> None:
    """A trainer acts at its phase (kills itself, or its node's agent); then the job recovers as it must."""
    if " at restore " in res.detail:  # it went off (or could not: nothing to restore) in the launch
        if not (inc.of("phase-fault") or run.fired):
            res.detail += " (nothing to restore: did not fire)"
        elif "agent" in res.detail and inc.of("phase-fault"):  # the restore got through; the agent is gone
            node = inc.of("phase-fault")[0]["p"] // run.profile.procs_per_node
            respawn_and_resume(run, inc, res, _node_dir(run, res, node))
            return
        run.warm_up(inc, res)
        return
    if not inc.wait(lambda: inc.of("phase-fault") or inc.exited(), run.profile.timeout_s):
        run.hang(inc, res, "never reached the fault's phase")
        return
    if not inc.of("phase-fault"):
        res.detail += " (the process ended before the phase)"
        return
    fault = inc.of("phase-fault")[0]
    mine = [e for e in inc.events if e["p"] == fault["p"]]  # one pipe: in the order they happened
    res.protected = max((e["step"] for e in mine[:mine.index(fault)] if e["ev"] == "protected"), default=0)
    if "agent" in res.detail:
        node = inc.of("phase-fault")[0]["p"] // run.profile.procs_per_node
        respawn_and_resume(run, inc, res, _node_dir(run, res, node))
    else:
        inc.wait(inc.exited, run.profile.timeout_s)


def respawn_and_resume(run: "ChaosRun", inc: "Incarnation", res: "TrialResult", d: str) -> None:
    """Restart the node's agent (as a launcher would) and check that saving comes back."""
    run.start_agent(d, inc.procs)
    mark = inc.last("trained")  # a step trained after the agent is back (commit events may still be in flight)
    if inc.exited():
        return
    res.saves_resumed = inc.wait(lambda: inc.last("committed") > mark + run.profile.interval or inc.exited(),
                                 run.profile.timeout_s) and not inc.exited()
    if not res.saves_resumed and not inc.exited():
        run.hang(inc, res, f"did not save again after its node's agent came back ({run.profile.timeout_s:g} s)")
    elif not res.saves_resumed:
        res.detail += f" (saving did not resume: {inc.exit_report()})"


def wait_protected(run: "ChaosRun", inc: "Incarnation") -> None:
    """One failure at a time: before a node's memory goes, let the newest committed step be protected (bounded:
    a quarter of the driver's time-out; the fault strikes then anyway)."""
    if run.profile.protection != "none":
        mark = inc.last("committed")
        inc.wait(lambda: inc.last("protected") >= mark or inc.exited(), run.profile.timeout_s / 4)


def _kill_agent(wipe: bool) -> Callable:
    def inject(run: "ChaosRun", inc: "Incarnation", res: "TrialResult") -> None:
        if not run.warm_up(inc, res):
            return
        if wipe:
            wait_protected(run, inc)
        time.sleep(run.rng.uniform(0, 2 * run.profile.step_time_s))
        res.protected = inc.last("protected")
        node = run.rng.randrange(run.profile.nodes) if res.mode == "numpy" else 0
        d = _node_dir(run, res, node)
        res.detail = f"SIGKILL the agent of node {node}{' and wipe its memory' if wipe else ''}"
        ct.kill_agent(d, wipe=wipe)
        respawn_and_resume(run, inc, res, d)
    return inject


def _lose_node(run: "ChaosRun", inc: "Incarnation", res: "TrialResult") -> None:
    """A whole node goes: its trainers and its agent SIGKILLed at once, its memory and directory gone (the
    job is torn down; a replacement node starts empty). With protection, the newest protected step survives."""
    if not run.warm_up(inc, res):
        return
    wait_protected(run, inc)
    time.sleep(run.rng.uniform(0, 2 * run.profile.step_time_s))
    node = run.rng.randrange(run.profile.nodes)
    res.protected = inc.last("protected")
    res.detail = f"lost node {node} (trainers, agent, memory); newest protected step {res.protected}"
    for q, p in enumerate(inc.procs):
        if q // run.profile.procs_per_node == node:
            os.killpg(p.pid, signal.SIGKILL)
    d = run.node_dirs[node]
    ct.kill_agent(d, wipe=True)
    shutil.rmtree(d, ignore_errors=True)  # the replacement node's agent starts on an empty directory


def _train_a_little(run: "ChaosRun", inc: "Incarnation", res: "TrialResult") -> None:
    """Faults on data at rest: train a little; the job is stopped, then ``after`` does the damage."""
    run.warm_up(inc, res)


def _fill_budget(run: "ChaosRun", inc: "Incarnation", res: "TrialResult") -> None:
    """A foreign process of the job takes the node's free memory, and every segment a trainer gives back, until
    a save is refused (committed steps must stay); then it lets go, and saving must come back."""
    if not run.warm_up(inc, res):
        return
    node = run.rng.randrange(run.profile.nodes)
    conn = proto.AgentConnection(run.node_dirs[node], timeout_s=run.profile.timeout_s)

    def refused() -> bool:
        return any("BudgetExceeded" in e.get("error", "") for e in inc.of("save-failed")) or inc.exited()
    try:
        conn.call("hello", job=run.job, role="trainer", process=900 + node, process_count=1, keep=1, pending=1,
                  budget=0)
        taken, deadline = 0, time.monotonic() + run.profile.timeout_s / 4
        while not refused() and time.monotonic() < deadline:
            st = conn.call("status")
            if not st["node_budget"]:
                break
            # Past the pooled segments (the agent frees those first), up to one page short of the budget.
            free = st["node_budget"] - (st["held_bytes"] - sum(st.get("pooled", {}).values())) - proto.PAGE
            if free >= proto.PAGE:
                try:
                    conn.call("reserve", step=taken + 1, nbytes=free // proto.PAGE * proto.PAGE)
                    taken += 1
                except BudgetExceededError:  # a trainer took the room since the status: look again
                    pass
            time.sleep(0.002)
        res.detail = f"filled node {node}'s budget ({taken} reservations): " + \
            ("a save was refused" if refused() else "no save was refused (segments reused)")
    finally:
        conn.close()  # its half-written slots are discarded with the connection
    mark = inc.last("trained")
    res.saves_resumed = inc.wait(lambda: inc.last("committed") > mark + run.profile.interval or inc.exited(),
                                 run.profile.timeout_s) and not inc.exited()
    if not res.saves_resumed and inc.exited():
        res.detail += f" (saving did not resume: {inc.exit_report()})"


# ------------------------------------------------------------------------------------------ peer messages
# Per piece of the TCP stream: delay-kind trials hold back 30% of pieces for up to 0.3 s (well inside the trainers'
# peer time-out, so requests succeed late), from the incarnation's restore on; drop-kind trials drop 10% of
# pieces, at most 1..3 times per trial (a reset or a stall of up to twice the peer time-out: requests in flight
# fail and are retried or fall back), from the end of the restore on: a restore that cannot reach a node for a
# moment rightly settles for an older step, which the driver would count against the fault that restore checks
# (the previous trial's); restores across drops are checked in tests/test_hardening.py.
PEER_FAULTS = {"peer-delay": dict(delay_p=0.3, delay_max_s=0.3),
               "peer-drop": dict(delay_p=0.05, delay_max_s=0.05, drop_p=0.1)}


def _peer_prep(kind: str) -> Callable:
    def prep(run: "ChaosRun", res: "TrialResult") -> tuple[None, int]:
        """Put a proxy in front of a random node's peer endpoint before the incarnation starts, so that its
        restore (reading the other nodes' chunks) and its protection pulls cross it."""
        end_trial(run)
        node = run.rng.randrange(run.profile.nodes) if res.mode == "numpy" else 0
        d, seed, drops = _node_dir(run, res, node), run.rng.randrange(1 << 32), run.rng.randint(1, 3)
        info = peer_files.read_peer_info(d)
        if info is None:
            res.detail = f"node {node}'s agent serves no peers: nothing to intercept"
            return None, -1
        opts = dict(PEER_FAULTS[kind])
        if "drop_p" in opts:
            opts.update(max_drops=drops, stall_max_s=2 * run.profile.peer_timeout_s)
        proxy = PeerProxy(info["address"], seed=seed, io_timeout_s=run.profile.timeout_s / 4,
                          armed="drop_p" not in opts, **opts)
        published = dict(info)
        del published["token"]  # the agent's peer file keeps the token in its own file
        peer_files.write_peer_info(d, {**published, "address": proxy.address})
        run.peer_proxy = (proxy, d, published, node)
        return None, -1
    return prep


def _peer_traffic(run: "ChaosRun", inc: "Incarnation", res: "TrialResult") -> None:
    """Train while the proxy delays or drops: a few commits, and a step protected after the proxy went in
    (protection pulls cross it), then the job is stopped; the next restore reads around what it did."""
    if getattr(run, "peer_proxy", None) is None:
        run.warm_up(inc, res)
        return
    run.peer_proxy[0].arm()  # every process has restored (launch returns once all have trained)
    if run.warm_up(inc, res) and run.profile.protection != "none":
        mark = inc.last("committed")
        inc.wait(lambda: inc.last("protected") >= mark or inc.exited(), run.profile.timeout_s / 2)
    proxy, _, _, node = run.peer_proxy
    res.detail = f"proxy in front of node {node}'s peer endpoint: {proxy.stats.summary()}"


def end_trial(run: "ChaosRun") -> None:
    """Take the trial's peer proxy out: close it, and give the agent's own address back to its peer file
    (unless a restarted agent has written its own since)."""
    entry, run.peer_proxy = getattr(run, "peer_proxy", None), None
    if entry is None:
        return
    proxy, d, published, _ = entry
    proxy.close()
    try:
        now = peer_files.read_peer_info(d)
        if now is not None and now.get("address") == proxy.address:
            peer_files.write_peer_info(d, published)
    except OSError:  # the node's directory went (node loss): nothing to give back
        pass


# ------------------------------------------------------------------------------------------ data at rest
def _newest_record(run: "ChaosRun", res: "TrialResult") -> tuple[int, str, int, int, str] | None:
    """(node, node dir, step, process, record name) of the newest snapshot commit record on a random node (not
    the protection slots that trainers keep there under pseudo process indices)."""
    node = run.rng.randrange(run.profile.nodes)
    d = run.node_dirs[node]
    recs = sorted((int(m.group(2)), int(m.group(1)), name) for name in os.listdir(d)
                  if (m := proto.REC_RE.match(name)) and int(m.group(1)) < run.n)
    if not recs:
        res.detail = f"node {node} held nothing to corrupt"
        return None
    step, process, name = recs[-1]
    return node, d, step, process, name


def _corrupt_chunk(run: "ChaosRun", res: "TrialResult") -> None:
    """Flip one bit inside a chunk of the newest committed step a random node holds."""
    found = _newest_record(run, res)
    if found is None:
        return
    node, d, step, process, name = found
    with open(os.path.join(d, name), "rb") as f:
        rec = msgpack.unpackb(f.read(), raw=False)
    chunks = [(a.path, c) for a in mf.decode(rec["manifest"]).arrays for c in a.chunks if c.nbytes]
    path, chunk = run.rng.choice(chunks)
    off = chunk.offset + run.rng.randrange(chunk.nbytes)
    fd = os.open(os.path.join(d, rec["seg"]), os.O_RDWR | os.O_NOFOLLOW)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ (1 << run.rng.randrange(8))]), off)
    finally:
        os.close(fd)
    res.detail = f"flipped a bit of {path} in step {step} of process {process} (node {node})"


def _corrupt_record(run: "ChaosRun", res: "TrialResult") -> None:
    """Flip a bit of the newest commit record of a node, then restart its agent so that it adopts it again."""
    found = _newest_record(run, res)
    if found is None:
        return
    node, d, step, process, name = found
    path = os.path.join(d, name)
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[run.rng.randrange(len(data))] ^= 1 << run.rng.randrange(8)
        f.seek(0)
        f.write(data)
    ct.kill_agent(d, wipe=False)
    run.start_agent(d)
    res.detail = f"flipped a bit of the record of step {step} of process {process} (node {node}); agent restarted"


FAULTS: dict[str, Fault] = {
    "kill-trainer": Fault(_no_prep, _kill_trainer),
    "kill-trainer-phase": Fault(_phase_prep("kill-self", SAVE_PHASES + ("restore",)), _wait_phase),
    "kill-agent": Fault(_no_prep, _kill_agent(False)),
    "kill-agent-wipe": Fault(_no_prep, _kill_agent(True)),
    "kill-agent-phase": Fault(_phase_prep("kill-agent", ("reserved", "copy", "commit", "committed", "restore")),
                              _wait_phase),
    "kill-agent-phase-wipe": Fault(_phase_prep("kill-agent-wipe", ("copy", "committed", "restore")), _wait_phase),
    "corrupt-chunk": Fault(_no_prep, _train_a_little, _corrupt_chunk),
    "corrupt-record": Fault(_no_prep, _train_a_little, _corrupt_record),
    "fill-budget": Fault(_no_prep, _fill_budget),
    # A proxy in front of one node's peer endpoint (jaxckpt/tools/chaos/proxy.py), for the trial's restore and training.
    "peer-delay": Fault(_peer_prep("peer-delay"), _peer_traffic),
    "peer-drop": Fault(_peer_prep("peer-drop"), _peer_traffic),
    "node-loss": Fault(_no_prep, _lose_node),
}
# Faults that destroy stored data: the newest committed step may be lost (restore falls back, or starts over).
DESTRUCTIVE = {"kill-agent-wipe", "kill-agent-phase-wipe", "corrupt-chunk", "corrupt-record", "node-loss"}
# ... of which these take a whole node's memory: with Config.protection, the newest protected step must survive.
NODE_LOSS = {"kill-agent-wipe", "kill-agent-phase-wipe", "node-loss"}
JAX_KINDS = ("kill-trainer", "kill-agent")
