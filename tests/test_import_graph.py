"""The package's modules import each other without cycles: every import counts, those inside functions too (a
function-level import that dodges a cycle is still one), and so do those in ``if TYPE_CHECKING:`` blocks (a
cycle only type checkers see is still one a reader must hold in their head: a protocol breaks it); and nothing
outside the package (tests, experiments, the harness) imports a private name of it."""

from __future__ import annotations

import ast
from pathlib import Path

from import_graph_testutil import PACKAGE, cycles, module_graph


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


def private_imports(folders: list[Path]) -> list[str]:
    """``file:line name`` for every import of a private name (or module) of the package in ``folders``."""
    found = []
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == PACKAGE.name:
                    names = node.module.split(".") + [alias.name for alias in node.names]
                elif isinstance(node, ast.Import):
                    names = [p for alias in node.names if alias.name.split(".")[0] == PACKAGE.name
                             for p in alias.name.split(".")]
                else:
                    continue
                found += [f"{path.name}:{node.lineno} {n}" for n in names if n.startswith("_") and not n.startswith("__")]
    return found


def test_nothing_outside_the_package_imports_its_private_names(tmp_path):
    root = PACKAGE.parent
    assert private_imports([root / "tests", root / "experiments", root / "hf_kvcompress_eval"]) == []
    (tmp_path / "reach.py").write_text(f"from {PACKAGE.name}.cache.persist import _load, save_cache\n"
                                       f"import {PACKAGE.name}.codec._hidden\n")
    assert private_imports([tmp_path]) == ["reach.py:1 _load", "reach.py:2 _hidden"]
