"""Nobody gets in: token authentication, private files, no pickle, loopback only, names that cannot escape.

- peers authenticate with the job's token, compared with ``hmac.compare_digest`` (checked in the source, and
  at run time: near-miss tokens of every kind get nothing);
- a real agent started under umask 0 still makes its directory 0700 and every file in it 0600 (socket, lock,
  pid, segments, commit records, peer files), and has no listening socket beyond loopback;
- the package (jaxckpt/, backends/) has no pickle, marshal, shelve or dill on any path, no ``torch.load``
  without ``weights_only=True`` and no ``np.load(allow_pickle=True)`` (a source scan, itself tested);
- a transport server and a job's peer server bind loopback unless configured otherwise;
- names from peers (segment names, commit records, job ids, step numbers of the persistent tier) cannot leave
  the job's namespace: '../x', absolute paths, NUL bytes and overlong names get clean errors and nothing is
  created, read or removed outside.
"""
from __future__ import annotations

import ast
import hmac
import ipaddress
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgpack
import numpy as np
import psutil
import pytest
import zmq

import jaxckpt
from jaxckpt import Config
from jaxckpt.backends.agent import protocol as proto
from jaxckpt.backends.memory import MemoryStore
from jaxckpt.backends.shm import ShmStore
from jaxckpt.backends.transport import VERSION, ZmqTransport
from jaxckpt.core.coordination import LocalCoordinator
from jaxckpt.errors import AgentError, ConfigError, JaxckptError, PeerError, StepError
from jaxckpt.testing.store import manifest_of, pattern

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = (ROOT / "jaxckpt", ROOT / "backends")
TOKEN = b"0123456789abcdef0123456789abcdef-job-token"


def sources() -> list[Path]:
    out = sorted(p for d in PACKAGE_DIRS for p in d.rglob("*.py"))
    assert len(out) > 30, out  # the scan really sees the package
    return out


# ------------------------------------------------------------------------------------------------ pickle
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}


def pickle_findings(text: str, name: str = "<src>") -> list[str]:
    """Every way ``text`` could unpickle (or unmarshal) data: imports, calls, and options that allow it."""
    found = []
    tree = ast.parse(text, name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{name}:{node.lineno}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] in BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in BANNED_MODULES:
            found.append(f"{name}:{node.lineno}: from {node.module} import")
        elif isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            kwargs = {k.arg: k.value for k in node.keywords}
            if re.search(r"(^|\.)(pickle|cPickle|_pickle|dill|cloudpickle|marshal|shelve|joblib)\.", func + "."):
                if func.split(".")[0] in BANNED_MODULES:
                    found.append(f"{name}:{node.lineno}: {func}(...)")
            if func.endswith("torch.load") or func == "load" and "weights_only" in kwargs:
                wo = kwargs.get("weights_only")
                if not (isinstance(wo, ast.Constant) and wo.value is True):
                    found.append(f"{name}:{node.lineno}: {func}(...) without weights_only=True")
            if "allow_pickle" in kwargs:
                ap = kwargs["allow_pickle"]
                if not (isinstance(ap, ast.Constant) and ap.value is False):
                    found.append(f"{name}:{node.lineno}: {func}(allow_pickle=...)")
            if func.endswith(("read_pickle", "to_pickle")) or func in ("__import__", "importlib.import_module") \
                    and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in BANNED_MODULES:
                found.append(f"{name}:{node.lineno}: {func}(...)")
    return found


def test_the_pickle_scan_catches_every_form():
    planted = """
import pickle
import dill as d
from marshal import loads
import shelve, os
from cloudpickle import dumps
x = pickle.loads(b"")
y = torch.load("f")
z = torch.load("f", weights_only=False)
w = np.load("f", allow_pickle=True)
v = numpy.load("f", allow_pickle=flag)
m = __import__("pickle")
"""
    found = pickle_findings(planted)
    for what in ("import pickle", "import dill", "from marshal", "import shelve", "from cloudpickle",
                 "pickle.loads", "torch.load(...) without", "allow_pickle", "__import__"):
        assert any(what in f for f in found), (what, found)
    assert len([f for f in found if "torch.load" in f]) == 2
    clean = 'torch.load("f", weights_only=True)\nnp.load("f")\nnp.load("f", allow_pickle=False)\nimport json\n'
    assert pickle_findings(clean) == []


