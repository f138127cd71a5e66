"""``jaxckpt.Checkpointer``: asynchronous snapshots of JAX pytrees, restored onto any sharding.

Save path, three hops: this front end (flatten, zero-copy views) -> the core engine (plan, copy + checksum on
worker threads) -> the store (slot commit). The commit across processes runs on a background thread.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxckpt.core import manifest as mf
from jaxckpt.config import Config
from jaxckpt.core.coordination import Coordinator, LocalCoordinator
from jaxckpt.core.engine import ArrayRecord, CheckpointEngine, SaveHandle
from jaxckpt.jax import shards
from jaxckpt.jax.fused import wrap_step
from jaxckpt.core.restore import restore_step
from jaxckpt.jax.restore import restore_tree
from jaxckpt.jax.tree import Leaf, flatten

log = logging.getLogger("jaxckpt.jax")

__all__ = ["Checkpointer", "SaveHandle"]


def _record(leaf: Leaf, owned: bool = False) -> ArrayRecord:
    v, kind = leaf.value, leaf.kind
    if kind in ("jax", "prng_key"):
        key = (kind, v.shape, v.dtype, v.sharding)
    else:
        a = np.asarray(v)
        key = (kind, a.shape, a.dtype.str)

    def meta() -> mf.ArrayMeta:
        lay = shards.array_layout(leaf.path, v, kind)
        attrs: dict[str, Any] = {}
        if kind == "prng_key":
            attrs = {"impl": str(jax.random.key_impl(v)), "key_dtype": str(v.dtype), "key_shape": list(v.shape)}
        return mf.ArrayMeta(leaf.path, leaf.keypath, lay.shape, lay.dtype, kind, shards.describe_sharding(v), attrs)

    return ArrayRecord(leaf.path, key, lambda: shards.array_layout(leaf.path, v, kind), meta,
                       lambda devs: shards.local_sources(v, kind, devs, owned))


class Checkpointer:
    """In-memory asynchronous checkpointing of JAX pytrees (docs/design.md states the guarantees)."""

    def __init__(self, config: Config | None = None, *, coordinator: Coordinator | None = None) -> None:
        config = (config or Config()).with_env()
        if coordinator is None:
            if jax.process_count() > 1:
                from jaxckpt.jax.coordination import JaxCoordinator
                coordinator = JaxCoordinator()
            else:
                coordinator = LocalCoordinator()
        self.engine = CheckpointEngine(config, coordinator, framework="jax")
        self.config = config
        self.persister = None  # the persistent tier (jaxckpt.orbax.persist), with Config.persistent_dir
        if config.persistent_dir:
            from jaxckpt.orbax.persist import Persister  # imports orbax: only jobs with a persistent tier pay for it
            try:
                self.persister = Persister(self.engine, config)
            except BaseException:
                self.engine.close()
                raise

    @property
    def store(self):
        """The store holding this process's snapshots."""
        return self.engine.store

    def save(self, step: int, state: Any) -> SaveHandle:
        """Start a snapshot of ``state`` as step ``step`` and return at once.

        The snapshot equals ``state`` at this call bit for bit, even if the caller's next jitted step donates
        its buffers. Raises StepError if ``step`` is not newer than the last saved step, UnsupportedLeafError
        for a leaf it cannot hold, BudgetExceededError when the store's memory budget is full.
        """
        return self._save(step, state, owned=False)

    def _save(self, step: int, state: Any, owned: bool, extra: Any = None) -> SaveHandle:
        """``owned``: the arrays are jaxckpt's private copies (the fused path), read lazily by the workers.
        ``extra``: small JSON-able state saved alongside (``jaxckpt.orbax.persist.encode_extra``)."""
        t0 = time.perf_counter()
        self.engine.check_open()
        leaves, treedef = flatten(state)
        records = [_record(l, owned and l.kind == "jax") for l in leaves if l.kind != "value"]
        values = [mf.LeafMeta(l.path, l.keypath, l.value) for l in leaves if l.kind == "value"]
        if extra is not None:
            from jaxckpt.orbax.persist import extra_leaf
            values.append(extra_leaf(extra))
        persist = self.persister is not None and self.persister.wants(step)
        if persist:  # before save(): a small snapshot can commit before save() returns
            self.persister.note(step, treedef, leaves)
        try:
            return self.engine.save(step, records, values, tuple(l.path for l in leaves), t0=t0)
        except BaseException:
            if persist:
                self.persister.forget(step)
            raise

    def wrap_step(self, fn: Callable, *, state_argnum: int = 0, donate_argnums: Sequence[int] = (0,),
                  **jit_kwargs: Any) -> Callable:
        """Jit ``fn`` so that ``f(*args, save_step=k)`` also snapshots ``args[state_argnum]`` as step ``k`` from
        inside the compiled program (see ``jaxckpt.jax.fused``); without ``save_step`` it is the plain step."""
        return wrap_step(lambda k, st: self._save(k, st, owned=True), fn, state_argnum=state_argnum, donate_argnums=donate_argnums, **jit_kwargs)

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

    @property
    def last_restore_report(self):
        """Where the last restore read its bytes (a ``jaxckpt.core.sources.RestoreReport``: bytes per source kind,
        node and source, fallbacks taken), or None before the first restore."""
        return self.engine.last_restore_report

    def restore(self, target: Any = None, step: int | None = None) -> Any:
        """The state saved at ``step`` (default: the latest committed), laid out like ``target``.

        ``target`` is a pytree of ``jax.ShapeDtypeStruct`` (with shardings), jax or numpy arrays; arrays come
        back with exactly the target's shardings, whatever the saved ones were. Without a target, nested
        dicts of numpy arrays come back. With ``Config.persistent_dir``, a step memory cannot supply (not held, or
        its chunks gone) comes from the persistent directory (``jaxckpt.orbax.persist.restore``); the source is logged.
        """
        if self.persister is not None:
            return self._restore(target, step).state
        return restore_step(self.engine, step, lambda step, manifests, reader: restore_tree(
            target, manifests, reader, step=step, process=self.engine.process_index))

    def _restore(self, target: Any, step: int | None):
        """A ``jaxckpt.orbax.persist.Restored``: state, extra state, step and source (memory or persistent)."""
        from jaxckpt.orbax.persist import restore
        return restore(self.engine, self.persister, target, step)

    def close(self) -> None:
        """Finish in-flight saves (and the persists they start), stop the threads and free the store."""
        if self.persister is not None:
            self.persister.close()
        self.engine.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
