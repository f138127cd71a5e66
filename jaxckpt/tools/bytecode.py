"""Byte-compile jaxckpt's modules once, as installing the package does, before launching many processes.

A source checkout run with ``PYTHONDONTWRITEBYTECODE`` set (this project's machines set it) has no ``.pyc``
files, so every process a benchmark or the test suite launches compiles each jaxckpt module it imports again:
about 200 ms of a relaunched trainer's ``Checkpointer()`` (bench cluster), paid by every one of the suite's
hundreds of launched processes. An installed package never pays it. The variable only stops Python *writing*
bytecode; the files written here are read by every later process.
"""
from __future__ import annotations

import os
import time
from typing import Any


def byte_compile(extra_dirs: tuple[str, ...] = ()) -> dict[str, Any]:
    """Compile the ``jaxckpt`` and ``jaxckpt.backends`` packages (and ``extra_dirs``) where they are writable;
    ``written`` False where a directory is not (the caller's figures then include that compilation), with
    whether ``PYTHONDONTWRITEBYTECODE`` is set and the seconds it took."""
    import compileall

    import jaxckpt
    import jaxckpt.backends

    t0 = time.perf_counter()
    dirs = [*jaxckpt.__path__, *jaxckpt.backends.__path__, *extra_dirs]
    ok = all(os.access(d, os.W_OK) and compileall.compile_dir(d, quiet=2) for d in dirs)
    return {"written": bool(ok), "dont_write_bytecode_env": bool(os.environ.get("PYTHONDONTWRITEBYTECODE")),
            "seconds": time.perf_counter() - t0}