def test_no_pickle_on_any_path_of_the_package():
    findings = [f for p in sources() for f in pickle_findings(p.read_text(), str(p.relative_to(ROOT)))]
    assert findings == [], "\n".join(findings)
    # Plain text too, for anything the AST misses (strings handed to exec, comments excluded by design).
    for p in sources():
        for n, line in enumerate(p.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            assert not re.search(r"\b(cPickle|pickle\.load|dill\.load|marshal\.loads?|shelve\.open)\b", code), \
                f"{p}:{n}: {line.strip()}"


# ------------------------------------------------------------------------------------------ the token
def _names_token(node: ast.AST) -> bool:
    text = ast.unparse(node).lower()
    return "token" in text and "tokens" not in text


def test_tokens_are_compared_in_constant_time_only():
    """No ``==``/``!=``/``in`` on a token anywhere in the package; the peer server uses hmac.compare_digest."""
    bad, digests = [], 0
    for p in sources():
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                     for op in node.ops):
                sides = [node.left, *node.comparators]
                # Only comparisons of token values (attributes like ``slot.token.conn`` are not tokens).
                if any(_names_token(s) and not ast.unparse(s).lower().split("token")[-1].startswith(".")
                       for s in sides):
                    bad.append(f"{p.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("hmac.compare_digest", "compare_digest"):
                digests += 1
    assert bad == [], "\n".join(bad)
    server = (ROOT / "backends" / "transport.py").read_text()
    assert "hmac.compare_digest(token, self._token)" in server
    assert digests >= 1


@pytest.fixture
def server():
    store = MemoryStore(Config())
    slot = store.reserve(3, 4096)
    np.frombuffer(slot.buffer, np.uint8)[:] = pattern(3, 4096)
    store.commit(slot, b"the manifest of step 3")
    srv = ZmqTransport(frame_bytes=4096).serve(store, token=TOKEN)
    yield store, srv
    srv.close()
    store.close()


def test_a_wrong_token_gets_nothing(server):
    store, srv = server
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(srv.address)
    near_misses = [TOKEN[:-1] + bytes([TOKEN[-1] ^ 1]), bytes([TOKEN[0] ^ 0x80]) + TOKEN[1:], TOKEN[:-1],
                   TOKEN + b"x", b"", TOKEN.upper(), TOKEN.decode(), None, 0, [TOKEN], {"token": TOKEN},
                   b"\x00" * len(TOKEN), TOKEN * 50]
    try:
        for i, token in enumerate(near_misses):
            for op, fields in (("steps", {}), ("manifest", {"step": 3}), ("read", {"step": 3, "offset": 0,
                                                                                   "nbytes": 64})):
                req = {"v": VERSION, "id": i, "op": op, **fields}
                if token is not None:
                    req["token"] = token
                sock.send(msgpack.packb(req, use_bin_type=True))
                assert sock.poll(20_000)
                header, *payload = sock.recv_multipart()
                header = msgpack.unpackb(header, raw=False)
                assert (header["ok"], header["code"]) == (False, "auth"), (token, op, header)
                assert header["steps"] == [] and payload in ([b""], []), (token, op, header, payload)
        assert srv.served == 0 and srv.refused == 3 * len(near_misses)
        good = ZmqTransport(frame_bytes=4096).connect(srv.address, token=TOKEN, timeout_s=20)
        try:
            np.testing.assert_array_equal(np.frombuffer(good.read(3, 0, 4096), np.uint8), pattern(3, 4096))
        finally:
            good.close()
    finally:
        sock.close()


def test_a_server_without_a_token_is_refused_and_job_tokens_are_strong():
    with pytest.raises(PeerError, match="non-empty token"):
        ZmqTransport().serve(MemoryStore(Config()), token=b"")
    from jaxckpt.backends.peers import Peers

    coord = LocalCoordinator()
    store = MemoryStore(Config(job_id="sec"))
    peers = Peers(Config(job_id="sec"), coord, store)
    again = Peers(Config(job_id="sec"), coord, store)  # the process 0 of another job (or instance)
    try:
        token = peers._token  # process 0's, broadcast to the others in the round "peer token"
        assert re.fullmatch(rb"[0-9a-f]{64}", token), token  # 256 random bits from secrets
        assert not hmac.compare_digest(token, again._token)  # a new one each time
    finally:
        peers.close()
        again.close()
        store.close()


# ------------------------------------------------------------------------------------------ listeners
def _listening(pid: int) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def _all_loopback(addrs) -> bool:
    return all(ipaddress.ip_address(ip.split("%")[0]).is_loopback for ip, _ in addrs)


def test_servers_bind_loopback_unless_configured():
    before = _listening(os.getpid())
    store = MemoryStore(Config())
    srv = ZmqTransport().serve(store, token=TOKEN)
    coord = LocalCoordinator()
    from jaxckpt.backends.peers import Peers

    peers = Peers(Config(job_id="loop"), coord, store)  # the default config of a multi-process job
    try:
        new = _listening(os.getpid()) - before
        assert len(new) == 2 and _all_loopback(new), new
        assert srv.address.startswith("tcp://127.0.0.1:") and peers.server.address.startswith("tcp://127.0.0.1:")
    finally:
        peers.close()
        srv.close()
    wide = ZmqTransport().serve(store, token=TOKEN, host="0.0.0.0")  # configured: then, and only then
    try:
        new = _listening(os.getpid()) - before
        assert ("0.0.0.0", int(wide.address.rsplit(":", 1)[1])) in new
    finally:
        wide.close()
        store.close()


# ------------------------------------------------------------------------------- a real agent's files
BASE = f"/dev/shm/jaxckpt-sectest-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def agent_dir():
    os.makedirs(BASE, mode=0o700, exist_ok=True)
    d = os.path.join(BASE, uuid.uuid4().hex[:8])
    yield d
    try:
        proto.stop_agent(d, timeout_s=30)
    except JaxckptError:  # the test left something else where the socket goes
        pass
    proto.kill_agent(d)
    shutil.rmtree(d, ignore_errors=True)
    try:
        os.unlink(proto.default_log_path(d))
    except FileNotFoundError:
        pass
    if not os.listdir(BASE):
        os.rmdir(BASE)


def _start_agent(job: str, d: str, *extra: str, umask: int = 0) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", job, "--dir", d, *extra],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         umask=umask)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(d, proto.SOCKET_NAME)):
        assert p.poll() is None and time.monotonic() < deadline, "the agent did not start"
        time.sleep(0.01)
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(d, "peer.addr")):  # the peer server comes up with the agent
        assert p.poll() is None and time.monotonic() < deadline, "the agent serves no peers"
        time.sleep(0.01)
    return p


