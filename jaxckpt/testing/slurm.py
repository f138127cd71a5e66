"""An emulated SLURM cluster on this machine, from Debian's ``slurm-wlm`` and ``munge``: one ``slurmctld`` and one
``slurmd -N <node>`` per node, each on its own port, ``ProctrackType=proctrack/cgroup`` (cgroups v1), munge with
a key of its own. Tests (tests/test_slurm.py) run real ``salloc``/``srun``/``sbatch``
against it. With ``memory_mb`` the nodes have that much memory and SLURM enforces the jobs' ``--mem``
(``TaskPlugin=task/cgroup``, ``ConstrainRAMSpace=yes``, memory a consumable resource): each step's processes run
in a memory cgroup under their job's, as on a site that constrains memory (tests/test_slurm_memory.py).

Every file lives under one root directory; the daemons run in the foreground as children of this process (own
sessions) and :meth:`SlurmCluster.stop` cancels every job, waits for their steps, stops the daemons and removes
the cgroups they made and the nodes' agent memory. If this process dies first (SIGKILL, a time-out), the daemons
get SIGTERM (PR_SET_PDEATHSIG) and a reaper process it started (``python -m jaxckpt.testing.slurm --reap``, its
own session, reading a pipe from this process until EOF) does the rest of stop(): the steps' processes, the
cgroups, the memory, the hosts line. Node names must resolve (JAX's SLURM detection connects to the first node by name): if
they do not, ``/etc/hosts`` gets one marked line mapping them to 127.0.0.1, removed again by ``stop``.
Needs root (slurmd runs as root; steps run as the caller), the binaries, and the freezer cgroup (v1) mounted:
:func:`unavailable` says why not when it cannot run.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterator, Sequence

from jaxckpt.errors import LaunchError
from jaxckpt.node_identity import parse_agent_dir_name

log = logging.getLogger("jaxckpt.testing")

BINARIES = ("slurmctld", "slurmd", "slurmstepd", "munged", "srun", "salloc", "sbatch", "squeue", "scancel",
            "scontrol", "sinfo")
CGROUP_ROOT = "/sys/fs/cgroup"
HOSTS = "/etc/hosts"
# SLURM resolves with AF_INET and AI_ADDRCONFIG, which finds nothing where 127.0.0.1 is the only IPv4 address (a
# network namespace with loopback alone, as tests/isolated runs use): a second loopback address makes glibc count
# IPv4 as configured. Added only then, removed by stop().
EXTRA_LOOPBACK = "127.0.0.2/32"


def unavailable(memory: bool = False) -> str | None:
    """Why an emulated cluster cannot run here (None if it can): root, the packages, cgroup v1's freezer, and with
    ``memory`` (a cluster of ``memory_mb``) cgroup v1's memory controller."""
    if os.geteuid() != 0:
        return "the emulated SLURM cluster needs root (slurmd runs as root)"
    missing = [b for b in BINARIES if shutil.which(b) is None and not os.path.exists(f"/usr/sbin/{b}")]
    if missing:
        return f"SLURM/munge not installed (missing {', '.join(missing)}; apt-get install slurm-wlm munge)"
    if not os.path.isdir(os.path.join(CGROUP_ROOT, "freezer")):
        return f"proctrack/cgroup needs cgroup v1's freezer controller at {CGROUP_ROOT}/freezer"
    if memory and not os.path.isfile(os.path.join(CGROUP_ROOT, "memory", "memory.limit_in_bytes")):
        return f"task/cgroup's ConstrainRAMSpace needs cgroup v1's memory controller at {CGROUP_ROOT}/memory"
    return None


