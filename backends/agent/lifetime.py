"""How long a node's snapshot memory lives under a scheduler, and who frees it (docs/deploy.md has the table).

Under SLURM with ProctrackType=proctrack/cgroup (measured on the emulated cluster of tests/test_slurm.py):

* every process of a step dies with the step, ``setsid`` or not, by SIGKILL; files in /dev/shm stay;
* signals other than SIGKILL reach a step's *tasks* only (the processes srun started, children of slurmstepd):
  at the allocation's end (``scancel JOB``, the batch script's end, the time limit) each task gets SIGTERM, the
  job is COMPLETING meanwhile, and the whole step gets SIGKILL ``KillWait`` seconds later;
* a step started from inside another step (``srun --overlap`` run by a task) usually outlives that step: its
  ``srun`` dies with the step it was started from, and the new step runs on (5 of 6 runs of an srun killed
  with a failed step's cgroup), still getting the allocation's end as above; but not always: an ``srun``
  SIGKILLed on its own, or one that gets the failed step's SIGTERM first, cancels its step (4 of 4 runs), which
  SIGKILLs its task; so does a multi-node step that ends normally on one node before the others (1 of 10 agents
  of 2-node trainer steps; the memory is then left for the next agent, the sweep or the Epilog).

So the agent runs as a step of its own: a trainer that spawns it under SLURM starts it through
``srun --overlap -N1 -n1 --nodelist=<this node>`` (:func:`step_launch`, used by ``protocol.spawn_agent``), and a
batch script may start it itself (``srun --overlap --ntasks-per-node=1 jaxckpt agent --job J --wait &``: that
srun lives outside every step, so the agent's step lives until the allocation ends, whatever the trainers' steps
do). Either way the agent is a task: it gets the SIGTERM at the allocation's end, sees the job COMPLETING and
frees its memory (:func:`keep_on_term`) within ``KillWait``, with no administrator's epilog: it asks within half of
``KillWait`` (:class:`TermDecision`, which learns it as the agent starts), and an answer that does not come in
that time frees the memory, where waiting on would end in slurmd's SIGKILL with the memory left to no one.
A step's failure
usually leaves a spawned agent serving; when it takes it along (the srun race above), the agent's files stay and
the relaunched step's agent adopts them: a relaunch restores from memory either way. An agent that kept the
memory at such a SIGTERM asks again for a while (a share of KillWait, :meth:`TermDecision.watch`) and removes it
if the allocation ends meanwhile: a batch script that ends right after its last step (measured with mpirun in an
allocation, whose end took a spawned agent's step along) would otherwise leave it to no one. A SIGTERM while the
allocation runs (``scancel --signal=TERM``, srun forwarding a Ctrl-C) leaves the memory for the next agent.
A batch script's ``--wait`` agent that a trainer's spawned agent beat to the directory may get the allocation's
SIGTERM while it still waits, just as that holder, whose own step ended a moment earlier, leaves the memory
(its SIGTERM came while the job ran): the waiting agent then waits up to ``daemon.TERM_WAIT_S`` for the holder
to end, takes the directory over and makes the same decision for it (``Agent._outlast_holder``).

Where ``srun`` is not at hand the trainer spawns the agent inside its own step: it dies with that step (its
files stay and the next step's agent adopts them) and never hears of the allocation's end. Memory no agent was
left to free (that case, or an agent SIGKILLed) is swept by the next agent of the same user on that node
(:func:`sweep_ended`), by ``jaxckpt doctor --sweep``, or by an administrator's epilog that removes
``/dev/shm/jaxckpt-*@slurm$SLURM_JOB_ID@*``: the default directory names its allocation
(``jaxckpt.node_identity.agent_dir_name``).

Outside SLURM nothing changes: SIGTERM frees the memory, as ``jaxckpt agent --stop`` and ``stop_agent`` do.
"""
from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import stat
import subprocess
import threading
import time
from typing import Mapping

from jaxckpt.backends.agent.protocol import LOCK_NAME
from jaxckpt.node_identity import ENV_SLURM_JOB, ENV_SLURM_NODE, allocation, parse_agent_dir_name

log = logging.getLogger("jaxckpt.backends.agent.lifetime")

QUERY_TIMEOUT_S = 5.0  # how long a question to SLURM may take when its KillWait is not known
# After a SIGTERM the agent has KillWait seconds before slurmd's SIGKILL: this share of it may go to the question
# (a controller busy ending many jobs answers late), the rest to unlinking the memory and exiting.
DECIDE_SHARE = 0.5
MIN_QUERY_S = 0.5  # a question given less than this is not worth asking: SLURM rarely answers faster under load
# An agent that kept the memory at a SIGTERM (the allocation ran) asks again, every WATCH_POLL_S, until this share
# of KillWait has passed since the SIGTERM: a batch script's end just after its last step may have taken the
# agent's step along first. The rest of KillWait is for removing the memory.
WATCH_SHARE = 0.6
WATCH_POLL_S = 0.5
_KILL_WAIT_RE = re.compile(r"^KillWait\s*=\s*(\d+)\s*sec", re.MULTILINE)
# The states of a job whose allocation still runs: a step that ends now is not the allocation's end.
RUNNING = frozenset({"RUNNING", "SUSPENDED", "STOPPED", "CONFIGURING", "RESIZING", "SIGNALING", "STAGE_OUT"})
# States in which a job holds no allocation any more (a requeued one is a new allocation of the same id).
ENDED = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED", "PENDING", "REQUEUED", "REQUEUE_HOLD",
                   "REQUEUE_FED", "GONE"})
