"""``jaxckpt agent``: the node agent, one per node and job, owning the node's snapshot memory.

It holds the lock of its directory (a second agent exits at once), adopts what an earlier agent of the
directory committed, listens on a Unix socket (mode 0600) and serves each connection on its own thread:

  trainers   ``hello`` as process P of the job, then reserve/commit/abort/steps/open/unpin/delete/held on their
             own slots only (agent_table.py holds the state machine); a second live connection claiming P is
             refused, a dead one's claim is taken over. A dropped connection discards its half-written slots
             and releases its pins. ``pull`` fills a slot being written with protection blocks built from
             this node's and other nodes' chunks (protect_pull.py).
  tools      ``hello`` as a client: status (``jaxckpt ls``), manifest (``jaxckpt inspect``), shutdown.
  readers    ``hello`` as a reader of the job (a restoring process of this node): index, and open/unpin of any
             process's committed slot, which the reader maps read-only (zero-copy); its pins go with it.

Peers on other nodes read the same memory over the peer transport (serve.py): the agent serves every
committed slot of its node, token-authenticated, on ``--peer-bind`` (loopback by default; off loopback with
ZeroMQ CURVE, ``--peer-security``, jaxckpt.backends.curve), and publishes its address and CURVE public key in
``peer.addr`` next to ``peer.token``.

Peers must run as our uid (checked with SO_PEERCRED). On SIGTERM or SIGINT (or ``shutdown``) it stops
listening, unlinks every segment and record, removes its directory and exits 0; under SLURM a SIGTERM while the
allocation runs (a step's end) leaves the memory to the next step's agent instead (``agent/lifetime.py``). It
logs to a file.
"""
from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import sys
import secrets
import signal
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgpack

from jaxckpt.backends.agent import cgroup, lifetime
from jaxckpt.backends.agent.protocol import (LOCK_NAME, PID_NAME, SOCKET_NAME, VERSION, ProtocolError,
                                             ensure_private_dir, open_segment, pid_alive, recv_msg, remove_file,
                                             send_msg, write_private)
from jaxckpt.backends.agent.table import Limits, Refused, SlotTable
from jaxckpt.config import Config, peer_uses_curve
from jaxckpt.errors import ConfigError, StoreUnavailableError

log = logging.getLogger("jaxckpt.backends.agent.daemon")

EXIT_ALREADY_RUNNING = 3
# How long a waiting agent that got SIGTERM waits for the holder of its directory to end (Agent._outlast_holder):
# a holder's own stop and lifetime decision take well under a second, and both must end inside SLURM's KillWait
# (30 s by default, 5 s on the suite's emulated cluster) together with this agent's squeue.
TERM_WAIT_S = 2.0
MAX_INT = 1 << 62
MAX_PROCESS = 999_999_999  # process indices name files (agent_protocol.SEG_RE)
TRAINER_OPS = ("reserve", "commit", "abort", "steps", "open", "unpin", "delete", "held", "lend", "pull")
ANY_OPS = ("status", "manifest", "shutdown")
READER_OPS = ("index", "open", "unpin")
# A message must arrive whole within this long of its first byte: a client that stalls mid-message (or
# announces more bytes than it sends) loses its connection instead of pinning a thread for ever.
MESSAGE_TIMEOUT_S = 30.0


@dataclass(eq=False)
class _Conn:
    id: int
    sock: socket.socket
    pid: int
    process: int | None = None  # set by a trainer's hello
    client: bool = False  # set by a tool's hello
    reader: bool = False  # set by a reader's hello (with client)
    pins: Counter = field(default_factory=Counter)
    recovery_wait_s: float = 0.0  # how long its hello waited for the node's share to be recovered


