"""The MLflow child runs the pipeline flow itself opens under its parent run.

- A node that launches: its run is opened here when the launch starts (`open_node_run`) and
  resumed by id by the stage's process (POSTTRAIN_RUN_ID, posttrain.stages.common.stage_run), so the run's
  duration in MLflow is the stage's. A launch that dies before the stage could end its run gets it
  ended here (`end_if_running`).
- A node served from the cache: a short child run of its own in this pipeline run
  (`record_cached`), tagged `posttrain.cached=true` and pointing at the run that produced the
  result (`posttrain.cached_from`, its artifact URI, a note linking it), with that result's
  metrics, so the pipeline run can be followed to every node it reused.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from posttrain.core.tracking import clean_key, open_run

log = logging.getLogger("posttrain.flow")

RUN_ID_ENV = "POSTTRAIN_RUN_ID"


def _tracking(spec: Any):
    t = getattr(spec, "tracking", None)
    return t if t is not None and t.enabled else None


def open_node_run(spec: Any, name: str, kind: str, parent_run_id: str | None, key: str) -> str | None:
    """Open node `name`'s child run now; its id (None: tracking off, or MLflow unreachable: the
    stage then creates its own run as it would alone)."""
    tracking = _tracking(spec)
    if tracking is None or parent_run_id is None:
        return None
    try:
        return open_run(tracking, name, parent_run_id, {"posttrain.stage": kind, "posttrain.node": name,
                                                        "posttrain.cache_key": key})
    except Exception as e:  # noqa: BLE001 - tracking never stops a stage from running
        log.warning("%s: could not open its MLflow run before launching (%s); the stage opens its own", name, e)
        return None


def end_if_running(spec: Any, run_id: str | None, status: str = "FAILED", error: str | None = None) -> None:
    """End a run the stage left RUNNING (its process died before it could end it)."""
    tracking = _tracking(spec)
    if tracking is None or run_id is None:
        return
    try:
        from mlflow import MlflowClient

        client = MlflowClient(tracking.tracking_uri)
        if client.get_run(run_id).info.status == "RUNNING":
            if error:
                client.set_tag(run_id, "posttrain.error", error[:5000])
            client.set_terminated(run_id, status)
    except Exception as e:  # noqa: BLE001
        log.warning("could not end MLflow run %s: %s", run_id, e)


def record_cached(spec: Any, name: str, kind: str, parent_run_id: str | None, key: str,
                  original_run_id: str | None, metrics: dict[str, Any]) -> str | None:
    """A finished child run for a node served from the cache; its id (None when tracking is off)."""
    tracking = _tracking(spec)
    if tracking is None or parent_run_id is None:
        return None
    try:
        from mlflow import MlflowClient
        from mlflow.entities import Metric

        client = MlflowClient(tracking.tracking_uri)
        tags: dict[str, Any] = {"posttrain.stage": kind, "posttrain.node": name, "posttrain.cached": "true",
                                "posttrain.cache_key": key}
        note = f"Served from the cache (key {key[:16]}): inputs and settings unchanged."
        if original_run_id:
            original = client.get_run(original_run_id)
            tags.update({"posttrain.cached_from": original_run_id,
                         "posttrain.cached_artifacts": original.info.artifact_uri})
            note += (f" The result was produced by run [{original.info.run_name}]"
                     f"(#/experiments/{original.info.experiment_id}/runs/{original_run_id}); its artifacts: "
                     f"{original.info.artifact_uri}")
        tags["mlflow.note.content"] = note
        run_id = open_run(tracking, f"{name} (cached)", parent_run_id, tags)
        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(clean_key(k), float(v), now, 0) for k, v in metrics.items()
                                          if isinstance(v, (int, float)) and not isinstance(v, bool)])
        client.set_terminated(run_id, "FINISHED")
        return run_id
    except Exception as e:  # noqa: BLE001 - tracking never fails a cached node
        log.warning("%s: cached, but its MLflow child run was not recorded: %s", name, e)
        return None
