"""The node agent's control protocol and directory layout, shared by the agent, ShmStore and the CLI.

Directory (``Config.shm_dir``, default ``/dev/shm/jaxckpt-<uid>-<job>[@slurm<id>]@<node>``; mode 0700, owned by us,
checked):

  agent.lock            fcntl lock held by the running agent (one agent per directory)
  agent.pid             its pid and generation, for tools and tests
  agent.sock            Unix socket, mode 0600: trainers and the CLI talk to the agent here
  seg-p<P>-<gen>-<n>    a shared-memory segment (mode 0600) of process P, created by agent generation <gen>
  rec-p<P>-s<step>      commit record of (P, step): segment, size, manifest; written last, atomically
  peer.addr, peer.token where peers read this node's snapshots, and the token they need (peer_files.py)

Messages are msgpack maps framed by a 4-byte big-endian length, never pickle, at most ``MAX_MESSAGE_BYTES``
(a manifest travels inline in ``commit`` and ``open``). A request is ``{"v": 1, "op": ..., fields}``; a reply
is ``{"ok": true, fields}`` or ``{"ok": false, "code": ..., "error": message}``; :func:`raise_for` turns the
codes into jaxckpt errors. Every name that becomes a path is validated against a strict pattern first.
"""
from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import re
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

import msgpack

from jaxckpt.config import Config
from jaxckpt.errors import (AgentError, BudgetExceededError, ClosedError, ConfigError, StepError,
                            StoreUnavailableError)
from jaxckpt.core.manifest import MAX_MANIFEST_BYTES
from jaxckpt.node_identity import agent_dir_name, allocation, node_identity
from jaxckpt.backends.agent.capacity import nearest_existing
from jaxckpt.protection import PROTECT_BASE  # noqa: F401 - re-exported: the agent lists protection slots apart

VERSION = 1
PAGE = mmap.PAGESIZE
SOCKET_NAME, LOCK_NAME, PID_NAME = "agent.sock", "agent.lock", "agent.pid"
MAX_MESSAGE_BYTES = MAX_MANIFEST_BYTES + (1 << 20)  # a full-size manifest plus the envelope
RPC_TIMEOUT_S = 120.0  # a reserve may fallocate gigabytes on first use
SEG_RE = re.compile(r"seg-p(\d{1,9})-([0-9a-f]{16})-(\d{1,12})\Z")
REC_RE = re.compile(r"rec-p(\d{1,9})-s(\d{1,19})\Z")
_HEADER = struct.Struct(">I")


class ProtocolError(AgentError):
    """A message that is too large, truncated, or not a msgpack map."""


# --------------------------------------------------------------------------------------------------- layout
def agent_dir(config: Config) -> str:
    """The node agent's directory for ``config``: ``Config.shm_dir``, or under ``shm_base`` one per job and node
    (and SLURM allocation): ``jaxckpt.node_identity.agent_dir_name``."""
    if config.shm_dir:
        return os.path.normpath(config.shm_dir)
    return os.path.join(shm_base(config), agent_dir_name(config.job_id, node_identity(config).name))


def shm_base(config: Config | None = None) -> str:
    """Where default agent directories live: ``Config.shm_root``, else /dev/shm, or the temp directory on a system
    without it. A root that is not a directory is a ConfigError: made here, the directories would land on
    whatever filesystem holds the path (a disk), not the memory an administrator mounted there."""
    root = config.shm_root if config is not None else ""
    if root:
        if not os.path.isdir(root):
            raise ConfigError(f"Config.shm_root={root!r}: no such directory (mount the tmpfs there first: "
                              f"docs/deploy.md, \"Huge pages\")")
        return os.path.normpath(root)
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def default_log_path(directory: str) -> str:
    """Where an agent logs unless told otherwise: on disk (not in shared memory), one file per directory."""
    digest = hashlib.blake2b(os.path.abspath(directory).encode(), digest_size=4).hexdigest()
    return os.path.join(tempfile.gettempdir(), f"jaxckpt-agent-{os.geteuid()}-{os.path.basename(directory)}-"
                                               f"{digest}.log")


def ensure_private_dir(path: str, *, create: bool) -> str:
    """``path`` as a directory owned by us with no group/other access; refuses anything else (symlinks too)."""
    if create:
        parent = os.path.dirname(path)
        try:
            if parent:
                os.makedirs(parent, exist_ok=True)
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
        except PermissionError as e:  # e.g. a root-owned 0755 directory above it (Kubernetes' hostPath makes those)
            raise AgentError(cannot_make(path, e.strerror)) from None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise StoreUnavailableError(f"node agent directory {path} does not exist (no agent runs there)") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise AgentError(f"refusing agent directory {path}: it must be a directory owned by uid {os.geteuid()} "
                         f"with mode 0700 (found mode {stat.filemode(st.st_mode)}, uid {st.st_uid})")
    return path


