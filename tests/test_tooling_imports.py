"""The tooling (jaxckpt/tools: bench, chaos, the launcher) imports in one direction: no two of its modules import
each other, directly or through others, at the top or inside a function. Read from the source, not by importing."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """{module: modules of the same tree it imports}, for every .py file under ``root`` (package ``package``),
    counting imports anywhere in the file, lazy and TYPE_CHECKING ones included."""
    mods = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join((package, *parts[:-1])) if parts[-1] == "__init__" else ".".join((package, *parts))
        mods[name] = path
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in mods else node.module)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_tooling_modules_import_each_other_in_no_circle():
    graph = import_graph(ROOT / "jaxckpt" / "tools", "jaxckpt.tools")
    assert "jaxckpt.tools.chaos.run" in graph and "jaxckpt.tools.bench.report" in graph, sorted(graph)
    assert cycles(graph) == []


def test_the_check_finds_a_circle_through_a_lazy_import(tmp_path):
    """Known answer: a -> b at the top, b -> c inside a function, c -> a under TYPE_CHECKING; d alone."""
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from p import b\n")
    (pkg / "b.py").write_text("def f():\n    from p.c import g\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import p.a\ndef g(): ...\n")
    (pkg / "d.py").write_text("from p import a\n")
    assert cycles(import_graph(pkg, "p")) == [["p.a", "p.b", "p.c"]]
