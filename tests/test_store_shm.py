"""ShmStore against the Store conformance suite, plus what only the shared-memory store and its agent promise.

Every store here gets its own agent directory under /dev/shm (spawned on first use, stopped and checked gone
at teardown), so nothing leaks between tests or into /dev/shm.
"""
import itertools
import mmap
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from jaxckpt import cli
from jaxckpt.backends.agent import protocol as proto
from jaxckpt.backends.shm import ShmStore
from jaxckpt.config import Config
from jaxckpt.errors import AgentError, BudgetExceededError, StepNotFoundError, StoreUnavailableError
from jaxckpt.registry import get_store_class
from jaxckpt.core.store import Store
from jaxckpt.testing.store import N, StoreTests, manifest_of, pattern
from shm_trainer import agent_processes

BASE = f"/dev/shm/jaxckpt-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
_n = itertools.count()


def fresh_config(**changes) -> Config:
    n = next(_n)
    return Config(store="shm", job_id=f"t{n}", shm_dir=f"{BASE}/node{n}", **changes)


def stop(config: Config) -> None:
    """Stop the config's agent (it frees its memory) and check that nothing is left."""
    d = proto.agent_dir(config)
    try:
        os.unlink(proto.default_log_path(d))
    except FileNotFoundError:
        pass
    if proto.stop_agent(d, config.job_id, timeout_s=20):
        assert not os.path.exists(d), f"agent left {os.listdir(d)} in {d}"
        return
    pid = proto.read_pid_file(d)  # no agent answered: a test killed it; remove what it left
    if pid is not None:
        try:
            os.kill(pid[0], signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _base_dir():
    yield
    leftovers = os.listdir(BASE) if os.path.exists(BASE) else []
    if os.path.exists(BASE):
        os.rmdir(BASE)
    assert not leftovers, f"agent directories left behind: {leftovers}"
    deadline = time.monotonic() + 30
    while agent_processes(BASE) and time.monotonic() < deadline:
        time.sleep(0.05)  # a stopped agent has removed its directory, and exits right after
    assert not agent_processes(BASE), "agent processes left running"


@pytest.fixture
def configs():
    """Configs whose agents are stopped (and checked gone) after the test."""
    made: list[Config] = []
    yield made
    for c in made:
        stop(c)


class TestShmStore(StoreTests):
    @pytest.fixture(autouse=True)
    def _track(self, configs):
        self._configs = configs

    def config(self, **changes) -> Config:
        c = fresh_config(**changes)
        self._configs.append(c)
        return c

    def make_store(self, config: Config) -> Store:
        return ShmStore(config)

    # ------------------------------------------------------------------------------- beyond the contract
    def test_registered_as_shm(self) -> None:
        assert get_store_class("shm") is ShmStore

    def test_slot_buffer_is_the_shared_segment(self, store: ShmStore) -> None:
        slot = store.reserve(1, N)
        path = os.path.join(store.directory, slot.token.seg)
        np.frombuffer(slot.buffer, dtype=np.uint8)[:] = pattern(1)
        # An independent mapping of the agent's segment file sees the bytes the moment they are written.
        fd = os.open(path, os.O_RDONLY)
        with mmap.mmap(fd, N, prot=mmap.PROT_READ) as other:
            np.testing.assert_array_equal(np.frombuffer(other, dtype=np.uint8), pattern(1))
        os.close(fd)
        store.commit(slot, manifest_of(1))
        with store.open(1) as view:  # restore reads the same memory: no intermediate copy
            assert np.shares_memory(np.frombuffer(view.buffer, dtype=np.uint8),
                                    np.frombuffer(slot.buffer, dtype=np.uint8))
            self.assert_snapshot(view, 1)

    def test_files_socket_and_directory_are_private(self, store: ShmStore) -> None:
        self.write(store, 1)
        self.write(store, 2, commit=False)
        d = store.directory
        assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700
        names = os.listdir(d)
        assert {"agent.sock", "agent.lock", "agent.pid"} <= set(names)
        assert sum(n.startswith("seg-") for n in names) == 2 and "rec-p0-s1" in names
        for n in names:
            st = os.lstat(os.path.join(d, n))
            assert stat.S_IMODE(st.st_mode) == 0o600, (n, oct(st.st_mode))
            assert st.st_uid == os.geteuid()
        assert stat.S_ISSOCK(os.lstat(os.path.join(d, "agent.sock")).st_mode)

    def test_a_new_store_of_the_same_process_finds_committed_steps(self, open_store, configs) -> None:
        a = open_store()
        self.write(a, 1)
        self.write(a, 2)
        self.write(a, 3, commit=False)  # half-written when its writer goes away
        a.close()
        b = ShmStore(configs[-1])
        try:
            assert b.steps() == [1, 2]
            for s in (1, 2):
                with b.open(s) as view:
                    self.assert_snapshot(view, s)
            self.write(b, 3)  # the discarded slot's step can be saved again
        finally:
            b.close()

    def test_processes_do_not_see_each_others_slots(self, configs) -> None:
        c = self.config()
        p0, p1 = ShmStore(c, process_index=0, process_count=2), ShmStore(c, process_index=1, process_count=2)
        try:
            self.write(p0, 5)
            slot = self.write(p1, 5, commit=False)
            assert p1.steps() == [] and p1.open(5) is None
            p1.commit(slot, manifest_of(5))
            self.write(p1, 6)
            assert p0.steps() == [5] and p0.open(6) is None
            assert not set(p0._maps) & set(p1._maps)  # never the same segment
            p1.delete(5)
            with p0.open(5) as view:
                self.assert_snapshot(view, 5)
        finally:
            p0.close()
            p1.close()

    def test_agent_killed_then_respawned_adopts_committed_steps(self, store: ShmStore) -> None:
        self.write(store, 1)
        self.write(store, 2)
        self.write(store, 4, 0)  # an empty snapshot has no segment, only its record
        writing = self.write(store, 3, commit=False)
        pid, gen = proto.read_pid_file(store.directory)
        os.kill(pid, signal.SIGKILL)
        _wait_dead(pid)
        with pytest.raises(StoreUnavailableError, match="step 3: save skipped"):
            store.commit(writing, manifest_of(3))
        assert store.metrics["saves_skipped"] == 1
        # steps() reconnects, spawning a new agent, which adopts 1, 2 and 4 and discards the half-written 3.
        assert store.steps() == [1, 2, 4]
        assert proto.read_pid_file(store.directory)[1] != gen
        with store.open(2) as view:
            self.assert_snapshot(view, 2)
        with store.open(4) as view:
            assert len(view.buffer) == 0 and bytes(view.manifest) == manifest_of(4)
        self.write(store, 3)
        assert store.steps() == [1, 2, 3, 4]
        assert not [n for n in os.listdir(store.directory) if n.startswith(".rec")]

    def test_a_delete_the_dead_agent_never_got_reaches_the_agent_that_adopts_its_steps(self, store: ShmStore,
                                                                                        caplog) -> None:
        """Retention deletes step 1 while the agent is down; the next agent adopts the dead one's committed
        slots, step 1 among them, and must get that delete: kept, it took budget no engine counted any more, and a
        tight budget then refused every later save (chaos --profile long, kill-agent)."""
        self.write(store, 1)
        self.write(store, 2)
        pid, gen = proto.read_pid_file(store.directory)
        os.kill(pid, signal.SIGKILL)
        _wait_dead(pid)
        with caplog.at_level("WARNING", logger="jaxckpt.backends.shm"):
            store.delete(1)
        assert store.steps() == [2]  # reconnected: the new agent adopted 1 and 2, then got the delete
        assert "step 1: delete not delivered (sent again to the agent that comes back)" in caplog.text
        assert proto.read_pid_file(store.directory)[1] != gen
        assert not [n for n in os.listdir(store.directory) if n == proto.record_name(store.process_index, 1)]
        with store.open(2) as view:
            self.assert_snapshot(view, 2)

    def test_an_agent_dying_during_the_handshake_is_retried_not_fatal(self, store: ShmStore) -> None:
        # A SIGKILLed agent's socket accepts until the kernel has torn the process down, then resets the
        # connection: the next request must go to the agent started after it (CI once saw this as a failure).
        import socket
        import struct
        import threading

        self.write(store, 1)
        pid, gen = proto.read_pid_file(store.directory)
        os.kill(pid, signal.SIGKILL)
        _wait_dead(pid)
        path = os.path.join(store.directory, proto.SOCKET_NAME)
        os.unlink(path)
        dying = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dying.bind(path)
        os.chmod(path, 0o600)
        dying.listen(4)
        resets = []

        def accept_and_reset() -> None:
            conn, _ = dying.accept()
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
            dying.close()  # and then the process is gone: connections are refused until the next agent listens
            resets.append(1)

        t = threading.Thread(target=accept_and_reset, daemon=True)
        t.start()
        try:
            with store.open(1) as view:  # the old connection is dead, the next one is reset, the third serves
                self.assert_snapshot(view, 1)
        finally:
            dying.close()
            t.join(10)
        assert resets == [1]
        assert proto.read_pid_file(store.directory)[1] != gen

    def test_an_agent_lost_between_reserve_and_mapping_skips_the_save(self, store: ShmStore, monkeypatch) -> None:
        # A chaos run found it: the agent answers reserve and is SIGKILLed before the trainer maps the segment;
        # the agent started after it adopts only committed slots, so it unlinks that segment. Training must go on
        # (the save is skipped, as for any agent lost mid-save), not die of the missing file.
        self.write(store, 1)
        replaced = _replace_the_agent_before_mapping(monkeypatch, store.config)
        with pytest.raises(StoreUnavailableError, match=r"step 2: save skipped on process 0: cannot open segment "
                                                        r".*seg-p0-.*: No such file or directory \(the node agent "
                                                        r"that named it was lost\)"):
            store.reserve(2, N)
        assert len(replaced) == 1 and not os.path.exists(os.path.join(store.directory, replaced[0]))
        assert store.metrics["saves_skipped"] == 1
        monkeypatch.undo()
        assert store.steps() == [1]  # the next request goes to the new agent, which adopted step 1
        self.write(store, 2)
        assert store.steps() == [1, 2]
        for step in (1, 2):
            with store.open(step) as view:
                self.assert_snapshot(view, step)

    def test_a_node_memory_lost_between_open_and_mapping_is_a_missing_step(self, open_store, configs,
                                                                           monkeypatch) -> None:
        # The same window on the read side, where the node's memory went with its agent (a wiped node): the step
        # is reported missing (a restore then reads it from elsewhere), and the store serves on.
        writer = open_store()
        self.write(writer, 1)
        writer.close()
        reader = ShmStore(configs[-1])  # a relaunched process: nothing mapped yet
        try:
            replaced = _replace_the_agent_before_mapping(monkeypatch, reader.config, wipe=True)
            with pytest.raises(StepNotFoundError, match=r"step 1 of process 0 is gone: cannot open segment "
                                                        r".*seg-p0-.*: No such file or directory \(the node agent "
                                                        r"that named it was lost\)"):
                reader.open(1)
            assert len(replaced) == 1
            monkeypatch.undo()
            assert reader.steps() == []
            self.write(reader, 2)
            with reader.open(2) as view:
                self.assert_snapshot(view, 2)
        finally:
            reader.close()

    def test_a_reader_of_a_node_whose_memory_went_after_naming_the_step_finds_it_missing(
            self, store: ShmStore, monkeypatch) -> None:
        # The read side of another process's slots on this node (a restore's NodeAgentHolder): the same window.
        from jaxckpt.backends.agent.readers import NodeAgentHolder

        self.write(store, 1)
        holder = NodeAgentHolder(store.directory, store.config.job_id, "node0", timeout_s=20.0)
        try:
            assert [(e.process, e.step) for e in holder.held()] == [(0, 1)]
            replaced = _replace_the_agent_before_mapping(monkeypatch, store.config, wipe=True,
                                                         module="jaxckpt.backends.agent.readers")
            with pytest.raises(StepNotFoundError, match=r"step 1 of process 0 is gone from the .*: cannot open "
                                                        r"segment .*seg-p0-.*: No such file or directory \(the "
                                                        r"agent that named it was lost\)"):
                holder.open(0, 1)
            assert len(replaced) == 1
            monkeypatch.undo()
            assert holder.held() == []  # the next request reaches the new agent
        finally:
            holder.close()

    def test_a_reader_reads_a_manifest_alone_without_pinning_or_mapping_the_snapshot(self, store: ShmStore,
                                                                                     monkeypatch) -> None:
        # What protection's start-up scan reads of a surviving process's step: the manifest only. An open pins the
        # step and maps and faults in its whole segment (a relaunched process paid 50 ms of CPU for 320 MiB).
        from jaxckpt.backends.agent import readers
        from jaxckpt.backends.agent.readers import NodeAgentHolder

        self.write(store, 1)
        holder = NodeAgentHolder(store.directory, store.config.job_id, "node0", timeout_s=20.0)
        mapped: list[str] = []  # the segments the reader mapped (the real function runs; the calls are counted)
        real = readers.open_segment
        monkeypatch.setattr(readers, "open_segment", lambda d, name, *a, **k: mapped.append(name) or
                            real(d, name, *a, **k))

        def pins() -> list[int]:
            return [s["pins"] for s in proto.agent_status(store.directory)["slots"] if s["step"] == 1]
        try:
            assert holder.manifest(0, 1) == manifest_of(1)
            assert mapped == [] and pins() == [0]
            o = holder.open(0, 1)  # the control: an open does map and pin it
            try:
                assert bytes(o.manifest) == manifest_of(1)
                assert len(mapped) == 1 and mapped[0].startswith("seg-p0-") and pins() == [1], mapped
            finally:
                o.close()
            with pytest.raises(StepNotFoundError, match=r"step 2 of process 0 is not held by the node agent at "):
                holder.manifest(0, 2)
            with pytest.raises(StepNotFoundError, match=r"step 1 of process 3 is not held by the node agent at "):
                holder.manifest(3, 1)
        finally:
            holder.close()

    def test_lost_agent_memory_is_named_on_open(self, store: ShmStore) -> None:
        self.write(store, 1)
        pid, _ = proto.read_pid_file(store.directory)
        os.kill(pid, signal.SIGKILL)
        _wait_dead(pid)
        for n in os.listdir(store.directory):  # the node's memory is gone with its agent
            if n.startswith(("seg-", "rec-")):
                os.unlink(os.path.join(store.directory, n))
        with pytest.raises(StepNotFoundError, match=r"step 1 of process 0 is gone.*memory was lost"):
            store.open(1)
        assert store.steps() == []

    def test_second_agent_on_the_same_directory_exits(self, store: ShmStore) -> None:
        r = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", store.config.job_id, "--dir",
                            store.directory, "--log", os.devnull], timeout=60)
        assert r.returncode == 3
        self.write(store, 1)  # the first one still serves

    def test_agent_of_another_job_refuses(self, store: ShmStore) -> None:
        with pytest.raises(AgentError, match=f"serves job '{store.config.job_id}'"):
            ShmStore(store.config.replace(job_id="other"))

    def test_sigterm_frees_everything(self, configs) -> None:
        c = self.config()
        s = ShmStore(c)
        self.write(s, 1)
        view = s.open(1)
        pid, _ = proto.read_pid_file(s.directory)
        os.kill(pid, signal.SIGTERM)
        s._spawned.wait(timeout=30)
        assert s._spawned.returncode == 0
        assert not os.path.exists(s.directory)
        self.assert_snapshot(view, 1)  # a mapping outlives the unlink; the memory goes when it is unmapped
        view.close()
        s.close()

    def test_malformed_and_oversized_messages_are_refused(self, store: ShmStore) -> None:
        import socket
        import struct

        path = os.path.join(store.directory, proto.SOCKET_NAME)
        for payload in (struct.pack(">I", proto.MAX_MESSAGE_BYTES + 1), struct.pack(">I", 3) + b"\xc1\xc1\xc1"):
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
                s.sendall(payload)
                s.settimeout(10)
                assert s.recv(16) == b""  # the agent drops the connection
        conn = proto.AgentConnection(store.directory)
        with pytest.raises(AgentError, match="before hello"):
            conn.call("steps")
        with pytest.raises(AgentError, match="malformed"):
            conn.call("hello", job=store.config.job_id, role="trainer", process=-1, keep=1, pending=1, budget=0)
        with pytest.raises(AgentError, match="version"):
            proto.raise_for(_raw_call(conn, {"v": 99, "op": "hello"}))
        conn.call("hello", job=None, role="client")  # a tool: may look, never touch a trainer's slots
        with pytest.raises(AgentError, match="not permitted"):
            conn.call("reserve", step=1, nbytes=10)
        conn.close()
        self.write(store, 1)  # the agent serves on

    def test_names_are_validated(self) -> None:
        for bad in ("../x", "seg-p0-../../etc/passwd", "seg-p0-0123456789abcdef-1/..", "agent.sock", 5, "rec-p0-s1"):
            with pytest.raises(AgentError):
                proto.check_name(bad)
        assert proto.check_name("seg-p3-0123456789abcdef-17") == "seg-p3-0123456789abcdef-17"

    def test_node_budget(self, configs) -> None:
        c = self.config()
        d = proto.agent_dir(c)
        os.makedirs(d, mode=0o700)
        agent = subprocess.Popen([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", c.job_id, "--dir", d,
                                  "--budget-bytes", str(3 * N), "--log", os.devnull])
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(d, proto.SOCKET_NAME)) and time.monotonic() < deadline:
            time.sleep(0.01)
        p0, p1 = ShmStore(c, process_index=0, process_count=2), ShmStore(c, process_index=1, process_count=2)
        try:
            self.write(p0, 1)
            self.write(p1, 1)
            self.write(p0, 2)
            with pytest.raises(BudgetExceededError, match=rf"step 2 of process 1: .*budget of {3 * N} bytes for the "
                                                          r"node .*committed steps \[1\] are kept"):
                p1.reserve(2, N)
            assert p0.steps() == [1, 2] and p1.steps() == [1]
        finally:
            p0.close()
            p1.close()
            stop(c)
            agent.wait(timeout=30)

    def test_ls_and_inspect(self, store: ShmStore, capsys) -> None:
        import json

        from jaxckpt.core import manifest as mf
        from jaxckpt.core.box import Box

        m = mf.Manifest(step=7, process=0, process_count=1, framework="numpy",
                        arrays=(mf.ArrayMeta("params/w", (("key", "params"), ("key", "w")), (4, 4), "float32",
                                             "numpy", "", {}, (mf.ChunkMeta(Box((0, 0), (4, 4)), 0, 64, 0xDEADBEEF,
                                                                            0),)),),
                        leaves=(mf.LeafMeta("lr", (("key", "lr"),), 0.5),), nbytes=64)
        slot = store.reserve(7, 64)
        store.commit(slot, mf.encode(m))
        args = ["--job", store.config.job_id, "--dir", store.directory]
        assert cli.main(["ls", *args]) == 0
        out = capsys.readouterr().out
        assert "committed" in out and "64 B" in out and f"job {store.config.job_id}" in out
        assert "protection bytes pulled from other nodes: 0 B" in out  # this agent pulled nothing
        assert cli.main(["ls", *args, "--json"]) == 0
        (st,) = json.loads(capsys.readouterr().out)
        assert st["pulled_bytes"] == 0
        assert [(s["process"], s["step"], s["state"], s["nbytes"]) for s in st["slots"]] == [(0, 7, "committed", 64)]
        assert cli.main(["inspect", "7", *args]) == 0
        out = capsys.readouterr().out
        assert "params/w" in out and "(4, 4)" in out and "float32" in out and "deadbeef" in out and "0:4 0:4" in out
        assert cli.main(["inspect", "7", *args, "--json"]) == 0
        (got,) = json.loads(capsys.readouterr().out)
        assert got["arrays"][0]["chunks"][0]["crc32c"] == "deadbeef" and got["leaves"] == [{"path": "lr", "value": 0.5}]
        assert cli.main(["inspect", "8", *args]) == 1
        assert "step 8 is not committed" in capsys.readouterr().err
        assert cli.main(["ls", "--job", "nobody", "--dir", store.directory + "-none"]) == 1
        assert "no node agent is listening" in capsys.readouterr().err
        assert cli.main(["ls", "--job", "nobody", "--dir", store.directory]) == 1
        assert f"serves job '{store.config.job_id}', not 'nobody'" in capsys.readouterr().err
        assert cli.main(["ls", "--dir", store.directory, "--dir", store.directory, "--json"]) == 0  # any job
        assert len(json.loads(capsys.readouterr().out)) == 2


