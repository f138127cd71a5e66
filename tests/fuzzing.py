"""Hypothesis settings and value strategies shared by the bad-input tests (``test_bad_input*.py``)."""
from __future__ import annotations

from hypothesis import HealthCheck, settings, strategies as st

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
SMALL_FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))

# Any value a msgpack map may carry, dtype and kind names among them: what a damaged or lying peer could send.
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.integers(-3, 70)
    | st.floats() | st.text(max_size=8) | st.binary(max_size=8)
    | st.sampled_from(["float32", "int16", "bfloat16", "O", "object", "finfo", "(2,)i4", "i4,f4", "U3", "V8",
                       "jax", "numpy", "prng_key", "numpy_scalar", "key", "idx", "attr", "params/w", "name",
                       "np", "count", "key<fry>", "threefry2x32"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)
