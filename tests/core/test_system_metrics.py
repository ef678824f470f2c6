"""TrackingConfig.system_metrics: a Tracker samples CPU/memory/disk/network through MLflow's
SystemMetricsMonitor (which needs psutil, a runtime dependency) into the run as `system/...`."""

from __future__ import annotations

import time
import uuid

import pytest
from mlflow import MlflowClient

from posttrain.core.tracking import TrackingConfig
from posttrain.core.tracking import Tracker


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for var in ("POSTTRAIN_PARENT_RUN_ID", "MLFLOW_PARENT_RUN_ID", "RANK", "MLFLOW_SYSTEM_METRICS_NODE_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.1")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING", "1")


def _run(tmp_path, system_metrics: bool) -> dict[str, float]:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    name = f"sysm-{uuid.uuid4().hex[:8]}"
    cfg = TrackingConfig(tracking_uri=uri, experiment=name, artifact_location=str(tmp_path / name),
                         system_metrics=system_metrics)
    with Tracker(cfg, "sft") as tr:
        tr.log_metrics({"loss": 1.0}, step=0)
        assert tr.flush(timeout=60)
        assert (tr._monitor is not None) == system_metrics
        deadline = time.monotonic() + 60
        # Wait until the monitor has aggregated and recorded at least one sample (it publishes
        # on finish(), which end() calls before marking the run finished).
        while system_metrics and tr._monitor._logging_step < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    run = MlflowClient(uri).get_run(tr.run_id)
    assert run.info.status == "FINISHED"
    return run.data.metrics


def test_system_metrics_logged_to_sqlite(tmp_path):
    metrics = _run(tmp_path, system_metrics=True)
    system = {k: v for k, v in metrics.items() if k.startswith("system/")}
    assert "system/cpu_utilization_percentage" in system, sorted(metrics)
    assert 0.0 <= system["system/cpu_utilization_percentage"] <= 100.0
    assert system["system/system_memory_usage_megabytes"] > 0
    assert metrics["loss"] == 1.0


def test_no_system_metrics_when_off(tmp_path):
    metrics = _run(tmp_path, system_metrics=False)
    assert metrics == {"loss": 1.0}


def test_on_by_default_and_a_run_shorter_than_one_interval_still_gets_a_sample(tmp_path, monkeypatch):
    """Stage runs sample by default; MLflow's monitor publishes only after its first interval, so a
    short stage would have none: the Tracker takes one closing sample."""
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "30")
    cfg = TrackingConfig(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", experiment="short",
                         artifact_location=str(tmp_path / "short"))
    assert cfg.system_metrics
    with Tracker(cfg, "sft") as tr:
        tr.log_metrics({"loss": 1.0}, step=0)
    metrics = MlflowClient(cfg.tracking_uri).get_run(tr.run_id).data.metrics
    assert metrics["system/system_memory_usage_megabytes"] > 0, sorted(metrics)
    with Tracker(cfg, "pipeline", system_metrics=False) as tr:  # the override (the pipeline's parent run)
        tr.log_metrics({"loss": 1.0}, step=0)
    assert MlflowClient(cfg.tracking_uri).get_run(tr.run_id).data.metrics == {"loss": 1.0}