def _raw_call(conn, msg: dict) -> dict:
    proto.send_msg(conn.sock, msg)
    return proto.recv_msg(conn.sock)


def _replace_the_agent_before_mapping(monkeypatch, config: Config, *, wipe: bool = False,
                                      module: str = "jaxckpt.backends.shm") -> list[str]:
    """Have ``module``'s next mapping of a segment first SIGKILL its agent (``wipe``: and its node's memory) and
    wait for a new agent to listen (it adopts what is left): the real processes in the window between an agent's
    reply and the mapping of what it named. The names of the segments it was about to map, once it has."""
    import importlib

    where = importlib.import_module(module)
    real, replaced = where.open_segment, []

    def replace_then_map(directory: str, name: str, size: int, **kw):
        if not replaced:
            pid, gen = proto.read_pid_file(directory)
            os.kill(pid, signal.SIGKILL)
            _wait_dead(pid)
            for n in os.listdir(directory) if wipe else ():
                if n.startswith(("seg-", "rec-")):
                    os.unlink(os.path.join(directory, n))
            proto.start_agent(config, directory)
            deadline = time.monotonic() + 60
            while (proto.read_pid_file(directory) or (0, gen))[1] == gen or not _listens(directory):
                assert time.monotonic() < deadline, "the new agent did not listen"
                time.sleep(0.01)
            replaced.append(name)
        return real(directory, name, size, **kw)

    monkeypatch.setattr(where, "open_segment", replace_then_map)
    return replaced


