"""The layers hold: what each part of jaxckpt imports, checked in fresh interpreters.

- every module of the numpy-only core (``jaxckpt.core``) and of ``jaxckpt.protection`` imports with
  ``jaxckpt.backends``, jax, torch and zmq blocked (a ``sys.meta_path`` finder that refuses them);
- the node agent, started as ``python -m jaxckpt.cli agent`` (through a wrapper that writes ``sys.modules`` when
  the process exits) and made to serve a trainer, a reader, a peer and a protection pull, imported no tooling
  (``jaxckpt.tools``: bench, chaos, launcher), no flax or optax, and no jax, torch or orbax;
- ``import jaxckpt`` and ``import jaxckpt.orbax``, and a save and restore through ``jaxckpt.Checkpointer``, import
  no tooling, flax or optax;
- the torch front end saves and restores a state dict bit for bit with jax, jaxlib, orbax, flax, optax and
  ml_dtypes blocked (a torch-only install: bfloat16 and float8 tensors included);
- read from the source: every folder of the library imports only the layers below it (any import, at the top,
  inside a function or under TYPE_CHECKING), none imports the tooling, and no module (the tooling's too) calls
  or imports another module's private function or method.
"""
import ast
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

from pathlib import Path

import numpy as np
import pytest

from jaxckpt.backends.agent import protocol as proto
from jaxckpt.testing import remove_agents

BASE = f"/dev/shm/jaxckpt-layers-{os.getpid()}-{uuid.uuid4().hex[:8]}"
TOOLING = ("jaxckpt.tools", "flax", "optax")

# Put first in a fresh interpreter: refuses to import the top-level packages named in BLOCKED (and below them).
BLOCKER = textwrap.dedent("""
    import sys

    class _Blocked:
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                raise ImportError(f"{name} is blocked in this test", name=name)
            return None

    sys.meta_path.insert(0, _Blocked())
""")


def _python(code: str, *, blocked: tuple[str, ...] = (), timeout: float = 240) -> dict:
    """Run ``code`` in a fresh interpreter with ``blocked`` packages refused; the JSON it prints last."""
    script = f"BLOCKED = {blocked!r}\n{BLOCKER}\n{textwrap.dedent(code)}"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                       cwd=os.path.dirname(os.path.abspath(__file__)))
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def _offending(modules, prefixes) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes))


# ------------------------------------------------------------------------------------------------ the core
def test_core_and_protection_import_with_backends_jax_torch_and_zmq_blocked():
    blocked = ("jaxckpt.backends", "jax", "jaxlib", "torch", "zmq")
    got = _python("""
        import importlib, json, pkgutil
        import jaxckpt.core, jaxckpt.protection
        names, failed = [], {}
        for pkg in (jaxckpt.core, jaxckpt.protection):
            for m in pkgutil.iter_modules(pkg.__path__):
                name = f"{pkg.__name__}.{m.name}"
                names.append(name)
                try:
                    importlib.import_module(name)
                except ImportError as e:
                    failed[name] = f"{type(e).__name__}: {e}"
        print(json.dumps({"names": names, "failed": failed, "modules": sorted(sys.modules)}))
    """, blocked=blocked)
    assert not got["failed"], got["failed"]
    # the walk found the modules that used to reach into the backends
    for name in ("jaxckpt.core.engine", "jaxckpt.core.catalog", "jaxckpt.core.capabilities",
                 "jaxckpt.protection.runtime", "jaxckpt.protection.holder", "jaxckpt.protection.slot"):
        assert name in got["names"], got["names"]
    assert _offending(got["modules"], blocked) == []


# ------------------------------------------------------------------------------------------- the node agent
@pytest.fixture
def agent_dir():
    os.makedirs(BASE, mode=0o700, exist_ok=True)
    d = os.path.join(BASE, f"layers-{uuid.uuid4().hex[:6]}")
    yield d
    left = remove_agents(BASE, also=[d])
    if os.path.isdir(BASE) and not os.listdir(BASE):
        os.rmdir(BASE)
    assert not left, f"agents did not clean up {left}"


