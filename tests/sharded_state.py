"""Sharded JAX states of the multi-process tests on simulated nodes: a (nodes x 2) "data" x "model" mesh, device
arrays built from host arrays by PartitionSpec, and a shard-by-shard bitwise check. Launched test processes
import this module by name (tests/ is on their path)."""
from __future__ import annotations

import numpy as np


def node_mesh(nodes: int):
    """The job's mesh: axis "data" across the simulated nodes, "model" across each process's 2 devices."""
    import jax

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return jax.sharding.Mesh(np.array(devices).reshape(nodes, 2), ("data", "model"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)


def sharding(mesh, spec: tuple):
    from jax.sharding import NamedSharding, PartitionSpec as P
    return NamedSharding(mesh, P(*spec))


def device_state(mesh, host: dict, specs: dict, step: int) -> dict:
    """``host``'s arrays on ``mesh``, each with its PartitionSpec from ``specs``, plus the step number."""
    import jax

    return {k: jax.make_array_from_callback(h.shape, sharding(mesh, specs[k]), lambda idx, h=h: h[idx])
            for k, h in host.items()} | {"step": step}


def check_bitwise(got: dict, host: dict, step: int) -> None:
    """Every local shard of every array in ``got`` equals ``host``'s bytes (NaN payloads included)."""
    for k, h in host.items():
        for shard in got[k].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data).view(np.uint8), h[shard.index].view(np.uint8),
                                          err_msg=f"{k} step {step}")
    assert got["step"] == step
