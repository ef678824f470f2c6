"""TrackingConfig: where and how core.tracking logs a stage's (or the pipeline's) runs."""

from __future__ import annotations

from pydantic import Field

from core.config import ConfigModel


class TrackingConfig(ConfigModel):
    enabled: bool = Field(True, description="Log to MLflow (from rank 0).")
    tracking_uri: str = Field("sqlite:///mlflow.db", description="MLflow tracking URI.")
    experiment: str = Field("posttrain", description="MLflow experiment (pipeline = parent run).")
    artifact_location: str | None = Field(None, description="Artifact root of a new experiment.")
    log_every: int = Field(10, ge=1, description="Log metrics every N steps.")
    system_metrics: bool = Field(False, description="Sample CPU/GPU/memory utilization.")
    tags: dict[str, str] = Field({}, description="Extra tags on every run.")