# ``python -m jaxckpt.cli ...`` that writes every module it imported to the file named first, when it exits
# (``-X importtime`` would miss modules loaded through importlib.import_module, as the CLI loads its subcommands).
RECORD_MODULES = ("import atexit, json, runpy, sys\n"
                  "out = sys.argv.pop(1)\n"
                  "atexit.register(lambda: open(out, 'w').write(json.dumps(sorted(sys.modules))))\n"
                  "runpy.run_module('jaxckpt.cli', run_name='__main__', alter_sys=True)\n")


def _exercise_agent(d: str, job: str) -> None:
    """A trainer saves, a reader and a peer read, and the agent pulls a protection copy block: its every path."""
    from jaxckpt.config import Config
    from jaxckpt.backends.shm import ShmStore
    from jaxckpt.core import capabilities as cap
    from jaxckpt.testing.store import StoreTests, manifest_of, pattern

    store = ShmStore(Config(store="shm", job_id=job, shm_dir=d))
    try:
        suite = StoreTests()
        suite.test_agent_holders_read_committed_snapshots(store)  # node holder (Unix socket) and remote (peer)
        suite.test_protection_slots_are_apart_and_the_agent_pull_fills_one(store)  # the agent's pull
        assert store.supports(cap.NodeAgent) and store.steps() == [3, 7]
        with store.open(3) as view:
            assert bytes(view.manifest) == manifest_of(3)
            np.testing.assert_array_equal(np.frombuffer(view.buffer, np.uint8), pattern(3))
    finally:
        store.close()


def test_node_agent_imports_no_tooling_flax_optax_jax_or_torch(agent_dir, tmp_path):
    job, d = "layers", agent_dir
    record, log = tmp_path / "modules.json", tmp_path / "agent.log"
    agent = subprocess.Popen([sys.executable, "-c", RECORD_MODULES, str(record), "agent", "--job", job, "--dir", d,
                              "--log", str(log), "--node", "n0"])
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(d, "peer.addr")):  # serving trainers and peers
            assert agent.poll() is None, f"the agent exited with {agent.returncode}: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "the agent did not serve peers within 60s"
            time.sleep(0.02)
        _exercise_agent(d, job)
        assert proto.stop_agent(d, job, timeout_s=30)
        assert agent.wait(timeout=60) == 0
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGKILL)
            agent.wait()
    modules = json.loads(record.read_text())
    # what the agent did is in the record: its lazily imported pull, its peer transport
    for m in ("jaxckpt.backends.agent.daemon", "jaxckpt.backends.agent.protection_pull", "jaxckpt.backends.transport"):
        assert m in modules, sorted(x for x in modules if x.startswith("jaxckpt"))
    # ml_dtypes too: its import was most of the agent's start-up, and no name of these manifests needs it
    assert _offending(modules, TOOLING + ("jax", "jaxlib", "torch", "orbax", "ml_dtypes")) == []


