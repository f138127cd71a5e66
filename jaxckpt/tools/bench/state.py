"""The benchmarks' JAX state: float32 arrays on a 2x4 mesh of 8 CPU devices with a mix of shardings, the target
that restores it and the bitwise check of a restore (``bench save``, its leaf sweep, ``restore``, ``scaling`` and
``memory`` measure on it). jax is imported inside the functions: the caller has configured 8 CPU devices first."""
from __future__ import annotations

from typing import Any

DEVICES = 8
MESH = (2, 4)
N_ARRAYS = 8
COLS = 1024
SPECS = (("data", "model"), (None, ("data", "model")), (("data", "model"), None), ("model", "data"))


def spec_text(spec: tuple) -> str:
    """``P('data', None)``: a partition spec as the report prints it."""
    def axis(a: Any) -> str:
        return "None" if a is None else repr(a) if isinstance(a, str) else "(" + ", ".join(map(repr, a)) + ")"
    return "P(" + ", ".join(axis(a) for a in spec) + ")"


def make_state(size_bytes: int) -> dict[str, Any]:
    """About ``size_bytes`` of float32 arrays, created on device with a mix of shardings over a 2x4 mesh."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:DEVICES]).reshape(MESH), ("data", "model"))
    rows = max(DEVICES, size_bytes // (N_ARRAYS * 4 * COLS) // DEVICES * DEVICES)
    state = {}
    for i in range(N_ARRAYS):
        sharding = NamedSharding(mesh, P(*SPECS[i % len(SPECS)]))
        make = jax.jit(lambda off: jax.lax.broadcasted_iota(jnp.float32, (rows, COLS), 0) * 1e-3
                       + jax.lax.broadcasted_iota(jnp.float32, (rows, COLS), 1) + off, out_shardings=sharding)
        state[f"layer{i}/w"] = make(jnp.float32(i))
    jax.block_until_ready(state)
    return state


def restore_target(state: dict[str, Any]) -> dict[str, Any]:
    """The abstract target that restores ``state``'s arrays on their own shardings."""
    import jax
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}


def check_equal(what: str, out: dict[str, Any], state: dict[str, Any]) -> None:
    """AssertionError naming ``what`` and the array unless ``out`` is ``state`` bit for bit, on its shardings."""
    import numpy as np
    for k, v in state.items():
        if out[k].sharding != v.sharding:
            raise AssertionError(f"{what}: {k} restored with sharding {out[k].sharding}, saved {v.sharding}")
        if not np.array_equal(np.asarray(out[k]).view(np.uint8), np.asarray(v).view(np.uint8)):
            raise AssertionError(f"{what}: {k} restored differs from the saved array")
