"""``Config.shm_root``: the default agent directories made under a tmpfs an administrator mounted, for instance one
with huge pages (docs/deploy.md, "Huge pages"). What users rely on: the agent and every trainer of the job find
the same directory there, a relaunched trainer restores from it bit for bit with the segments mapped in 2 MiB
pages, ``jaxckpt doctor`` says which pages a directory gets, and a root that is not there is an error naming it
(never a directory made on whatever disk holds the path)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from jaxckpt.backends.agent import capacity
from jaxckpt.backends.agent.protocol import agent_dir, shm_base
from jaxckpt.config import Config
from jaxckpt.errors import ConfigError
from jaxckpt.node_identity import agent_dir_name, node_identity
from test_node_identity import _json_docs


def test_root_must_be_an_absolute_directory(tmp_path):
    with pytest.raises(ConfigError, match=r"Config.shm_root='huge': must be an absolute path"):
        Config(shm_root="huge")
    missing = str(tmp_path / "not-mounted")
    cfg = Config(job_id="j", shm_root=missing)
    with pytest.raises(ConfigError, match="no such directory") as e:
        agent_dir(cfg)
    assert missing in str(e.value) and not os.path.exists(missing)
    cfg = Config(job_id="j", shm_root=str(tmp_path))
    assert shm_base(cfg) == str(tmp_path)
    assert agent_dir(cfg) == os.path.join(str(tmp_path), agent_dir_name("j", node_identity(cfg).name))
    # a directory named by hand wins; the root still says where default ones live
    assert agent_dir(cfg.replace(shm_dir=str(tmp_path / "mine"))) == str(tmp_path / "mine")
    assert Config().with_env({"JAXCKPT_SHM_ROOT": str(tmp_path)}).shm_root == str(tmp_path)


def test_huge_mode_of_a_tmpfs_is_its_mount_option():
    chosen = ""
    if os.path.exists("/sys/kernel/mm/transparent_hugepage/shmem_enabled"):
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            chosen = next(w[1:-1] for w in f.read().split() if w.startswith("["))
    forced = {"force": "always", "deny": "never"}.get(chosen)
    assert capacity._huge_mode("ext4", "rw,relatime") == ""
    assert capacity._huge_mode("tmpfs", "rw,size=1g,huge=within_size") == (forced or "within_size")
    assert capacity._huge_mode("tmpfs", "rw,size=1g") == (forced or "never")


# ------------------------------------------------------------------ a huge-page tmpfs, real processes and agent
SCRIPT = r"""
set -e
mount -t tmpfs -o size=256m,huge=within_size tmpfs "$ROOT" || exit 77  # a kernel without tmpfs huge pages
# The agent the first trainer starts outlives this shell (and keeps the namespace's tmpfs): stopped however it ends.
trap '"$PY" -m jaxckpt.cli agent --job huge-root --shm-root "$ROOT" --stop > /dev/null 2>&1' EXIT
cd /tmp
"$PY" - <<'EOF'
import os, jaxckpt, numpy as np, jax
cfg = jaxckpt.Config(store="shm", job_id="huge-root", shm_root=os.environ["ROOT"])
state = {"w": jax.numpy.arange(4 << 20, dtype=jax.numpy.float32).reshape(1024, 4096),
         "b": jax.numpy.full((3, 5), 7, jax.numpy.int32)}
ck = jaxckpt.Checkpointer(cfg)
ck.save(1, state)
ck.wait()
ck.close()
EOF
"$PY" - <<'EOF'
import json, os, jaxckpt, numpy as np, jax
from jaxckpt.backends.agent.protocol import agent_dir
root = os.environ["ROOT"]
cfg = jaxckpt.Config(store="shm", job_id="huge-root", shm_root=root)
ck = jaxckpt.Checkpointer(cfg)
target = {"w": jax.ShapeDtypeStruct((1024, 4096), np.float32), "b": jax.ShapeDtypeStruct((3, 5), np.int32)}
got = ck.restore(target, step=ck.latest_step())
equal = bool(np.array_equal(np.asarray(got["w"]), np.arange(4 << 20, dtype=np.float32).reshape(1024, 4096))
             and np.array_equal(np.asarray(got["b"]), np.full((3, 5), 7, np.int32)))
pmd, mapped, name = 0, 0, None  # this process's mappings of files under the root, from /proc/self/smaps
with open("/proc/self/smaps") as f:
    for line in f:
        parts = line.split()
        if len(parts) >= 6 and "-" in parts[0]:
            name = parts[5]
        elif name and name.startswith(root + "/") and parts[0] == "Rss:":
            mapped += int(parts[1])
        elif name and name.startswith(root + "/") and parts[0] in ("ShmemPmdMapped:", "FilePmdMapped:"):
            pmd += int(parts[1])
