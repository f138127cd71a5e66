"""The benchmarks' JAX state: float32 arrays on a 2x4 mesh of 8 CPU devices with a mix of shardings, the target
that restores it and the bitwise check of a restore (``bench save``, its leaf sweep, ``restore``, ``scaling`` and
``memory`` measure on it). jax is imported inside the functions: the caller has configured 8 CPU devices first
(``setup_jax``).

With ``JAXCKPT_BENCH_DEVICES=default`` in the environment (what ``bench device`` sets for every process it
starts) the same state lives on the default backend's devices instead, an accelerator's where there is one, on
a mesh of all of them: the benchmarks then measure the accelerator's path (device-to-host copies) unchanged."""
from __future__ import annotations

import math
import os
from typing import Any

DEVICES = 8
MESH = (2, 4)
N_ARRAYS = 8
COLS = 1024
SPECS = (("data", "model"), (None, ("data", "model")), (("data", "model"), None), ("model", "data"))


ENV = "JAXCKPT_BENCH_DEVICES"


def on_default_backend() -> bool:
    """Whether this process benchmarks the default backend's devices (``bench device``) rather than 8 CPU ones."""
    return os.environ.get(ENV, "cpu8") == "default"


def setup_jax(name: str) -> Any:
    """jax, configured for benchmark ``name`` before it initialises: 8 CPU devices, or (``on_default_backend``)
    the default backend as it is; RuntimeError when there are too few devices."""
    import jax
    if not on_default_backend():
        jax.config.update("jax_num_cpu_devices", DEVICES)
        if jax.device_count() < DEVICES:
            raise RuntimeError(f"bench {name} needs {DEVICES} devices, JAX has {jax.device_count()}")
    return jax


def mesh_shape(n: int) -> tuple[int, int]:
    """The ('data', 'model') mesh of ``n`` devices: 2x4 for the 8 CPU devices, 2 x n/2 for an even count, else 1 x n."""
    return MESH if n == DEVICES else (2, n // 2) if n % 2 == 0 else (1, n)


def bench_devices() -> list[Any]:
    """The devices the state is laid out on: 8 CPU devices, or every device of the default backend."""
    import jax
    return list(jax.devices()) if on_default_backend() else list(jax.devices()[:DEVICES])


def devices_text() -> str:
    """The devices of the state as the reports name them: '8 CPU devices', '1 NVIDIA H200 devices' (jax imported)."""
    devices = bench_devices()
    kind = "CPU" if devices[0].platform == "cpu" else devices[0].device_kind
    return f"{len(devices)} {kind} device{'s' if len(devices) > 1 else ''}"


def spec_text(spec: tuple) -> str:
    """``P('data', None)``: a partition spec as the report prints it."""
    def axis(a: Any) -> str:
        return "None" if a is None else repr(a) if isinstance(a, str) else "(" + ", ".join(map(repr, a)) + ")"
    return "P(" + ", ".join(axis(a) for a in spec) + ")"


def make_state(size_bytes: int) -> dict[str, Any]:
    """About ``size_bytes`` of float32 arrays, created on device with a mix of shardings over a 2x4 mesh (or the
    default backend's mesh, ``bench_devices``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = bench_devices()
    mesh = Mesh(np.array(devices).reshape(mesh_shape(len(devices))), ("data", "model"))
    # Rows a multiple of 8 and of the device count: every spec's split is even on either mesh.
    unit = math.lcm(DEVICES, len(devices))
    rows = max(unit, size_bytes // (N_ARRAYS * 4 * COLS) // unit * unit)
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
