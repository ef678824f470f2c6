"""Every field of every config schema is read by some product code: a setting that nothing reads
does nothing, whatever its description (and the Prefect form) promises.

The check is textual, so it proves presence, not correctness: a field counts as read when product
code (or an infra/ launch template) outside the schema's own field declarations and validators
names it as an attribute (`.field`) or a key (`"field"`). The settings that once did nothing have behaviour tests beside
their stages (tests/stages/test_stages.py: kernels, backend, DPO's reference copy, evaluation's layout
and sampling seeds; tests/core/test_data_loader.py: packing and micro_batch_size).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from posttrain.core.config import ConfigModel

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "kernels", "stages", "flows", "registry", "benchmarks")
SCHEMA_MODULES = ("posttrain.core.model.config", "posttrain.core.lora.config", "posttrain.core.parallel.config", "posttrain.core.optim",
                  "posttrain.core.data.config", "posttrain.core.checkpoint.config", "posttrain.core.reliability.config", "posttrain.core.tracking.config",
                  "posttrain.stages.launch.config", "posttrain.stages.config", "posttrain.flows.config", "posttrain.registry.mlflow_registry")


def schemas() -> list[type[ConfigModel]]:
    for m in SCHEMA_MODULES:
        importlib.import_module(m)
    seen, todo = [], list(ConfigModel.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls not in seen and cls.__module__.startswith("posttrain."):
            seen.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(seen, key=lambda c: c.__qualname__)


def _declarations(path: Path) -> set[int]:
    """Lines of the file that declare schema fields or validate them (not reads)."""
    tree = ast.parse(path.read_text())
    lines: set[int] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for stmt in cls.body:
            validator = isinstance(stmt, ast.FunctionDef) and any(
                "validator" in ast.unparse(d) for d in stmt.decorator_list)
            if isinstance(stmt, ast.AnnAssign) or validator:
                lines.update(range(stmt.lineno, stmt.end_lineno + 1))
    return lines


def product_text() -> str:
    chunks = []
    for f in sorted(f for p in PACKAGES for f in (ROOT / p).rglob("*.py")):
        skip = _declarations(f)
        chunks.extend(line for i, line in enumerate(f.read_text().splitlines(), 1) if i not in skip)
    chunks.extend(f.read_text() for f in sorted((ROOT / "infra").rglob("*.j2")))  # the launch templates
    return "\n".join(chunks)


def unread_fields(text: str, classes: list[type[ConfigModel]] | None = None) -> list[str]:
    out = []
    for cls in schemas() if classes is None else classes:
        for name in cls.model_fields:
            if not re.search(rf"\.{name}\b|[\"']{name}[\"']", text):
                out.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
    return out


def test_every_schema_field_is_read_somewhere():
    assert len(schemas()) >= 15  # the walk found the schemas
    assert unread_fields(product_text()) == []


def test_the_check_finds_an_unread_field():
    class Probe(ConfigModel):
        never_read_anywhere_xyz: int = 0
        max_steps: int = 1  # read by the training stages

    assert unread_fields(product_text(), [Probe]) == [f"{__name__}.{Probe.__qualname__}.never_read_anywhere_xyz"]


@pytest.mark.parametrize("module", SCHEMA_MODULES)
@pytest.mark.slow
def test_schema_modules_are_torch_free(module, tmp_path):
    """The flow process loads every schema; none may pull torch in."""
    import subprocess
    import sys

    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", f"importing {module} loads torch"
