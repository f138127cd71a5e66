"""``jaxckpt bench device``: the quick run end to end on this machine's default backend (the CPU: there is no
accelerator here), its JSON, its markdown, and a failing part recorded while the others still report.

No timing thresholds: that every part ran in its own processes on the default backend's devices (one CPU device,
not the 8 the other benchmarks configure), that the donation check restored bit for bit, that every figure is
finite and positive, and that nothing is left in /dev/shm. On a GPU the same command is the device check.
"""
import math
import os
import subprocess
import sys
import time

from jaxckpt.tools.bench import device, report


def _shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("jaxckpt")} if os.path.isdir("/dev/shm") else set()


def test_quick_run_every_part_json_and_markdown(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\n<!-- bench:device:begin -->\nold\n<!-- bench:device:end -->\n")
    before = _shm()
    proc = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "bench", "device", "--quick", "--out",
                           str(tmp_path / "parts"), "--json", str(tmp_path / "device.json"), "--update-md", str(md)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    res = report.read_json(tmp_path / "device.json")
    assert res["bench"] == "device" and res["mode"] == "quick" and res["failed"] == {}
    assert set(res["parts"]) == set(device.PARTS)
    assert sorted(os.listdir(tmp_path / "parts")) == sorted(f"{p}.{x}" for p in device.PARTS for x in ("json", "log"))
    floors = res["parts"]["floors"]
    assert floors["facts"]["backend"] == "cpu" and floors["facts"]["devices"] == 1
    assert floors["facts"]["devices_text"] == "1 CPU device"
    assert floors["donation"] == {"saves": 3, "bitwise": True}
    assert {"d2h_s", "h2d_s", "d2h_pinned_s", "pinned_read_s"} <= set(floors["results"][0])
    # save and restore laid their state on the default backend's one device, not on 8 CPU devices
    assert res["parts"]["save"]["setup"]["devices_text"] == "1 CPU device"
    assert res["parts"]["save"]["setup"]["mesh"] == "1x1"
    assert res["parts"]["restore"]["setup"]["devices_text"] == "1 CPU device"
    assert res["parts"]["torch"]["setup"]["device"] == "cpu"  # no GPU for torch here: the state dict stays put
    stall = res["parts"]["stall"]
    assert [r["size"] for r in stall["results"]] == ["tiny"]
    assert set(stall["results"][0]["processes"][0]["modes"]) == set(device.STALL_MODES)
    # Every figure finite; positive but for process indices and what is a difference (an overhead, CPU added)
    signed = ("/process", "overhead", "breakdown", "cost_vs_floor")
    bad = [(p, v) for p, v in report.numbers(res)
           if not math.isfinite(v) or (v <= 0 and not any(w in p for w in signed))]
    assert not bad, bad[:10]
    text = md.read_text()
    assert "\nold\n" not in text
    for heading in ("### `jaxckpt bench device`", "#### `jaxckpt bench save`", "#### `jaxckpt bench restore`",
                    "#### `jaxckpt bench stall`", "#### `jaxckpt bench torch`", "| 4 MiB |",
                    "restored bit for bit"):
        assert heading in text, heading
    assert (tmp_path / "docs" / "bench" / "device.json").exists()
    assert _shm() - before == set()


def test_a_failing_part_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    # The save part's process exits 3 after a line of output (as a part that crashes on a device would); the
    # floors part runs for real after it.
    real = device.part_command

    def command(part, opts, json_path):
        if part == "save":
            return [sys.executable, "-c", "import sys; print('save broke here'); sys.exit(3)"]
        return real(part, opts, json_path)

    monkeypatch.setattr(device, "part_command", command)
    args = device_args(["--quick", "--parts", "save,floors"])
    res = device.measure(device.options(args), "jaxckpt bench device --quick", str(tmp_path))
    assert set(res["parts"]) == {"floors"} and set(res["failed"]) == {"save"}
    assert res["failed"]["save"]["rc"] == 3 and "save broke here" in res["failed"]["save"]["log_tail"]
    assert res["parts"]["floors"]["donation"]["bitwise"] is True
    text = device.render(res)
    assert "Part `save` failed (3, after" in text and "save broke here" in text and "| 4 MiB |" in text


PART_THAT_HANGS = """
import os, signal, subprocess, sys, tempfile, time
from jaxckpt import Config
from jaxckpt.backends.agent import protocol as proto
d = tempfile.mkdtemp(prefix="jaxckpt-bench-devtest-", dir="/dev/shm")
starting = proto.spawn_agent(Config(job_id="devtest2", shm_dir=d), f"{d}/starting")
os.kill(starting.pid, signal.SIGSTOP)  # an agent still starting when the time is up: no pid file written
serving = proto.spawn_agent(Config(job_id="devtest", shm_dir=d), f"{d}/serving")
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(sys.argv[1], "w") as f:
    f.write(f"{d} {child.pid} {serving.pid} {starting.pid}")
for _ in range(300):  # its pid file: the agent serves (on a machine this slow, it too is still starting)
    if proto.read_pid_file(f"{d}/serving"):
        break
    time.sleep(0.1)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_part_out_of_time_goes_with_its_processes_agents_and_scratch(tmp_path, monkeypatch):
    # The part starts two real node agents in a scratch directory of its own (one serving, one stopped before it
    # wrote its pid file, as an agent still starting) and a child process, then hangs: at its time limit the
    # driver kills the part's session, kills both agents (which run in sessions of their own: one found by its
    # pid file, the other by the directory its command line names) and removes the directory, and the next part
    # still runs.
    real, facts = device.part_command, tmp_path / "facts"

    def command(part, opts, json_path):
        if part == "save":
            return [sys.executable, "-c", PART_THAT_HANGS, str(facts)]
        return real(part, opts, json_path)

    monkeypatch.setattr(device, "part_command", command)
    opts = {**device.options(device_args(["--quick", "--parts", "save,floors"])), "timeout": 10.0}
    res = device.measure(opts, "jaxckpt bench device --quick", str(tmp_path / "parts"))
    assert res["failed"]["save"]["rc"] == "timeout" and "floors" in res["parts"]
    scratch, *pids = facts.read_text().split()
    assert not os.path.exists(scratch)
    for pid in map(int, pids):
        for _ in range(100):  # SIGKILLed: gone once its parent (or init) reaps it
            if not _alive(pid):
                break
            time.sleep(0.05)
        assert not _alive(pid), pid


def device_args(words):
    import argparse
    p = argparse.ArgumentParser()
    device.add_arguments(p)
    return p.parse_args(words)


def test_bad_options_are_refused_before_measuring(tmp_path):
    for words in (["--parts", "floors,gpu"], ["--gpt-sizes", "huge"], ["--steps", "0"], ["--sizes", "0"]):
        proc = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "bench", "device", "--quick", *words,
                               "--json", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (words, proc.stderr[-2000:])
        assert "bench device" in proc.stderr or "bad size" in proc.stderr, proc.stderr[-2000:]
        assert not (tmp_path / "x.json").exists()
