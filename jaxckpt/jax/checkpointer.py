"""``jaxckpt.Checkpointer``: asynchronous snapshots of JAX pytrees, restored onto any sharding.

The shared face (``jaxckpt.frontend.Checkpointer``) with the JAX front end (``jaxckpt.jax.frontend``): save path,
three hops: the front end (flatten, zero-copy views) -> the core engine (plan, copy + checksum on worker threads)
-> the store (slot commit); the commit across processes runs on a background thread. Plus ``wrap_step``, the
fused way in (``jaxckpt.jax.fused``).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from jaxckpt.config import Config
from jaxckpt.core.coordination import Coordinator
from jaxckpt.core.engine import SaveHandle
from jaxckpt.frontend.checkpointer import Checkpointer as Face
from jaxckpt.frontend.checkpointer import Restored
from jaxckpt.jax.frontend import JaxFrontend
from jaxckpt.jax.fused import wrap_step

log = logging.getLogger("jaxckpt.jax")

__all__ = ["Checkpointer", "Restored", "SaveHandle"]


class Checkpointer(Face):
    """In-memory asynchronous checkpointing of JAX pytrees (docs/design.md states the guarantees).

    ``save(step, state)`` returns at once; the snapshot equals ``state`` at the call bit for bit, even if the
    caller's next jitted step donates its buffers, or numpy leaves are written in place after it returns (they
    are copied at the call; jax arrays are read by the workers). ``restore(target)``: ``target`` is a pytree of
    ``jax.ShapeDtypeStruct`` (with shardings), jax or numpy arrays; arrays come back with exactly the target's
    shardings, whatever the saved ones were; without a target, nested dicts of numpy arrays come back.
    """

    def __init__(self, config: Config | None = None, *, coordinator: Coordinator | None = None) -> None:
        config = (config or Config()).with_env()
        if config.compilation_cache_dir:
            from jaxckpt.jax.compile_cache import enable
            enable(config.compilation_cache_dir)
        super().__init__(JaxFrontend(config), config, coordinator=coordinator)

    def wrap_step(self, fn: Callable, *, state_argnum: int = 0, donate_argnums: Sequence[int] = (0,),
                  copy: str = "auto", **jit_kwargs: Any) -> Callable:
        """Jit ``fn`` so that ``f(*args, save_step=k)`` also snapshots ``args[state_argnum]`` as step ``k``;
        without ``save_step`` it is the plain step. ``copy``: ``"in_program"``, the compiled program copies the
        state to pinned host memory; ``"before_step"``, a save() waited for until its copy is taken, then the
        program; ``"auto"``, the first on an accelerator, the second on CPU devices (``jaxckpt.jax.fused``).

        A save that is refused (StepError, ClosedError, UnsupportedLeafError, BudgetExceededError) raises
        before the program runs: nothing was donated, the arguments are intact and the step did not run, so the
        caller can run it again without ``save_step``. A failure after the program ran (reading the copies)
        returns the step's output; the save's handle holds the error and ``wait()`` raises it. The wrapped
        function's ``last_save`` attribute is the SaveHandle of its latest call with ``save_step``."""
        return wrap_step(self, fn, state_argnum=state_argnum, donate_argnums=donate_argnums, copy=copy,
                         **jit_kwargs)
