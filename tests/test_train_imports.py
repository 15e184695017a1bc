"""The import graph of lctrain has no cycle, and the layers point one way.

Read from the source with `ast` (nothing is imported): every ``import lctrain...`` and ``from
lctrain... import ...``, at the top of a module or inside a function, is an edge. A package's own
``__init__`` importing its submodules, and a module reaching its own ancestor packages, are not
cycles (Python initialises a package before its submodules).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lctrain

ROOT = Path(lctrain.__file__).parent


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _target(name: str, modules: set[str]) -> str | None:
    """The lctrain module that importing ``name`` runs (a module, else its package)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """lctrain module -> the lctrain modules it imports (anywhere in its source)."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    modules = set(files)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for imported in names:
                target = _target(imported, modules)
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_lctrain_has_no_import_cycle():
    graph = import_graph()
    assert "lctrain.launch.launcher" in graph["lctrain.train.runner"]  # the graph is read
    assert cycles(graph) == []


def test_a_cycle_is_found(tmp_path):
    """The checker itself: a two-module cycle (inside a function) and a package's own re-export."""
    pkg = tmp_path / "lctrain"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("from lctrain.a.x import f\n")
    (pkg / "a" / "x.py").write_text("import lctrain.a\ndef f():\n    from lctrain.b import g\n")
    (pkg / "b.py").write_text("from lctrain.a import x\n")
    graph = import_graph(pkg)
    assert graph["lctrain.a.x"] == {"lctrain.b"}  # its own package is not an edge
    assert cycles(graph) == [["lctrain.a.x", "lctrain.b"]]


@pytest.mark.parametrize("lower, upper", [("lctrain.model", "lctrain.parallel"),
                                          ("lctrain.model", "lctrain.train"),
                                          ("lctrain.parallel", "lctrain.train"),
                                          ("lctrain.memory", "lctrain.train"),
                                          ("lctrain.data", "lctrain.parallel"),
                                          ("lctrain.data", "lctrain.train")])
def test_layers_point_one_way(lower, upper):
    """Models don't know they are parallel; nothing below the runner imports training."""
    graph = import_graph()
    for name, imports in graph.items():
        if name == lower or name.startswith(lower + "."):
            assert not any(i == upper or i.startswith(upper + ".") for i in imports), name
