"""The multi-process launcher: real processes, real signals, nothing left behind."""
import json
import signal
import os
import subprocess
import sys
import textwrap
import time

import pytest

from jaxckpt.errors import LaunchError
from jaxckpt.testing import expect_ok, kill_node, launch, node_info, start


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # gone; or reaped between the open and the read (ESRCH)
        return True
    return state == "Z"  # killed, waiting only for init to reap it


def _wait_gone(pids, within=30.0) -> list[int]:
    # SIGKILL is asynchronous: give the kernel a moment, then report who is still alive.
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if not _gone(p)]


def _wait_files(paths, within=60.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and not all(os.path.exists(p) for p in paths):
        time.sleep(0.05)
    assert all(os.path.exists(p) for p in paths), f"processes did not start: {paths}"


# ------------------------------------------------------------------ functions run in the launched processes
def where_am_i(tag):
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    info = node_info()
    total = multihost_utils.process_allgather(np.array([info.process_id + 1]))  # a real gloo collective
    return {"tag": tag, "process": jax.process_index(), "count": jax.process_count(), "local": jax.local_device_count(),
            "global": jax.device_count(), "node": info.node, "nodes": info.node_count, "rank": info.local_rank,
            "node_dir": os.path.isdir(info.node_dir), "sum": int(np.sum(total))}


def one_plain_process():
    """A one-process job saves and restores as a user's own single process would: no distributed runtime."""
    import jax
    import numpy as np
    from jax._src import distributed
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxckpt import Checkpointer, Config

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    host = np.arange(48, dtype=np.float32).reshape(12, 4)
    x = jax.device_put(host, NamedSharding(mesh, P("d")))
    with Checkpointer(Config()) as ck:
        ck.save(1, {"x": x})
        ck.wait()
        got = np.asarray(ck.restore({"x": x}, step=1)["x"])
    return {"client": distributed.global_state.client is not None, "count": jax.process_count(),
            "local": jax.local_device_count(), "equal": got.tobytes() == host.tobytes()}


def fail_on_one(msg):
    if node_info().process_id == 1:
        raise ValueError(msg)
    return "fine"


def not_json():
    return {1, 2}


def fail_one_block_others():
    from jax._src import distributed

    if node_info().process_id == 1:
        raise RuntimeError("process 1 gave up")
    distributed.global_state.client.wait_at_barrier("never-complete", 600_000)


def spawn_and_hang(folder):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.path.join(folder, f"pids-{node_info().process_id}.json"), "w") as f:
        json.dump([os.getpid(), child.pid], f)
    time.sleep(600)


def ready_then_sleep(folder):
    open(os.path.join(folder, f"ready-{node_info().process_id}"), "w").close()
    time.sleep(600)


def kill_other_node():
    info = node_info()
    if info.node == 1:
        time.sleep(600)
    if info.process_id == 0:
        # node 1's processes are up once they have written their pids (the launcher wrote pids.json)
        return {"killed": len(kill_node(1))}
    return {"killed": 0}


def report_prefix(folder):
    info = node_info()
    open(os.path.join(folder, f"ready-{info.process_id}"), "w").close()
    if info.node == 1:
        time.sleep(600)
    return {"prefix_node": os.environ["PREFIX_NODE"]}


def through_setsid(node):
    """A prefix like srun's: per node, and the worker is no child of the launcher's (its own session)."""
    return ["env", f"PREFIX_NODE={node}", "setsid", "--wait"]


# ----------------------------------------------------------------------------------------------- tests
def test_results_by_process_and_node():
    results = launch(where_am_i, nodes=2, procs_per_node=2, devices_per_proc=2, args=("t",), timeout=120)
    values = expect_ok(results)
    assert [(r.process_id, r.node, r.local_rank, r.returncode) for r in results] == \
        [(0, 0, 0, 0), (1, 0, 1, 0), (2, 1, 0, 0), (3, 1, 1, 0)]
    for i, v in enumerate(values):
        assert v == {"tag": "t", "process": i, "count": 4, "local": 2, "global": 8, "node": i // 2, "nodes": 2,
                     "rank": i % 2, "node_dir": True, "sum": 10}


def test_a_one_process_job_runs_without_a_distributed_runtime():
    # Under jax.distributed XLA runs even one process's collectives through gloo (a step up to several times
    # slower): a launched single process must be the plain process a user runs, and checkpoint as one.
    (v,) = expect_ok(launch(one_plain_process, nodes=1, procs_per_node=1, devices_per_proc=4, timeout=120))
    assert v == {"client": False, "count": 1, "local": 4, "equal": True}