def test_a_real_agent_under_umask_0_keeps_everything_private_and_listens_on_loopback_only(agent_dir):
    job = "secperm"
    p = _start_agent(job, agent_dir, umask=0)
    try:
        old = os.umask(0)  # the trainer too: nothing may depend on a friendly umask
        try:
            store = ShmStore(Config(store="shm", job_id=job, shm_dir=agent_dir))
            slot = store.reserve(1, 8192)
            np.frombuffer(slot.buffer, np.uint8)[:] = pattern(1, 8192)
            store.commit(slot, manifest_of(1))
            store.reserve(2, 8192)  # half-written
        finally:
            os.umask(old)
        st = os.lstat(agent_dir)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
        names = os.listdir(agent_dir)
        assert {"agent.sock", "agent.lock", "agent.pid", "rec-p0-s1", "peer.addr", "peer.token"} <= set(names)
        assert sum(n.startswith("seg-") for n in names) == 2
        for n in names:
            st = os.lstat(os.path.join(agent_dir, n))
            assert stat.S_IMODE(st.st_mode) == 0o600, (n, oct(st.st_mode))
            assert st.st_uid == os.geteuid()
        listening = _listening(p.pid)
        assert _all_loopback(listening), listening  # the Unix socket, and at most a loopback peer server
        store.close()
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0