class Agent:
    """The agent of ``job`` in ``directory``; :meth:`run` serves until stopped."""

    def __init__(self, job: str, directory: str, *, node: str = "", node_budget: int = 0,
                 peer_bind: str | None = "127.0.0.1", message_timeout_s: float = MESSAGE_TIMEOUT_S,
                 peer_security: str = "auto", transport: str = "zmq", agent_dirs: str = "", agent_peers: str = "",
                 agent_port: int = 0) -> None:
        # validates the job id (it names files), the rendezvous, and refuses a bind off loopback that could not be
        # protected
        Config(job_id=job, peer_bind=peer_bind or "127.0.0.1", peer_security=peer_security, transport=transport,
               agent_peers=agent_peers, agent_port=agent_port)
        self.job, self.dir = job, os.path.abspath(directory)
        self.node = node or socket.gethostname()
        self.generation = secrets.token_hex(8)
        self.started = time.time()
        self.table = SlotTable(self.dir, self.generation, node_budget=node_budget)
        self.adoption: dict = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: dict[int, _Conn] = {}
        self._ids = itertools.count(1)
        self._lock_fd: int | None = None
        self._listener: socket.socket | None = None
        self.peer_bind = peer_bind  # None: serve no peers
        self.peer_security = peer_security  # Config.peer_security of the peer server
        self.transport = transport  # Config.transport: the peer server's, and the protection pull's reads
        self.message_timeout_s = message_timeout_s
        self.peer_server = None
        self.snapshots = None  # agent_serve.AgentSnapshots once serving
        self.pulled_bytes = 0  # protection blocks' bytes this agent pulled from other nodes (protect_pull.py)
        self._pull_buckets = None  # protection_pull.Buckets, made at the first pull: each process's bandwidth cap
        # Config.agent_dirs: the job's other agents, from which a fresh node's agent recovers its node's share
        # as soon as it serves (agent/recovery.py); its trainers' hellos wait for that
        self.agent_dirs = agent_dirs
        # Config.agent_peers / agent_port: the same, across machines, by address (agent/rendezvous.py)
        self.agent_peers, self.agent_port = agent_peers, agent_port
        self.token = b""  # the peer token it serves with, once serving
        if agent_peers:
            from jaxckpt.backends.agent.peer_files import TOKEN_ENV, read_token

            if not (os.environ.get(TOKEN_ENV) or os.path.isdir(self.dir) and read_token(self.dir)):
                raise ConfigError(f"agent of job {job}: Config.agent_peers ({agent_peers!r}) needs the job's shared "
                                  f"peer token on every node (Config.peer_token, {TOKEN_ENV}); a token made here "
                                  f"would match no other node's")
        self.recovery = None
        self.term = lifetime.TermDecision(self.generation)  # what a SIGTERM does to the node's memory
        self.startup: dict[str, float] = {}  # startup_cost() once serving
        self.modules_at_serving: list[str] = []  # _packages() once serving

    # ------------------------------------------------------------------------------------------ lifecycle
    def acquire(self, *, create: bool = True) -> bool:
        """Take the directory's lock; False if another agent holds it, or (``create=False``) if the directory or
        its lock file is gone: an agent that freed it removed both."""
        if not create and not os.path.isdir(self.dir):
            return False
        ensure_private_dir(self.dir, create=create)
        path = os.path.join(self.dir, LOCK_NAME)
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o600)
            except FileNotFoundError:
                if create:
                    raise
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            try:
                same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if same:  # not a lock file an exiting agent unlinked after we opened it
                self._lock_fd = fd
                return True
            os.close(fd)

    def run(self, *, wait: bool = False) -> int:
        """Serve until SIGTERM/SIGINT or a shutdown request; free everything; the exit code. With ``wait``, an
        agent already serving the directory is waited out (then this one adopts what it leaves) instead of
        making this one exit: an agent run as its own SLURM step that a trainer's own agent beat to the lock."""
        def on_term(*_: Any) -> None:
            self.term.signalled()
            if self._listener is not None:  # serving: wake the accept loop now, not at its time-out (KillWait runs)
                self._request_stop()
            else:
                self._stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_term)
        while not self.acquire():
            if not wait:
                log.info("another agent already serves %s; exiting", self.dir)
                return EXIT_ALREADY_RUNNING
            self.term.learn_kill_wait()
            if self._stop.wait(0.2):
                if not self.term.received or not self._outlast_holder():
                    return 0
                break  # the holder left its memory and is gone: this agent decides for it (below)
        free = True
        try:
            self.adoption = self.table.adopt()
            if self.term.received:  # got here through _outlast_holder: no serving, only the lifetime decision
                free = self.term.free(f"while waiting for the holder of {self.dir}, which left it")
                return 0
            self._write_pid()
            self._serve_peers()
            self._listen()
            # SIGTERM/SIGINT stay with on_term (set above): it also records the signal for the lifetime decision
            self.startup = startup_cost()
            self.modules_at_serving = _packages()
            threading.Thread(target=_import_late, name="agent-import-late", daemon=True).start()
            if (self.agent_dirs or self.agent_peers) and not self.table.committed():
                from jaxckpt.backends.agent.recovery import Recovery

                self.recovery = Recovery(self)
                self.recovery.start()
            log.info("agent %s (pid %d) of job %s on node %s serving %s, %.0f ms after exec (%.0f ms CPU)",
                     self.generation, os.getpid(), self.job, self.node, self.dir, 1e3 * self.startup["serving_s"],
                     1e3 * self.startup["cpu_s"])
            self.term.learn_kill_wait()
            self._accept_loop()
            if self.term.received:  # a step's end under SLURM leaves the memory to the next step (agent/lifetime.py)
                free = self.term.free()
        finally:
            self.shutdown(free=free)
            if not free:  # kept at a SIGTERM while the allocation ran: its end may follow at once
                self.term.watch(self.dir)
        return 0

    def _outlast_holder(self) -> bool:
        """SIGTERM came while another agent holds the directory (a waiting ``--wait`` agent): True if that one
        ends within TERM_WAIT_S leaving its memory, and this agent now holds the lock. Under SLURM the holder may
        be a trainer's spawned agent whose own step ended a moment before the allocation (its SIGTERM came while
        the job still ran, so it kept the memory for a next step); without this the allocation's end would find
        no agent to free it. A holder that freed its memory removed the directory: nothing is left to decide."""
        deadline = time.monotonic() + TERM_WAIT_S
        while time.monotonic() < deadline:
            try:
                if self.acquire(create=False):
                    return True
            except StoreUnavailableError:  # the holder removed the directory between our checks: it freed it
                return False
            if not os.path.isdir(self.dir):
                return False
            time.sleep(0.05)
        return False

    def _write_pid(self) -> None:
        path = os.path.join(self.dir, PID_NAME)
        write_private(path, msgpack.packb({"pid": os.getpid(), "generation": self.generation, "job": self.job,
                                           "started": self.started}), path + ".tmp")

    def _serve_peers(self) -> None:
        """Serve the node's committed snapshots to peers and publish the address (peer_files.py)."""
        from jaxckpt.backends.agent import peer_files
        from jaxckpt.backends.agent import serve as agent_serve

        self.snapshots = agent_serve.AgentSnapshots(self.table, self.dir, self.transport, about={
            "node": self.node, "job": self.job, "generation": self.generation, "directory": self.dir})
        # a dead predecessor's address (we hold the directory's lock): readers would wait out a connect to it
        remove_file(os.path.join(self.dir, peer_files.PEER_NAME))
        if self.peer_bind is None:
            return
        try:
            from jaxckpt.core.transport import get_transport

            self.token = token = peer_files.load_or_make_token(self.dir)
            # reached by address alone (Config.agent_peers): a known port, and the CURVE key the token derives
            self.peer_server = get_transport(self.transport).serve(
                self.snapshots, token=token, host=self.peer_bind, port=self.agent_port,
                curve=peer_uses_curve(self.peer_bind, self.peer_security), token_key=bool(self.agent_peers))
            peer_files.write_peer_info(self.dir, {"address": self.peer_server.address, "node": self.node,
                                                  "job": self.job, "generation": self.generation,
                                                  "pid": os.getpid(), "directory": self.dir,
                                                  "server_key": self.peer_server.public_key})
        except Exception:  # noqa: BLE001 - the node's trainers are served without it; restores say what is missing
            log.exception("agent %s: cannot serve peers on %s", self.generation, self.peer_bind)

    def _listen(self) -> None:
        path = os.path.join(self.dir, SOCKET_NAME)
        remove_file(path)  # a socket left by an agent that died: we hold the lock, so it is stale
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is created 0600: no window in which others could connect
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(64)
        sock.settimeout(0.2)  # wakes the loop to notice a stop request
        self._listener = sock

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError as e:
                if self._stop.is_set():
                    break  # woken by _request_stop
                if e.errno in (errno.EINTR, errno.ECONNABORTED):
                    continue
                raise
            if self._stop.is_set():  # the wake-up connection of _request_stop
                sock.close()
                break
            sock.settimeout(None)
            pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
            if uid != os.geteuid():
                log.warning("refused a connection from pid %d of uid %d", pid, uid)
                sock.close()
                continue
            conn = _Conn(next(self._ids), sock, pid)
            with self._lock:
                self._conns[conn.id] = conn
            threading.Thread(target=self._serve, args=(conn,), name=f"agent-conn-{conn.id}", daemon=True).start()

    def shutdown(self, *, free: bool = True) -> None:
        """Stop listening, drop every connection, unlink all memory, remove the directory; with ``free=False``
        the segments, records and directory stay for the next agent to adopt, as after a kill."""
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
            remove_file(os.path.join(self.dir, SOCKET_NAME))
            self._listener = None
        with self._lock:
            conns = list(self._conns.values())
        for c in conns:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self.peer_server is not None:
            self.peer_server.close()
            self.peer_server = None
        if self._lock_fd is None:
            return
        from jaxckpt.backends.agent.peer_files import remove_peer_files
        remove_peer_files(self.dir)
        if not free:
            remove_file(os.path.join(self.dir, PID_NAME))  # its pid may be reused: never signalled through this file
            os.close(self._lock_fd)
            self._lock_fd = None
            log.info("agent %s stopped: its memory stays in %s", self.generation, self.dir)
            return
        nsegs, nbytes = self.table.close()
        remove_file(os.path.join(self.dir, SOCKET_NAME))  # a dead predecessor's, when this agent never listened
        remove_file(os.path.join(self.dir, PID_NAME))
        remove_file(os.path.join(self.dir, LOCK_NAME))  # while still locked: a newer agent re-creates it
        try:
            os.rmdir(self.dir)
        except OSError as e:
            log.warning("could not remove %s: %s", self.dir, e)
        os.close(self._lock_fd)
        self._lock_fd = None
        log.info("agent %s stopped: freed %d segments (%d bytes)", self.generation, nsegs, nbytes)

    # ----------------------------------------------------------------------------------------- connections
    def _serve(self, conn: _Conn) -> None:
        try:
            while not self._stop.is_set():
                try:
                    msg = recv_msg(conn.sock, message_timeout_s=self.message_timeout_s)
                except ProtocolError as e:  # oversized, stalled or garbled: the connection is dropped
                    log.warning("dropped connection %d (pid %d, process %s): %s", conn.id, conn.pid, conn.process, e)
                    break
                if msg is None:
                    break
                reply, after = self._handle(conn, msg)
                send_msg(conn.sock, reply)
                if after is not None:
                    after()
        except (OSError, ProtocolError) as e:
            if not self._stop.is_set():
                log.info("connection %d (pid %d, process %s) ended: %s", conn.id, conn.pid, conn.process, e)
        finally:
            self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        with self._lock:
            if self._conns.pop(conn.id, None) is None:
                return
        try:
            conn.sock.close()
        except OSError:
            pass
        for (p, step), n in conn.pins.items():  # a trainer's or a reader's
            for _ in range(n):
                self.table.unpin(p, step)
        if conn.process is not None:
            self.table.drop_owner(conn.id, conn.process)
            log.info("process %d (pid %d) disconnected", conn.process, conn.pid)

    def _handle(self, conn: _Conn, msg: dict) -> tuple[dict, Any]:
        op = msg.get("op")
        try:
            if msg.get("v") != VERSION:
                raise Refused("version", f"protocol version {msg.get('v')!r} is not {VERSION}")
            if op == "hello":
                return self._hello(conn, msg), None
            if conn.process is None and not conn.client:
                raise Refused("bad", f"{op!r} before hello")
            if op in ANY_OPS:
                return self._tool_op(conn, op, msg)
            if conn.reader and op in READER_OPS:
                if op == "index":
                    return {"ok": True, "held": self.snapshots.held() if self.snapshots else [],
                            "generation": self.generation, "node": self.node}, None
                return {"ok": True, **self._trainer_op(conn, _int(msg, "process", MAX_PROCESS), op, msg)}, None
            if op not in TRAINER_OPS or conn.process is None:
                raise Refused("bad", f"unknown or not permitted operation {op!r}")
            return {"ok": True, **self._trainer_op(conn, conn.process, op, msg)}, None
        except Refused as e:
            return {"ok": False, "code": e.code, "error": str(e)}, None
        except (KeyError, TypeError, ValueError) as e:
            log.warning("malformed %r request from pid %d: %s", op, conn.pid, e)
            return {"ok": False, "code": "bad", "error": f"malformed {op!r} request: {e}"}, None
        except OSError as e:  # the node's files: reported to the trainer, the agent serves on
            log.exception("%r request from pid %d failed", op, conn.pid)
            return {"ok": False, "code": "os", "error": f"node agent at {self.dir}: {op} failed: {e}"}, None

    def _hello(self, conn: _Conn, msg: dict) -> dict:
        if conn.process is not None or conn.client:
            raise Refused("bad", "hello was already said on this connection")
        reader = msg.get("role") == "reader"
        client = msg.get("role") == "client" or reader
        if msg["job"] != self.job and not (client and not reader and msg["job"] is None):  # tools may ask any agent
            raise Refused("job", f"this agent ({self.dir}) serves job {self.job!r}, not {msg['job']!r}")
        if client:
            conn.client, conn.reader = True, reader
        else:
            process = _int(msg, "process", MAX_PROCESS)
            if self.recovery is not None:  # join the recovery of the node's share rather than fetch it again
                t0 = time.monotonic()
                self.recovery.wait()
                conn.recovery_wait_s = time.monotonic() - t0
            limits = Limits(budget=_int(msg, "budget"), keep=max(1, _int(msg, "keep")),
                            pending=max(1, _int(msg, "pending")))
            self._claim(conn, process)
            self.table.declare(process, limits)
            log.info("process %d (pid %d) connected", process, conn.pid)
        return {"ok": True, "pid": os.getpid(), "generation": self.generation, "node": self.node, "dir": self.dir,
                "job": self.job, "started": self.started, "adoption": self.adoption,
                "steps": self.table.steps(conn.process) if conn.process is not None else [],
                # how long this hello waited for the recovery of the node's share (agent/recovery.py), and its end
                "recovery_wait_s": conn.recovery_wait_s,
                "recovery": dict(self.recovery.report) if self.recovery is not None else {}}

    def _claim(self, conn: _Conn, process: int) -> None:
        with self._lock:
            other = next((c for c in self._conns.values() if c.process == process and c is not conn), None)
        if other is not None:
            if pid_alive(other.pid) and other.pid != conn.pid:
                raise Refused("busy", f"process {process} of job {self.job} is already connected (pid {other.pid})")
            log.warning("process %d: pid %d takes over from connection of pid %d", process, conn.pid, other.pid)
            try:
                other.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._drop(other)
        conn.process = process

    def _trainer_op(self, conn: _Conn, p: int, op: str, msg: dict) -> dict:
        t = self.table
        if op == "steps":
            return {"steps": t.steps(p)}
        if op == "held":
            return {"bytes": t.held(p)}
        step = _int(msg, "step")
        if op == "reserve":
            entry, created = t.reserve(p, step, _int(msg, "nbytes"), conn.id)
            return {"seg": entry.seg.name if entry.seg else None, "size": entry.seg.size if entry.seg else 0,
                    "created": created, "segs": t.segments(p), "generation": self.generation}
        if op == "commit":
            manifest = msg["manifest"]
            if not isinstance(manifest, bytes):
                raise TypeError("manifest must be bytes")
            t.commit(p, step, manifest, conn.id)
            return {}
        if op == "abort":
            t.abort(p, step, conn.id)
            return {}
        if op == "open":
            entry = t.pin(p, step)
            if entry is None:
                return {"found": False, "steps": t.steps(p)}
            conn.pins[(p, step)] += 1
            return {"found": True, "seg": entry.seg.name if entry.seg else None, "nbytes": entry.nbytes,
                    "size": entry.seg.size if entry.seg else 0, "manifest": entry.manifest}
        if op == "unpin":
            if conn.pins[(p, step)] > 0:
                conn.pins[(p, step)] -= 1
                t.unpin(p, step)
            return {}
        if op == "lend":
            return {"lent": t.lend(p, step)}
        if op == "pull":
            return self._pull(conn, p, step, msg)
        t.delete(p, step)  # op == "delete"
        return {}

    def _pull(self, conn: _Conn, p: int, step: int, msg: dict) -> dict:
        """Build protection blocks into the slot this connection is writing (protect_pull.py)."""
        from jaxckpt.backends.agent.protection_pull import Buckets, pull_into
        from jaxckpt.errors import JaxckptError

        entry = self.table.writing(p, step, conn.id)
        if entry.seg is None:
            raise Refused("bad", f"step {step} of process {p}: an empty slot has nothing to fill")
        from jaxckpt.backends.agent import serve as agent_serve

        local = self.snapshots or agent_serve.AgentSnapshots(self.table, self.dir)
        m = open_segment(self.dir, entry.seg.name, entry.seg.size)
        try:
            with self._lock:
                if self._pull_buckets is None:
                    self._pull_buckets = Buckets()
            crcs, pulled, account, times = pull_into(memoryview(m)[:entry.nbytes], msg, step, local,
                                              buckets=self._pull_buckets, owner=p, transport=self.transport)
        except JaxckptError as e:  # a peer that failed, a bad chunk: the trainer's protection of the step fails
            raise Refused("pull", f"step {step}: {type(e).__name__}: {e}") from None
        finally:
            try:
                m.close()
            except BufferError:  # a failed pull's traceback still holds a view: the mapping goes with it
                pass
        with self._lock:
            self.pulled_bytes += pulled
        return {"crcs": crcs, "pulled": pulled, "bandwidth": account, "times": times}

    def _tool_op(self, conn: _Conn, op: str, msg: dict) -> tuple[dict, Any]:
        if op == "status":
            with self._lock:
                trainers = {str(c.process): c.pid for c in self._conns.values() if c.process is not None}
            return {"ok": True, "job": self.job, "node": self.node, "dir": self.dir, "pid": os.getpid(),
                    "generation": self.generation, "started": self.started, "now": time.time(),
                    "trainers": trainers, "adoption": self.adoption,
                    "peer_address": self.peer_server.address if self.peer_server else None,
                    "peer_key": self.peer_server.public_key if self.peer_server else "",
                    "peer_refused": self.peer_server.refused if self.peer_server else 0,
                    "pulled_bytes": self.pulled_bytes, "startup": self.startup,
                    "recovery": self.recovery.report if self.recovery is not None else {},
                    # what this process imported, when it began to serve and now: a replacement node's agent
                    # must not pay for frameworks it never uses (jax, ml_dtypes, torch); tests read it here
                    "modules_at_serving": self.modules_at_serving, "modules": _packages(),
                    # the cgroup the snapshots are charged to, which a process elsewhere (a trainer pod beside a
                    # DaemonSet's agent, jaxckpt doctor) cannot read from /proc
                    "memory_cgroup": _room(), **self.table.status()}, None
        if op == "manifest":
            m = self.table.manifest(_int(msg, "process", MAX_PROCESS), _int(msg, "step"))
            return {"ok": True, "found": m is not None, "manifest": m or b""}, None
        log.info("shutdown requested by pid %d", conn.pid)
        return {"ok": True}, self._request_stop  # op == "shutdown": reply first, then stop

    def _request_stop(self) -> None:
        self._stop.set()
        # Wake the accept loop now: shutdown() of a listening unix socket does not end a blocked accept() on
        # Linux, so without this connection the stop waits out the accept's 0.2 s time-out (paid by every
        # `jaxckpt agent --stop`, store close and test teardown).
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:
                wake.settimeout(1.0)
                wake.connect(os.path.join(self.dir, SOCKET_NAME))
        except OSError:
            pass  # the listener is gone already: nothing to wake