def test_tracebacks_and_bad_return_values():
    results = launch(fail_on_one, nodes=1, procs_per_node=2, devices_per_proc=1, args=("boom from one",),
                     timeout=120, fail_fast_grace=1.0)
    assert results[0].ok and results[0].value == "fine"
    assert not results[1].ok and results[1].returncode == 1
    assert "Traceback" in results[1].error and "fail_on_one" in results[1].error
    assert "ValueError: boom from one" in results[1].error
    with pytest.raises(LaunchError, match="1 of 2 processes failed") as e:
        expect_ok(results)
    assert "ValueError: boom from one" in str(e.value)

    results = launch(not_json, nodes=1, procs_per_node=1, distributed=False, timeout=60)
    assert "not JSON-serialisable" in results[0].error and "not_json" in results[0].error


def test_one_failure_stops_the_job():
    results = launch(fail_one_block_others, nodes=1, procs_per_node=3, devices_per_proc=1, timeout=300,
                     fail_fast_grace=1.0)
    assert "RuntimeError: process 1 gave up" in results[1].error and not results[1].killed
    for r in (results[0], results[2]):
        assert r.killed and not r.timed_out and not r.reported
        assert "killed 1s after process 1 failed" in r.error


def test_timeout_reaps_processes_and_their_children(tmp_path):
    results = launch(spawn_and_hang, nodes=2, procs_per_node=1, args=(str(tmp_path),), distributed=False,
                     timeout=8)
    assert all(r.timed_out and r.killed and not r.reported for r in results)
    assert all("timed out after 8s" in r.error for r in results)
    pids = [p for i in range(2) for p in json.loads((tmp_path / f"pids-{i}.json").read_text())]
    assert len(pids) == 4
    assert _wait_gone(pids) == []


def test_kill_node_from_outside_and_inside(tmp_path):
    with start(ready_then_sleep, nodes=2, procs_per_node=2, args=(str(tmp_path),), distributed=False) as job:
        _wait_files([tmp_path / f"ready-{i}" for i in range(4)])
        assert job.kill_node(1) == [2, 3]
        assert _wait_gone(job.pids(1)) == []
        assert job.poll()[:2] == [None, None]
        with pytest.raises(LaunchError, match="node 5: no such simulated node"):
            job.kill_node(5)
        for bad in (-1, 4):  # -1 would have been the last process, as a list index
            with pytest.raises(LaunchError, match=f"process {bad}: no such process \\(job has 4 processes\\)"):
                job.kill_process(bad)
        assert job.poll()[:2] == [None, None]
    results = job.results()
    assert [r.returncode for r in results[2:]] == [-9, -9]
    assert all(r.killed and "node 1 killed by kill_node" in r.error for r in results[2:])
    assert all(r.killed and "killed when the launcher closed" in r.error for r in results[:2])

    results = launch(kill_other_node, nodes=2, procs_per_node=2, distributed=False, timeout=120)
    assert [r.value for r in results[:2]] == [{"killed": 2}, {"killed": 0}]
    assert all(r.killed and r.returncode == -9 and "killed by kill_node" in r.error for r in results[2:])


def test_a_prefix_runs_each_node_and_kills_reach_the_worker_behind_it(tmp_path):
    """Processes started through a prefix (as srun starts them on a node of an allocation): each node's own words,
    and kill_node reaches the worker itself, which the prefix's process group does not hold."""
    with start(report_prefix, nodes=2, procs_per_node=1, args=(str(tmp_path),), distributed=False,
               prefix=through_setsid) as job:
        _wait_files([tmp_path / f"ready-{i}" for i in range(2)])
        with open(os.path.join(job.launch_dir, "worker-1.pid")) as f:
            worker = int(f.read())
        assert worker not in job.pids() and os.getsid(worker) != os.getsid(job.pids(1)[0])
        assert job.kill_node(1) == [1]
        assert _wait_gone([worker]) == []
        assert job.wait(60)
    results = job.results()
    assert results[0].value == {"prefix_node": "0"}
    assert results[1].killed and "node 1 killed by kill_node" in results[1].error


def test_launch_refuses_what_a_fresh_process_cannot_find():
    with pytest.raises(TypeError, match="module-level function"):
        launch(lambda: 1, nodes=1, procs_per_node=1)
    with pytest.raises(TypeError, match="JSON-serialisable"):
        launch(where_am_i, nodes=1, procs_per_node=1, args=(object(),))
    with pytest.raises(LaunchError, match="not started by jaxckpt.testing.launch"):
        node_info()


