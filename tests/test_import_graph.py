"""The package's modules import each other without cycles: every import counts, those inside functions too (a
function-level import that dodges a cycle is still one), and so do those in ``if TYPE_CHECKING:`` blocks (a
cycle only type checkers see is still one a reader must hold in their head: a protocol breaks it)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hf_kvcompress"


def module_graph(root: Path) -> dict[str, set[str]]:
    """``module -> modules of the same package it imports`` for the package in folder ``root``."""
    modules: dict[str, Path] = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text())):
            for target in _targets(node, package):
                # ``from p import x``: the submodule p.x when there is one, else module p (that defines x)
                found = target if target in modules else target.rpartition(".")[0]
                if found in modules and found != name:
                    graph[name].add(found)
    return graph


def _imports(tree: ast.AST):
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _targets(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parent = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parent + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" for alias in node.names]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
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


def test_the_package_has_no_import_cycle():
    graph = module_graph(PACKAGE)
    assert len(graph) > 50 and graph["hf_kvcompress.cache.cache"]  # the walk found the package
    assert cycles(graph) == []


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """`module_graph` with each subpackage's modules merged into one node (``hf_kvcompress.codec.lanes`` ->
    ``hf_kvcompress.codec``; top-level modules stay themselves): folders must not import each other in a loop
    either, since importing any module of a package runs its ``__init__``."""
    root = min(graph, key=len)

    def node(name: str) -> str:
        parts = name.split(".")
        return ".".join(parts[:2]) if len(parts) > 2 or name == root else name

    merged: dict[str, set[str]] = {}
    for name, targets in graph.items():
        merged.setdefault(node(name), set()).update(node(t) for t in targets)
    for name, targets in merged.items():
        targets.discard(name)
    return merged


def test_the_package_folders_import_each_other_without_cycles():
    packages = package_graph(module_graph(PACKAGE))
    assert {"hf_kvcompress.codec", "hf_kvcompress.cache", "hf_kvcompress.lossy"} <= set(packages)
    # the root package re-exports the public API, so it imports everything and nothing imports it back
    assert cycles(packages) == []


def test_the_check_finds_cycles_hidden_in_a_function_or_under_type_checking(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub.b import thing\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import x\n"
        "def thing():\n    from .. import a\n    return a\n")
    (package / "c.py").write_text("from .sub import b\n")
    # the function-level import closes a -> b -> a, the TYPE_CHECKING one b -> c -> b (one component)
    assert cycles(module_graph(package)) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_the_folder_check_finds_a_cycle_between_two_folders(tmp_path):
    package = tmp_path / "pkg"
    for sub in ("one", "two"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "one" / "a.py").write_text("from ..two.b import y\n")
    (package / "two" / "b.py").write_text("y = 1\n")
    (package / "two" / "c.py").write_text("def f():\n    from ..one import a\n    return a\n")
    graph = module_graph(package)
    assert cycles(graph) == []  # no module cycle: a -> b, c -> a
    assert cycles(package_graph(graph)) == [["pkg.one", "pkg.two"]]
