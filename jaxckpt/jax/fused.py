"""The fused way in: a jitted step that also returns its incoming state, copied to pinned host memory by XLA.

XLA schedules that device-to-host copy inside the program, overlapped with the forward and backward pass and
ordered before the donated update writes the buffers (REFT's "copy while the weights are not being written").
The host copy belongs to jaxckpt alone, so ``save()`` needs no views of live buffers and the workers read it
lazily. On CPU the copy is plain memcpy on the compute cores; BENCHMARKS.md says which way is faster where.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

HOST_KIND = "pinned_host"


def _host_sharding(x: Any) -> Any:
    if isinstance(x, jax.Array) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x.sharding.with_memory_kind(HOST_KIND)
    return None  # PRNG keys and python leaves come back as the program's (private) outputs


def _to_host(state: Any, host: Any) -> Any:
    # A device_put inside the program, not pinned_host out_shardings: XLA:CPU (jax 0.10) aliases a donated input
    # returned unchanged to that output and then rejects it ("Memory kind mismatch") on meshes with Auto axes.
    return jax.tree_util.tree_map(lambda x, s: x if s is None else jax.device_put(x, s), state, host,
                                  is_leaf=lambda v: v is None)


def wrap_step(save: Callable[[int, Any], Any], fn: Callable, *, state_argnum: int = 0,
              donate_argnums: Sequence[int] = (0,), **jit_kwargs: Any) -> Callable:
    """``fused(*args, save_step=None)``: ``fn(*args)`` jitted with ``donate_argnums``; with ``save_step=k`` the same
    program also copies ``args[state_argnum]`` to host and ``save(k, copy)`` snapshots it, exactly as
    ``ckpt.save(k, state)`` right before the call would.
    """
    plain = jax.jit(fn, donate_argnums=tuple(donate_argnums), **jit_kwargs)
    fused_by_layout: dict[Any, Callable] = {}

    def fused_for(state: Any) -> Callable:
        leaves, treedef = jax.tree_util.tree_flatten(state)
        key = (treedef, tuple((getattr(x, "sharding", None), getattr(x, "shape", None)) for x in leaves))
        f = fused_by_layout.get(key)
        if f is None:
            host = jax.tree_util.tree_map(_host_sharding, state)
            f = jax.jit(lambda *a: (fn(*a), _to_host(a[state_argnum], host)),
                        donate_argnums=tuple(donate_argnums), **jit_kwargs)
            fused_by_layout[key] = f
        return f

    def call(*args: Any, save_step: int | None = None) -> Any:
        if save_step is None:
            return plain(*args)
        state = args[state_argnum]
        out, copy = fused_for(state)(*args)
        # Python and numpy leaves come back from jit as device arrays: save the caller's own leaves for those.
        # jax.Array leaves were donated, so their copies (host, or device) are the only ones left, and ours.
        snap = jax.tree_util.tree_map(lambda orig, c: c if isinstance(orig, jax.Array) else orig, state, copy)
        save(save_step, snap)
        return out

    return call
