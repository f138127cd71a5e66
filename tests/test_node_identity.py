"""The node is the scheduler's failure domain (jaxckpt.node_identity), and everything follows it.

- the identity's order (Config.node_name, K8S_NODE_NAME, SLURMD_NODENAME, the host name), the scheduler detected,
  and the default agent directory: one per job, SLURM allocation and node, unambiguous;
- jaxckpt's launcher gives each simulated node its own name, hence its own default agent directory;
- two agents on one node (two pods of a machine: separate /dev/shm, separate agents) are one failure domain:
  protection keeps none of that machine's redundancy on it, and losing the machine (both agents and their memory)
  is rebuilt bit for bit from the other machine. Grouped by agent, as before, the copies of one agent landed on
  its neighbour on the same machine and the loss was a DataLossError;
- a shared-memory filesystem too small for the budget is a ConfigError at Checkpointer() naming the sizes and the
  fix, and ``jaxckpt doctor`` reports it (a real 64 MB tmpfs in a private mount namespace; root only).
"""
import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from jaxckpt.config import Config
from jaxckpt.errors import ConfigError
from jaxckpt.node_identity import (agent_dir_name, detect_scheduler, local_process_count, node_identity,
                                   parse_agent_dir_name, torchrun_store_hazard)
from jaxckpt.testing import expect_ok, launch, node_info, remove_agents
import test_protection_runtime as prt

BASE = f"/dev/shm/jaxckpt-nodeid-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def base_dir():
    os.makedirs(BASE, mode=0o700)
    yield BASE
    remove_agents(BASE)


# ------------------------------------------------------------------------------------------- pure functions
def test_identity_order():
    env = {"K8S_NODE_NAME": "gke-pool-1-abc", "SLURMD_NODENAME": "n7"}
    assert node_identity(Config(node_name="mine"), env).name == "mine"
    assert node_identity(Config(node_name="mine"), env).source == "Config.node_name"
    got = node_identity(Config(), env)
    assert (got.name, got.source) == ("gke-pool-1-abc", "K8S_NODE_NAME (Kubernetes downward API)")
    got = node_identity(Config(), {"SLURMD_NODENAME": "n7"})
    assert (got.name, got.source) == ("n7", "SLURMD_NODENAME (SLURM)")
    got = node_identity(Config(), {})
    assert got.source == "host name" and got.name
    # the Config field comes from the environment like every field
    assert node_identity(Config().with_env({"JAXCKPT_NODE_NAME": "envnode"}), {}).name == "envnode"
    with pytest.raises(ConfigError, match="node_name"):
        Config(node_name="a/b")
    with pytest.raises(ConfigError, match="node_name"):
        Config(node_name="x" * 254)


