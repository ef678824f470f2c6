"""The layering rules of docs/architecture.md, enforced on the source tree.

    kernels/   imports no project package (a leaf: torch and triton only)
    core/      imports no stages, flows or registry
    stages/    imports no prefect
    flows/     imports no torch at module level, and importing the flow modules loads no torch
    no import cycles between the project's files (every import counts, lazy ones included)
    no product file over 500 lines without a reason written at its top
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "kernels", "stages", "flows", "registry", "benchmarks")
MAX_LINES = 500
REASON = "Why this file is long:"


def product_files() -> list[Path]:
    return sorted(f for p in PACKAGES for f in (ROOT / p).rglob("*.py") if "__pycache__" not in f.parts)


def module_name(path: Path) -> str:
    """The dotted name a product file installs as: core/lora/config.py is posttrain.core.lora.config."""
    parts = ["posttrain", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top(module: str) -> str:
    """The package a module belongs to: the project folder for posttrain.<folder>..., else the
    top-level name (torch, prefect)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "posttrain" and len(parts) > 1 else parts[0]


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(path: Path, module_level_only: bool = False) -> list[tuple[str, list[str], int]]:
    """(module, names imported from it, line) for every import of the file, relative imports
    resolved; `import a.b` gives ("a.b", [], line). TYPE_CHECKING blocks are skipped (never run)."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    out: list[tuple[str, list[str], int]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                continue
            if isinstance(child, ast.Import) and (top or not module_level_only):
                out.extend((a.name, [], child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and (top or not module_level_only):
                base = child.module or ""
                if child.level:
                    base_pkg = pkg.rsplit(".", child.level - 1)[0] if child.level > 1 else pkg
                    base = f"{base_pkg}.{base}" if base else base_pkg
                out.append((base, [a.name for a in child.names], child.lineno))
            visit(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, True)
    return out


def violations(package: str, forbidden: tuple[str, ...], module_level_only: bool = False) -> list[str]:
    bad = []
    for f in product_files():
        if top(module_name(f)) != package:
            continue
        for mod, _, line in imports(f, module_level_only):
            if top(mod) in forbidden:
                bad.append(f"{f.relative_to(ROOT)}:{line} imports {mod}")
    return sorted(set(bad))


def test_kernels_are_a_leaf():
    assert violations("kernels", tuple(p for p in PACKAGES if p != "kernels")) == []


def test_core_imports_no_stages_flows_or_registry():
    assert violations("core", ("stages", "flows", "registry", "benchmarks")) == []


def test_stages_import_no_prefect():
    assert violations("stages", ("prefect",)) == []


@pytest.mark.slow
def test_flows_import_no_torch_at_module_level(tmp_path):
    assert violations("flows", ("torch", "triton"), module_level_only=True) == []
    code = ("import sys, posttrain.flows.pipeline, posttrain.flows.deploy, posttrain.flows.cli, posttrain.flows.dag, posttrain.flows.ui, posttrain.flows.report, posttrain.flows.demo; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing the flow modules loaded: {out.stdout}"


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports. `from pkg import sub` with `sub` a module is an
    edge to pkg.sub (pkg's __init__ runs first, as for any submodule); a name is an edge to the
    module it comes from."""
    files = {module_name(f): f for f in product_files()}
    graph: dict[str, set[str]] = {m: set() for m in files}

    def owner(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    for m, f in files.items():
        for base, names, _ in imports(f):
            targets = [f"{base}.{n}" if f"{base}.{n}" in files else base for n in names] or [base]
            graph[m].update(t for t in map(owner, targets) if t is not None and t != m)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
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

    for v in graph:  # the recursion is as deep as the longest import chain: a few dozen
        if v not in index:
            strong(v)
    return out


def test_no_import_cycles_between_files():
    graph = import_graph()
    assert len(graph) > 50 and graph["posttrain.stages.sft"]  # the graph is real
    assert cycles(graph) == []


def test_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_long_product_file_without_a_reason():
    long = []
    for f in product_files():
        text = f.read_text()
        if text.count("\n") > MAX_LINES and REASON not in "\n".join(text.splitlines()[:40]):
            long.append(f"{f.relative_to(ROOT)}: {text.count(chr(10))} lines")
    assert long == [], f"split these, or say at the top ('{REASON} ...') why they stay whole"


@pytest.mark.parametrize("path,expected", [("core/lora/config.py", "posttrain.core.lora.config"),
                                           ("core/data/__init__.py", "posttrain.core.data")])
def test_module_names(path, expected):
    assert module_name(ROOT / path) == expected


LAZY = ("posttrain.core.model", "posttrain.core.parallel", "posttrain.core.data", "posttrain.core.lora", "posttrain.core.checkpoint", "posttrain.core.reliability")


@pytest.mark.parametrize("package", LAZY)
def test_lazy_packages_export_what_they_list(package):
    """Every name a lazily exporting package lists resolves to the object (not a same-named
    submodule), also after that submodule was imported directly."""
    import importlib
    import types

    pkg = importlib.import_module(package)
    for name in pkg.__all__:
        value = getattr(pkg, name)
        assert not isinstance(value, types.ModuleType), f"{package}.{name} is a module"


def test_lazy_exports_refuse_a_name_that_is_also_a_submodule():
    from posttrain.core.lazy import lazy_exports

    with pytest.raises(ImportError, match=r"\['apply'\] are also submodules"):
        lazy_exports("posttrain.core.parallel", {"apply": "posttrain.core.parallel.apply"})
