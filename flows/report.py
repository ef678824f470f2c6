"""Plots people would rather look at than read, logged to the pipeline's parent run:
loss curves of every training stage, and a chart comparing the evaluated models per metric."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("posttrain.report")


def _metric_history(client, run_id: str, key: str) -> tuple[list[int], list[float]]:
    hist = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
    return [m.step for m in hist], [m.value for m in hist]


def loss_curves(cfg, results: dict[str, Any]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=cfg.tracking.tracking_uri)
    runs = {n: r.mlflow_run_id for n, r in results.items() if r.mlflow_run_id and r.kind in ("sft", "distill", "dpo")}
    fig, axes = plt.subplots(1, max(len(runs), 1), figsize=(4.5 * max(len(runs), 1), 3.5), squeeze=False)
    for ax, (name, run_id) in zip(axes[0], runs.items()):
        for key in ("loss", "val/loss", "val/kl"):
            steps, values = _metric_history(client, run_id, key)
            if steps:
                ax.plot(steps, values, label=key, marker="." if key != "loss" else None)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    return fig


def eval_results(result) -> dict[str, dict[str, float]]:
    """{model name: metrics} of an evaluate node's result, in the order of its `models`."""
    summary = json.loads((Path(result.output_dir) / "results.json").read_text())
    per_model = summary["results"]
    return {n: per_model[n] for n in summary.get("order", per_model)}


def eval_chart(result):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_model = eval_results(result)
    metrics = [m for m in ("exact_match", "preference_accuracy", "perplexity")
               if any(m in v for v in per_model.values())]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.5), squeeze=False)
    names = [n.split("/", 1)[-1] for n in per_model]
    for ax, metric in zip(axes[0], metrics):
        ax.bar(names, [per_model[n].get(metric, float("nan")) for n in per_model])
        ax.set_title(metric)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    return fig


def stage_table(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per node: before -> after of the metric its kind is meant to move."""
    rows = []
    keys = {"sft": ("val/loss_initial", "val/loss"), "distill": ("val/kl_initial", "val/kl"),
            "dpo": ("val/accuracy_initial", "val/accuracy")}
    for name, r in results.items():
        m = r.metrics
        if r.kind in keys:
            a, b = keys[r.kind]
            rows.append({"stage": name, "metric": b, "before": m.get(a), "after": m.get(b), "cached": r.cached})
        elif r.kind == "evaluate":
            rows.append({"stage": name, "metric": "exact_match", "before": None, "after": m.get("exact_match"),
                         "cached": r.cached})
        else:
            rows.append({"stage": name, "metric": "rows/sft_train", "before": None,
                         "after": m.get("rows/sft_train"), "cached": r.cached})
    return rows


def log_reports(cfg, results: dict[str, Any], parent) -> None:
    """Best effort: a plotting problem never fails a pipeline that trained fine."""
    try:
        parent.log_dict(stage_table(results), "stage_table.json")
        parent.log_figure(loss_curves(cfg, results), "plots/loss_curves.png")
        for name, r in results.items():
            if r.kind == "evaluate":
                parent.log_figure(eval_chart(r), f"plots/eval_comparison_{name}.png")
    except Exception as e:  # noqa: BLE001
        log.warning("could not make the report plots: %s", e)
