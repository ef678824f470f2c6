"""What the evaluation writes (rank 0): results.json, samples.json, the manifest, and MLflow.

    results.json   {"models": {name: path as given}, "results": {name: {metric: value}},
                    "counts": {...}, "metrics": [families computed], "selected": {...} (with select)}
    samples.json   one entry per model x prompt x sample: model, index, sample, prompt, reference,
                   completion, score (the verifier's, else exact match; None without either), group,
                   and each per-sample metric (exact_match, normalized_match, reward, judge)
    manifest.json  outputs results / samples; `metrics`: models[0]'s metrics unprefixed plus
                   `models/<name>/<key>` for every other model; `results` {name: metrics}; `models`
                   {name: path}; `selected` {"model": the path exactly as in cfg.models, "name",
                   "metric", "mode", "value"} when `select` is set; mlflow_run_id and
                   mlflow_model_runs {name: run id}

MLflow: the stage run gets the manifest's metrics, results.json and samples.json as artifacts, a
comparison table (MlflowClient.log_table, `comparison_table.json`: one row per model, a column per
metric) and a samples table (`samples_table.json`); under it one nested run per model
(tags mlflow.parentRunId, posttrain.eval_model=<name>, posttrain.eval_index=<i>) with that model's
metrics (the same keys for every model; MLflow turns '@' and '=' into '_') and its own samples
table, so the models compare side by side in MLflow's run table. A table that cannot be logged is a
warning: tracking never fails an evaluation that has computed its results.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from posttrain.core.manifest import write_manifest
from posttrain.core.tracking import Tracker
from posttrain.stages.common import dump_json
from posttrain.stages.config import EvalConfig

log = logging.getLogger("posttrain.evaluate")

TABLE = "samples_table.json"
COMPARISON = "comparison_table.json"  # one row per evaluated model
COLUMNS = ("model", "index", "sample", "group", "prompt", "reference", "completion", "score")


def table_of(samples: list[dict[str, Any]]) -> dict[str, list]:
    """Samples as MLflow table columns; non-string references (unit tests, lists) as JSON text."""
    extra = sorted({k for s in samples for k in s} - set(COLUMNS))
    cols: dict[str, list] = {c: [] for c in (*COLUMNS, *extra)}
    for s in samples:
        for c in cols:
            v = s.get(c)
            cols[c].append(v if v is None or isinstance(v, (str, int, float, bool)) else json.dumps(v, default=str))
    return cols


def mlflow_table(tracker: Any, data: dict[str, list], artifact_file: str, what: str, client: Any = None) -> None:
    """`data` (columns) as an MLflow table of the tracker's run (`client`: an MlflowClient to reuse).
    Tracking never fails an evaluation that has its results: a table not logged is a warning."""
    if not tracker.run_id:
        return
    try:
        from mlflow import MlflowClient

        tracker.flush(timeout=60)
        client = client or MlflowClient(tracker.tracking_uri)
        client.log_table(tracker.run_id, data=data, artifact_file=artifact_file)
    except Exception as e:  # noqa: BLE001 - an outage, or a value pandas cannot hold (the JSON files have it)
        log.warning("evaluate: %s table not logged to MLflow run %s: %s: %s", what, tracker.run_id,
                    type(e).__name__, e)


def log_table(tracker: Any, samples: list[dict[str, Any]], client: Any = None) -> None:
    """The samples as an MLflow table of the tracker's run."""
    if samples:
        mlflow_table(tracker, table_of(samples), TABLE, "samples", client)


def comparison_rows(names: list[str], models: dict[str, str], results: dict[str, dict]) -> dict[str, list]:
    """One row per evaluated model (in evaluation order): model, path, then every metric any
    model has (blank where a model lacks it), as MLflow table columns."""
    keys = sorted({k for n in names for k in results[n]})
    cols: dict[str, list] = {"model": list(names), "path": [str(models[n]) for n in names]}
    for k in keys:
        cols[k] = [results[n].get(k) for n in names]
    return cols


def log_comparison(tracker: Any, names: list[str], models: dict[str, str], results: dict[str, dict]) -> None:
    """The models side by side as an MLflow table of the stage run (`comparison_table.json`: the
    run's Artifacts and the experiment's Evaluation/table views show it one row per model)."""
    mlflow_table(tracker, comparison_rows(names, models, results), COMPARISON, "comparison")


def model_runs(cfg: EvalConfig, stage: Any, names: list[str], results: dict[str, dict],
               samples: list[dict[str, Any]]) -> dict[str, str]:
    """One nested MLflow run per evaluated model under the stage's run: {name: run id}."""
    if not stage.run_id or cfg.tracking is None:
        return {}
    from mlflow import MlflowClient

    client = MlflowClient(stage.tracking_uri)
    ids: dict[str, str] = {}
    for i, (name, path) in enumerate(zip(names, cfg.models)):
        run = Tracker(cfg.tracking, run_name=f"evaluate/{name}", parent_run_id=stage.run_id,
                      tags={"posttrain.stage": "evaluate", "posttrain.eval_model": name, "posttrain.eval_index": i},
                      system_metrics=False)  # a few seconds of bookkeeping, inside the stage run's sampling
        try:
            run.log_params({"model": path, "name": name, "index": i})
            run.log_metrics(results[name], step=0)
            if cfg.save_samples:
                log_table(run, [s for s in samples if s["model"] == name], client)
            run.flush(timeout=60)
        finally:
            run.end()
        if run.run_id:
            ids[name] = run.run_id
    return ids


def write_outputs(cfg: EvalConfig, out: Path, stage: Any, names: list[str], results: dict[str, dict],
                  metrics: dict[str, float], samples: list[dict[str, Any]], counts: dict[str, int],
                  families: list[str], selected: dict | None) -> dict:
    models = dict(zip(names, cfg.models))
    # `order`: the names in cfg.models' order (JSON files store mappings sorted by key); first = models[0]
    summary: dict[str, Any] = {"models": models, "order": list(names), "results": results, "counts": counts,
                               "metrics": families}
    if selected is not None:
        summary["selected"] = selected
    dump_json(out / "results.json", summary)
    outputs = {"results": "results.json"}
    if cfg.save_samples:
        dump_json(out / "samples.json", samples)
        outputs["samples"] = "samples.json"
    runs = model_runs(cfg, stage, names, results, samples)
    extra: dict[str, Any] = {"results": results, "models": models, "order": list(names), "counts": counts,
                             "mlflow_run_id": stage.run_id, "mlflow_model_runs": runs}
    if selected is not None:
        extra["selected"] = selected
        stage.set_tags({"posttrain.selected_model": selected["name"]})
    stage.log_metrics(metrics, step=0)
    log_comparison(stage, names, models, results)
    stage.log_artifact(str(out / "results.json"))
    if cfg.save_samples:
        stage.log_artifact(str(out / "samples.json"))
        log_table(stage, samples)
    return write_manifest(out, "evaluate", outputs, metrics=metrics, config=cfg.model_dump(mode="json"),
                          inputs={**models, **{f"data/{i}": s for i, s in enumerate(cfg.data.sources)}}, extra=extra)
