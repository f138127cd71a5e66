"""JAX's persistent compilation cache, wired from ``Config.compilation_cache_dir``.

A relaunched job compiles its training step again unless XLA's executables were kept: with the cache on, the
first run writes each compiled program to the directory and the relaunch loads it (seconds of start-up on a
small model, minutes on a large one). Every program is cached, however fast it compiled or small it is: a
relaunch pays for every compile it repeats. ``jaxckpt launch --compilation-cache DIR`` sets the same for the
processes it starts (through ``JAXCKPT_COMPILATION_CACHE_DIR``, which ``Config().with_env()`` reads).
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("jaxckpt.jax.compile_cache")

__all__ = ["enable"]


def enable(directory: str) -> None:
    """Point JAX's persistent compilation cache at ``directory`` (made if missing), caching every program.

    Call before the step is first compiled; an already-set, different directory is kept (JAX reads it once)."""
    import jax

    directory = os.path.abspath(os.path.expanduser(directory))
    current = jax.config.jax_compilation_cache_dir
    if current and os.path.abspath(current) != directory:
        log.warning("JAX's compilation cache is already %s; Config.compilation_cache_dir=%s is not applied",
                    current, directory)
        return
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    log.info("JAX's persistent compilation cache: %s", directory)