def startup_cost() -> dict[str, float]:
    """Seconds from this process's start (the spawn's fork and exec) to now, wall and CPU (all threads): what a
    replacement node's first ``Checkpointer()`` waits for when it spawns the agent. Wall time is read against
    the kernel's record of the process start (clock ticks), so the interpreter's own start-up counts too."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rpartition(b")")[2].split()  # the command name may hold spaces and parentheses
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in ticks since boot
    return {"serving_s": max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started),
            "cpu_s": time.process_time()}


def _room() -> dict | None:
    """This agent's memory cgroup room (``cgroup.room``) as its status reply carries it; None without a limit."""
    r = cgroup.room()
    return None if r is None else {"path": r.path, "limit": r.limit, "used": r.used, "free": r.free}


def _packages() -> list[str]:
    """The top-level packages this process has imported."""
    return sorted({m.partition(".")[0] for m in list(sys.modules)})


def _import_late() -> None:
    """Import numpy once serving: the agent needs it to decode a manifest (the first index a reader or a peer
    asks for, a protection pull), not to serve, so its start does not wait for it and its first index seldom
    does."""
    try:
        import numpy  # noqa: F401
    except Exception:  # noqa: BLE001 - the request that needs it will raise it to its caller
        log.exception("agent: importing numpy failed")


def _int(msg: dict, key: str, hi: int = MAX_INT) -> int:
    v = msg[key]
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= hi:
        raise ValueError(f"{key}={v!r} is not an integer in [0, {hi}]")
    return v