def _listens(directory: str) -> bool:
    try:
        proto.AgentConnection(directory, timeout_s=5).close()
        return True
    except (StoreUnavailableError, AgentError):
        return False


def _wait_dead(pid: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:  # our own child (spawned from this process): reap it
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            pass
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} did not die")


# ------------------------------------------------------------------------------------ through the Checkpointer
def _jax_state(v: float):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    return {"a": jax.device_put(np.arange(1 << 16, dtype=np.float32) * v, NamedSharding(mesh, P("x"))),
            "r": jax.device_put(np.full(1 << 15, v, np.float32), NamedSharding(mesh, P())),
            "k": jax.random.key(int(v))}


def _bits(x) -> np.ndarray:
    import jax

    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


def test_restored_arrays_never_alias_the_agents_memory(configs):
    import jaxckpt

    c = fresh_config(keep=1)
    configs.append(c)
    with jaxckpt.Checkpointer(c) as ck:
        ck.save(1, _jax_state(1.0)).result()
        got = ck.restore(_jax_state(0.0))
        for s in (2, 3, 4):  # keep=1: step 1's segment is written again by step 3
            h = ck.save(s, _jax_state(float(s)))
            h.result()
        # Memory accounting: keep + 1 segments of the snapshot's size, plus the manifest as metadata.
        assert ck.store.held_bytes() == 2 * proto.round_to_pages(h.nbytes)
        st = ck.store._call("held", block=False)
        assert st["bytes"] == ck.store.held_bytes()
        want = _jax_state(1.0)
        for k in want:
            np.testing.assert_array_equal(_bits(got[k]), _bits(want[k]))


