"""`make demo`: the whole pipeline on the embedded default (configs/demo.yaml), then a table of
each stage's metric before and after, the registered model and the commands to open the UIs."""

from __future__ import annotations

import time
from pathlib import Path

import posttrain.configs

# configs/, installed as package data of posttrain.configs: the wheel alone runs the demo.
DEMO_CONFIG = Path(posttrain.configs.__file__).resolve().parent / "demo.yaml"


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def main(overrides: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    from posttrain.core.config import load_config
    from posttrain.flows.config import PipelineConfig
    from posttrain.flows.pipeline import run_pipeline
    from posttrain.flows.report import stage_table

    console = Console()
    cfg = load_config(PipelineConfig, DEMO_CONFIG, overrides or [])
    t0 = time.time()
    result = run_pipeline(cfg)
    wall = time.time() - t0

    table = Table(title=f"posttrain demo — {wall:.0f} s")
    for col in ("stage", "metric", "before", "after", "cached"):
        table.add_column(col)
    for row in stage_table(result.stages):
        table.add_row(row["stage"], row["metric"], _fmt(row["before"]), _fmt(row["after"]), str(row["cached"]))
    console.print(table)
    from posttrain.flows.report import eval_results

    for name, ev in result.stages.items():
        if ev.kind != "evaluate":
            continue
        per_model = eval_results(ev)
        tasks = sorted({k.split("=", 1)[1] for m in per_model.values() for k in m if k.startswith("exact_match/task=")})
        t = Table(title=f"{name}: exact match on the held-out test split, per task")
        for col in ("model", "exact_match", *tasks, "perplexity"):
            t.add_column(col)
        for model, m in per_model.items():
            t.add_row(model, _fmt(m.get("exact_match")), *(_fmt(m.get(f"exact_match/task={k}")) for k in tasks),
                      _fmt(m.get("perplexity")))
        console.print(t)
    if result.registered:
        r = result.registered
        console.print(f"registered [bold]{r['model_name']}[/] v{r['version']} as {', '.join(r['aliases'])} "
                      f"({r['metric']} = {r['candidate_value']:.3f}; champion before: {r['champion_value']})")
    console.print(f"MLflow parent run: {result.parent_run_id}")
    console.print("Open the UIs:  .venv/bin/posttrain ui     (Prefect http://127.0.0.1:4200, "
                  "MLflow http://127.0.0.1:5000)")
    return 0 if result.ok else 1