def test_spawned_agent_serves_before_importing_numpy_and_never_imports_a_framework(agent_dir):
    """The agent a replacement node's first store spawns (as ``Checkpointer()`` does) serves before it imports
    numpy (it imports it next, in the background), and imports no jax, ml_dtypes or torch while it serves a
    trainer, a reader, a peer and a pull: a restore on that node waits for its start. Its ``sys.modules`` and
    its start-up cost come from the real process, through its status reply."""
    from jaxckpt.backends.shm import ShmStore
    from jaxckpt.config import Config

    job, d = "layers-spawn", agent_dir
    t0 = time.monotonic()
    store = ShmStore(Config(store="shm", job_id=job, shm_dir=d))  # no agent runs there: this spawns one
    waited = time.monotonic() - t0
    try:
        assert store.metrics["agent_spawns"] == 1
        st = proto.agent_status(d, job)
        assert st["pid"] != os.getpid() and st["trainers"] == {"0": os.getpid()}
        at_serving = st["modules_at_serving"]  # numpy comes next, imported on a thread of its own
        assert _offending(at_serving, ("numpy", "jax", "jaxlib", "ml_dtypes", "torch", "orbax") + TOOLING) == []
        assert "jaxckpt" in at_serving and "zmq" in at_serving, at_serving  # it serves trainers and peers
        assert _offending(st["modules"], ("jax", "jaxlib", "ml_dtypes", "torch", "orbax") + TOOLING) == []
        # exec -> serving as the agent measured it (its size is a benchmark's business): it started after the
        # store began to wait and served before the store returned (+ a clock tick: the kernel's start time)
        startup = st["startup"]
        assert 0 < startup["serving_s"] <= waited + 0.011 and 0 < startup["cpu_s"], (startup, waited)
    finally:
        store.close()
    _exercise_agent(d, job)
    modules = proto.agent_status(d, job)["modules"]
    assert "numpy" in modules  # manifests and the pull's XOR need it
    assert _offending(modules, ("jax", "jaxlib", "ml_dtypes", "torch", "orbax") + TOOLING) == []


# ----------------------------------------------------------------------------------- the library, Orbax
def test_import_jaxckpt_and_the_orbax_handler_and_a_jax_save_import_no_tooling():
    got = _python("""
        import json
        import jaxckpt
        after_import = sorted(sys.modules)
        import jaxckpt.orbax
        from jaxckpt.orbax import SnapshotHandler, TieredCheckpointManager
        after_orbax = sorted(sys.modules)
        import jax.numpy as jnp
        import numpy as np
        state = {"w": jnp.arange(8, dtype=jnp.float32), "n": np.int64(3)}
        with jaxckpt.Checkpointer(jaxckpt.Config(store="memory")) as ck:
            ck.save(1, state).result()
            got = ck.restore(state)
        same = bool(np.array_equal(np.asarray(got["w"]), np.arange(8, dtype=np.float32)) and got["n"] == 3)
        print(json.dumps({"import": after_import, "orbax": after_orbax, "used": sorted(sys.modules), "same": same}))
    """)
    assert got["same"]
    assert not _offending(got["import"], ("jax", "jaxlib", "torch", "orbax")), "import jaxckpt imported a front end"
    for stage in ("import", "orbax", "used"):
        assert _offending(got[stage], TOOLING) == [], stage
    assert "jaxckpt.orbax.handler" in got["orbax"] and "jaxckpt.jax.checkpointer" in got["used"]



def test_a_trainer_on_the_node_agent_without_protection_imports_only_what_it_uses(agent_dir):
    """A relaunched trainer's ``Checkpointer()`` pays for every module it imports (a replacement node's start-up):
    with ``protection="none"`` it saves and restores through its node's agent importing no protection module, none
    of the agent's own side (its slot table, its server) and no config-file parser, and reads no installed
    distribution's entry points for a built-in store."""
    got = _python(f"""
        import json
        import jax.numpy as jnp
        import numpy as np
        import jaxckpt
        from jaxckpt import registry
        state = {{"w": jnp.arange(8, dtype=jnp.float32)}}
        with jaxckpt.Checkpointer(jaxckpt.Config(store="shm", job_id="layers-lean", shm_dir={agent_dir!r})) as ck:
            ck.save(1, state).result()
            got = ck.restore(state)
            same = bool(np.array_equal(np.asarray(got["w"]), np.arange(8, dtype=np.float32)))
        print(json.dumps({{"modules": sorted(sys.modules), "same": same,
                          "entry_points": registry._entry_points_loaded}}))
    """)
    assert got["same"]
    assert "jaxckpt.backends.shm" in got["modules"]
    unused = ("jaxckpt.protection.slot", "jaxckpt.protection.plan", "jaxckpt.protection.runtime",
              "jaxckpt.backends.agent.table", "jaxckpt.backends.agent.serve", "tomllib")
    assert _offending(got["modules"], unused) == []
    assert got["entry_points"] is False