def test_a_relaunch_restores_the_newest_adopted_step_on_the_manifest_its_start_up_decoded(configs, monkeypatch):
    """A Checkpointer on an agent that kept its job's steps reads whose they are to adopt them, and decodes the
    newest's manifest whole, the step a relaunch restores next, which that restore does not decode again (a
    4,096-leaf state's manifest: 130-170 ms); an older step's is decoded only when it is restored. Both bit for
    bit."""
    import jaxckpt
    from jaxckpt.core import manifest as mf

    c = fresh_config(keep=2)
    configs.append(c)
    with jaxckpt.Checkpointer(c) as ck:
        ck.save(1, _jax_state(1.0)).result()
        ck.save(2, _jax_state(2.0)).result()
    sources: list[str] = []
    decode = mf.decode

    def counted(data, *, source="manifest"):
        sources.append(source)
        return decode(data, source=source)

    monkeypatch.setattr(mf, "decode", counted)
    with jaxckpt.Checkpointer(c) as ck:
        assert ck.latest_step() == 2
        adopted = list(sources)
        assert adopted == ["step 2 manifest of process 0"], adopted  # step 1's: whose it is, with mf.owner
        newest = ck.restore(_jax_state(0.0))
        assert sources == adopted, f"the restore of step 2 decoded {sources[len(adopted):]} again"
        older = ck.restore(_jax_state(0.0), step=1)
        assert sources[len(adopted):] == ["step 1 manifest of process 0"]
    for step, got in ((2, newest), (1, older)):
        want = _jax_state(float(step))
        for k in want:
            np.testing.assert_array_equal(_bits(got[k]), _bits(want[k]), err_msg=f"step {step} {k}")