def test_the_agent_refuses_a_directory_or_socket_others_could_reach(agent_dir):
    os.makedirs(agent_dir, mode=0o755)
    os.chmod(agent_dir, 0o755)  # e.g. made by someone else, or a shared path
    with pytest.raises(AgentError, match="mode 0700"):
        proto.ensure_private_dir(agent_dir, create=True)
    with pytest.raises(AgentError, match="mode 0700"):
        ShmStore(Config(store="shm", job_id="secdir", shm_dir=agent_dir))
    r = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", "secdir", "--dir", agent_dir],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and not os.path.exists(os.path.join(agent_dir, proto.SOCKET_NAME))
    # said in one line (a DaemonSet's log, a batch script's stderr), not a traceback
    assert f"AgentError: refusing agent directory {agent_dir}" in r.stderr and "Traceback" not in r.stderr, r.stderr
    os.rmdir(agent_dir)
    link_target = agent_dir + "-target"
    os.makedirs(link_target, mode=0o700)
    try:
        os.symlink(link_target, agent_dir)  # a symlink is refused even when it points at a private directory
        with pytest.raises(AgentError, match="must be a directory"):
            proto.ensure_private_dir(agent_dir, create=False)
        os.unlink(agent_dir)
        os.makedirs(agent_dir, mode=0o700)
        with open(os.path.join(agent_dir, proto.SOCKET_NAME), "w"):
            pass  # a regular file where the socket should be
        with pytest.raises(AgentError, match="not a socket"):
            proto.AgentConnection(agent_dir)
    finally:
        shutil.rmtree(link_target, ignore_errors=True)


# ------------------------------------------------------------------------------ names from peers
BAD_NAMES = ["../x", "../../etc/passwd", "/etc/passwd", "/dev/shm/x", "seg-p0-0123456789abcdef-1/../../x",
             "seg-p0-0123456789abcdef-1\x00", "seg-p0-0123456789abcdef-\x001", "seg-p0-" + "0" * 16 + "-" + "1" * 5000,
             "rec-p0-s1", "agent.sock", "", ".", "..", "seg-p-1-0123456789abcdef-1", b"seg-p0-0123456789abcdef-1",
             None, 5]


@pytest.mark.parametrize("name", BAD_NAMES, ids=[repr(n)[:30] for n in BAD_NAMES])
def test_segment_names_cannot_leave_the_directory(tmp_path, name):
    d = tmp_path / "agent"
    d.mkdir(mode=0o700)
    outside = tmp_path / "x"
    outside.write_bytes(b"untouched")
    with pytest.raises(AgentError):
        proto.check_name(name)
    with pytest.raises(AgentError):
        proto.open_segment(str(d), name, 1)
    assert outside.read_bytes() == b"untouched" and os.listdir(d) == []
    for process, step in ((-1, 1), (0, -1), (10**10, 1), ("0/..", 1), (0, "../x")):
        with pytest.raises(AgentError):
            proto.record_name(process, step)


def _as_another_user(fn):
    """``fn()``'s result (a str or None), run as a user who owns nothing here: uid 65534 in a forked child when
    this is root (root may write anywhere), else this user."""
    if os.geteuid() != 0:
        return fn()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, run, report, exit without the parent's teardown
        code = 1
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.write(w, msgpack.packb(fn()))
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            got = f.read()
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child failed"
    return msgpack.unpackb(got)


