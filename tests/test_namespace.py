"""One namespace (issue 39): the project's folders install as posttrain.core, posttrain.kernels,
posttrain.stages, posttrain.flows, posttrain.registry and posttrain.benchmarks, and nothing of ours
is importable under a bare top-level name that another distribution may own (Hugging Face's
`kernels` is one).

  * no file of the repository imports a bare project name (`import core`, `from flows.x import y`);
  * pyproject.toml's package list is exactly the folders that hold an __init__.py, each mapped to
    posttrain.<dotted folder>;
  * in this environment `posttrain.core` is the repository's core/ and a bare `core` is found
    nowhere off the repository root.
"""

from __future__ import annotations

import ast
import importlib.machinery
import sys
import tomllib
from pathlib import Path

from test_security import python_files  # every .py of the repository (tests/test_security.py's walk)

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("core", "kernels", "stages", "flows", "registry", "benchmarks")


def bare_imports(path: Path) -> list[str]:
    """'line N: module' for each absolute import of `path` whose top-level name is a project folder."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        else:
            continue
        bad += [f"line {node.lineno}: {n}" for n in names if n.split(".")[0] in FOLDERS]
    return bad


def test_no_file_imports_a_bare_project_name():
    files = python_files()
    assert len(files) > 200 and ROOT / "tests" / "test_namespace.py" in files  # the scan is real
    bad = {str(f.relative_to(ROOT)): b for f in files if (b := bare_imports(f))}
    assert bad == {}, "import these as posttrain.<name>"


def test_the_scan_catches_each_form(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os, core.x\nfrom flows import y\nfrom . import kernels\nimport posttrain.stages\n"
                 "def g():\n    from registry.hf import z\n    import benchmarks as b\n")
    assert bare_imports(f) == ["line 1: core.x", "line 2: flows", "line 6: registry.hf", "line 7: benchmarks"]


def test_the_package_list_is_every_folder_with_an_init():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {f"posttrain.{f}": f for f in FOLDERS}
    folders = sorted("posttrain." + ".".join(p.parent.relative_to(ROOT).parts)
                     for f in FOLDERS for p in (ROOT / f).rglob("__init__.py") if "__pycache__" not in p.parts)
    assert sorted(setuptools["packages"]) == folders
    assert "posttrain.kernels.jit" in folders and "posttrain.stages.launch" in folders


def test_posttrain_names_resolve_to_the_folders_and_bare_names_to_nothing(monkeypatch):
    import posttrain.core
    import posttrain.kernels

    assert Path(posttrain.core.__file__) == ROOT / "core" / "__init__.py"
    assert Path(posttrain.kernels.__file__) == ROOT / "kernels" / "__init__.py"
    # Off the repository root, nothing on the path is one of our folders under its bare name
    # (tests/kernels, a folder of tests, may be found; and Hugging Face's `kernels` where
    # installed). On the root itself, as in this run (`python -m pytest` puts the working directory
    # first), the folders are found by their bare names: a checkout's limit, docs/architecture.md.
    elsewhere = [p for p in sys.path if p not in ("", ".") and Path(p).resolve() != ROOT]
    for name in FOLDERS:
        spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
        where = [] if spec is None else [spec.origin, *(spec.submodule_search_locations or [])]
        assert not [w for w in where if w and Path(w).resolve().is_relative_to(ROOT / name)], (name, where)
