"""The evaluation harness sits outside the library: hf_kvcompress never imports hf_kvcompress_eval (but for the
CLI's optional ``eval`` subcommand), the harness has no import cycle of its own, and its suites ship as data."""

from __future__ import annotations

import ast
import fnmatch
import sys
from pathlib import Path

import pytest
from import_graph_testutil import PACKAGE, cycles, module_graph

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from hf_kvcompress.cli import main

ROOT = PACKAGE.parent
HARNESS = ROOT / "hf_kvcompress_eval"


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_the_library_imports_the_harness_only_from_the_cli():
    importers = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
                       if "hf_kvcompress_eval" in _imported_roots(p))
    assert importers == ["hf_kvcompress/cli.py"]


def test_the_harness_has_no_import_cycle():
    graph = module_graph(HARNESS)
    assert graph["hf_kvcompress_eval.runner"]  # the walk found the harness
    assert cycles(graph) == []


def test_every_data_file_of_the_harness_is_package_data():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = patterns["hf_kvcompress_eval"]
    data = [p.relative_to(HARNESS).as_posix() for p in HARNESS.rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    assert "suites/quick.toml" in data
    assert [f for f in data if not any(fnmatch.fnmatch(f, g) for g in globs)] == []


@pytest.mark.parametrize("argv", [["eval", "--suite", "quick"], ["bench", "generate", "--smoke"]])
def test_eval_and_bench_without_the_harness_say_how_to_install_it(monkeypatch, capsys, argv):
    for name in [n for n in sys.modules if n.split(".")[0] == "hf_kvcompress_eval"] + ["hf_kvcompress_eval"]:
        monkeypatch.setitem(sys.modules, name, None)  # an import fails as if the harness were not installed
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hf_kvcompress_eval) is not installed" in err, err
