"""The fused way in: a jitted step that also snapshots its incoming state, in one of two ways (``copy``).

``in_program``: the program also returns its incoming state, copied to pinned host memory by XLA.

XLA schedules that device-to-host copy inside the program, overlapped with the forward and backward pass and
ordered before the donated update writes the buffers (REFT's "copy while the weights are not being written").
The host copy belongs to jaxckpt alone, so the save needs no views of live buffers and the workers read it
lazily: the calling thread pays one flatten and one layout key per save, whatever the number of shards. On
CPU the copy is plain memcpy on the compute cores; BENCHMARKS.md says which way is faster where. On an
accelerator an array replicated over several devices of a process is copied once, in pieces
(``shards.local_pieces``; the state's layout is planned on them, as save()'s): the pinned copies hold what is
saved and nothing more.

``before_step``: ``save()`` of the incoming state, waited for until this process's bytes are in host memory, then
the plain program. Where save() reads the live buffers in place (CPU devices: their memory is host memory, so
``shards.pinned_sharding`` answers None), the program's copy would be a second copy of every byte on the cores
the step computes on, and a save() overlapped with the step holds back its donation; waiting for the one copy
costs the step less there (BENCHMARKS.md, the stall section). ``auto`` (the default) takes ``before_step`` there
and ``in_program`` on an accelerator. Either way the snapshot is the state at the call, bit for bit.

Exception safety: the program donates the caller's state, so every check that can refuse the save (closed,
leaf kinds, step order, the store's budget: the slot is reserved first) runs before it; a refusal raises with
the caller's arguments untouched. What can only fail after the program ran is recorded on the save's handle
(raised by ``Checkpointer.wait()``) and logged, and the step's output is returned.
"""
from __future__ import annotations

import logging
import time
from concurrent import futures
from typing import Any, Callable, Protocol, Sequence

import jax

from jaxckpt.errors import ConfigError, PlanError
from jaxckpt.jax import shards

log = logging.getLogger("jaxckpt.jax.fused")

HOST_KIND = "pinned_host"
MAX_PROGRAMS = 16  # fused programs kept, one per state layout
COPY_WAYS = ("auto", "in_program", "before_step")


class FusedTarget(Protocol):
    """What ``wrap_step`` needs of a checkpointer (``jaxckpt.jax.checkpointer.Checkpointer``)."""

    frontend: Any  # its JaxFrontend: ``layout(state)``

    def begin_save(self, step: int, layout: Any, leaves: list[Any], t0: float) -> Any: ...

    def start_save(self, begun: Any, leaves: list[Any], owned: bool, exclude_s: float = 0.0) -> Any: ...

    def cancel_save(self, begun: Any, error: BaseException) -> None: ...  # sets begun.failed, the failed handle

    def save(self, step: int, state: Any) -> Any: ...  # the SaveHandle


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


def _reads_in_place(state: Any) -> bool:
    """Whether save() reads ``state``'s buffers where they lie (no pinned host copy: CPU devices), judged by its
    first jax array; a state without one has nothing for a program to copy."""
    for x in jax.tree_util.tree_leaves(state):
        if isinstance(x, jax.Array):
            return shards.pinned_sharding(x.sharding) is None
    return True


def wrap_step(target: FusedTarget, fn: Callable, *, state_argnum: int = 0,
              donate_argnums: Sequence[int] = (0,), copy: str = "auto", **jit_kwargs: Any) -> Callable:
    """``fused(*args, save_step=None)``: ``fn(*args)`` jitted with ``donate_argnums``; with ``save_step=k``
    ``target`` also snapshots ``args[state_argnum]``, exactly as ``ckpt.save(k, state)`` right before the call
    would: copied by the same program (``copy="in_program"``) or saved and waited for before it runs
    (``"before_step"``); ``"auto"`` picks per the module docstring. A refused save raises before the program runs
    (the arguments are intact, the step did not run); see the module docstring.
    """
    if copy not in COPY_WAYS:
        raise ConfigError(f"wrap_step(copy={copy!r}): one of {', '.join(COPY_WAYS)}")
    plain = jax.jit(fn, donate_argnums=tuple(donate_argnums), **jit_kwargs)
    way = [None if copy == "auto" else copy]  # auto: decided by the first state saved
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
        if way[0] is None:
            way[0] = "before_step" if _reads_in_place(args[state_argnum]) else "in_program"
            log.info("wrap_step: snapshots taken %s", way[0].replace("_", " "))
        if way[0] == "before_step":
            # Refusals raise in save(), before anything ran. Once this process's bytes are copied (and its parity
            # stripes, which read the views too, are made) the views are dropped, so the program donates the
            # buffers; a copy that failed is on the handle (wait() raises it).
            t0 = time.perf_counter()
            handle = call.last_save = target.save(save_step, args[state_argnum])
            handle.wait_local()
            if handle.parity is not None:
                futures.wait([handle.parity])
            handle.save_call_seconds = time.perf_counter() - t0  # the calling thread's time in the save
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
