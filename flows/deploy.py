"""Deployments of the pipeline flow, served by this process (`flow.serve`'s multi-deployment
form): one run on demand from the UI, one recurring retraining on the config's cron schedule.
Both take the typed PipelineConfig as their parameter, which the Prefect UI renders as a form
whose values can be edited per run or on the deployment.

    PREFECT_API_URL=http://127.0.0.1:4200/api posttrain serve configs/demo.yaml
"""

from __future__ import annotations

from pathlib import Path

from core.config import load_config
from flows.config import PipelineConfig
from flows.pipeline import post_training

ON_DEMAND = "on-demand"
SCHEDULED = "scheduled-retraining"


def build_deployments(cfg: PipelineConfig) -> list:
    params = {"config": cfg.model_dump(mode="json")}
    deployments = [post_training.to_deployment(
        name=ON_DEMAND, parameters=params, tags=["posttrain"],
        description="Run the post-training pipeline now; edit the config in the run form.")]
    if cfg.schedule:
        deployments.append(post_training.to_deployment(
            name=SCHEDULED, cron=cfg.schedule, parameters=params, tags=["posttrain", "scheduled"],
            description=f"Recurring retraining ({cfg.schedule}); parameters editable on the deployment."))
    return deployments


def serve(config: str | Path | None = None, overrides: list[str] | None = None) -> None:
    """Register the deployments with the Prefect API and execute their runs until interrupted."""
    from prefect import serve as prefect_serve

    from flows.demo import DEMO_CONFIG

    cfg = load_config(PipelineConfig, config or DEMO_CONFIG, overrides or [])
    prefect_serve(*build_deployments(cfg))
