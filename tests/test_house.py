"""The house rules, read from the source with `ast` (nothing is imported): lctrain's top-level
packages import each other one way (function-level imports included), lctrain reaches
lctrain_kernels only through its public modules, and the kernels depend on torch and triton
alone (numpy for the document balance, the standard library, and the optional packages of the
backends that wrap them, imported only when those backends load)."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PUBLIC = {"lctrain_kernels", "lctrain_kernels.api", "lctrain_kernels.vocabulary",
          "lctrain_kernels.distributed"}
KERNEL_DEPENDENCIES = {"torch", "triton", "numpy", "lctrain_kernels", "__future__"}
OPTIONAL_BACKENDS = {"flash_attn", "cudnn"}  # FlashAttention 4, cuDNN's frontend: lazily


def _imports(path: Path):
    """(module imported, whether at the top of the file) for every import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            yield name, id(node) in top


def _package_graph() -> dict[str, set[str]]:
    """lctrain's top-level package -> the other top-level packages it imports."""
    graph: dict[str, set[str]] = {}
    for path in (ROOT / "lctrain").rglob("*.py"):
        parts = path.relative_to(ROOT / "lctrain").with_suffix("").parts
        package = parts[0] if len(parts) > 1 else "(top)"
        edges = graph.setdefault(package, set())
        for name, _ in _imports(path):
            p = name.split(".")
            if p[0] == "lctrain" and len(p) > 1 and p[1] != package:
                edges.add(p[1])
    return graph


def _loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one package (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
                found.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_lctrain_packages_import_one_way():
    assert _loops(_package_graph()) == []


def test_the_loop_finder_finds_a_loop():
    assert _loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_lctrain_reaches_the_kernels_through_public_modules_only():
    reached = sorted(f"{path.relative_to(ROOT)}: {name}"
                     for path in (ROOT / "lctrain").rglob("*.py")
                     for name, _ in _imports(path)
                     if name.split(".")[0] == "lctrain_kernels" and name not in PUBLIC)
    assert reached == []


def test_kernels_depend_on_torch_and_triton_only():
    allowed = KERNEL_DEPENDENCIES | set(sys.stdlib_module_names)
    wrong, eager = [], []
    for path in (ROOT / "kernels").rglob("*.py"):
        for name, at_top in _imports(path):
            root = name.split(".")[0]
            if root in OPTIONAL_BACKENDS:
                if at_top:
                    eager.append(f"{path.relative_to(ROOT)}: {name}")
            elif root not in allowed:
                wrong.append(f"{path.relative_to(ROOT)}: {name}")
    assert wrong == [] and eager == []


def _defines_an_op(tree: ast.AST) -> list[str]:
    """Classes deriving from an autograd Function and uses of torch.library in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(base) for base in node.bases]
            found += [node.name for base in bases if base.endswith("autograd.Function")
                      or base == "Function"]
        elif isinstance(node, ast.Attribute) and ast.unparse(node.value) == "torch.library":
            found.append(ast.unparse(node))
    return found


def test_every_op_and_autograd_function_lives_in_the_kernels():
    found = {str(path.relative_to(ROOT)): _defines_an_op(ast.parse(path.read_text()))
             for path in (ROOT / "lctrain").rglob("*.py")}
    assert {path: names for path, names in found.items() if names} == {}
    sample = ast.parse("class F(torch.autograd.Function): pass\nx = torch.library.custom_op")
    assert _defines_an_op(sample) == ["F", "torch.library.custom_op"]
