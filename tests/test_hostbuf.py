"""Restored host buffers are aligned so that a CPU device adopts them instead of copying them again."""
import jax
import numpy as np
import pytest

from jaxckpt.core import hostbuf


@pytest.mark.parametrize("shape,dtype", [((0,), np.float32), ((3, 5), np.int8), ((1 << 20,), np.float32),
                                         ((7, 9, 11), np.float64), ((4,), np.dtype("V3"))])
def test_empty_is_aligned_contiguous_and_of_the_asked_shape(shape, dtype):
    a = hostbuf.empty(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(dtype) and a.flags.c_contiguous and a.flags.writeable
    assert a.size == 0 or a.ctypes.data % hostbuf.ALIGN == 0  # an empty array has no data to align


def test_copy_is_private_and_bitwise_equal():
    src = np.arange(1000, dtype=np.float32).reshape(10, 100)
    src.view(np.uint32)[0, :2] = [0x7FC00001, 0xFFA00002]  # NaN payloads survive
    out = hostbuf.copy(src[:, ::1])
    np.testing.assert_array_equal(out.view(np.uint32), src.view(np.uint32))
    assert not np.shares_memory(out, src) and out.ctypes.data % hostbuf.ALIGN == 0


def test_a_cpu_device_adopts_an_aligned_buffer_without_copying_it():
    host = hostbuf.empty((1 << 16,), np.float32)
    host[:] = 1.5
    x = jax.device_put(host, jax.devices()[0])
    # Restore relies on this: the private copy made while verifying is the device buffer, not copied again.
    assert x.unsafe_buffer_pointer() == host.ctypes.data
    np.testing.assert_array_equal(np.asarray(x), host)