def test_checkpointer_skips_saves_while_the_agent_is_gone_and_saves_on(configs):
    import jaxckpt

    c = fresh_config(keep=1)
    configs.append(c)
    with jaxckpt.Checkpointer(c) as ck:
        ck.save(1, _jax_state(1.0)).result()
        pid = proto.kill_agent(ck.store.directory)
        _wait_dead(pid)
        h = ck.save(2, _jax_state(2.0))  # neither save() nor wait() raises: training goes on
        ck.wait()
        assert h.skipped and isinstance(h.error, StoreUnavailableError) and "step 2" in str(h.error)
        with pytest.raises(StoreUnavailableError, match="step 2: save skipped"):
            h.result()
        assert ck.store.metrics["saves_skipped"] == 1
        step, deadline = 3, time.monotonic() + 60
        while True:  # the store respawns the agent; saves are skipped until it listens
            h = ck.save(step, _jax_state(float(step)))
            ck.wait()
            if not h.skipped or time.monotonic() > deadline:
                break
            step += 1
            time.sleep(0.01)
        assert not h.skipped and ck.latest_step() == step
        assert ck.store.metrics["saves_skipped"] == step - 2
        got = ck.restore(_jax_state(0.0))
        want = _jax_state(float(step))
        for k in want:
            np.testing.assert_array_equal(_bits(got[k]), _bits(want[k]))
        # The respawned agent adopted step 1 from its predecessor; the engine's retention dropped it.
        assert ck.all_steps() == [step] and ck.store.steps() == [step]