# ------------------------------------------------------------------------------------------ torch only
def test_torch_front_end_saves_and_restores_bit_for_bit_without_jax():
    torch = pytest.importorskip("torch")
    blocked = ("jax", "jaxlib", "orbax", "flax", "optax", "ml_dtypes")
    got = _python("""
        import json
        import torch
        import jaxckpt
        from jaxckpt.backends.torch import Checkpointer

        g = torch.Generator().manual_seed(7)
        def state(seed):
            t = torch.Generator().manual_seed(seed)
            return {"model": {"w": torch.randn(5, 7, generator=t), "b": torch.randn(7, generator=t).bfloat16(),
                              "q": torch.randint(0, 255, (9,), generator=t, dtype=torch.uint8)
                                   .view(torch.float8_e4m3fn),
                              "ids": torch.arange(11, dtype=torch.int64)},
                    "step": seed, "lr": 0.5}
        want = state(1)
        with Checkpointer(jaxckpt.Config(store="memory")) as ck:
            ck.save(1, want).result()
            got = ck.restore(state(2))
        def bits(t):
            return t.view(torch.uint8).tolist() if t.element_size() == 1 else t.view(torch.int16).tolist() \\
                if t.dtype == torch.bfloat16 else t.numpy().tobytes().hex()
        same = all(got["model"][k].dtype == v.dtype and bits(got["model"][k]) == bits(v)
                   for k, v in want["model"].items())
        print(json.dumps({"same": same, "values": [got["step"], got["lr"]], "modules": sorted(sys.modules)}))
    """, blocked=blocked)
    assert got["same"] and got["values"] == [1, 0.5]
    assert _offending(got["modules"], blocked) == []
    # a state without DTensors imports neither DTensor's module nor DCP's (0.7 s of a relaunch's start-up, sympy's)
    assert _offending(got["modules"], ("torch.distributed.tensor", "torch.distributed.checkpoint", "sympy")) == []


def test_ml_dtypes_stand_ins_have_the_widths_of_the_real_types():
    """Without ml_dtypes its types travel as same-width unsigned integers; the widths must be the real ones."""
    ml = pytest.importorskip("ml_dtypes")
    from jaxckpt.core.dtypes import ML_WIDTHS

    real = {n: np.dtype(getattr(ml, n)).itemsize for n in ML_WIDTHS if hasattr(ml, n)}
    assert real and real == {n: ML_WIDTHS[n] for n in real}
    from jaxckpt.torch.dtypes import DTYPE_NAMES  # every ml_dtypes name torch uses has a stand-in
    assert {n for n in DTYPE_NAMES.values() if not hasattr(np, n)} <= set(ML_WIDTHS)


# --------------------------------------------------------------------------------------- from the source
ROOT = Path(__file__).resolve().parent.parent
# Each unit of the library (a folder, or a module at the top of the package) and its layer: a unit imports only
# units of a lower layer, so two units of one layer never import each other. A new folder must be placed here.
LAYERS = {
    "jaxckpt.errors": 0,
    "jaxckpt.registry": 1,  # stores and parts by name (Config checks its names against it)
    "jaxckpt.config": 2,
    "jaxckpt.node_identity": 3,  # what a node is (Config.node_name, the scheduler's variables)
    "jaxckpt.core": 4,
    "jaxckpt.protection": 5, "jaxckpt.persistent": 5,  # parts of the core's protocols (core/protect.py, Tier)
    "jaxckpt.backends.agent": 6,  # the node agent (builds protection blocks)
    "jaxckpt.backends": 7,  # the stores (shm starts and talks to the agent) and the peer transport
    "jaxckpt.frontend": 8,  # the front-end protocol and the shared Checkpointer face
    "jaxckpt.early_agent": 8,  # jaxckpt.start_agent(): the node agent started before the framework
    "jaxckpt.jax": 9, "jaxckpt.torch": 9,  # the front ends
    "jaxckpt.orbax": 10,  # Orbax's handler and tiered manager, on the JAX front end
    "jaxckpt.backends.torch": 10,  # the torch front end's earlier public name (a re-export)
    "jaxckpt": 11,  # the package's own __init__: the public face
    "jaxckpt.cli": 12,
}
TOOLING_UNITS = {"jaxckpt.tools", "jaxckpt.testing"}  # may import anything (and each other); the library never them


