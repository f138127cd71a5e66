"""The ``Checkpointer`` face, written once for every front end: save, wait, restore, the steps, the advice, the
last restore's report, the persistent tier, close.

A front end (``jaxckpt.frontend.protocol.Frontend``) supplies its leaves to records, its arrays from host boxes
and its coordinator and collective; this class drives the engine with them. Save path: the front end's layout
(cached per state layout) -> :meth:`CheckpointEngine.begin` (checks, plan, slot) -> the front end takes what
must be taken now -> :meth:`CheckpointEngine.start` (copy + checksum on worker threads, commit across processes
in the background). Restore path: ``jaxckpt.core.restore.restore_step`` (open, fallback, report) with the front
end's ``build``. ``jaxckpt.Checkpointer`` (JAX) and ``jaxckpt.torch.Checkpointer`` are this class with their
front end; the chaos numpy trainer uses it as it is.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from jaxckpt.config import Config
from jaxckpt.core import manifest as mf
from jaxckpt.core.advise import IntervalAdvice
from jaxckpt.core.coordination import Coordinator
from jaxckpt.core.engine import CheckpointEngine, Reservation, SaveHandle
from jaxckpt.core.extra import extra_leaf, extra_of
from jaxckpt.core.restore import restore_step
from jaxckpt.core.sources import RestoreReport
from jaxckpt.errors import ConfigError
from jaxckpt.frontend.protocol import Frontend, StateLayout

log = logging.getLogger("jaxckpt.frontend")
# _build's default collective: the front end's own for the target (what the persistent tier's build uses)
TARGETS_OWN: Any = object()

__all__ = ["Begun", "Checkpointer", "Restored"]


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
class Begun:
    """A save that passed every check (the fused path runs its program only after this)."""

    layout: StateLayout
    res: Reservation | SaveHandle  # a SaveHandle when the store was unreachable (skipped, decided)
    values: list[mf.LeafMeta]
    persist: bool
    failed: SaveHandle | None = None  # set by cancel_save: the handle holding the error


class Checkpointer:
    """In-memory asynchronous checkpointing through ``frontend`` (docs/design.md states the guarantees).

    ``coordinator``: the job's coordination (default: the front end's for a job of several processes).
    ``engine``: attach to an existing engine (e.g. a JAX Checkpointer's) so that two front ends share one store,
    one commit protocol and one retention policy; ``close()`` then leaves it open.
    """

    def __init__(self, frontend: Frontend, config: Config | None = None, *, coordinator: Coordinator | None = None,
                 engine: CheckpointEngine | None = None) -> None:
        self.frontend = frontend
        if engine is not None:
            if config is not None or coordinator is not None:
                raise ConfigError("pass either engine= or config=/coordinator=, not both")
            config = engine.config
        else:
            config = (config or Config()).with_env()
        if config.persistent_dir and not frontend.persists:
            raise ConfigError(f"Config.persistent_dir={config.persistent_dir!r}: the {frontend.framework} front end "
                              f"has no persistent tier (it writes Orbax's format, for JAX state); unset it")
        if engine is None:
            protection, imported = None, None
            if config.protection != "none":
                w, c = time.perf_counter(), time.thread_time()
                from jaxckpt.protection.runtime import Protector
                protection, imported = Protector, (time.perf_counter() - w, time.thread_time() - c)
            engine = CheckpointEngine(config, coordinator or frontend.coordinator(), frontend.framework,
                                      protection=protection)
            if imported is not None:  # before the engine and its watch: a stage of its start-up all the same
                engine.startup.record("protection import", *imported, first=True)
            self._owns_engine = True
        else:
            self._owns_engine = False
        self.engine, self.config = engine, config
        self.persister = None  # the persistent tier (jaxckpt.persistent), with Config.persistent_dir
        if config.persistent_dir and self._owns_engine:
            from jaxckpt.persistent import Persister  # imports orbax: only jobs with a persistent tier pay for it
            try:
                with engine.startup.stage("persistent"):  # its import (orbax's) and set-up
                    self.persister = Persister(engine, config, build=self._build)
            except BaseException:
                engine.close()
                raise

    @property
    def startup(self) -> dict[str, dict[str, float]]:
        """Where this checkpointer's construction spent its time: wall and CPU seconds per stage (the store and
        its agent's hello, protection, the adoption's rounds and scans, the persistent tier)."""
        return self.engine.startup.to_dict()

    @property
    def store(self):
        """The store holding this process's snapshots."""
        return self.engine.store

    @property
    def process_index(self) -> int:
        return self.engine.process_index

    @property
    def process_count(self) -> int:
        return self.engine.process_count

    # ------------------------------------------------------------------------------------------------ save
    def save(self, step: int, state: Any, *, extra: Any = None) -> SaveHandle:
        """Start a snapshot of ``state`` as step ``step`` and return at once (its handle).

        The snapshot equals ``state`` at this call bit for bit (the front end says what it takes now for that).
        ``extra``: small JSON-able state saved with it (``jaxckpt.core.extra``), given back by
        :meth:`restore_with_extra`. Raises StepError if ``step`` is not newer than the last saved step,
        UnsupportedLeafError for a leaf it cannot hold, BudgetExceededError when the store's memory budget is
        full; a refused save leaves nothing behind. Every process of a job saves the same steps.
        """
        t0 = time.perf_counter()
        layout, leaves = self.frontend.layout(state)
        begun = self.begin_save(step, layout, leaves, t0, extra=extra)
        return self.start_save(begun, leaves, owned=False)

    def begin_save(self, step: int, layout: StateLayout, leaves: list[Any], t0: float, extra: Any = None) -> Begun:
        """Every check a save makes, before anything is read or run: closed, leaf kinds (UnsupportedLeafError),
        step order (StepError), room in the budget (BudgetExceededError); the slot is then reserved."""
        self.engine.check_open()
        values = layout.value_metas(leaves)
        if extra is not None:
            values.append(extra_leaf(extra))
        res = self.engine.begin(step, layout.key, lambda: layout.records(leaves), t0)
        persist = isinstance(res, Reservation) and self.persister is not None and self.persister.wants(step)
        if persist:  # before start: a small snapshot can commit before save() returns
            self.persister.note(res.step, *self.frontend.persist_note(layout, leaves))
        return Begun(layout, res, values, persist)

    def start_save(self, begun: Begun, leaves: list[Any], owned: bool, exclude_s: float = 0.0) -> SaveHandle:
        """Take what must be taken now and hand the save to the workers; on failure the reservation is cancelled
        (a failed handle, raised by ``wait()``) and the error raised. ``owned``: the leaves are jaxckpt's own
        copies (the fused path). ``exclude_s``: seconds not counted in ``save_call_seconds``."""
        res = begun.res
        if isinstance(res, SaveHandle):
            return res
        try:
            reads = self.frontend.take(begun.layout, res.prep.devices, leaves, owned)
            handle = self.engine.start(res, reads, begun.values, begun.layout.order)
        except BaseException as e:
            self.cancel_save(begun, e)
            raise
        handle.save_call_seconds -= exclude_s
        return handle

    def cancel_save(self, begun: Begun, error: BaseException) -> None:
        """Give up a begun save (what was to be saved could not be produced); ``begun.failed`` is then the handle
        holding ``error``."""
        if isinstance(begun.res, SaveHandle):
            return
        if begun.persist:
            self.persister.forget(begun.res.step)
        begun.failed = self.engine.cancel(begun.res, error)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far is committed by all processes (and protected); raise the first failure."""
        self.engine.wait(timeout)

    # ------------------------------------------------------------------------------------------------ steps
    def latest_step(self) -> int | None:
        """The newest step committed by all processes, or None; with nothing in memory, the newest persisted."""
        return self.engine.newest_step()

    def all_steps(self) -> list[int]:
        """Committed steps still held in memory, ascending."""
        return self.engine.all_steps()

    def advise_interval(self, mtbf_node_s: float, nodes: int, *, step_time_s: float | None = None,
                        overhead_s: float | None = None, latency_s: float | None = None,
                        restart_s: float = 0.0) -> IntervalAdvice:
        """How often to snapshot so that the expected lost time is least (Young/Daly; ``jaxckpt.core.advise``
        states the formula and its assumptions), for ``nodes`` nodes failing every ``mtbf_node_s`` seconds on
        average. The step time, the per-snapshot overhead (what save() blocks) and the save -> committed latency
        are this job's own measured medians unless given; ``restart_s``: relaunch + restore time."""
        return self.engine.advise_interval(mtbf_node_s, nodes, step_time_s=step_time_s, overhead_s=overhead_s,
                                           latency_s=latency_s, restart_s=restart_s)

    @property
    def last_restore_report(self) -> RestoreReport | None:
        """Where the last restore read its bytes and where its time went (a ``jaxckpt.core.sources.RestoreReport``:
        bytes per source kind, node and source, fallbacks, steps passed over, per-phase ``timeline``), or None
        before the first restore."""
        return self.engine.last_restore_report

    # ---------------------------------------------------------------------------------------------- restore
    def restore(self, target: Any = None, step: int | None = None) -> Any:
        """The state saved at ``step`` (default: the newest), laid out like ``target`` (None: plain nested
        containers of host arrays). A restore of the newest step that cannot read it bit for bit falls back to the
        newest older step every process holds, in the same call (``last_restore_report.skipped`` says so), so
        every process of a job calls it. With ``Config.persistent_dir`` the persisted steps are restored like the
        ones in memory: a chunk memory cannot give good bytes for comes from the directory, a step only persisted
        comes from there whole."""
        return self.restore_with_extra(target, step).state

    def restore_with_extra(self, target: Any = None, step: int | None = None, **options: Any) -> Restored:
        """As :meth:`restore`, with the extra state saved with the step, its step and where its bytes came from;
        ``options`` go to the front end's ``build`` (torch: ``in_place``)."""
        gather = self.frontend.gather(self.engine, target, self.config)

        def fill(at: int, manifests: list[mf.Manifest], reader: Any) -> tuple[Any, Any]:
            own = next((m for m in manifests if m.process == self.engine.process_index), manifests[0])
            return self._build(target, manifests, reader, at, gather, **options), extra_of(own)
        # Without the collective a process's restore is its own: it may plan from its node's manifests first.
        # With split replicas a node holds 1/R of each replicated array: its manifests rarely suffice, and trying
        # them first cost a split restore on 4 nodes about 5 ms (BENCHMARKS.md), so it opens every one at once.
        near = gather is None and self.config.replicas == "whole"
        state, extra = restore_step(self.engine, step, fill, near=near)
        report = self.engine.last_restore_report
        return Restored(state, extra, report.step, _source(report), report)

    def _build(self, target: Any, manifests: list[mf.Manifest], reader: Any, step: int, gather: Any = TARGETS_OWN,
               **options: Any) -> Any:
        """The front end's build of ``target``; ``gather``: the collective (default: the one for ``target``)."""
        if gather is TARGETS_OWN:
            gather = self.frontend.gather(self.engine, target, self.config)
        return self.frontend.build(target, manifests, reader, step=step, process=self.engine.process_index,
                                   gather=gather, **options)

    # ------------------------------------------------------------------------------------------------ close
    def close(self) -> None:
        """Finish in-flight saves (and the persists they start), stop the threads and free the store (unless the
        engine was passed in: it is then only waited for)."""
        if self.persister is not None:
            self.persister.close()
        if self._owns_engine:
            self.engine.close()
        else:
            self.engine.wait(timeout=self.config.commit_timeout_s * 2)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