print(json.dumps({"dir": agent_dir(cfg), "equal": equal, "step": ck.latest_step(), "rss_kib": mapped,
                  "pmd_kib": pmd}))
ck.close()
from jaxckpt.cli import main
os.environ["JAXCKPT_SHM_ROOT"] = root  # how a site sets it for every process of the job
main(["doctor", "--json", "--job", "huge-root"])
os.environ["JAXCKPT_SHM_ROOT"] = root + "/absent"
print(json.dumps({"doctor_rc": main(["doctor", "--json"])}))
EOF
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare to mount a huge-page tmpfs in a private mount namespace")
def test_trainers_and_agent_share_a_huge_page_root(tmp_path):
    root = tmp_path / "huge"
    root.mkdir()
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "bash", "-c", SCRIPT],
                       env={**os.environ, "PY": sys.executable, "ROOT": str(root), "JAXCKPT_LOG_LEVEL": "ERROR",
                            "JAX_PLATFORMS": "cpu"},
                       capture_output=True, text=True, timeout=240)
    if r.returncode == 77:
        pytest.skip("this kernel's tmpfs takes no huge= option (no transparent huge pages for shared memory)")
    assert r.returncode == 0, r.stderr[-3000:]
    docs = [json.loads(d) for d in _json_docs(r.stdout)]
    out, doctor, bad = docs[0], docs[1], docs[2]
    assert out["equal"] and out["step"] == 1, out
    assert os.path.dirname(out["dir"]) == str(root) and os.path.basename(out["dir"]).startswith("jaxckpt-"), out
    assert doctor["agent"]["directory"] == out["dir"] and doctor["shm"]["mount"] == str(root), doctor
    assert out["rss_kib"] >= 16 << 10, out  # the restoring process mapped the snapshot's segment from the root
    if doctor["shm"]["huge"] == "within_size":  # unless the kernel denies huge pages to every tmpfs
        assert out["pmd_kib"] >= 2048, out  # and in 2 MiB pages
        assert not any("4 KiB pages" in w for w in doctor["warnings"]), doctor["warnings"]
    assert bad == {"doctor_rc": 2}, bad
    assert "Config.shm_root=" in r.stderr and "no such directory" in r.stderr, r.stderr[-2000:]


def test_doctor_names_small_pages(tmp_path):
    """A tmpfs without huge pages (the usual /dev/shm) is named with its fix; what the mount says is reported."""
    from jaxckpt.cli.doctor import report

    cfg = Config(store="shm", job_id="pages")
    cap = capacity.shm_capacity(agent_dir(cfg))
    r = report(cfg, sweep=False)
    assert r["shm"]["huge"] == cap.huge
    small = [w for w in r["warnings"] if "4 KiB pages" in w]
    if cap.fstype == "tmpfs" and cap.huge not in ("always", "within_size"):
        assert len(small) == 1 and "huge=within_size" in small[0] and "JAXCKPT_SHM_ROOT" in small[0], small
    else:
        assert small == [], small
    # a job that keeps its snapshots in its own process (store="memory") maps no agent segments: nothing to say
    assert not any("4 KiB pages" in w for w in report(cfg.replace(store="memory"), sweep=False)["warnings"])


def test_agent_command_takes_the_root(tmp_path):
    """`jaxckpt agent` run on its own (a SLURM step, a DaemonSet) finds the trainers' directory under the root they
    use (--shm-root, else JAXCKPT_SHM_ROOT), and refuses a root that is not there."""
    job = "root-cli"
    want = os.path.join(str(tmp_path), agent_dir_name(job, node_identity(Config(job_id=job)).name))
    env = {k: v for k, v in os.environ.items() if k != "JAXCKPT_SHM_ROOT"}
    for extra, env_root in ((["--shm-root", str(tmp_path)], None), ([], str(tmp_path))):
        r = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", job, "--stop", *extra],
                           env={**env, **({"JAXCKPT_SHM_ROOT": env_root} if env_root else {})},
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and f"no agent serves {want}" in r.stdout, (r.stdout, r.stderr)
    missing = str(tmp_path / "absent")
    r = subprocess.run([sys.executable, "-m", "jaxckpt.cli", "agent", "--job", job, "--shm-root", missing],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"Config.shm_root={missing!r}: no such directory" in r.stderr, r.stderr
    assert not os.path.exists(missing)
