"""``jaxckpt.Checkpointer``: asynchronous snapshots of JAX pytrees, restored onto any sharding.

Save path, three hops: this front end (flatten, zero-copy views) -> the core engine (plan, copy + checksum on
worker threads) -> the store (slot commit). The commit across processes runs on a background thread.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax

from jaxckpt.core import manifest as mf
from jaxckpt.config import Config
from jaxckpt.core.advise import IntervalAdvice
from jaxckpt.core.coordination import Coordinator, LocalCoordinator
from jaxckpt.core.engine import CheckpointEngine, Reservation, SaveHandle
from jaxckpt.jax.fused import wrap_step
from jaxckpt.core.restore import restore_step
from jaxckpt.core.extra import extra_of, extra_leaf
from jaxckpt.core.sources import RestoreReport
from jaxckpt.jax.gather import gather_for
from jaxckpt.jax.restore import restore_tree
from jaxckpt.jax.snapshot import Saver, TreePlan

log = logging.getLogger("jaxckpt.jax")

__all__ = ["Checkpointer", "Restored", "SaveHandle"]


@dataclass
class Restored:
    """A restored step: the state, the extra state saved with it (or None), its step, and where its bytes came
    from: ``source`` is "memory", "persistent" (the persistent directory) or "memory+persistent"."""

    state: Any
    extra: Any
    step: int
    source: str
    report: RestoreReport | None = None


def _source(report: RestoreReport) -> str:
    disk = report.bytes_by_kind.get("persistent", 0)
    if not disk:
        return "memory"
    return "persistent" if disk == report.nbytes else "memory+persistent"


@dataclass
class _Begun:
    """A save that passed every check (jaxckpt.jax.fused runs its program only after this)."""

    plan: TreePlan
    res: Reservation | SaveHandle  # a SaveHandle when the store was unreachable (skipped, decided)
    values: list[mf.LeafMeta]
    persist: bool
    failed: SaveHandle | None = None  # set by cancel_save: the handle holding the error


class Checkpointer:
    """In-memory asynchronous checkpointing of JAX pytrees (docs/design.md states the guarantees)."""

    def __init__(self, config: Config | None = None, *, coordinator: Coordinator | None = None) -> None:
        config = (config or Config()).with_env()
        if config.compilation_cache_dir:
            from jaxckpt.jax.compile_cache import enable
            enable(config.compilation_cache_dir)
        if coordinator is None:
            if jax.process_count() > 1:
                from jaxckpt.jax.coordination import JaxCoordinator
                coordinator = JaxCoordinator()
            else:
                coordinator = LocalCoordinator()
        self.engine = CheckpointEngine(config, coordinator, framework="jax")
        self._saver = Saver()  # layout plans: what save() computes once per tree structure and shardings
        self.config = config
        self.persister = None  # the persistent tier (jaxckpt.persistent), with Config.persistent_dir
        if config.persistent_dir:
            from jaxckpt.persistent import Persister  # imports orbax: only jobs with a persistent tier pay for it
            try:
                self.persister = Persister(self.engine, config, build=self._build)
            except BaseException:
                self.engine.close()
                raise

    @property
    def store(self):
        """The store holding this process's snapshots."""
        return self.engine.store

    def save(self, step: int, state: Any, *, extra: Any = None) -> SaveHandle:
        """Start a snapshot of ``state`` as step ``step`` and return at once.

        The snapshot equals ``state`` at this call bit for bit, even if the caller's next jitted step donates
        its buffers, or numpy leaves are written in place after it returns (they are copied here; jax arrays
        are read by the workers). ``extra``: small JSON-able state saved with it (``jaxckpt.core.extra``), given
        back by :meth:`restore_with_extra`. Raises StepError if ``step`` is not newer than the last saved step,
        UnsupportedLeafError for a leaf it cannot hold, BudgetExceededError when the store's memory budget is
        full; a refused save leaves nothing behind.
        """
        t0 = time.perf_counter()
        leaves, treedef = jax.tree_util.tree_flatten(state)
        begun = self.begin_save(step, leaves, treedef, state, t0, extra=extra)
        return self.start_save(begun, leaves, owned=False)

    def begin_save(self, step: int, leaves: list[Any], treedef: Any, state: Any, t0: float, extra: Any = None,
                   ) -> _Begun:
        """Every check a save makes, before anything is read or run: closed, leaf kinds (UnsupportedLeafError),
        step order (StepError), room in the budget (BudgetExceededError); the slot is then reserved."""
        self.engine.check_open()
        plan = self._saver.plan(leaves, treedef, tree=state)
        values = plan.value_metas(leaves)
        if extra is not None:
            values.append(extra_leaf(extra))
        res = self.engine.begin(step, plan.key, lambda: plan.records(leaves), t0)
        persist = isinstance(res, Reservation) and self.persister is not None and self.persister.wants(step)
        if persist:  # before start(): a small snapshot can commit before save() returns
            self.persister.note(res.step, treedef, plan.leaf_list(leaves))
        return _Begun(plan, res, values, persist)

    def start_save(self, begun: _Begun, leaves: list[Any], owned: bool, exclude_s: float = 0.0) -> SaveHandle:
        """Take what must be read as of now and hand the save to the workers; on failure the reservation is
        cancelled (a failed handle, raised by ``wait()``) and the error raised. ``owned``: the arrays are
        jaxckpt's private copies (the fused path), read lazily by the workers. ``exclude_s``: seconds not
        counted in ``save_call_seconds`` (the fused path's program)."""
        res = begun.res
        if isinstance(res, SaveHandle):
            return res
        try:
            sources = self._saver.pins(begun.plan, res.prep.devices, leaves, owned)
            handle = self.engine.start(res, sources, begun.values, begun.plan.order)
        except BaseException as e:
            self.cancel_save(begun, e)
            raise
        handle.save_call_seconds -= exclude_s
        return handle

    def cancel_save(self, begun: _Begun, error: BaseException) -> None:
        """Give up a begun save (what was to be saved could not be produced); ``begun.failed`` is then the handle
        holding ``error``."""
        if isinstance(begun.res, SaveHandle):
            return
        if begun.persist:
            self.persister.forget(begun.res.step)
        begun.failed = self.engine.cancel(begun.res, error)

    def wrap_step(self, fn: Callable, *, state_argnum: int = 0, donate_argnums: Sequence[int] = (0,),
                  **jit_kwargs: Any) -> Callable:
        """Jit ``fn`` so that ``f(*args, save_step=k)`` also snapshots ``args[state_argnum]`` as step ``k`` from
        inside the compiled program (see ``jaxckpt.jax.fused``); without ``save_step`` it is the plain step.

        A save that is refused (StepError, ClosedError, UnsupportedLeafError, BudgetExceededError) raises
        before the program runs: nothing was donated, the arguments are intact and the step did not run, so the
        caller can run it again without ``save_step``. A failure after the program ran (reading the copies)
        returns the step's output; the save's handle holds the error and ``wait()`` raises it. The wrapped
        function's ``last_save`` attribute is the SaveHandle of its latest call with ``save_step``."""
        return wrap_step(self, fn, state_argnum=state_argnum, donate_argnums=donate_argnums, **jit_kwargs)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far is committed by all processes; raise the first failure."""
        self.engine.wait(timeout)

    def latest_step(self) -> int | None:
        """The newest step committed by all processes, or None; with nothing in memory, the newest persisted."""
        step = self.engine.latest_step()
        if step is None and self.persister is not None:
            step = self.persister.latest_step()
        return step

    def all_steps(self) -> list[int]:
        """Committed steps still held, ascending."""
        return self.engine.all_steps()

    def advise_interval(self, mtbf_node_s: float, nodes: int, *, step_time_s: float | None = None,
                        overhead_s: float | None = None, latency_s: float | None = None,
                        restart_s: float = 0.0) -> "IntervalAdvice":
        """How often to snapshot so that the expected lost time is least (Young/Daly; ``jaxckpt.core.advise``
        states the formula and its assumptions), for ``nodes`` nodes failing every ``mtbf_node_s`` seconds on
        average. The step time, the per-snapshot overhead (what save() blocks) and the save -> committed latency
        are this job's own measured medians unless given; ``restart_s``: relaunch + restore time."""
        return self.engine.advise_interval(mtbf_node_s, nodes, step_time_s=step_time_s, overhead_s=overhead_s,
                                           latency_s=latency_s, restart_s=restart_s)

    @property
    def last_restore_report(self):
        """Where the last restore read its bytes (a ``jaxckpt.core.sources.RestoreReport``: bytes per source kind,
        node and source, fallbacks taken), or None before the first restore."""
        return self.engine.last_restore_report

    def restore(self, target: Any = None, step: int | None = None) -> Any:
        """The state saved at ``step`` (default: the newest committed), laid out like ``target``.

        ``target`` is a pytree of ``jax.ShapeDtypeStruct`` (with shardings), jax or numpy arrays; arrays come
        back with exactly the target's shardings, whatever the saved ones were. Without a target, nested
        dicts of numpy arrays come back. With ``Config.persistent_dir``, the persisted steps are restored like the
        ones in memory: a chunk memory cannot give good bytes for comes from the directory, and a step only
        persisted comes from there whole (``last_restore_report`` says which bytes came from where).
        """
        return self.restore_with_extra(target, step).state

    def restore_with_extra(self, target: Any = None, step: int | None = None) -> Restored:
        """As :meth:`restore`, with the extra state saved with the step (``save(..., extra=)``) and where the
        bytes came from."""
        def fill(at: int, manifests: list, reader: Any) -> tuple[Any, Any]:
            own = next((m for m in manifests if m.process == self.engine.process_index), manifests[0])
            return self._build(target, manifests, reader, at), extra_of(own)
        state, extra = restore_step(self.engine, step, fill)
        report = self.engine.last_restore_report
        return Restored(state, extra, report.step, _source(report), report)

    def _build(self, target: Any, manifests: list, reader: Any, step: int) -> Any:
        """``target``'s arrays from the opened step's host boxes (the persistent tier writes with this too)."""
        return restore_tree(target, manifests, reader, step=step, process=self.engine.process_index,
                            gather=gather_for(self.engine, target, self.config))

    def close(self) -> None:
        """Finish in-flight saves (and the persists they start), stop the threads and free the store."""
        if self.persister is not None:
            self.persister.close()
        self.engine.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