def _modules() -> dict[str, Path]:
    """Every module of the installed package ``jaxckpt`` by name (``jaxckpt.backends`` lives in backends/)."""
    out = {}
    for base, pkg in ((ROOT / "jaxckpt", "jaxckpt"), (ROOT / "backends", "jaxckpt.backends")):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([pkg] + parts)] = path
    return out


def _unit(module: str, modules: dict[str, Path]) -> str | None:
    """The layer unit ``module`` belongs to: the deepest one named in LAYERS or TOOLING_UNITS that holds it."""
    best = None
    for u in list(LAYERS) + list(TOOLING_UNITS):
        if (module == u or module.startswith(u + ".")) and (best is None or len(u) > len(best)):
            best = u
    if best == "jaxckpt" and module != "jaxckpt":  # a module at the package's top is its own unit
        return None
    return best


def _imports(tree: ast.AST, module: str, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """Every jaxckpt module ``tree`` imports anywhere in it (``from jaxckpt import Config`` is the package)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "jaxckpt"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                pkg = module.split(".")[:len(module.split(".")) - node.level + (1 if modules[module].name ==
                                                                                 "__init__.py" else 0)]
                base = ".".join(pkg + ([base] if base else []))
            if base.split(".")[0] != "jaxckpt":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((node.lineno, sub if sub in modules else base))
    return out


def test_every_folder_imports_only_the_layers_below_it_and_never_the_tooling():
    modules = _modules()
    unplaced = sorted({m for m in modules if _unit(m, modules) is None and m.count(".") == 1
                       and modules[m].name == "__init__.py"})
    assert unplaced == [], f"folders with no layer in LAYERS (place them): {unplaced}"
    bad = []
    for module, path in sorted(modules.items()):
        src = _unit(module, modules) or module  # a top-level module (config, errors, registry) is its own unit
        for line, target in _imports(ast.parse(path.read_text()), module, modules):
            dst = _unit(target, modules) or target
            if dst == src or (src in TOOLING_UNITS and dst in TOOLING_UNITS):
                continue
            where = f"{path.relative_to(ROOT)}:{line}: {module} imports {target}"
            if src in TOOLING_UNITS:
                continue
            if dst in TOOLING_UNITS:
                bad.append(f"{where} (tooling)")
            elif src not in LAYERS or dst not in LAYERS:
                bad.append(f"{where} (a unit with no layer: {src if src not in LAYERS else dst})")
            elif LAYERS[dst] >= LAYERS[src]:
                bad.append(f"{where} ({src}, layer {LAYERS[src]}, may not import {dst}, layer {LAYERS[dst]})")
    assert bad == [], "\n".join(bad)


def test_the_layer_check_sees_an_upward_import_a_lazy_one_and_a_relative_one():
    """The check itself: what a violation looks like to it (so that the test above cannot pass by seeing nothing)."""
    modules = _modules()
    lazy = ast.parse("def f():\n    from jaxckpt.protection.runtime import Protector\n")
    assert _imports(lazy, "jaxckpt.core.engine", modules) == [(2, "jaxckpt.protection.runtime")]
    assert _unit("jaxckpt.protection.runtime", modules) == "jaxckpt.protection"
    assert LAYERS[_unit("jaxckpt.protection.runtime", modules)] > LAYERS[_unit("jaxckpt.core.engine", modules)]
    rel = ast.parse("from .handler import SnapshotHandler\nfrom jaxckpt import Config\n")
    assert _imports(rel, "jaxckpt.orbax.tiered", modules) == [(1, "jaxckpt.orbax.handler"), (2, "jaxckpt")]
    assert _unit("jaxckpt.backends.agent.daemon", modules) == "jaxckpt.backends.agent"
    assert _unit("jaxckpt.backends.shm", modules) == "jaxckpt.backends"
    assert _unit("jaxckpt.config", modules) == "jaxckpt.config"  # a top-level module is its own unit


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own(owner: ast.AST) -> bool:
    """``self``, ``cls`` or ``super()``: the object's own class reaching its own (or a base's) private names."""
    return (isinstance(owner, ast.Name) and owner.id in ("self", "cls")) or \
        (isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super")


def _private_uses(tree: ast.AST, defined_here: set[str], private_defs: dict[str, set[str]], module: str
                  ) -> list[tuple[int, str]]:
    """Every ``x._name`` (read, written or called; x not self/cls/super()) and import of ``_name`` from jaxckpt,
    where ``_name`` is a private function, method or attribute another module of jaxckpt defines and this one does
    not: a library object's insides reached from outside its module."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if (_is_private(node.attr) and node.attr not in defined_here and private_defs.get(node.attr, set()) -
                    {module} and not _own(node.value)):
                out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxckpt"):
            out += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names if _is_private(a.name)]
    return sorted(out)