def test_a_directory_the_user_cannot_make_is_said_with_its_parent():
    """An agent directory under one the user may not write (a Kubernetes hostPath of DirectoryOrCreate: root's,
    mode 0755) is an AgentError naming the directory above it, its owner and mode, and what to do, where it was a
    bare PermissionError; ``jaxckpt doctor`` reports the same problem before a job starts."""
    from jaxckpt.cli import doctor

    parent = Path(f"/dev/shm/jaxckpt-hostpath-{uuid.uuid4().hex[:8]}")  # /dev/shm: any user may reach it
    parent.mkdir(mode=0o755)
    os.chmod(parent, 0o755 if os.geteuid() == 0 else 0o555)
    d = str(parent / "gpt" / "node0")

    def attempt():
        try:
            proto.ensure_private_dir(d, create=True)
        except AgentError as e:
            said = str(e)
        else:
            return "made"
        # doctor's check of the directory (what its report lists), and nothing of JAX in this forked child
        return [said, doctor._unusable_dir(d)]

    try:
        said, problem = _as_another_user(attempt)
        mode = stat.filemode(os.stat(parent).st_mode)
        assert not os.path.exists(parent / "gpt")
        # the report lists what that check says: here, for this user, a directory that is not its own and private
        os.chmod(parent, 0o755)
        listed = doctor.report(Config(store="shm", shm_dir=str(parent)))["problems"]
        assert any(p.startswith(f"refusing agent directory {parent}:") for p in listed), listed
    finally:
        os.chmod(parent, 0o755)
        shutil.rmtree(parent)
    who = 65534 if os.geteuid() == 0 else os.geteuid()
    assert said == (f"cannot make the node agent directory {d} as uid {who} (Permission denied): {parent} is owned by "
                    f"uid {os.geteuid()} with mode {mode}; make it under a directory this user may write (a memory "
                    f"filesystem such as /dev/shm, mode 1777, or one the user owns)"), said
    assert problem == said.replace("(Permission denied)", "(permission denied)"), problem


def _forge_record(d: str, name: str, **fields) -> None:
    rec = {"v": 1, "process": 0, "step": 1, "nbytes": 4096, "seg": "seg-p0-0123456789abcdef-0", "size": 4096,
           "manifest": manifest_of(1), "committed_at": 1.0, **fields}
    with open(os.path.join(d, name), "wb") as f:
        f.write(msgpack.packb(rec, use_bin_type=True))
    os.chmod(os.path.join(d, name), 0o600)


