"""One namespace (issue 39): the project's folders install as posttrain.core, posttrain.kernels,
posttrain.stages, posttrain.flows, posttrain.registry, posttrain.benchmarks, posttrain.configs and
posttrain.infra (the last two for their package data), and nothing of ours is importable under a
bare top-level name that another distribution may own (Hugging Face's `kernels` is one).

  * no file of the repository imports a bare project name (`import core`, `from flows.x import y`);
  * pyproject.toml's package list is exactly the folders that hold an __init__.py, each mapped to
    posttrain.<dotted folder>;
  * in this environment `posttrain.core` is the repository's core/, the repository root is on no
    import path (tests/conftest.py), and a bare `core` or `kernels` is found nowhere, here or in
    the ranks of a launched stage;
"""

from __future__ import annotations

import ast
import importlib.machinery
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from test_security import python_files  # every .py of the repository (tests/test_security.py's walk)

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("core", "kernels", "stages", "flows", "registry", "benchmarks", "configs", "infra")


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


def _ours(origin: str | None, locations: list[str]) -> list[str]:
    """Those of a found module's origin and search locations that lie in the repository's folders."""
    return [w for w in (origin, *locations) if w and any(Path(w).resolve().is_relative_to(ROOT / f) for f in FOLDERS)]


def test_posttrain_names_resolve_to_the_folders_and_bare_names_to_nothing():
    import posttrain.core
    import posttrain.kernels

    assert Path(posttrain.core.__file__) == ROOT / "core" / "__init__.py"
    assert Path(posttrain.kernels.__file__) == ROOT / "kernels" / "__init__.py"
    # The root is on no import path (tests/conftest.py takes it off), so no folder of ours is
    # found by its bare name (tests/kernels, a folder of tests, may be; Hugging Face's `kernels`
    # where installed).
    assert [p for p in sys.path if Path(p or ".").resolve() == ROOT] == []
    for name in FOLDERS:
        spec = importlib.machinery.PathFinder.find_spec(name, sys.path)
        assert spec is None or _ours(spec.origin, spec.submodule_search_locations or []) == [], name


def test_transformers_imports_beside_us_with_hugging_faces_kernels():
    """transformers (>= 5.25 with Hugging Face's `kernels` installed) imports `kernels` as it loads
    its activations; in a process whose path held the repository root that would be our folder."""
    import transformers.activations  # noqa: F401

    kernels = sys.modules.get("kernels")
    assert kernels is None or not Path(kernels.__file__).resolve().is_relative_to(ROOT / "kernels")


@pytest.mark.slow
def test_the_ranks_import_path_holds_no_folder_of_ours(tmp_path):
    """What a rank of a launched stage sees: the launcher's environment (local_env), started in
    another directory; `kernels` and `core` resolve to nothing of ours."""
    from posttrain.stages.launch.commands import local_env
    from posttrain.stages.launch.config import LauncherConfig

    env = local_env(LauncherConfig(nproc_per_node=2), None)
    assert [p for p in env.get("PYTHONPATH", "").split(":") if p and Path(p).resolve() == ROOT] == []
    script = ("import importlib.util, json, sys; print(json.dumps({n: (s.origin, list(s.submodule_search_locations "
              "or [])) if (s := importlib.util.find_spec(n)) else None for n in sys.argv[1:]}))")
    out = subprocess.run([sys.executable, "-c", script, *FOLDERS, "posttrain.core"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, check=True)
    found = json.loads(out.stdout)
    assert found["posttrain.core"][0] == str(ROOT / "core" / "__init__.py")
    for name in FOLDERS:
        assert found[name] is None or _ours(*found[name]) == [], (name, found[name])