def _die_with_parent() -> None:
    """In a daemon's child, before exec: SIGTERM when the process that started the cluster dies, so a test run
    killed before stop() (a time-out, SIGKILL) leaves no slurmctld, slurmd or munged behind."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _free_block(count: int, lo: int = 40000, hi: int = 60000) -> int:
    """The first of ``count`` consecutive TCP ports that were all free a moment ago (bound on every address)."""
    rng = random.Random(os.getpid() ^ int(time.time()))
    for _ in range(200):
        base = rng.randrange(lo, hi - count)
        socks = []
        try:
            for p in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise LaunchError(f"no {count} consecutive free ports in {lo}-{hi}")


class SlurmCluster:
    """``nodes`` emulated nodes named ``<prefix>1..N`` (``cpus`` CPUs each; the prefix random unless given) under
    ``root``, with slurm.conf's ``Epilog`` if ``epilog`` names a script, and with ``memory_mb`` that much memory a
    node and the jobs' ``--mem`` enforced by memory cgroups; start() / stop()."""

    def __init__(self, root: str, *, nodes: int = 3, cpus: int = 2, prefix: str = "", kill_wait: int = 5,
                 epilog: str = "", memory_mb: int = 0) -> None:
        self.root = os.path.abspath(root)
        # Node names name the cgroups (slurm_<node>) and /etc/hosts entries: unique per cluster unless given.
        prefix = prefix or f"jx{os.urandom(2).hex()}n"
        self.nodes = [f"{prefix}{k}" for k in range(1, nodes + 1)]
        self.cpus, self.kill_wait, self.epilog = cpus, kill_wait, os.path.abspath(epilog) if epilog else ""
        self.memory_mb = memory_mb
        self.conf = os.path.join(self.root, "slurm.conf")
        self._procs: dict[str, subprocess.Popen] = {}
        self._hosts_line: str | None = None
        self._added_loopback = False
        self._reaper: subprocess.Popen | None = None
        self.srun_ports = (0, 0)

    @property
    def env(self) -> dict[str, str]:
        """The environment in which SLURM's commands talk to this cluster (SLURM_CONF)."""
        return {**os.environ, "SLURM_CONF": self.conf}

    def run(self, cmd: Sequence[str], *, timeout: float = 60.0, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run a SLURM command against this cluster; LaunchError with its output if ``check`` and it fails."""
        r = subprocess.run(list(cmd), env={**self.env, **(env or {})}, capture_output=True, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
        if check and r.returncode != 0:
            raise LaunchError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()[-2000:]}")
        return r

    # ------------------------------------------------------------------------------------------- start
    def start(self, timeout: float = 60.0) -> "SlurmCluster":
        """Write the configuration, start munged, slurmctld and every slurmd; wait until every node is idle."""
        why = unavailable(memory=bool(self.memory_mb))
        if why:
            raise LaunchError(why)
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        for d in ("state", "spool", "log"):
            os.makedirs(os.path.join(self.root, d), exist_ok=True)
        os.chmod(self.root, 0o755)
        key = os.path.join(self.root, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o600)
        base = _free_block(len(self.nodes) + 1 + 64)
        ctld_port, node_ports = base, list(range(base + 1, base + 1 + len(self.nodes)))
        self.srun_ports = (base + 1 + len(self.nodes), base + len(self.nodes) + 64)
        self._write_conf(ctld_port, node_ports)
        self._resolve_nodes()
        self._ipv4_configured()
        self._start_reaper()
        sock = os.path.join(self.root, "munge.sock")
        self._spawn("munged", ["munged", "-F", "--force", f"--key-file={key}", f"--socket={sock}",
                               f"--pid-file={self.root}/munged.pid", f"--seed-file={self.root}/munged.seed",
                               f"--log-file={self.root}/log/munged.log"])
        self._wait(lambda: os.path.exists(sock), timeout, "munged's socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", self.conf])
        self._wait(lambda: self.run(["sinfo", "-h"], check=False).returncode == 0, timeout, "slurmctld")
        for n in self.nodes:
            os.makedirs(os.path.join(self.root, "spool", n), exist_ok=True)
            self._spawn(f"slurmd-{n}", ["slurmd", "-D", "-N", n, "-f", self.conf])
        self._wait(self._all_idle, timeout, "every node idle")
        log.info("emulated SLURM cluster %s up: nodes %s, slurmctld port %d", self.root, ",".join(self.nodes),
                 ctld_port)

    def _write_conf(self, ctld_port: int, node_ports: list[int]) -> None:
        r = self.root
        task, select = ("task/cgroup", "CR_CPU_Memory") if self.memory_mb else ("task/none", "CR_CPU")
        memory = self.memory_mb or 2000
        lines = [
            "ClusterName=jaxckpt", "SlurmctldHost=localhost(127.0.0.1)", f"SlurmctldPort={ctld_port}",
            "AuthType=auth/munge", f"AuthInfo=socket={r}/munge.sock", "CredType=cred/munge", "MpiDefault=none",
            "ProctrackType=proctrack/cgroup", f"TaskPlugin={task}", "ReturnToService=2",
            f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmdSpoolDir={r}/spool/%n", f"StateSaveLocation={r}/state", "SlurmUser=root", "SlurmdUser=root",
            "SchedulerType=sched/backfill", "SelectType=select/cons_tres", f"SelectTypeParameters={select}",
            f"SlurmctldLogFile={r}/log/slurmctld.log", f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "SlurmctldDebug=info", "SlurmdDebug=info", f"KillWait={self.kill_wait}", "InactiveLimit=0",
            "MinJobAge=30", "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none", f"SrunPortRange={self.srun_ports[0]}-{self.srun_ports[1]}",
        ]
        if self.epilog:  # run by every slurmd as root when a job's processes on its node are gone
            lines.append(f"Epilog={self.epilog}")
        lines += [f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={memory} "
                  f"Port={p}" for n, p in zip(self.nodes, node_ports)]
        lines.append("PartitionName=jx Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4")
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(r, "cgroup.conf"), "w") as f:
            f.write(f"CgroupPlugin=cgroup/v1\nCgroupMountpoint={CGROUP_ROOT}\nCgroupAutomount=no\n"
                    f"ConstrainCores=no\nConstrainRAMSpace={'yes' if self.memory_mb else 'no'}\n")

    def _resolve_nodes(self) -> None:
        unresolved = []
        for n in self.nodes:
            try:
                if socket.gethostbyname(n) != "127.0.0.1":
                    raise LaunchError(f"node name {n} resolves to {socket.gethostbyname(n)}, not 127.0.0.1")
            except socket.gaierror:
                unresolved.append(n)
        if unresolved:
            self._hosts_line = f"127.0.0.1 {' '.join(unresolved)}  # jaxckpt emulated SLURM cluster {self.root}\n"
            with open(HOSTS, "a") as f:
                f.write(self._hosts_line)

    def _ipv4_configured(self) -> None:
        try:
            socket.getaddrinfo("127.0.0.1", "1", socket.AF_INET, socket.SOCK_STREAM, 0, socket.AI_ADDRCONFIG)
            return
        except socket.gaierror:
            pass
        log.warning("emulated SLURM cluster: no IPv4 address but 127.0.0.1; adding %s to lo", EXTRA_LOOPBACK)
        subprocess.run(["ip", "addr", "add", EXTRA_LOOPBACK, "dev", "lo"], check=True, capture_output=True,
                       timeout=10)
        self._added_loopback = True

    def _state_path(self) -> str:
        return os.path.join(self.root, "reaper.json")

    def _start_reaper(self) -> None:
        with open(self._state_path(), "w") as f:
            json.dump({"root": self.root, "nodes": self.nodes, "hosts_line": self._hosts_line,
                       "added_loopback": self._added_loopback}, f)
        err = open(os.path.join(self.root, "log", "reaper.out"), "ab")
        try:
            self._reaper = subprocess.Popen([sys.executable, "-m", "jaxckpt.testing.slurm", "--reap",
                                             self._state_path()], stdin=subprocess.PIPE, stdout=err,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            err.close()

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(os.path.join(self.root, "log", f"{name}.out"), "ab")
        try:
            self._procs[name] = subprocess.Popen(cmd, env={**os.environ, "SLURM_CONF": self.conf},
                                                 stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                                 start_new_session=True, preexec_fn=_die_with_parent)
        finally:
            out.close()

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [n for n, p in self._procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                tail = ""
                for n in dead or list(self._procs)[-1:]:
                    try:
                        with open(os.path.join(self.root, "log", f"{n}.out"), "rb") as f:
                            tail += f"--- {n}:\n" + f.read()[-1500:].decode(errors="replace")
                    except OSError:
                        pass
                raise LaunchError(f"emulated SLURM cluster: no {what} within {timeout:g}s"
                                  f"{' (' + ', '.join(dead) + ' exited)' if dead else ''}\n{tail}")
            time.sleep(0.1)

    def _all_idle(self) -> bool:
        r = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        states = dict(line.split() for line in r.stdout.split("\n") if line.strip())
        return r.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes)

    # ------------------------------------------------------------------------------------------- jobs
    def jobs(self) -> list[str]:
        """Ids of the jobs the controller still knows as pending, running or completing."""
        r = self.run(["squeue", "-h", "-o", "%i"], check=False)
        return [j for j in r.stdout.split() if j.strip()]

    def salloc(self, nodes: int, name: str, *, extra: Sequence[str] = (), timeout: float = 60.0) -> str:
        """A new allocation of ``nodes`` nodes (no shell); its job id."""
        self.run(["salloc", "--no-shell", f"-N{nodes}", "-J", name, *extra], timeout=timeout)
        r = self.run(["squeue", "-h", "-n", name, "-o", "%i"])
        ids = r.stdout.split()
        if len(ids) != 1:
            raise LaunchError(f"salloc {name}: expected one job, squeue says {ids}")
        return ids[0]

    def agent_step(self, job: str, name: str, log_path: str, *args: str) -> subprocess.Popen:
        """``jaxckpt agent --job name [args]`` started as a step of allocation ``job`` (``srun --overlap``, this
        interpreter), logging to ``log_path``; the Popen is its ``srun``."""
        return subprocess.Popen(["srun", f"--jobid={job}", "--overlap", sys.executable, "-m", "jaxckpt.cli", "agent",
                                 "--job", name, "--log", log_path, *args], env=self.env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def job_state(self, job: str) -> str:
        """The job's state ("RUNNING", "COMPLETING", ...), "GONE" once the controller forgot it."""
        r = self.run(["squeue", "-h", "-j", job, "-o", "%T"], check=False)
        return (r.stdout.strip() or "GONE") if r.returncode == 0 else "GONE"

    def wait_gone(self, job: str, timeout: float = 60.0) -> None:
        """Until ``job`` is neither running nor completing."""
        self._wait(lambda: self.job_state(job) in ("GONE", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT"),
                   timeout, f"end of job {job}")

    def job_log(self, job: str, limit: int = 60) -> str:
        """The controller's and every slurmd's log lines that name ``job`` (its steps included), for a failed
        test's message: the order in which SLURM ended the job and signalled its steps."""
        # slurmstepd's own lines ("[5.0] task 0 (123) exited. Killed by signal 9.", "*** STEP 5.0 ... CANCELLED")
        # say how each step's processes ended, which the others do not
        pat = re.compile(rf"(JobId={job}\b|StepId={job}\.|job[ _]?{job}\b|\[{job}\.\w+\] (task|\*\*\*|Sent|error)|"
                         rf"STEP {job}\.)", re.IGNORECASE)
        lines = []
        for path in sorted(glob.glob(os.path.join(self.root, "log", "slurm*.log"))):
            try:
                with open(path, errors="replace") as f:
                    lines += [f"{os.path.basename(path)}: {ln.rstrip()}" for ln in f if pat.search(ln)]
            except OSError:
                continue
        return "\n".join(lines[-limit:])

    @contextlib.contextmanager
    def controller_stopped(self) -> Iterator[None]:
        """slurmctld stopped (SIGSTOP) inside the block, resumed (SIGCONT) after it: a controller that answers
        nothing, as one swamped by a storm of job ends; the slurmds and the running steps go on."""
        ctld = self._procs.get("slurmctld")
        if ctld is None or ctld.poll() is not None:
            raise LaunchError("slurmctld is not running")
        os.kill(ctld.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(ctld.pid, signal.SIGCONT)

    # -------------------------------------------------------------------------------------------- stop
    def stop(self, timeout: float = 60.0) -> None:
        """Cancel every job, wait for their steps, stop the daemons, remove the cgroups and the hosts line."""
        try:
            if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
                jobs = self.jobs()
                if jobs:
                    self.run(["scancel", *jobs], check=False)
                deadline = time.monotonic() + timeout
                while self.jobs() and time.monotonic() < deadline:
                    time.sleep(0.2)
                self._wait_steps(deadline)
        finally:
            for name in sorted(self._procs, key=lambda n: (n == "munged", n == "slurmctld")):
                p = self._procs[name]
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
                    try:
                        p.wait(15)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait(15)
            self._procs.clear()
            self._clean_up()
            if self._reaper is not None:  # nothing left for it: it finds no state and exits
                try:
                    os.remove(self._state_path())
                except FileNotFoundError:
                    pass
                self._reaper.stdin.close()
                try:
                    self._reaper.wait(30)
                except subprocess.TimeoutExpired:
                    self._reaper.kill()
                    self._reaper.wait(10)
                self._reaper = None

    def _clean_up(self) -> None:
        """Once the daemons are gone (stop(), or the reaper after this process died): SIGKILL to what is left in
        the nodes' cgroups, then remove the cgroups, the nodes' agent memory, the hosts line, the extra address."""
        self._kill_strays()
        self._remove_cgroups()
        self._remove_memory()
        self._unresolve()
        if self._added_loopback:
            subprocess.run(["ip", "addr", "del", EXTRA_LOOPBACK, "dev", "lo"], check=False,
                           capture_output=True, timeout=10)
            self._added_loopback = False

    def _remove_memory(self) -> None:
        """The default agent directories of this cluster's nodes (names unique to it) left in /dev/shm."""
        base = "/dev/shm"
        for name in os.listdir(base) if os.path.isdir(base) else []:
            parsed = parse_agent_dir_name(name)
            if parsed is not None and parsed[3] in self.nodes:
                log.info("emulated SLURM cluster: removing %s/%s", base, name)
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)

    def leftovers(self) -> list[str]:
        """What stop() failed to remove (daemons still running, processes or cgroups of this cluster's nodes, its
        line in /etc/hosts): empty once the cluster is gone."""
        left = [f"{n} (pid {p.pid})" for n, p in self._procs.items() if p.poll() is None]
        left += [f"process {pid} in a node's cgroup" for pid in self._pids()]
        left += [f"process {pid} with this cluster's SLURM_CONF" for pid in self._clients()]
        left += [f"cgroup {d}" for d in self._cgroup_dirs()]
        left += [f"/dev/shm/{n}" for n in (os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else [])
                 if (p := parse_agent_dir_name(n)) is not None and p[3] in self.nodes]
        if self._reaper is not None and self._reaper.poll() is None:
            left.append(f"reaper (pid {self._reaper.pid})")
        if self._hosts_line is not None:
            left.append(f"{HOSTS} line {self._hosts_line.strip()!r}")
        return left

    def _cgroup_dirs(self) -> list[str]:
        return [os.path.join(CGROUP_ROOT, c, f"slurm_{n}") for c in sorted(os.listdir(CGROUP_ROOT))
                for n in self.nodes if os.path.isdir(os.path.join(CGROUP_ROOT, c, f"slurm_{n}"))]

    def _pids(self) -> list[int]:
        """Processes still in this cluster's freezer cgroups (steps' tasks and their slurmstepd)."""
        pids: set[int] = set()
        for n in self.nodes:
            top = os.path.join(CGROUP_ROOT, "freezer", f"slurm_{n}")
            for dirpath, _, files in os.walk(top):
                if "cgroup.procs" in files:
                    try:
                        with open(os.path.join(dirpath, "cgroup.procs")) as f:
                            pids |= {int(x) for x in f.read().split()}
                    except OSError:
                        continue
        return sorted(pids)

    def _wait_steps(self, deadline: float) -> None:
        while self._pids() and time.monotonic() < deadline:
            time.sleep(0.2)

    def _clients(self) -> list[int]:
        """Processes that talk to this cluster (SLURM_CONF names its slurm.conf): srun, salloc, sbatch left
        waiting on a controller that is gone, and the steps' tasks."""
        mark, pids = f"SLURM_CONF={self.conf}".encode(), []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:
                continue
        return pids

    def _kill_strays(self) -> None:
        pids = sorted(set(self._pids()) | set(self._clients()))
        if pids:
            log.warning("emulated SLURM cluster: SIGKILL to %d processes left in its cgroups: %s", len(pids), pids)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while self._pids() and time.monotonic() < deadline:
            time.sleep(0.1)

    def _remove_cgroups(self) -> None:
        for top in self._cgroup_dirs():
            for dirpath, _, _ in sorted(os.walk(top), key=lambda t: -t[0].count("/")):
                try:
                    os.rmdir(dirpath)
                except OSError as e:
                    log.warning("emulated SLURM cluster: cgroup %s not removed: %s", dirpath, e)

    def _unresolve(self) -> None:
        if self._hosts_line is None:
            return
        try:
            with open(HOSTS) as f:
                lines = f.readlines()
            with open(HOSTS, "w") as f:
                f.writelines(line for line in lines if line != self._hosts_line)
        except OSError as e:
            log.warning("emulated SLURM cluster: could not remove its line from %s: %s", HOSTS, e)
        self._hosts_line = None

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running(prefix: str = "jaxckpt-slurm-", **options: object) -> Iterator[SlurmCluster]:
    """A started cluster (``SlurmCluster`` ``options``) under a new temporary root; on exit it is stopped, checked
    to have left nothing (LaunchError naming what) and its root removed. A SIGTERM meanwhile (a test run's
    time-out) unwinds through the stop instead of ending the process at once."""
    root = tempfile.mkdtemp(prefix=prefix)
    cluster = SlurmCluster(root, **options)  # type: ignore[arg-type]
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        cluster.start()
        yield cluster
    finally:
        try:
            cluster.stop()
            left = cluster.leftovers()
            if left:
                raise LaunchError(f"the emulated cluster left {left}")
        finally:
            signal.signal(signal.SIGTERM, previous)
            shutil.rmtree(root, ignore_errors=True)


def until(cond: Callable[[], object], timeout_s: float, interval_s: float = 0.1) -> bool:
    """Poll ``cond`` until it is true (True) or ``timeout_s`` has passed (False): what a test waits for of SLURM."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def agent_dirs(base: str, name: str, job: str) -> list[str]:
    """The default agent directories (names) of jaxckpt job ``name`` in SLURM allocation ``job`` under ``base``, one
    per node that ran an agent (``jaxckpt.node_identity.agent_dir_name``)."""
    try:
        names = os.listdir(base)
    except OSError:
        return []
    return sorted(d for d in names if d.startswith(f"jaxckpt-{os.geteuid()}-{name}@slurm{job}@"))


class Allocation:
    """``nodes`` nodes of a SLURM allocation to run a job's processes on through ``srun``, one step per process
    (:meth:`prefix`, for ``jaxckpt.tools.launcher.start(prefix=...)``): the allocation this process runs in
    (``SLURM_JOB_ID``), else one of an emulated cluster started here under ``root`` (needs root) and stopped by
    :meth:`close`. The processes join a JAX coordinator on loopback, so the nodes must be this machine (an
    emulated cluster, or an allocation whose nodes resolve to loopback): anything else is a LaunchError."""

    def __init__(self, nodes: int, root: str) -> None:
        self.cluster: SlurmCluster | None = None
        job = os.environ.get("SLURM_JOB_ID", "").strip()
        if job:
            self.conf, self.job = os.environ.get("SLURM_CONF", ""), job
            r = subprocess.run(["scontrol", "show", "hostnames", os.environ.get("SLURM_JOB_NODELIST", "")],
                               capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
            self.nodes = r.stdout.split()
            if len(self.nodes) < nodes:
                raise LaunchError(f"SLURM job {job} has {len(self.nodes)} nodes ({r.stderr.strip() or 'scontrol'}), "
                                  f"{nodes} needed")
            far = [n for n in self.nodes[:nodes] if not socket.gethostbyname(n).startswith("127.")]
            if far:
                raise LaunchError(f"SLURM job {job}: nodes {', '.join(far)} are not this machine; the processes "
                                  f"join a coordinator on loopback (run it on an emulated cluster)")
        else:
            self.cluster = SlurmCluster(root, nodes=nodes).start()
            self.conf = self.cluster.conf
            try:
                self.job = self.cluster.salloc(nodes, f"jaxckpt-{os.getpid()}")
            except BaseException:
                self.close()
                raise
            self.nodes = list(self.cluster.nodes)
        self.nodes = self.nodes[:nodes]

    def prefix(self, node: int) -> list[str]:
        """The words that run a command as a step of one task on the allocation's ``node``-th node. Steps
        overlap (a node's processes and agents share its CPUs, as the own launcher's do)."""
        conf = [f"SLURM_CONF={self.conf}"] if self.conf else []
        return ["env", *conf, "srun", f"--jobid={self.job}", "--overlap", "-N1", "-n1", "--ntasks-per-node=1",
                f"--nodelist={self.nodes[node]}", "--kill-on-bad-exit=1", "--input=none", "--quiet"]

    def close(self) -> None:
        """Stop the emulated cluster this started (its allocation with it); an existing allocation is left."""
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None


def _reap(state_path: str) -> int:
    """The reaper: wait until the process that started the cluster closes our stdin or dies, then clean up what
    its stop() did not (nothing, when stop() ran: it removes the state file first)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while sys.stdin.buffer.read(4096):
        pass
    try:
        with open(state_path) as f:
            state = json.load(f)
    except FileNotFoundError:
        return 0
    log.warning("emulated SLURM cluster %s: its starter died before stop(); cleaning up", state["root"])
    c = SlurmCluster(state["root"], nodes=0)
    c.nodes, c._hosts_line, c._added_loopback = list(state["nodes"]), state["hosts_line"], state["added_loopback"]
    c._clean_up()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--reap":
        sys.exit(_reap(sys.argv[2]))
    sys.exit("usage: python -m jaxckpt.testing.slurm --reap STATE_FILE")