def test_forged_commit_records_never_reach_outside_the_directory(agent_dir, tmp_path):
    """Records an agent adopts name segments; a record naming '../x', an absolute path, another process's
    segment or a symlink is discarded, and the files it names are neither mapped nor removed."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * 8192)
    os.makedirs(agent_dir, mode=0o700)
    rel = os.path.relpath(victim, agent_dir)
    _forge_record(agent_dir, "rec-p0-s1", seg=rel)
    _forge_record(agent_dir, "rec-p0-s2", step=2, seg=str(victim))
    _forge_record(agent_dir, "rec-p0-s3", step=3, seg="seg-p1-0123456789abcdef-0")  # process 1's segment
    _forge_record(agent_dir, "rec-p0-s4", step=4, seg="seg-p0-0123456789abcdef-4\x00/../../x")
    _forge_record(agent_dir, "rec-p0-s5", step=6)  # says step 6 under the name of step 5
    # (16 bytes: fewer than the symlink's own size, which a size check alone would take for a segment's)
    _forge_record(agent_dir, "rec-p0-s7", step=7, seg="seg-p0-0123456789abcdef-7", nbytes=16, size=16)
    os.symlink(victim, os.path.join(agent_dir, "seg-p0-0123456789abcdef-7"))  # a segment that is a symlink
    with open(os.path.join(agent_dir, "seg-p1-0123456789abcdef-0"), "wb") as f:
        f.write(b"\0" * 4096)
    os.chmod(os.path.join(agent_dir, "seg-p1-0123456789abcdef-0"), 0o600)
    # Records that are not private regular files: a FIFO (opening it to read blocked the agent's start-up for
    # good), a record others may read, a symlink to a well-formed record outside
    os.mkfifo(os.path.join(agent_dir, "rec-p0-s8"), 0o600)
    _forge_record(agent_dir, "rec-p0-s9", step=9)
    os.chmod(os.path.join(agent_dir, "rec-p0-s9"), 0o640)
    _forge_record(str(tmp_path), "rec-p0-s10", step=10)
    os.symlink(tmp_path / "rec-p0-s10", os.path.join(agent_dir, "rec-p0-s10"))
    p = _start_agent("secrec", agent_dir)
    try:
        store = ShmStore(Config(store="shm", job_id="secrec", shm_dir=agent_dir))
        try:
            assert store.agent["adoption"] == {"adopted": {}, "discarded": 11}, store.agent["adoption"]
            assert store.steps() == []
            for step in range(1, 11):
                assert store.open(step) is None
        finally:
            store.close()
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0
    assert victim.read_bytes() == b"v" * 8192  # never written, truncated or removed
    assert not os.path.exists(agent_dir)


@pytest.mark.parametrize("job", ["../x", "a/b", "/abs", "x\x00y", "", "j" * 129, "..\\x"])
def test_job_ids_that_could_name_paths_are_refused(job):
    with pytest.raises(ConfigError, match="job_id"):
        Config(job_id=job)
    with pytest.raises(ConfigError, match="job_id"):
        Config(store="shm").with_env({"JAXCKPT_JOB_ID": job} if "\x00" not in job else {"JAXCKPT_JOB_ID": "a/b"})
    if "\x00" not in job and job:
        r = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", job], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode != 0 and "ConfigError" in r.stderr and "job_id" in r.stderr, r.stderr[-2000:]
    if "\x00" not in job:
        assert not os.path.lexists(f"/dev/shm/jaxckpt-{os.geteuid()}-{job}")


@pytest.mark.parametrize("step", ["../x", "/etc", "..", "1/../../x", "5\x00", "9" * 5000, -1, 2.0, True, None])
def test_step_numbers_cannot_name_paths_of_the_persistent_tier(tmp_path, step):
    from jaxckpt.persistent import PersistentHolder, directory as persisted

    directory = tmp_path / "persist"
    directory.mkdir()
    (tmp_path / "x").mkdir()
    with pytest.raises(StepError, match="step must be a non-negative int"):
        persisted.read_index(directory, step)
    with pytest.raises(StepError, match="step must be a non-negative int"):
        persisted.step_dir(directory, step)
    with pytest.raises(StepError, match="step must be a non-negative int"):
        PersistentHolder(directory).open(0, step)
    assert os.listdir(directory) == [] and os.listdir(tmp_path / "x") == []


def test_restore_refuses_a_step_that_could_name_a_path(tmp_path):
    cfg = Config(persistent_dir=str(tmp_path / "persist"), persistent_interval=1, job_id="secstep")
    with jaxckpt.Checkpointer(cfg) as ck:
        ck.save(1, {"x": np.arange(4)}).result()
        ck.wait()
        for step in ("../x", "/etc", "1/..", 1.5):
            with pytest.raises(StepError, match="step must be a non-negative int"):
                ck.restore(step=step)
        np.testing.assert_array_equal(ck.restore(step=1)["x"], np.arange(4))
    assert sorted(os.listdir(tmp_path)) == ["persist"]


def test_a_segment_removed_under_a_live_agent_is_a_clean_error(agent_dir):
    p = _start_agent("secgone", agent_dir)
    try:
        store = ShmStore(Config(store="shm", job_id="secgone", shm_dir=agent_dir))
        try:
            slot = store.reserve(1, 8192)
            store.commit(slot, manifest_of(1))
            store._maps.clear()  # a fresh process would map it anew
            seg = next(n for n in os.listdir(agent_dir) if n.startswith("seg-"))
            os.unlink(os.path.join(agent_dir, seg))
            os.symlink("/etc/passwd", os.path.join(agent_dir, seg))  # and something planted in its place
            with pytest.raises(AgentError, match=f"cannot open segment .*{seg}"):
                store.open(1)
        finally:
            store.close()
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0


def test_the_agent_log_is_private_and_never_follows_a_symlink(agent_dir, tmp_path):
    """The default log path is predictable (under /tmp): a symlink planted there must not redirect the agent's
    writes (it logs elsewhere, or refuses to start), and the log is 0600 whatever the umask."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    log_path = tmp_path / "agent.log"
    os.symlink(victim, log_path)
    p = subprocess.Popen([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", "seclog", "--dir", agent_dir,
                          "--log", str(log_path)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, umask=0)
    deadline = time.monotonic() + 60
    while p.poll() is None and not os.path.exists(os.path.join(agent_dir, proto.SOCKET_NAME)):
        assert time.monotonic() < deadline, "the agent neither started nor refused to"
        time.sleep(0.01)
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=60)
    assert victim.read_bytes() == b"precious"
    os.unlink(log_path)
    p = _start_agent("seclog", agent_dir, "--log", str(log_path), umask=0)
    try:
        assert stat.S_IMODE(os.lstat(log_path).st_mode) == 0o600
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
