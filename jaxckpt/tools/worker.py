"""``python -m jaxckpt.tools.worker SPEC``: one process of a job started by ``jaxckpt.testing.launch``.

Joins the JAX job the environment describes, calls the function named in the JSON spec, and writes
``result-<process id>.json`` (``{"ok": true, "value": ...}`` or ``{"ok": false, "error": traceback}``) before
shutting JAX down, so the result survives even if the shutdown barrier never completes.
"""
from __future__ import annotations

import ctypes
import importlib
import importlib.util
import json
import logging
import os
import signal
import sys
import traceback
from typing import Any, Callable

log = logging.getLogger("jaxckpt.tools.worker")


def _die_with_parent(parent_pid: int | None) -> None:
    # A launcher killed with SIGKILL cannot reap us; the kernel then does (Linux only). Started through another
    # launcher (srun), the parent is that launcher's (slurmstepd), not the one that wrote the spec.
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(3)  # the launcher died before we got here


def _resolve(target: dict[str, Any]) -> Callable:
    if target["module"] == "__main__":
        spec = importlib.util.spec_from_file_location("__mp_main__", target["file"])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["__mp_main__"] = mod
        spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(target["module"])
    obj: Any = mod
    for part in target["qualname"].split("."):
        obj = getattr(obj, part)
    return obj


def _write(path: str, payload: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(payload)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        spec = json.load(f)
    _die_with_parent(spec["parent_pid"])
    logging.basicConfig(level=os.environ.get("JAXCKPT_LOG_LEVEL", "WARNING").upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from jaxckpt.tools.node import WORKER_PID_FILE, init_from_env, node_info

    info = node_info()
    _write(os.path.join(info.launch_dir, WORKER_PID_FILE.format(info.process_id)), str(os.getpid()))
    result = os.path.join(info.launch_dir, f"result-{info.process_id}.json")
    try:
        if spec.get("before"):
            _resolve(spec["before"])(*spec["args"])  # before JAX, as a training script's first lines
        if spec["distributed"]:
            init_from_env()  # before the target's module is imported: it may touch JAX at import time
        value = _resolve(spec["target"])(*spec["args"])
        try:
            payload = json.dumps({"ok": True, "value": value})
        except (TypeError, ValueError) as e:
            raise TypeError(f"the return value of {spec['target']['qualname']} is not JSON-serialisable: {e}") \
                from None
    except BaseException:  # noqa: BLE001 - every failure becomes the process's reported traceback
        _write(result, json.dumps({"ok": False, "error": traceback.format_exc()}))
        sys.stdout.flush()
        sys.stderr.flush()
        # No JAX shutdown: its barrier would wait for processes that may be blocked on this one.
        os._exit(1)
    _write(result, payload)
    if spec["distributed"] and info.process_count > 1:  # init_from_env starts no runtime for one process
        try:
            import jax
            jax.distributed.shutdown()
        except Exception:  # noqa: BLE001 - the result is already reported
            log.exception("jax.distributed.shutdown failed")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
