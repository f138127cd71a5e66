"""A save refused on one process while its previous step is still being copied (the node's memory budget full):
every process agrees the previous step first and the refused one after, as the commit rounds are numbered, so
the previous step commits everywhere and the refused one fails everywhere at once. Before, the refused step's
outcome went to the commit protocol ahead of the step being copied: that process waited in the refused step's
round, the others in the previous step's, each for ``commit_timeout_s``, and both steps were lost."""
import os
import uuid

import numpy as np

from jaxckpt.testing import expect_ok, launch, node_info, remove_agents

MIB = 1 << 20
ROWS = 64 * MIB // (4 * 1024)  # a 64 MiB float32 array per process: its copy outlasts a refused reservation


def refused_behind_a_copy(job_id: str, base: str) -> dict:
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jaxckpt
    from jaxckpt.errors import BudgetExceededError

    info = node_info()
    me = info.process_id
    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.process_index)), ("data",))
    x = jax.make_array_from_callback((2 * ROWS, 1024), NamedSharding(mesh, P("data")),
                                     lambda idx: np.full((ROWS, 1024), me + 1, np.float32))
    # process 0's node has room for one snapshot of its 64 MiB, not two; process 1's has no budget
    cfg = jaxckpt.Config(store="shm", job_id=job_id, shm_dir=os.path.join(base, f"node{info.node}"), keep=1,
                         max_pending_saves=2, commit_timeout_s=30.0, memory_budget_bytes=(96 * MIB if me == 0 else 0))
    with jaxckpt.Checkpointer(cfg) as ck:
        first = ck.save(1, {"x": x})
        refused, second_error = "", ""
        try:
            second = ck.save(2, {"x": x})
        except BudgetExceededError as e:
            refused = str(e)
        else:
            try:
                second.result(timeout=90)
            except jaxckpt.errors.CommitError as e:
                second_error = str(e)
        try:
            first.result(timeout=90)
            first_error = ""
        except jaxckpt.errors.JaxckptError as e:
            first_error = f"{type(e).__name__}: {e}"
        latest = ck.latest_step()
    return {"refused": refused, "first_error": first_error, "second_error": second_error, "latest": latest}


def test_a_save_refused_behind_a_copy_fails_alone():
    base = f"/dev/shm/jaxckpt-commit-order-{uuid.uuid4().hex[:8]}"
    try:
        values = expect_ok(launch(refused_behind_a_copy, nodes=2, procs_per_node=1, devices_per_proc=1,
                                  args=(f"commit-order-{uuid.uuid4().hex[:6]}", base), timeout=240))
    finally:
        remove_agents(base)
    assert "step 2" in values[0]["refused"] and values[1]["refused"] == "", values
    for v in values:  # the step being copied commits on every process; the refused one on none
        assert v["first_error"] == "" and v["latest"] == 1, v
    assert "step 2: not committed by every process: process(es) 0 did not save it (their snapshot failed or was " \
           "refused)" in values[1]["second_error"], values[1]


def different_steps(job_id: str) -> dict:
    import jax.numpy as jnp

    import jaxckpt

    me = node_info().process_id
    with jaxckpt.Checkpointer(jaxckpt.Config(job_id=job_id, commit_timeout_s=30.0)) as ck:
        ck.save(1, {"w": jnp.arange(8.0) + me}).result(timeout=60)
        errors = {}
        for step in ((2, 4) if me == 0 else (3, 5)):  # a user's bug: the processes disagree on the steps they save
            try:
                ck.save(step, {"w": jnp.arange(8.0) + me}).result()
                errors[step] = ""
            except jaxckpt.errors.CommitError as e:
                errors[step] = str(e)
        latest_then = ck.latest_step()
        ck.save(6, {"w": jnp.arange(8.0) + me}).result(timeout=60)  # they agree again
        return {"errors": errors, "latest_then": latest_then, "latest": ck.latest_step()}


def test_processes_saving_different_steps_each_fail_saying_so_and_keep_the_committed_step():
    """Process 0 saves steps 2 and 4, process 1 steps 3 and 5, then both step 6. Each step of one process fails on
    it, naming the round the other process waits in, without waiting out the 30 s commit time-out (one that ran
    out would say "did not arrive" or "no commit decision"); step 1 stays the newest until step 6 commits."""
    a, b = expect_ok(launch(different_steps, nodes=2, procs_per_node=1, devices_per_proc=1,
                            args=(f"commit-steps-{uuid.uuid4().hex[:6]}",), timeout=240))
    hint = "(the processes ran different rounds) (every process must save the same steps)"
    for step in (2, 4):  # process 0 decides: process 1 waits in the next round, so it skipped this one
        assert a["errors"][str(step)].startswith(f"step {step}: not committed by every process: round 'commit "
                                                 f"{step}'"), a
        assert a["errors"][str(step)].endswith(f"process 1 skipped it: it waits in round 'commit {step + 1}' "
                                               f"#{step + 1} already {hint}"), a
    for step in (3, 5):  # process 0, which decides, waits in a later round: it never saved this step
        assert b["errors"][str(step)].startswith(f"step {step}: not committed by every process: round 'commit "
                                                 f"{step}'"), b
        assert b["errors"][str(step)].endswith(f"process 0 (the leader) skipped it: it waits in round 'commit "
                                               f"{step + 1}' #{step + 1} already {hint}"), b
    assert a["latest_then"] == b["latest_then"] == 1  # the step committed before stays the newest, on both
    assert a["latest"] == b["latest"] == 6