def test_pull_requests_that_are_malformed_are_refused_and_the_slot_stays_usable(configs):
    """``pull`` (protection blocks built by the agent, backends/agent/protection_pull.py) with bad fields: a clean
    AgentError naming the step, the agent serves on, and the slot can still be committed."""
    from jaxckpt.errors import AgentError

    c = fresh_config()
    configs.append(c)
    store = ShmStore(c)
    try:
        slot = store.reserve(5, N)
        cases = [({"plan": b"not a plan", "tasks": [], "sources": {}}, r"step 5.*protection plan"),
                 ({"plan": b"", "tasks": "x", "sources": {}}, r"step 5"),
                 ({"plan": b"", "tasks": [], "sources": {"1": ["ipc:///tmp/x", b"t"]}}, r"tcp address"),
                 ({"plan": b"", "tasks": [], "sources": []}, r"sources must be a map")]
        for fields, match in cases:
            with pytest.raises(AgentError, match=match):
                store.pull(slot, **fields)
        np.frombuffer(slot.buffer, dtype=np.uint8)[:] = pattern(5)
        store.commit(slot, manifest_of(5))
        with store.open(5) as view:
            np.testing.assert_array_equal(np.frombuffer(view.buffer, dtype=np.uint8), pattern(5))
        with pytest.raises(StoreUnavailableError, match="not being written"):
            store.pull(slot, plan=b"", tasks=[], sources={})
    finally:
        store.close()
