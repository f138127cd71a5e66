"""Test-wide set-up: 8 CPU devices for in-process JAX tests (multi-process tests start their own processes)."""
import os

os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