def test_scheduler_detection_and_local_processes():
    assert detect_scheduler({}).name == "none"
    s = detect_scheduler({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "3", "SLURMD_NODENAME": "n1"})
    assert (s.name, s.job, dict(s.details)["step"]) == ("slurm", "42", "3")
    assert detect_scheduler({"TORCHELASTIC_RUN_ID": "r1", "TORCHELASTIC_RESTART_COUNT": "2"}).name == "torchrun"
    assert detect_scheduler({"OMPI_COMM_WORLD_RANK": "0"}).name == "mpirun"
    hydra = detect_scheduler({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "2"})  # MPICH's / Intel MPI's
    assert hydra.name == "mpirun" and dict(hydra.details) == {"rank": "1", "launcher": "Hydra (MPICH, Intel MPI)"}
    assert detect_scheduler({"PMI_RANK": "1", "PMI_SIZE": "4", "SLURM_JOB_ID": "9"}).name == "slurm"  # --mpi=pmi2
    assert local_process_count({"MPI_LOCALNRANKS": "3"}) == 3
    assert detect_scheduler({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}).name == "kubernetes"
    assert local_process_count({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "1"}) == 2
    assert local_process_count({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"}) == 1
    assert local_process_count({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert local_process_count({}) is None


def test_torchrun_store_hazard_only_where_a_restart_shares_the_store():
    shared = {"TORCHELASTIC_RUN_ID": "r1", "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"}
    said = torchrun_store_hazard(shared)
    assert said and "--max-restarts=3" in said and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in said, said
    # torch's opt-out (its workers see TORCHELASTIC_USE_AGENT_STORE=False), no restarts, or no torchrun: nothing
    for env in ({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}, {**shared, "TORCHELASTIC_MAX_RESTARTS": "0"},
                {**shared, "TORCHELASTIC_MAX_RESTARTS": "x"},
                {k: v for k, v in shared.items() if k != "TORCHELASTIC_RUN_ID"}, {}):
        assert torchrun_store_hazard(env) is None, env


def test_default_agent_directory_is_per_job_allocation_and_node():
    slurm = {"SLURM_JOB_ID": "77"}
    names = {agent_dir_name(j, n, e) for j in ("a", "a-b") for n in ("b-c", "c", "n1") for e in ({}, slurm)}
    assert len(names) == 12  # no two (job, allocation, node) share a directory
    name = agent_dir_name("job.1", "n1", slurm)
    assert name == f"jaxckpt-{os.geteuid()}-job.1@slurm77@n1"
    assert parse_agent_dir_name(name) == (os.geteuid(), "job.1", "slurm77", "n1")
    assert parse_agent_dir_name(agent_dir_name("j", "n1", {})) == (os.geteuid(), "j", "", "n1")
    odd = agent_dir_name("j", "node/with spaces" + "x" * 80, {})
    assert "/" not in odd and " " not in odd and len(odd) < 80 and parse_agent_dir_name(odd) is not None


# ---------------------------------------------------------------------- the launcher's simulated nodes
def report_identity():
    from jaxckpt.backends.agent.protocol import agent_dir
    import jaxckpt

    config = jaxckpt.Config(job_id="ident").with_env()
    ident = node_identity(config)
    return {"node": ident.name, "source": ident.source, "dir": agent_dir(config)}


def test_launcher_names_each_simulated_node():
    out = expect_ok(launch(report_identity, nodes=2, procs_per_node=2, distributed=False, timeout=120))
    assert [r["node"] for r in out] == ["node0", "node0", "node1", "node1"], out
    assert {r["source"] for r in out} == {"Config.node_name"}
    assert out[0]["dir"] == out[1]["dir"] != out[2]["dir"] == out[3]["dir"], out
    assert out[0]["dir"].endswith("@node0")


# ------------------------------------------------------------------- two agents on one node: placement
def _pod_config(base: str, job: str):
    """Simulated node n is a pod of its own (own agent and memory) on Kubernetes node host<n // 2>: the node name
    comes as the pod spec gives it, K8S_NODE_NAME (not the launcher's per-pod name)."""
    import jaxckpt

    n = node_info().node
    os.environ.pop("JAXCKPT_NODE_NAME", None)
    os.environ["K8S_NODE_NAME"] = f"host{n // 2}"
    return jaxckpt.Config(store="shm", job_id=job, shm_dir=f"{base}/{job}-node{n}", keep=2, chunk_bytes=prt.CHUNK,
                          agent_dirs=f"{base}/{job}-node*", commit_timeout_s=60.0, peer_timeout_s=20.0,
                          protection="hybrid")


def machine_save(base: str, job: str):
    """4 pods, each with its own agent, on 2 machines: the plan's nodes are the machines."""
    import jaxckpt

    mesh = prt._mesh()
    with jaxckpt.Checkpointer(_pod_config(base, job)) as ck:
        ck.save(1, prt.device_state(mesh, 1))
        ck.wait()
        prot = ck.engine.protection
        plan = next(iter(prot.plans().values()))
        own = {c.key: c.node for c in plan.chunks}
        # every block's holder node differs from the node of every byte it protects
        bad = [b.id for b in plan.copy_blocks if any(plan.chunks[i].node == b.node for i in b.chunks)]
        bad += [s.id for s in plan.stripes for u in s.units if u.node == s.node]
        return {"protected": prot.protected_steps(), "nodes": list(plan.nodes), "agents": list(plan.agents),
                "bad": bad, "chunk_nodes": sorted(set(own.values()))}


def machine_restore(base: str, job: str):
    import jax
    import jaxckpt

    mesh = prt._mesh()
    target = {k: jax.ShapeDtypeStruct(h.shape, h.dtype, sharding=prt._sharding(mesh, k))
              for k, h in prt.host_state(0).items()} | {"step": 0}
    with jaxckpt.Checkpointer(_pod_config(base, job)) as ck:
        got = ck.restore(target)
        prt.check_bitwise(got, 1)
        return {"latest": ck.latest_step(), "report": ck.last_restore_report.to_dict()}


def test_two_agents_on_one_node_keep_no_redundancy_there(base_dir):
    job = "machines"
    out = expect_ok(launch(machine_save, nodes=4, procs_per_node=1, devices_per_proc=2, args=(base_dir, job),
                           env=prt.ENV, timeout=240))
    assert all(r["protected"] == [1] for r in out), out
    assert out[0]["nodes"] == [0, 0, 1, 1] and out[0]["agents"] == [0, 1, 2, 3], out[0]
    assert out[0]["bad"] == [] and out[0]["chunk_nodes"] == [0, 1], out[0]
    for n in (0, 1):  # machine host0 is lost: both of its agents and their memory
        d = f"{base_dir}/{job}-node{n}"
        from jaxckpt.backends.agent import protocol as proto
        proto.kill_agent(d, remove_memory=True)
        shutil.rmtree(d, ignore_errors=True)
    out = expect_ok(launch(machine_restore, nodes=4, procs_per_node=1, devices_per_proc=2, args=(base_dir, job),
                           env=prt.ENV, timeout=240))
    assert [r["latest"] for r in out] == [1] * 4, out
    assert sum(r["report"]["bytes_by_kind"].get("rebuild", 0) for r in out) > 0


# ---------------------------------------------------------------- a container's small /dev/shm
CONTAINER = r"""
set -e
mount -t tmpfs -o size=64m tmpfs /dev/shm
cd /tmp
"$PY" - <<'EOF'
import json, os, jaxckpt
from jaxckpt.errors import ConfigError
try:
    jaxckpt.Checkpointer(jaxckpt.Config(store="shm", job_id="small", memory_budget_bytes=256 << 20))
    print(json.dumps({"error": None}))
except ConfigError as e:
    print(json.dumps({"error": str(e)}))
ck = jaxckpt.Checkpointer(jaxckpt.Config(store="shm", job_id="fits", memory_budget_bytes=32 << 20))
ck.close()
from jaxckpt.backends.agent.protocol import agent_dir, stop_agent
stop_agent(agent_dir(ck.config), "fits")
# jaxckpt doctor --json, without and then with a budget, in this process (one start-up, not three)
from jaxckpt.cli import main
main(["doctor", "--json"])
os.environ["JAXCKPT_MEMORY_BUDGET_BYTES"] = "268435456"
rc = main(["doctor", "--json"])
if rc:
    print(f"exit {rc}")
EOF
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare to mount a 64 MB tmpfs in a private mount namespace")
def test_small_shared_memory_is_an_error_at_checkpointer():
    env = {k: v for k, v in os.environ.items() if k != "JAXCKPT_SHM_ROOT"}  # the container's own /dev/shm
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "bash", "-c", CONTAINER],
                       env={**env, "PY": sys.executable, "JAXCKPT_LOG_LEVEL": "ERROR"},
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    docs = [json.loads(x) for x in _json_docs(r.stdout)]
    err = docs[0]["error"]
    assert err and "64.0 MiB" in err and "256.0 MiB" in err and "--shm-size" in err and "sizeLimit" in err, err
    ok, small = docs[1], docs[2]
    assert ok["problems"] == [] and ok["shm"]["size"] == 64 << 20, ok
    assert any("no memory budget" in w for w in ok["warnings"]), ok["warnings"]
    assert len(small["problems"]) == 1 and "64.0 MiB" in small["problems"][0], small
    assert "exit 1" in r.stdout


def _json_docs(text: str) -> list[str]:
    """The JSON documents printed one after another (single-line and indented ones alike)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        i = text.find("{", i)
        if i < 0:
            return out
        doc, end = dec.raw_decode(text, i)
        out.append(json.dumps(doc))
        i = end
