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
    runs = {n: r.mlflow_run_id for n, r in results.items() if r.mlflow_run_id and n not in ("data_prep", "evaluate")}
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


def eval_chart(results: dict[str, Any]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev = results["evaluate"]
    per_model = json.loads((Path(ev.output_dir) / "results.json").read_text())["results"]
    metrics = ["exact_match", "perplexity"]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.5), squeeze=False)
    names = [n.split("/", 1)[-1] for n in per_model]
    for ax, metric in zip(axes[0], metrics):
        ax.bar(names, [per_model[n].get(metric, float("nan")) for n in per_model])
        ax.set_title(metric)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    return fig


def stage_table(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per stage: before -> after of the metric it is meant to move."""
    rows = []
    keys = {"sft_teacher": ("val/loss_initial", "val/loss"), "sft_student": ("val/loss_initial", "val/loss"),
            "distill": ("val/kl_initial", "val/kl"), "dpo": ("val/accuracy_initial", "val/accuracy")}
    for name, r in results.items():
        m = r.metrics
        if name in keys:
            a, b = keys[name]
            rows.append({"stage": name, "metric": b, "before": m.get(a), "after": m.get(b), "cached": r.cached})
        elif name == "evaluate":
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
        if "evaluate" in results:
            parent.log_figure(eval_chart(results), "plots/eval_comparison.png")
    except Exception as e:  # noqa: BLE001
        log.warning("could not make the report plots: %s", e)
