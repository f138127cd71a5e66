"""The fused way in: a jitted step that also returns its incoming state, copied to pinned host memory by XLA.

XLA schedules that device-to-host copy inside the program, overlapped with the forward and backward pass and
ordered before the donated update writes the buffers (REFT's "copy while the weights are not being written").
The host copy belongs to jaxckpt alone, so the save needs no views of live buffers and the workers read it
lazily: the calling thread pays one flatten and one layout key per save, whatever the number of shards. On
CPU the copy is plain memcpy on the compute cores; BENCHMARKS.md says which way is faster where. On an
accelerator an array replicated over several devices of a process is copied once, in pieces
(``shards.local_pieces``; the state's layout is planned on them, as save()'s): the pinned copies hold what is
saved and nothing more.

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

from jaxckpt.errors import PlanError

log = logging.getLogger("jaxckpt.jax.fused")

HOST_KIND = "pinned_host"
MAX_PROGRAMS = 16  # fused programs kept, one per state layout


class FusedTarget(Protocol):
    """What ``wrap_step`` needs of a checkpointer (``jaxckpt.jax.checkpointer.Checkpointer``)."""

    frontend: Any  # its JaxFrontend: ``layout(state)``

    def begin_save(self, step: int, layout: Any, leaves: list[Any], t0: float) -> Any: ...

    def start_save(self, begun: Any, leaves: list[Any], owned: bool, exclude_s: float = 0.0) -> Any: ...

    def cancel_save(self, begun: Any, error: BaseException) -> None: ...  # sets begun.failed, the failed handle


def _host_sharding(sharding: Any) -> Any:
    # The copies' layout names a sharding for the jax arrays that are not PRNG keys (their process's replicas cut
    # apart: jaxckpt.jax.shards.local_pieces); keys and python leaves come back as the program's private outputs.
    return None if sharding is None else sharding.with_memory_kind(HOST_KIND)


def _to_host(leaves: list[Any], host: list[Any]) -> list[Any]:
    # A device_put inside the program, not pinned_host out_shardings: XLA:CPU (jax 0.10) aliases a donated input
    # returned unchanged to that output and then rejects it ("Memory kind mismatch") on meshes with Auto axes.
    # There the device_put keeps the input's spec, so the pieces (a spec of their own) are asked for first.
    return [x if s is None else jax.device_put(_placed(x, s), s) for x, s in zip(leaves, host)]


def _placed(x: Any, s: Any) -> Any:
    axis_types = getattr(s.mesh, "axis_types", ())
    if axis_types and all(t == jax.sharding.AxisType.Auto for t in axis_types):
        return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(s.mesh, s.spec))
    return x


def _misplaced(copies: Any, copy: list[Any], host: list[Any]) -> str | None:
    """The first copy not where the save's plan reads it (its sharding is not the one asked for), named."""
    for i, (c, s) in enumerate(zip(copy, host)):
        if s is not None and not c.sharding.is_equivalent_to(s, c.ndim):
            return f"{copies.order[i]}: the program placed its copy as {c.sharding}, not as {s}"
    return None


def wrap_step(target: FusedTarget, fn: Callable, *, state_argnum: int = 0,
              donate_argnums: Sequence[int] = (0,), **jit_kwargs: Any) -> Callable:
    """``fused(*args, save_step=None)``: ``fn(*args)`` jitted with ``donate_argnums``; with ``save_step=k`` the same
    program also copies ``args[state_argnum]`` to host and ``target`` snapshots it, exactly as
    ``ckpt.save(k, state)`` right before the call would. A refused save raises before the program runs (the
    arguments are intact, the step did not run); see the module docstring.
    """
    plain = jax.jit(fn, donate_argnums=tuple(donate_argnums), **jit_kwargs)
    fused_by_layout: dict[Any, tuple[Callable, list[Any], list[bool]]] = {}
    pieces = [True]  # copies in pieces, until a program places them elsewhere than asked

    def fused_for(key: Any, copies: Any) -> tuple[Callable, list[Any], list[bool]]:
        f = fused_by_layout.get(key)
        if f is None:
            host = [_host_sharding(s) for s in copies.shardings]
            f = (jax.jit(lambda *a: (fn(*a), _to_host(jax.tree_util.tree_leaves(a[state_argnum]), host)),
                         donate_argnums=tuple(donate_argnums), **jit_kwargs), host, [False])
            if len(fused_by_layout) >= MAX_PROGRAMS:
                fused_by_layout.pop(next(iter(fused_by_layout)))
            fused_by_layout[key] = f
        return f

    def call(*args: Any, save_step: int | None = None) -> Any:
        if save_step is None:
            return plain(*args)
        t0 = time.perf_counter()
        layout, leaves = target.frontend.layout(args[state_argnum])
        copies = layout if pieces[0] else layout.uncut or layout  # what the copies hold, the plan of their save
        begun = target.begin_save(save_step, copies, leaves, t0)  # may refuse: nothing has run yet
        program, host, checked = fused_for(copies.key, copies)
        t1 = time.perf_counter()
        try:
            out, copy = program(*args)
        except BaseException as e:
            target.cancel_save(begun, e)
            raise
        ran = time.perf_counter() - t1
        if copies.cuts and not checked[0]:  # once per program with pieces: they are where the plan reads them,
            # or nothing is read (uncut copies keep each leaf's own spec and are read per device as they come)
            checked[0] = True
            wrong = _misplaced(copies, copy, host)
            if wrong is not None:
                # Reading by the plan would save wrong bytes. This save fails (wait() raises); the next saves copy
                # every array as it lies, with programs of their own.
                pieces[0] = False
                fused_by_layout.clear()
                error = PlanError(f"step {save_step}: {wrong}; this snapshot is not taken, later ones copy the "
                                  f"arrays as they lie")
                target.cancel_save(begun, error)
                call.last_save = begun.failed
                log.error("%s", error)
                return out
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
