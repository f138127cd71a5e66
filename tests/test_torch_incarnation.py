"""The torch front end's rounds are an incarnation's own, on a store that outlives it.

torchrun shares one store across the rounds of its rendezvous unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
(docs/deploy.md, torchrun), and a user's TCPStore or FileStore may outlive a job too. Rounds of the previous
incarnation leave keys there (the results of its last rounds, which nobody read to the end): a restarted rank
that took them for its own would decide on them. Here a TCPStore held by the test serves two incarnations of a
2-rank gloo job (each with its gloo keys apart, so the process group forms): the first leaves an aborted commit
of step 2 (rank 1 gone before it), the second saves steps 1 and 2 again, and both ranks must see step 2
committed, the stale abort notwithstanding.
"""
import datetime
import os
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from jaxckpt.testing import launch, node_info  # noqa: E402


def incarnation(port: int, job_id: str, which: int) -> dict:
    from jaxckpt import Config
    from jaxckpt.errors import CommitError
    from jaxckpt.torch import Checkpointer

    info = node_info()
    rank = info.process_id
    client = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=60),
                           wait_for_workers=False)
    # gloo's own keys apart per incarnation (torch's opt-out does it by a fresh store); jaxckpt's rounds run on
    # the TCPStore underneath, which both incarnations share
    dist.init_process_group("gloo", store=dist.PrefixStore(f"gloo{which}", client), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    state = {"w": torch.arange(6, dtype=torch.float32) + rank}
    ck = Checkpointer(Config(store="memory", job_id=job_id, commit_timeout_s=3.0 if which == 0 else 30.0))
    ck.save(1, state).result()
    if which == 0:
        if rank == 1:
            os._exit(0)  # gone before step 2: the leader publishes step 2's round aborted, which nobody reads
        try:
            ck.save(2, state).result()
        except CommitError as e:
            sys.stdout.flush()
            os._exit(0 if "step 2" in str(e) else 3)
        os._exit(4)
    ck.save(2, state).result()
    out = {"latest": ck.latest_step()}
    ck.close()
    dist.destroy_process_group()
    return out


def test_a_later_incarnation_on_the_same_store_does_not_read_the_earlier_ones_rounds():
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60),
                           wait_for_workers=False)
    first = launch(incarnation, nodes=1, procs_per_node=2, distributed=False, args=[server.port, "inc", 0],
                   timeout=120)
    assert [r.returncode for r in first] == [0, 0], [r.output[-2000:] for r in first]
    second = launch(incarnation, nodes=1, procs_per_node=2, distributed=False, args=[server.port, "inc", 1],
                    timeout=120)
    bad = [f"--- process {r.process_id}: {r.error}\n{r.output[-1500:]}" for r in second if not r.ok]
    assert not bad, "\n".join(bad)
    assert [r.value for r in second] == [{"latest": 2}, {"latest": 2}]