def one_more_step(job_id: str) -> dict:
    import jax.numpy as jnp

    import jaxckpt

    me, errors = node_info().process_id, {}
    for extra in (1, 0):  # process ``extra`` saves step 3 as well (a user's last save on one process only)
        with jaxckpt.Checkpointer(jaxckpt.Config(job_id=f"{job_id}-{extra}", commit_timeout_s=30.0)) as ck:
            for step in (1, 2, 3) if me == extra else (1, 2):
                try:
                    ck.save(step, {"w": jnp.arange(8.0) + step}).result()
                    errors[f"{extra}/{step}"] = ""
                except jaxckpt.errors.CommitError as e:
                    errors[f"{extra}/{step}"] = str(e)
            errors[f"{extra}/latest"] = ck.latest_step()
    return errors


def test_a_step_saved_by_one_process_while_the_other_closes_fails_saying_so():
    """Each process in turn saves a step 3 the other does not, and the other closes its Checkpointer. Step 3 fails
    on the process that saved it, naming the process that is closing, without waiting out the 30 s commit time-out
    (one that ran out would say "did not arrive" or "published no result"); steps 1 and 2 commit on both, and both
    close (the one that closed first is not held up past its own close)."""
    a, b = expect_ok(launch(one_more_step, nodes=2, procs_per_node=1, devices_per_proc=1,
                            args=(f"commit-close-{uuid.uuid4().hex[:6]}",), timeout=240))
    tail = "is closing: it will not run this round (the processes ran different rounds) (every process must save " \
           "the same steps)"
    for extra, saver, other in ((1, b, a), (0, a, b)):
        assert [saver[f"{extra}/{s}"] for s in (1, 2)] == ["", ""] and [other[f"{extra}/{s}"] for s in (1, 2)] == \
            ["", ""], (saver, other)
        assert f"{extra}/3" not in other
        assert saver[f"{extra}/3"].startswith("step 3: not committed by every process: round 'commit 3'"), saver
        who = "process 0 (the leader)" if extra == 1 else "process 1"
        assert saver[f"{extra}/3"].endswith(f"{who} {tail}"), saver
        assert saver[f"{extra}/latest"] == other[f"{extra}/latest"] == 2


def only_process_0_saves(job_id: str) -> dict:
    import logging

    import jax.numpy as jnp

    import jaxckpt

    me, errors, warnings = node_info().process_id, {}, []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())
    keep = Keep(logging.WARNING)
    logging.getLogger("jaxckpt").addHandler(keep)
    try:
        # the time-outs long enough that a wait which runs them out cannot pass for one that concluded
        with jaxckpt.Checkpointer(jaxckpt.Config(job_id=job_id, commit_timeout_s=60.0, peer_timeout_s=60.0)) as ck:
            for step in (1, 2) if me == 0 else ():  # a user's bug: only process 0 saves; process 1 closes at once
                try:
                    ck.save(step, {"w": jnp.arange(8.0) + step}).result()
                    errors[step] = ""
                except jaxckpt.errors.JaxckptError as e:
                    errors[step] = f"{type(e).__name__}: {e}"
    finally:
        logging.getLogger("jaxckpt").removeHandler(keep)
    return {"errors": errors, "close": [w for w in warnings if w.startswith("close:")]}


def test_saves_of_process_0_alone_fail_saying_so_and_both_close_without_waiting_out_the_time_out():
    """Only process 0 saves (the habit of "rank 0 saves"); process 1 closes its Checkpointer at once. Process 0's
    first save meets process 1's close barrier and fails at once, with the hint that every process must save; its
    second save and its close barrier find that process 1 closed (it left one key saying so) and fail at once too,
    where both waited out the 60 s time-out (a wait that ran out says "did not arrive within 60s")."""
    a, b = expect_ok(launch(only_process_0_saves, nodes=2, procs_per_node=1, devices_per_proc=1,
                            args=(f"commit-alone-{uuid.uuid4().hex[:6]}",), timeout=240))
    hint = "(the processes ran different rounds) (every process must save the same steps: the first save plans on " \
           "all of them together)"
    assert a["errors"]["1"].startswith("CoordinationError: round 'save nodes'") and \
        a["errors"]["1"].endswith(f"process 1 is in round 'close' instead {hint}"), a
    assert a["errors"]["2"].startswith("CoordinationError: round 'save nodes'") and \
        a["errors"]["2"].endswith(f"process 1 has closed: it will not run this round {hint}"), a
    assert len(a["close"]) == 1 and "process 1 has closed: it will not run this round (the processes ran " \
        "different rounds)" in a["close"][0], a["close"]
    assert b["errors"] == {} and len(b["close"]) == 1 and "process 1 is in round 'close' instead" in b["close"][0], b