# srun's input variables by which a step inherits its parent step's request (prefixes).
STEP_REQUEST_VARS = ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_CPUS_PER_", "SLURM_GPUS", "SLURM_TRES_PER_",
                     "SLURM_MEM_PER_", "SLURM_GRES", "SLURM_CPU_BIND", "SLURM_DISTRIBUTION", "SLURM_EXACT",
                     "SLURM_EXCLUSIVE", "SLURM_NNODES", "SLURM_STEP_")


def slurm_job_state(job: str, timeout_s: float = QUERY_TIMEOUT_S) -> str | None:
    """The state SLURM reports for ``job`` ("RUNNING", "COMPLETING", ...; "GONE" once it has left the controller's
    memory), or None if it cannot be asked (no squeue, no controller): callers then decide without it."""
    try:
        r = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True,
                           timeout=timeout_s, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("cannot ask SLURM for the state of job %s: %s", job, e)
        return None
    if r.returncode == 0:
        state = r.stdout.strip().split("\n")[0].strip()
        return state or "GONE"
    if "invalid job id" in r.stderr.lower():
        return "GONE"
    log.warning("cannot ask SLURM for the state of job %s: %s", job, r.stderr.strip()[-300:])
    return None


def kill_wait_s(timeout_s: float = QUERY_TIMEOUT_S) -> float | None:
    """SLURM's KillWait (the seconds between a step's SIGTERM and its SIGKILL) as ``scontrol show config`` reports
    it, or None if it cannot be asked or does not say."""
    try:
        r = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=timeout_s,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("cannot ask SLURM for its KillWait: %s", e)
        return None
    m = _KILL_WAIT_RE.search(r.stdout) if r.returncode == 0 else None
    if m is None:
        log.warning("cannot read SLURM's KillWait from scontrol show config (exit %d): %s", r.returncode,
                    r.stderr.strip()[-300:])
        return None
    return float(m.group(1))


def term_query_timeout_s(kill_wait: float | None, since_term_s: float) -> float:
    """How long the question of :func:`keep_on_term` may take, ``since_term_s`` after the SIGTERM: its share of
    ``kill_wait`` (QUERY_TIMEOUT_S where KillWait is unknown) less what has passed, at least MIN_QUERY_S."""
    budget = QUERY_TIMEOUT_S if kill_wait is None else DECIDE_SHARE * kill_wait
    return max(MIN_QUERY_S, budget - since_term_s)


def step_launch(environ: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]] | None:
    """The ``srun`` words, and their environment, that start a command as a step of its own in this SLURM
    allocation, on this node (one task, sharing the allocation's resources), or None outside an allocation or
    without ``srun``. The environment drops what the calling step asked for (its task count, CPUs, GPUs, memory,
    binding: srun would read them as this step's request); output goes to /dev/null on the node, so no stream
    ties the new step to the spawning process, whose step may die first."""
    env = dict(os.environ if environ is None else environ)
    node = env.get(ENV_SLURM_NODE, "").strip()
    srun = shutil.which("srun", path=env.get("PATH"))
    if not allocation(env) or not node or srun is None:
        return None
    env = {k: v for k, v in env.items() if not k.startswith(STEP_REQUEST_VARS)}
    return [srun, "--overlap", f"--jobid={env[ENV_SLURM_JOB].strip()}", "-N1", "-n1", "--ntasks-per-node=1",
            f"--nodelist={node}", "--kill-on-bad-exit=0", "--input=none", "--output=/dev/null",
            "--error=/dev/null", "--job-name=jaxckpt-agent", "--quiet"], env


def keep_on_term(environ: Mapping[str, str] | None = None, *, timeout_s: float = QUERY_TIMEOUT_S
                 ) -> tuple[bool, str]:
    """Whether an agent that got SIGTERM keeps its node's memory for the next step's agent, and why: only under
    SLURM while the allocation runs (a step's end, not the allocation's), as SLURM answers within ``timeout_s``.
    Anything else frees it: an answer that comes after slurmd's SIGKILL would leave the memory to no one."""
    env = os.environ if environ is None else environ
    if not allocation(env):
        return False, "not under SLURM"
    job = env[ENV_SLURM_JOB]
    state = slurm_job_state(job, timeout_s)
    if state is None:
        return False, f"the state of SLURM job {job} is unknown"
    return state in RUNNING, f"SLURM job {job} is {state}"


