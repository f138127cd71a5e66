"""A restored array made from host pieces (``jaxckpt.jax.shards.make_array``, what every restore ends in): each
device holds the piece of its index, in memory of its own, whichever way JAX is asked to place the pieces (one
``make_array_from_callback`` for a sharded array, a batched ``device_put`` and an assembly for a replicated one or
another memory kind), and no later write to the host pieces or donation of one device's buffer reaches another."""
import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxckpt.jax import shards

SPECS = {"sharded": P("data", "model"), "split-over-model": P(None, "model"), "split-over-data": P("data", None),
         "replicated": P()}


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))


def _host_pieces(full: np.ndarray, sharding) -> dict:
    return {box: np.array(full[box.slices()]) for box in shards.needed_boxes(full.shape, sharding)}


@pytest.mark.parametrize("private", [True, False], ids=["private-pieces", "borrowed-pieces"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("layout", list(SPECS))
def test_each_device_holds_its_own_piece(layout, dtype, private):
    sharding = NamedSharding(_mesh(), SPECS[layout])
    full = (np.arange(16 * 12) * 0.5 - 7).astype(dtype).reshape(16, 12)
    pieces = _host_pieces(full, sharding)
    out = shards.make_array(full.shape, np.dtype(dtype), sharding, pieces, private=private)
    assert out.sharding == sharding and out.dtype == np.dtype(dtype) and out.shape == full.shape
    on = {s.device.id: s for s in out.addressable_shards}
    assert sorted(on) == sorted(d.id for d in sharding.addressable_devices)
    for s in on.values():  # the piece of its own index, bit for bit
        assert np.asarray(s.data).view(np.uint8).tobytes() == full[s.index].view(np.uint8).tobytes(), s.device
    pointers = [s.data.unsafe_buffer_pointer() for s in on.values()]
    assert len(set(pointers)) == len(pointers), "two devices share one buffer"
    if not private:  # the caller's pieces are theirs to reuse: the array has copies
        for h in pieces.values():
            h[...] = 0
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), full.view(np.uint8))
    # a donating program on one device's piece leaves the other devices' pieces as they were
    first = next(iter(on.values())).data
    jax.block_until_ready(jax.jit(lambda x: x * 0, donate_argnums=0)(first))
    for s in list(on.values())[1:]:
        assert np.asarray(s.data).view(np.uint8).tobytes() == full[s.index].view(np.uint8).tobytes(), s.device
