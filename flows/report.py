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


# One panel per metric family, one series per node (posttrain.stages.recipe: the run metric names).
CURVES = [("training objective", ("train/sft_loss", "train/kd_loss", "train/dpo_loss")),
          ("val/loss", ("val/loss",)), ("val/kl", ("val/kl",)),
          ("val/accuracy (DPO)", ("val/accuracy",)), ("val/margin (DPO)", ("val/margin",))]


def loss_curves(cfg, results: dict[str, Any]):
    """The training nodes' curves: a panel per family, each node a series, every point drawn
    (a short run is a few points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=cfg.tracking.tracking_uri)
    runs = {n: r.mlflow_run_id for n, r in results.items() if r.mlflow_run_id and r.kind in ("sft", "distill", "dpo", "grpo")}
    panels = []
    for title, keys in CURVES:
        series = [(f"{name} ({key})" if len(keys) > 1 else name, *_metric_history(client, run_id, key))
                  for name, run_id in runs.items() for key in keys]
        series = [s for s in series if s[1]]
        if series:
            panels.append((title, series))
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(4.5 * max(len(panels), 1), 3.5), squeeze=False)
    for ax, (title, series) in zip(axes[0], panels):
        for label, steps, values in series:
            ax.plot(steps, values, label=label, marker="o", markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
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
            "dpo": ("val/accuracy_initial", "val/accuracy"), "grpo": ("val/reward_initial", "val/reward")}
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


def mlflow_link(tracking_uri: str, experiment_id: str | None, run_id: str | None, text: str | None = None) -> str:
    """A markdown link to an MLflow run in the UI when the tracking URI is a server, else its id."""
    if not run_id:
        return "-"
    label = text or run_id[:12]
    if experiment_id and tracking_uri.startswith(("http://", "https://")):
        return f"[{label}]({tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{ML_VIEW})"
    return f"`{run_id}`"

# MLflow 3.17's UI picks an experiment's views from its sidebar switch (default: GenAI, traces and
# evaluation runs), not from the experiment's mlflow.experimentKind tag; this query parameter opens
# the model-training views (the runs table, a run's metrics) whatever the switch says.
ML_VIEW = "workflowType=machine_learning"


def experiment_link(tracking_uri: str, experiment_id: str | None, text: str) -> str:
    """A markdown link to the experiment's runs table when the tracking URI is a server."""
    if experiment_id and tracking_uri.startswith(("http://", "https://")):
        return f"[{text}]({tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs?{ML_VIEW})"
    return text


def run_summary_markdown(cfg, order: list[str], results: dict[str, Any], parent,
                         registered: dict[str, Any] | None) -> str:
    """What a Prefect flow run's artifact shows: every node (cached or not, its key metric, its
    wall time, its MLflow run), the pipeline's MLflow parent run and the registry decision."""
    uri, exp = cfg.tracking.tracking_uri, getattr(parent, "experiment_id", None)
    table = {row["stage"]: row for row in stage_table(results)}
    lines = [f"# {cfg.name}", "",
             f"MLflow parent run: {mlflow_link(uri, exp, getattr(parent, 'run_id', None))} ({uri}), in experiment "
             f"{experiment_link(uri, exp, cfg.tracking.experiment)}", "",
             "| node | kind | status | metric | before | after | duration | MLflow run |",
             "|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    for name in order:
        r = results.get(name)
        if r is None:
            lines.append(f"| {name} | | not run | | | | | |")
            continue
        row = table.get(name, {})
        status = "cached" if r.cached else "ran"
        took = "cached" if r.cached or r.seconds is None else f"{r.seconds:.1f} s"
        run = mlflow_link(uri, exp, r.mlflow_run_id)
        if r.cached and getattr(r, "cached_run_id", None):  # this run's cached child, and the run it reused
            run = f"{mlflow_link(uri, exp, r.cached_run_id, 'cached')}, from {mlflow_link(uri, exp, r.mlflow_run_id)}"
        lines.append(f"| {name} | {r.kind} | {status} | {row.get('metric', '')} | {fmt(row.get('before'))} | "
                     f"{fmt(row.get('after'))} | {took} | {run} |")
    if registered:
        version = f"{registered['model_name']} v{registered['version']}"
        if uri.startswith(("http://", "https://")):
            version = f"[{version}]({uri.rstrip('/')}/#/models/{registered['model_name']}/versions/" \
                      f"{registered['version']})"
        lines += ["", f"Registered {version} from `{registered['model']}` "
                      f"({registered['metric']}): {'promoted to champion' if registered['promoted'] else 'candidate'} "
                      f"({registered.get('reason', '')})"]
    return "\n".join(lines) + "\n"


def publish_run_artifact(cfg, order: list[str], results: dict[str, Any], parent,
                         registered: dict[str, Any] | None) -> None:
    """The run summary as a Prefect markdown artifact of this flow run (best effort)."""
    import re

    try:
        from prefect.artifacts import create_markdown_artifact

        key = re.sub(r"[^a-z0-9-]+", "-", cfg.name.lower()).strip("-") or "pipeline"
        create_markdown_artifact(markdown=run_summary_markdown(cfg, order, results, parent, registered),
                                 key=f"{key}-summary", description=f"posttrain pipeline {cfg.name}: every node")
    except Exception as e:  # noqa: BLE001
        log.warning("could not publish the Prefect run artifact: %s", e)
