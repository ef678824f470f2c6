"""TrackingConfig: where and how posttrain.core.tracking logs a stage's (or the pipeline's) runs."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, field_validator

from posttrain.core.config import ConfigModel


def default_tracking_uri() -> str:
    """$MLFLOW_TRACKING_URI (what `posttrain ui` tells a user to export), else ./mlflow.db."""
    return os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"


class TrackingConfig(ConfigModel):
    enabled: bool = Field(True, description="Log to MLflow (from rank 0).")
    tracking_uri: str = Field(default_factory=default_tracking_uri, validate_default=True,
                              description="MLflow tracking URI. Unset: $MLFLOW_TRACKING_URI, else "
                                          "sqlite:///mlflow.db; a relative SQLite path is resolved against the "
                                          "directory the config is loaded in, so every stage writes one database.")
    experiment: str = Field("posttrain", description="MLflow experiment (pipeline = parent run).")
    artifact_location: str | None = Field(None, description="Artifact root of a new experiment.")
    log_every: int = Field(10, ge=1, description="Log metrics every N steps.")
    system_metrics: bool = Field(True, description="Sample CPU, memory, disk, network and (NVIDIA) GPU use of each "
                                                   "stage run into MLflow as system/... metrics (every 10 s; "
                                                   "$MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL).")
    tags: dict[str, str] = Field({}, description="Extra tags on every run.")

    @field_validator("tracking_uri")
    @classmethod
    def _absolute(cls, uri: str) -> str:
        """sqlite:///relative.db -> sqlite:////<cwd>/relative.db (stage processes run elsewhere)."""
        prefix = "sqlite:///"
        if uri.startswith(prefix) and uri != prefix and not uri[len(prefix):].startswith("/"):
            return prefix + str(Path(uri[len(prefix):]).resolve())
        return uri
