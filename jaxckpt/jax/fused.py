"""The fused way in: a jitted step that also returns its incoming state, copied to pinned host memory by XLA.

XLA schedules that device-to-host copy inside the program, overlapped with the forward and backward pass and
ordered before the donated update writes the buffers (REFT's "copy while the weights are not being written").
The host copy belongs to jaxckpt alone, so the save needs no views of live buffers and the workers read it
lazily: the calling thread pays one flatten and one layout key per save, whatever the number of shards. On
CPU the copy is plain memcpy on the compute cores; BENCHMARKS.md says which way is faster where.

Exception safety: the program donates the caller's state, so every check that can refuse the save (closed,
leaf kinds, step order, the store's budget: the slot is reserved first) runs before it; a refusal raises with
the caller's arguments untouched. What can only fail after the program ran is recorded on the save's handle
(raised by ``Checkpointer.wait()``) and logged, and the step's output is returned.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol, Sequence

import jax

log = logging.getLogger("jaxckpt.jax.fused")

HOST_KIND = "pinned_host"
MAX_PROGRAMS = 16  # fused programs kept, one per state layout


class FusedTarget(Protocol):
    """What ``wrap_step`` needs of a checkpointer (``jaxckpt.jax.checkpointer.Checkpointer``)."""

    frontend: Any  # its JaxFrontend: ``layout(state)``

    def begin_save(self, step: int, layout: Any, leaves: list[Any], t0: float) -> Any: ...

    def start_save(self, begun: Any, leaves: list[Any], owned: bool, exclude_s: float = 0.0) -> Any: ...

    def cancel_save(self, begun: Any, error: BaseException) -> None: ...  # sets begun.failed, the failed handle


def _host_sharding(x: Any) -> Any:
    if isinstance(x, jax.Array) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x.sharding.with_memory_kind(HOST_KIND)
    return None  # PRNG keys and python leaves come back as the program's (private) outputs


def _to_host(leaves: list[Any], host: list[Any]) -> list[Any]:
    # A device_put inside the program, not pinned_host out_shardings: XLA:CPU (jax 0.10) aliases a donated input
    # returned unchanged to that output and then rejects it ("Memory kind mismatch") on meshes with Auto axes.
    return [x if s is None else jax.device_put(x, s) for x, s in zip(leaves, host)]


def wrap_step(target: FusedTarget, fn: Callable, *, state_argnum: int = 0,
              donate_argnums: Sequence[int] = (0,), **jit_kwargs: Any) -> Callable:
    """``fused(*args, save_step=None)``: ``fn(*args)`` jitted with ``donate_argnums``; with ``save_step=k`` the same
    program also copies ``args[state_argnum]`` to host and ``target`` snapshots it, exactly as
    ``ckpt.save(k, state)`` right before the call would. A refused save raises before the program runs (the
    arguments are intact, the step did not run); see the module docstring.
    """
    plain = jax.jit(fn, donate_argnums=tuple(donate_argnums), **jit_kwargs)
    fused_by_layout: dict[Any, Callable] = {}

    def fused_for(key: Any, leaves: list[Any]) -> Callable:
        f = fused_by_layout.get(key)
        if f is None:
            host = [_host_sharding(x) for x in leaves]
            f = jax.jit(lambda *a: (fn(*a), _to_host(jax.tree_util.tree_leaves(a[state_argnum]), host)),
                        donate_argnums=tuple(donate_argnums), **jit_kwargs)
            if len(fused_by_layout) >= MAX_PROGRAMS:
                fused_by_layout.pop(next(iter(fused_by_layout)))
            fused_by_layout[key] = f
        return f

    def call(*args: Any, save_step: int | None = None) -> Any:
        if save_step is None:
            return plain(*args)
        t0 = time.perf_counter()
        layout, leaves = target.frontend.layout(args[state_argnum])
        begun = target.begin_save(save_step, layout, leaves, t0)  # may refuse: nothing has run yet
        program = fused_for(layout.key, leaves)
        t1 = time.perf_counter()
        try:
            out, copy = program(*args)
        except BaseException as e:
            target.cancel_save(begun, e)
            raise
        ran = time.perf_counter() - t1
        # jax.Array leaves were donated, so their copies (host, or device) are the only ones left, and ours.
        # Python and numpy leaves come back from jit as device arrays: save the caller's own leaves for those.
        if len(layout.jax_leaves) != len(leaves):
            copy = [c if i in layout.jax_leaves else orig for i, (orig, c) in enumerate(zip(leaves, copy))]
        try:
            call.last_save = target.start_save(begun, copy, owned=True, exclude_s=ran)
        except Exception as e:  # noqa: BLE001 - the state was donated: the output must reach the caller
            call.last_save = begun.failed
            log.error("step %s: the fused snapshot failed after the step ran (%s: %s); training goes on, "
                      "wait() raises it", save_step, type(e).__name__, e)
        return out

    call.last_save = None  # the SaveHandle of the latest call with save_step (its save_call_seconds: the
    # calling thread's time in the save, the program excluded)
    return call