SCRIPT = textwrap.dedent("""
    import os, sys, time
    if "hang" in sys.argv:
        # Written first, before JAX starts: the time-out may well fire while a loaded machine is still in
        # jax.distributed's start-up, and those processes must be reaped too.
        pidfile = os.path.join(sys.argv[2], f"pid-{os.environ['JAXCKPT_PROCESS_ID']}")
        open(pidfile + ".tmp", "w").write(str(os.getpid()))
        os.replace(pidfile + ".tmp", pidfile)  # whole when it appears: the test reads it as soon as it exists
    import jaxckpt.testing as T
    info = T.init_from_env()
    import jax
    print("proc", jax.process_index(), "of", jax.process_count(), "devices", jax.device_count(),
          "node", info.node, "args", sys.argv[1:], flush=True)
    if "hang" in sys.argv:
        time.sleep(600)
    sys.exit(7 if "fail" in sys.argv and info.process_id == 1 else 0)
""")


def _cli(tmp_path, *args, timeout="120"):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "jaxckpt.cli", "launch", "--nodes", "2", "--procs-per-node", "1",
           "--devices-per-proc", "3", "--timeout", timeout, "--", sys.executable, str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_cli_launch(tmp_path):
    out = _cli(tmp_path, "x", "--log-level", "y")
    assert out.returncode == 0, out.stderr
    lines = sorted(l for l in out.stdout.splitlines() if l.startswith("["))
    assert lines == ["[0] proc 0 of 2 devices 6 node 0 args ['x', '--log-level', 'y']",
                     "[1] proc 1 of 2 devices 6 node 1 args ['x', '--log-level', 'y']"]
    out = _cli(tmp_path, "fail")
    assert out.returncode == 7 and "process 1 exited with code 7" in out.stderr


def test_cli_timeout_reaps(tmp_path):
    out = _cli(tmp_path, "hang", str(tmp_path), timeout="10")
    assert out.returncode == 124 and "timed out after 10s" in out.stderr
    pids = [int((tmp_path / f"pid-{i}").read_text()) for i in range(2)]
    assert _wait_gone(pids) == []


PARENT = textwrap.dedent("""
    import os, signal, sys, time
    from jaxckpt.testing import launch, node_info
    # A process started from a shell's background job inherits SIGINT ignored; a ctrl-c'd launcher has it default.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def hang(folder):
        pidfile = os.path.join(folder, f"pid-{node_info().process_id}")
        open(pidfile + ".tmp", "w").write(str(os.getpid()))
        os.replace(pidfile + ".tmp", pidfile)  # whole when it appears: the test reads it as soon as it exists
        time.sleep(600)

    if __name__ == "__main__":
        launch(hang, nodes=1, procs_per_node=2, args=(sys.argv[1],), distributed=False, timeout=300)
""")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill"])
def test_a_dying_launcher_takes_its_processes_along(tmp_path, sig):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)  # also covers functions defined in a script's __main__
    # TMPDIR: a launcher killed with SIGKILL cannot remove its scratch folder; keep it inside tmp_path
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        _wait_files([tmp_path / f"pid-{i}" for i in range(2)])
        pids = [int((tmp_path / f"pid-{i}").read_text()) for i in range(2)]
        parent.send_signal(sig)
        parent.wait(timeout=60)
    finally:
        parent.kill()
        parent.wait()
    assert _wait_gone(pids) == []


DEATHSIG_PARENT = textwrap.dedent("""
    import os, subprocess, sys
    from jaxckpt.tools import deathsig
    child = subprocess.Popen(deathsig.command(["sleep", "600"]), start_new_session=True)
    open(sys.argv[1] + ".tmp", "w").write(str(child.pid))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])  # whole when it appears: the test reads it as soon as it exists
    child.wait()
""")


def test_a_process_started_through_deathsig_dies_with_its_parent_without_preexec_fn(tmp_path):
    # What the chaos driver uses instead of preexec_fn (Python code in a child forked from a multithreaded parent).
    script, pidfile = tmp_path / "parent.py", tmp_path / "child.pid"
    script.write_text(DEATHSIG_PARENT)
    parent = subprocess.Popen([sys.executable, str(script), str(pidfile)])
    try:
        _wait_files([pidfile])
        child = int(pidfile.read_text())
        deadline = time.monotonic() + 60
        while not open(f"/proc/{child}/cmdline", "rb").read().startswith(b"sleep") and time.monotonic() < deadline:
            time.sleep(0.05)  # until the shim has armed the signal and exec'd the command (same pid)
        assert open(f"/proc/{child}/cmdline", "rb").read().startswith(b"sleep"), "shim did not exec the command"
        parent.kill()
        parent.wait(timeout=60)
    finally:
        parent.kill()
        parent.wait()
    assert _wait_gone([child]) == [], f"child {child} outlived its SIGKILLed parent"
    r = subprocess.run([sys.executable, "-m", "jaxckpt.tools.deathsig", "1", "--", "true"], timeout=60)
    assert r.returncode == 3  # pid 1 is not our parent: refuse instead of running unprotected
