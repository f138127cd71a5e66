"""JAX's persistent compilation cache through ``Config.compilation_cache_dir`` and ``jaxckpt launch
--compilation-cache``: a relaunched job loads its compiled step instead of compiling it again (real processes;
JAX's own cache-hit events count the loads)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

import jaxckpt
from jaxckpt.errors import ConfigError

# One "incarnation": a Checkpointer (which turns the cache on from the config or JAXCKPT_* environment), one
# jitted step compiled and run, and the cache events JAX recorded.
PROGRAM = textwrap.dedent("""
    import json, os, sys
    import jax, jax.numpy as jnp
    import jaxckpt
    from jaxckpt.testing import init_from_env

    events = []
    jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
    if os.environ.get("JAXCKPT_LAUNCH_SPEC"):
        init_from_env()
    cfg = jaxckpt.Config(compilation_cache_dir=sys.argv[1]) if len(sys.argv) > 1 else jaxckpt.Config()
    with jaxckpt.Checkpointer(cfg) as ck:
        step = jax.jit(lambda x: jnp.tanh(x @ x.T).sum() * 3.0 + jnp.cos(x).mean())
        y = float(step(jnp.arange(64.0).reshape(8, 8) / 64))
    print(json.dumps({"hits": events.count("/jax/compilation_cache/cache_hits"),
                      "misses": events.count("/jax/compilation_cache/cache_misses"),
                      "dir": jax.config.jax_compilation_cache_dir, "y": y}))
""")


def _run(cmd: list[str], tmp_path) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("JAXCKPT_COMPILATION_CACHE_DIR", None)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln[ln.index('{"hits"'):] for ln in out.stdout.splitlines() if '{"hits"' in ln]  # launch prefixes
    assert lines, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(lines[-1])


def test_config_cache_dir_makes_a_second_process_load_the_compiled_step(tmp_path):
    prog = tmp_path / "step.py"
    prog.write_text(PROGRAM)
    cache = tmp_path / "cache"
    first = _run([sys.executable, str(prog), str(cache)], tmp_path)
    assert first["dir"] == str(cache) and first["hits"] == 0 and first["misses"] >= 1, first
    assert os.listdir(cache), "the first process wrote no compiled program"
    again = _run([sys.executable, str(prog), str(cache)], tmp_path)
    assert again["hits"] >= 1 and again["y"] == first["y"], again


def test_jaxckpt_launch_gives_every_process_the_cache(tmp_path):
    prog = tmp_path / "step.py"
    prog.write_text(PROGRAM)
    cache = tmp_path / "launch-cache"
    cmd = [sys.executable, "-m", "jaxckpt.cli", "launch", "--compilation-cache", str(cache), "--", sys.executable,
           str(prog)]
    first = _run(cmd, tmp_path)
    assert first["dir"] == str(cache) and first["hits"] == 0, first
    again = _run(cmd, tmp_path)
    assert again["hits"] >= 1 and again["y"] == first["y"], again


def test_a_cache_dir_must_be_a_string():
    with pytest.raises(ConfigError, match="compilation_cache_dir"):
        jaxckpt.Config(compilation_cache_dir=3)