def cannot_make(path: str, reason: str) -> str:
    """Why the agent directory ``path`` cannot be made (``reason``: the error's text), naming the nearest
    directory above it that exists, its owner and mode, and what to do."""
    above = nearest_existing(path)
    try:
        st = os.stat(above)
        found = f"{above} is owned by uid {st.st_uid} with mode {stat.filemode(st.st_mode)}"
    except OSError as e:
        found = f"{above}: {e.strerror}"
    return (f"cannot make the node agent directory {path} as uid {os.geteuid()} ({reason}): {found}; make it "
            f"under a directory this user may write (a memory filesystem such as /dev/shm, mode 1777, or one the "
            f"user owns)")


def segment_name(process: int, generation: str, n: int) -> str:
    return check_name(f"seg-p{process}-{generation}-{n}", SEG_RE)


def record_name(process: int, step: int) -> str:
    return check_name(f"rec-p{process}-s{step}", REC_RE)


def check_name(name: Any, pattern: re.Pattern = SEG_RE) -> str:
    """``name`` if it matches ``pattern`` exactly (so it can never leave the directory), else ProtocolError."""
    if not isinstance(name, str) or not pattern.match(name):
        raise ProtocolError(f"invalid name {name!r} (expected {pattern.pattern})")
    return name


def remove_file(path: str) -> None:
    """Unlink ``path``; one already gone is fine (an agent and its predecessor, or a peer, may race to it)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def write_private(path: str, data: bytes, tmp: str) -> None:
    """``data`` as the whole of ``path``, mode 0600: written to ``tmp`` (same directory) and renamed over it, so a
    reader finds the old file or the new one, never a part of either."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an older file of that name may have had another mode
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_private(path: str, limit: int) -> bytes | None:
    """The bytes of ``path`` if it is a private regular file of ours of at most ``limit`` bytes (AgentError
    otherwise: another user's file, a link, a FIFO, one too large); None if it does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077 or st.st_size > limit:
            raise AgentError(f"refusing {path}: not a private regular file of uid {os.geteuid()} of at most "
                             f"{limit} bytes")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit)
    finally:
        os.close(fd)


def round_to_pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def open_segment(directory: str, name: str, size: int, *, writable: bool = True) -> mmap.mmap:
    """Map segment ``name`` of ``directory`` (``size`` bytes, shared); checks it is our private regular file."""
    path = os.path.join(directory, check_name(name))
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as e:  # gone, or a symlink planted in its place (O_NOFOLLOW): never followed
        raise AgentError(f"cannot open segment {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise AgentError(f"refusing segment {path}: not a private regular file of uid {os.geteuid()}")
        if st.st_size < size:
            raise AgentError(f"segment {path} holds {st.st_size} bytes, expected at least {size}")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)


# -------------------------------------------------------------------------------------------------- framing
def send_msg(sock: socket.socket, msg: dict) -> None:
    """Send one framed msgpack map."""
    body = msgpack.packb(msg, use_bin_type=True)
    if len(body) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message {msg.get('op', '?')!r} of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    sock.sendall(_HEADER.pack(len(body)) + body)


def recv_msg(sock: socket.socket, *, message_timeout_s: float | None = None) -> dict | None:
    """Receive one framed msgpack map; None on a clean end of stream before a message starts.

    The wait for a message to start is the socket's own time-out (an agent's trainers stay connected, idle,
    between saves). With ``message_timeout_s``, the whole message must arrive within that many seconds of its
    first byte: a peer that sends part of a message and stalls gets a ProtocolError instead of a thread.
    The body is allocated as it arrives, never from the length header alone.
    """
    first = _recv_exact(sock, 1, allow_eof=True)
    if first is None:
        return None
    deadline = None if message_timeout_s is None else time.monotonic() + message_timeout_s
    idle = sock.gettimeout()
    try:
        (n,) = _HEADER.unpack(first + _recv_exact(sock, _HEADER.size - 1, allow_eof=False, deadline=deadline))
        if n > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"message of {n} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
        body = _recv_exact(sock, n, allow_eof=False, deadline=deadline)
    finally:
        if deadline is not None:
            sock.settimeout(idle)
    try:
        msg = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=True, max_bin_len=n, max_str_len=n,
                              max_array_len=n, max_map_len=n, max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"malformed message ({type(e).__name__}: {e})") from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"message is a {type(msg).__name__}, expected a map")
    return msg


_RECV_PIECE = 1 << 20  # the buffer grows by what arrived, at most this much per read


def _recv_exact(sock: socket.socket, n: int, *, allow_eof: bool, deadline: float | None = None) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProtocolError(f"message stalled: {len(buf)} of {n} bytes arrived within the time-out")
            sock.settimeout(left)
        try:
            piece = sock.recv(min(n - len(buf), _RECV_PIECE))
        except socket.timeout:
            if deadline is None:
                raise
            raise ProtocolError(f"message stalled: {len(buf)} of {n} bytes arrived within the time-out") from None
        if not piece:
            if not buf and allow_eof:
                return None
            raise ConnectionResetError(f"connection closed after {len(buf)} of {n} bytes")
        buf += piece
    return bytes(buf)


def raise_for(reply: dict) -> dict:
    """``reply`` if it says ok, else the jaxckpt error its code stands for."""
    if reply.get("ok") is True:
        return reply
    code, error = reply.get("code"), str(reply.get("error", "the node agent refused the request"))
    raise {"step": StepError, "budget": BudgetExceededError, "closed": ClosedError}.get(code, AgentError)(error)


# --------------------------------------------------------------------------------------------------- client
class AgentConnection:
    """One connection to the agent of ``directory``: synchronous requests, one at a time (callers lock)."""

    def __init__(self, directory: str, timeout_s: float = RPC_TIMEOUT_S) -> None:
        self.directory = directory
        path = os.path.join(directory, SOCKET_NAME)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise StoreUnavailableError(f"no node agent is listening at {path}") from None
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
            raise AgentError(f"refusing {path}: not a socket owned by uid {os.geteuid()}")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        try:
            self.sock.connect(path)
        except OSError as e:
            self.sock.close()
            raise StoreUnavailableError(f"cannot connect to the node agent at {path}: {e.strerror or e}") from None

    def call(self, op: str, **fields: Any) -> dict:
        """Send a request and return its (ok) reply; StoreUnavailableError if the agent is gone."""
        try:
            send_msg(self.sock, {"v": VERSION, "op": op, **fields})
            reply = recv_msg(self.sock)
        except (OSError, ProtocolError) as e:
            self.close()
            raise StoreUnavailableError(f"node agent at {self.directory} stopped answering ({op}): {e}") from None
        if reply is None:
            self.close()
            raise StoreUnavailableError(f"node agent at {self.directory} closed the connection ({op})")
        return raise_for(reply)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def start_agent(config: Config, directory: str, *, recover: bool = False) -> subprocess.Popen:
    """Make the agent directory (private), hand it the job's peer token (``Config.peer_token``: the agent serves
    peers with it) and :func:`spawn_agent`: what a trainer does when no agent serves its node."""
    ensure_private_dir(directory, create=True)
    if config.peer_token:
        from jaxckpt.backends.agent.peer_files import read_token, write_token
        if read_token(directory) is None:
            write_token(directory, config.peer_token.encode())
    return spawn_agent(config, directory, recover=recover)


def spawn_agent(config: Config, directory: str, *, log_path: str | None = None,
                recover: bool = False) -> subprocess.Popen:
    """Start ``jaxckpt agent`` for ``config``'s job on ``directory``, detached (own session, no tty, no pipes).

    Under SLURM (with ``srun`` at hand) it starts as a step of its own in the allocation, on this node
    (``agent/lifetime.py``): a step's processes all die with the step (proctrack/cgroup), ``setsid`` or not, so
    only its own step lets the agent outlive the trainers' step and hear of the allocation's end (SIGTERM),
    when it frees the node's memory. The Popen is then the ``srun``; it dies with the spawner's step, which
    mostly leaves the agent's step running (not always: ``agent/lifetime.py``).
    Two spawns race harmlessly: the agent's lock lets one run; the other exits at once.
    An agent told ``Config.agent_peers`` serves where the job's other agents look for it (``--peers``,
    ``--peer-port``), and so recovers a lost node's share when it starts empty (``agent/recovery.py``); with
    ``recover`` it is also told ``Config.agent_dirs`` (an agent started before the trainer imports its framework,
    ``jaxckpt.start_agent``): one spawned by ``Checkpointer()`` starts when its trainer is about to restore, which
    then rebuilds what it needs itself.
    """
    from jaxckpt.backends.agent.lifetime import step_launch
    cmd = [sys.executable, "-m", "jaxckpt.cli", "agent", "--job", config.job_id, "--dir", directory,
           "--node", node_identity(config).name, "--log", log_path or default_log_path(directory),
           "--peer-bind", config.peer_bind, "--peer-security", config.peer_security, "--transport", config.transport]
    if config.agent_peers:
        cmd += ["--peers", config.agent_peers]
    if config.agent_port:
        cmd += ["--peer-port", str(config.agent_port)]
    if recover and config.agent_dirs:
        cmd += ["--agent-dirs", config.agent_dirs]
    step = step_launch()
    prefix, env = step if step is not None else ([], None)
    # Without srun under SLURM it stays in the spawning task's process group: where the step is a process group
    # (proctrack/pgid) a session of its own would take it out of the step's signals, past the allocation.
    return subprocess.Popen(prefix + cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=step is not None or not allocation(),
                            close_fds=True, env=env)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user counts: it exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_pid_file(directory: str) -> tuple[int, str] | None:
    """(pid, generation) of the agent that last ran in ``directory``, or None (also for anything but a regular
    file: a link is not followed and a FIFO not waited on, whoever reads another's directory)."""
    try:
        fd = os.open(os.path.join(directory, PID_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = msgpack.unpackb(os.read(fd, 4096), raw=False)
        return int(data["pid"]), str(data["generation"])
    except (OSError, ValueError, KeyError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return None
    finally:
        os.close(fd)


def agent_status(directory: str, job: str | None = None, *, timeout_s: float = 30.0) -> dict:
    """The status reply of the agent of ``directory`` (slots, pools, bytes, trainers: what ``jaxckpt ls`` shows)."""
    conn = AgentConnection(directory, timeout_s=timeout_s)
    try:
        conn.call("hello", job=job, role="client")
        return conn.call("status")
    finally:
        conn.close()


def stop_agent(directory: str, job: str | None = None, *, timeout_s: float = 30.0) -> bool:
    """Ask the agent of ``directory`` to shut down (it frees its memory) and wait until it has; False if none ran.
    AgentError if it answered but still holds its lock after ``timeout_s`` (its memory may not be freed)."""
    try:
        conn = AgentConnection(directory, timeout_s=timeout_s)
    except StoreUnavailableError:
        return False
    # The agent holds its lock until it has freed everything: the one sign of that which holds where the directory
    # stays (a mount point, as a Kubernetes volume is, cannot be removed) or lives in another mount namespace.
    lock = open_lock(directory)
    pid = read_pid_file(directory)  # for the error below: the agent removes the file as it stops
    try:
        try:
            conn.call("hello", job=job, role="client")
            conn.call("shutdown")
        finally:
            conn.close()
        deadline = time.monotonic() + timeout_s
        while os.path.exists(directory) and (lock is None or lock_held(lock)) and time.monotonic() < deadline:
            time.sleep(0.01)  # the agent removes the directory last, then lets its lock go
        if lock is not None and lock_held(lock) and os.path.exists(directory):
            who = f"pid {pid[0]}" if pid else "its pid unknown"
            raise AgentError(f"the agent of {directory} ({who}) answered the shutdown but still holds its lock after "
                             f"{timeout_s:g} s, so its memory may not be freed yet: wait longer, or look at what it "
                             f"waits on ('kill -USR1 <pid>' writes its threads' stacks to its log)")
    finally:
        if lock is not None:
            os.close(lock)
    return True


def open_lock(directory: str) -> int | None:
    """A read-only descriptor of the lock file of ``directory``'s agent (a regular file, no link followed), or
    None where there is none: the file an agent holds while it lives, even once it unlinked it."""
    try:
        fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def lock_held(fd: int) -> bool:
    """Whether an agent holds the lock file open as ``fd`` (:func:`open_lock`): it lets it go only as it exits."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)  # never in the way of a new agent's lock
    return False


def kill_agent(directory: str, *, remove_memory: bool = False) -> int | None:
    """SIGKILL the agent of ``directory`` (a node failure in tests); with ``remove_memory`` also delete its
    segments and records, as losing the node would. Returns the pid signalled, or None if none was recorded."""
    info = read_pid_file(directory)
    pid = None
    if info is not None:
        pid = info[0]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if remove_memory and os.path.isdir(directory):
        for name in os.listdir(directory):
            if SEG_RE.match(name) or REC_RE.match(name):
                os.unlink(os.path.join(directory, name))
    return pid