def _private_defs(trees: dict[str, ast.AST]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Per private name, the modules defining it; per module, the private names it defines: functions, methods,
    classes, attributes it assigns on ``self``/``cls``, names it assigns in a class body."""
    defs: dict[str, set[str]] = {}
    names: dict[str, set[str]] = {}
    for module, tree in trees.items():
        here = names.setdefault(module, set())
        for node in ast.walk(tree):
            found: list[str] = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.append(node.name)
                if isinstance(node, ast.ClassDef):  # class attributes and dataclass fields
                    for stmt in node.body:
                        targets = stmt.targets if isinstance(stmt, ast.Assign) else \
                            [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
                        found += [t.id for t in targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _own(node.value):
                found.append(node.attr)
            for name in found:
                if _is_private(name):
                    defs.setdefault(name, set()).add(module)
                    here.add(name)
    return defs, names


def test_no_module_reaches_into_another_module_s_private_names():
    modules = _modules()
    trees = {m: ast.parse(p.read_text()) for m, p in modules.items()}
    defs, names = _private_defs(trees)
    bad = [f"{modules[m].relative_to(ROOT)}:{line}: {what}" for m in sorted(trees)  # the tooling too
           for line, what in _private_uses(trees[m], names[m], defs, m)]
    assert bad == [], "\n".join(bad)


def test_the_private_check_sees_a_call_a_read_and_an_import_but_not_an_object_s_own_names():
    """The check itself, on the forms it must see (so that the test above cannot pass by seeing nothing)."""
    modules = _modules()
    trees = {m: ast.parse(p.read_text()) for m, p in modules.items()}
    defs, _ = _private_defs(trees)
    assert "jaxckpt.protection.runtime" in defs["_plans"]  # an attribute assigned on self is a definition
    probe = ast.parse("from jaxckpt.core.dtypes import _ML_WIDTHS\n"
                      "def f(ck, prot):\n"
                      "    ck._restore_step(None)\n"  # the Orbax handler calling Checkpointer's, as it once did
                      "    plan = prot._plans\n"  # the cluster bench reading the Protector's plans, as it once did
                      "    self._plans = super()._plans\n")
    assert _private_uses(probe, set(), {**defs, "_restore_step": {"jaxckpt.core.restore"}},
                         "jaxckpt.tools.bench.cluster_phases") == \
        [(1, "from jaxckpt.core.dtypes import _ML_WIDTHS"), (3, "ck._restore_step"), (4, "prot._plans")]
