"""Issue 39, last step: tests/ mirrors the packages, a scripted `git mv`.

    python scripts/mirror_tests.py          # moves, then rewrites references; run once on a clean tree

tests/<pkg>/ holds the tests of posttrain.<pkg> (core, kernels, stages, flows, registry,
benchmarks; tests/parallel becomes tests/core/parallel), tests/support/ the helpers the tests and
the ranks they launch import (stage modules, verifiers, fixtures, fake servers, tests/configs).
Checks of the repository as a whole (architecture, namespace, security, tiers, the wheel, the
test runner) stay in tests/.

What it rewrites, in every text file of the repository:
  * `tests.<module>` (imports, and the dotted stage/verifier names the ranks import) ->
    `tests.<dir>.<module>`;
  * bare imports of a moved module (`from test_stage_parallel import ...`, `import fault_stage`)
    -> `tests.<dir>.<module>`, so that no import depends on which test directory pytest put on
    sys.path first;
  * `tests/<module>.py`, `tests/parallel/`, `tests/configs/` in paths, comments and docs;
  * in a moved file, `Path(__file__).resolve().parents[1]` / `.parent.parent` (the repository
    root) -> `parents[2]`.
  * `"tests" / "<module>.py"` and `"tests" / "configs"` in paths assembled from pieces.
What it cannot see (fixed by hand, then said in the commit): other paths assembled from pieces,
and a module name built at run time.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

PLACE = {
    "core": """test_atomic test_checkpoint test_data test_data_loader test_data_prepared test_data_properties
               test_disaggregated test_faults test_generation_cascade test_generation_engine test_kto_unpaired
               test_lean_ops test_lora test_losses test_moe test_multi_adapter test_optimizers
               test_optimizers_parallel test_packed_attention test_precision test_preference_losses test_qat
               test_recovery test_reliability test_schema_fields test_selective_checkpointing test_system_metrics
               test_tasks test_tracking test_trainer test_weight_sync""",
    "kernels": "test_kernels_dispatch test_import_rules_kernels test_without_triton",
    "stages": """test_evaluate test_grpo test_grpo_teaches test_launch test_multi_adapter_stages test_serving
                 test_serving_ep test_serving_replicas test_serving_rollout test_serving_tp test_sharded_load
                 test_slurm test_stage_parallel test_stages test_user_data""",
    "flows": """test_chaos test_config test_config_properties test_dag test_dag_flow test_demo_teaches test_deploy
                test_generate_cli test_pipeline_e2e test_registry_refs test_run_form test_ui test_ui_browser
                test_user_dag""",
    "registry": "test_adapters test_hf_errors test_model_parity test_promotion test_registry_model test_tokenizer",
    "benchmarks": " ".join(sorted(p.stem for p in TESTS.glob("test_bench_*.py"))),
    "support": """data_fixtures eval_verifiers fake_replica fault_stage grpo_verifiers hf_models pipelines probe_stage
                  tier_guard ui_browser""",
}
STAY = {"conftest", "test_architecture", "test_isolation", "test_namespace", "test_run_tests", "test_security",
        "test_tiers", "test_wheel"}
DIRS = {"parallel": "core/parallel", "configs": "support/configs"}  # folders moved whole


def plan() -> dict[str, str]:
    """module -> its new dotted folder under tests/ ("core", "core.parallel", ...)."""
    where = {m: d for d, mods in PLACE.items() for m in mods.split()}
    flat = {p.stem for p in TESTS.glob("*.py")}
    missing = flat - set(where) - STAY
    if missing:
        sys.exit(f"no place for {sorted(missing)}: add them to PLACE or STAY")
    for d, new in DIRS.items():
        where.update({p.stem: new.replace("/", ".") for p in (TESTS / d).glob("*.py")})
    return where


def git(*args: str) -> None:
    subprocess.run(["git", *args], cwd=ROOT, check=True)


def rewrite(text: str, where: dict[str, str], moved_file: bool) -> str:
    names = "|".join(sorted(map(re.escape, where), key=len, reverse=True))
    # tests.<module> (also tests.parallel.<module>) -> tests.<dir>.<module>
    text = re.sub(rf"\btests\.(?:parallel\.)?({names})\b", lambda m: f"tests.{where[m[1]]}.{m[1]}", text)
    # from tests import <module>
    text = re.sub(rf"^(\s*)from tests import ({names})$", lambda m: f"{m[1]}from tests.{where[m[2]]} import {m[2]}",
                  text, flags=re.M)
    # bare imports of a moved module
    text = re.sub(rf"^(\s*)from ({names}) import ", lambda m: f"{m[1]}from tests.{where[m[2]]}.{m[2]} import ",
                  text, flags=re.M)
    text = re.sub(rf"^(\s*)import ({names})$", lambda m: f"{m[1]}import tests.{where[m[2]]}.{m[2]} as {m[2]}",
                  text, flags=re.M)
    # paths
    text = re.sub(rf"\btests/(?:parallel/)?({names})\.py\b",
                  lambda m: f"tests/{where[m[1]].replace('.', '/')}/{m[1]}.py", text)
    for d, new in DIRS.items():
        text = re.sub(rf"\btests/{d}/", f"tests/{new}/", text)
    # paths assembled from pieces: ROOT / "tests" / "<module>.py", ROOT / "tests" / "configs"
    text = re.sub(rf'"tests" / "({names})\.py"',
                  lambda m: '"tests" / ' + " / ".join(f'"{p}"' for p in where[m[1]].split(".")) + f' / "{m[1]}.py"', text)
    for d, new in DIRS.items():
        text = text.replace(f'"tests" / "{d}"', '"tests" / ' + " / ".join(f'"{p}"' for p in new.split("/")))
    if moved_file:
        text = text.replace("Path(__file__).resolve().parents[1]", "Path(__file__).resolve().parents[2]")
        text = text.replace("Path(__file__).resolve().parent.parent", "Path(__file__).resolve().parents[2]")
    return text


def main() -> None:
    where = plan()
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    text_files = [ROOT / f for f in files if Path(f).suffix in (".py", ".md", ".toml", ".yaml", ".yml", ".cfg", ".txt",
                                                                 ".j2", ".sh", "") and (ROOT / f).is_file()]
    moved_before = {p.resolve() for d in DIRS for p in (TESTS / d).rglob("*.py")}
    # rewrite first (paths known), then move
    for f in text_files:
        if f == Path(__file__).resolve():
            continue
        try:
            old = f.read_text()
        except UnicodeDecodeError:
            continue
        moved = f.resolve().parent == TESTS and f.stem in where or f.resolve() in moved_before
        new = rewrite(old, where, moved and f.resolve() not in moved_before)
        if f.resolve() in moved_before and f.parent.name == "parallel":
            new = new.replace("Path(__file__).resolve().parents[2]", "Path(__file__).resolve().parents[3]")
        if new != old:
            f.write_text(new)
    for d, new in DIRS.items():
        (TESTS / new).parent.mkdir(parents=True, exist_ok=True)
        git("mv", f"tests/{d}", f"tests/{new}")
    for m, d in where.items():
        src = TESTS / f"{m}.py"
        if src.exists():
            (TESTS / d.replace(".", "/")).mkdir(parents=True, exist_ok=True)
            git("mv", str(src.relative_to(ROOT)), f"tests/{d.replace('.', '/')}/{m}.py")


if __name__ == "__main__":
    main()
