"""kernels/ is a leaf package: it imports torch, Triton and the standard library, never the
project's other packages (core calls kernels, never the reverse); and only its device-code
modules (kernels/jit/) import Triton, so the rest imports where Triton is not installed.

Every import statement counts, at module level or inside a function or class.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"
PROJECT_PACKAGES = {"core", "stages", "flows", "registry", "benchmarks"}
SOURCES = sorted(KERNELS.rglob("*.py"))
# The one Triton import outside kernels/jit/: the probe that asks whether Triton is installed.
TRITON_PROBE = (KERNELS / "dispatch.py", "triton_available")


class Import(NamedTuple):
    line: int
    module: str  # absolute
    function: str | None  # the innermost enclosing function, None at module or class level


def imports(path: Path, root: Path = ROOT) -> list[Import]:
    """Every import of the file; relative imports resolved against the file's own package."""
    package = ("posttrain", *path.relative_to(root).with_suffix("").parts[:-1])  # installed as posttrain.kernels
    found: list[Import] = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(child.lineno, alias.name, function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = list(package[: len(package) - child.level + 1])
                    module = ".".join(base + ([child.module] if child.module else []))
                else:
                    module = child.module
                found.append(Import(child.lineno, module, function))
            visit(child, child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function)

    visit(ast.parse(path.read_text(), filename=str(path)), None)
    return found


def _top(module: str) -> str:
    """The project folder of a posttrain.<folder>... module, else the top-level name (torch, triton)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "posttrain" and len(parts) > 1 else parts[0]


def test_sources_found():
    assert KERNELS / "dispatch.py" in SOURCES and KERNELS / "jit" / "rmsnorm.py" in SOURCES


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_kernels_import_no_project_package(path):
    bad = [f"line {i.line}: {i.module}" for i in imports(path) if _top(i.module) in PROJECT_PACKAGES]
    assert not bad, f"{path.relative_to(ROOT)} imports project packages (kernels must stay a leaf): {bad}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_only_device_code_imports_triton(path):
    if path.parent == KERNELS / "jit":
        return
    bad = [f"line {i.line}: {i.module}" for i in imports(path)
           if _top(i.module) == "triton" and (path, i.function) != TRITON_PROBE]
    assert not bad, (f"{path.relative_to(ROOT)} imports Triton; only kernels/jit/ may, so that the rest "
                     f"imports without it: {bad}")


def test_the_checker_sees_nested_and_relative_imports(tmp_path):
    (tmp_path / "kernels" / "sub").mkdir(parents=True)
    f = tmp_path / "kernels" / "sub" / "mod.py"
    f.write_text("import torch\n\nclass C:\n    def g(self):\n        from posttrain.core.losses import x\n"
                 "        from .. import _utils\n\nfrom .jit import k\n")
    assert imports(f, tmp_path) == [Import(1, "torch", None), Import(5, "posttrain.core.losses", "g"),
                                    Import(6, "posttrain.kernels", "g"),
                                    Import(8, "posttrain.kernels.sub.jit", None)]