class TermDecision:
    """An agent's decision, after SIGTERM, whether to free its node's memory (:func:`keep_on_term`), taken within
    its share of SLURM's KillWait, which it learns on a thread of its own while it serves (or waits)."""

    def __init__(self, agent: str) -> None:
        self.agent = agent  # the agent's generation, for the log
        self.kill_wait_s: float | None = None  # SLURM's KillWait, once learnt
        self.term_at: float | None = None  # when the first SIGTERM/SIGINT came (time.monotonic)
        self._asked = False

    @property
    def received(self) -> bool:
        """Whether a SIGTERM/SIGINT came."""
        return self.term_at is not None

    def signalled(self) -> None:
        """Note the signal's arrival (called from the signal handler: nothing that may block)."""
        if self.term_at is None:
            self.term_at = time.monotonic()

    def learn_kill_wait(self) -> None:
        """Under SLURM, ask once, on a daemon thread, for KillWait; elsewhere nothing."""
        if self._asked or not allocation():
            return
        self._asked = True

        def ask() -> None:
            self.kill_wait_s = kill_wait_s()
            if self.kill_wait_s is not None:
                log.info("agent %s: SLURM's KillWait is %g s: a SIGTERM's decision takes at most %.1f s",
                         self.agent, self.kill_wait_s, term_query_timeout_s(self.kill_wait_s, 0.0))

        threading.Thread(target=ask, name="agent-kill-wait", daemon=True).start()

    def free(self, context: str = "") -> bool:
        """Whether to free the node's memory now. The signal's arrival is logged before SLURM is asked, so that an
        agent SIGKILLed while it asks still says what it was doing; the decision after, with how long it took."""
        since = time.monotonic() - (self.term_at or time.monotonic())
        timeout = term_query_timeout_s(self.kill_wait_s, since)
        where = f" {context}" if context else ""
        log.info("agent %s: SIGTERM%s %.0f ms ago; deciding within %.1f s (KillWait %s)", self.agent, where,
                 1e3 * since, timeout, "unknown" if self.kill_wait_s is None else f"{self.kill_wait_s:g} s")
        t0 = time.monotonic()
        keep, why = keep_on_term(timeout_s=timeout)
        log.info("agent %s: SIGTERM (%s, asked in %.0f ms): %s", self.agent, why, 1e3 * (time.monotonic() - t0),
                 "leaving the node's memory to the next agent" if keep else "freeing the node's memory")
        return not keep

    def watch(self, directory: str) -> bool:
        """After :meth:`free` kept the node's memory and the agent let ``directory`` go (a next agent may take it
        over): ask SLURM again until ``WATCH_SHARE`` of KillWait has passed since the SIGTERM, and if the
        allocation has ended meanwhile, remove the directory unless a newer agent holds it. True if removed.

        A spawned agent's step may end with the step of the process that spawned it (its ``srun`` dies there),
        a moment before the allocation ends (the batch script's last step, then its end; measured with mpirun in
        an allocation): its SIGTERM comes while the job still runs, and no agent would be left to free the memory
        at the allocation's end."""
        if self.term_at is None or self.kill_wait_s is None or not allocation():
            return False
        job = os.environ[ENV_SLURM_JOB]
        deadline = self.term_at + WATCH_SHARE * self.kill_wait_s
        while (left := deadline - time.monotonic()) >= MIN_QUERY_S:
            time.sleep(min(WATCH_POLL_S, left - MIN_QUERY_S))
            state = slurm_job_state(job, max(MIN_QUERY_S, deadline - time.monotonic()))
            if state is None or state in RUNNING:  # unknown: the decision stands
                continue
            removed = _remove_unserved(directory)
            log.info("agent %s: SLURM job %s is %s %.1f s after the SIGTERM: %s", self.agent, job, state,
                     time.monotonic() - self.term_at, f"removed {directory}" if removed else
                     f"{directory} is another agent's now")
            return removed
        log.info("agent %s: SLURM job %s still runs %.1f s after the SIGTERM: the memory stays for the next agent",
                 self.agent, job, time.monotonic() - self.term_at)
        return False


def sweep_ended(base: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """Remove this user's default agent directories under ``base`` whose SLURM allocation has ended and that no
    agent serves; the paths removed. Directories of running (or unknown) allocations and of this one are left."""
    own = allocation(environ)
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    states: dict[str, str | None] = {}
    for name in names:
        parsed = parse_agent_dir_name(name)
        if parsed is None or parsed[0] != os.geteuid() or not parsed[2] or parsed[2] == own:
            continue
        job = parsed[2][len("slurm"):]
        if job not in states:
            states[job] = slurm_job_state(job)
        if states[job] not in ENDED:
            continue
        path = os.path.join(base, name)
        if _remove_unserved(path):
            log.warning("removed %s: left by SLURM job %s, which is %s", path, job, states[job])
            removed.append(path)
    return removed


def _remove_unserved(path: str) -> bool:
    """Remove the agent directory ``path`` (ours, private) unless an agent holds its lock."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return False
    lock = os.path.join(path, LOCK_NAME)
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = None
    except OSError:
        return False
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # an agent serves it
        shutil.rmtree(path, ignore_errors=True)
        return not os.path.lexists(path)
    finally:
        if fd is not None:
            os.close(fd)
