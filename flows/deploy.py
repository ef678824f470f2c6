"""Deployments of the pipeline flow, served by this process (`flow.serve`'s multi-deployment
form): one run on demand from the UI, one recurring retraining on the config's cron schedule.
Both take the typed PipelineConfig as their parameter, which the Prefect UI renders as a form
whose values can be edited per run or on the deployment: the served config's own form (one section
per node, everyday knobs first; flows/form.py), its DAG summarized in the description.

    PREFECT_API_URL=http://127.0.0.1:4200/api posttrain serve configs/demo.yaml
"""

from __future__ import annotations

from pathlib import Path

from posttrain.core.config import load_config
from posttrain.flows.config import PipelineConfig
from posttrain.flows.pipeline import post_training

ON_DEMAND = "on-demand"
SCHEDULED = "scheduled-retraining"


def machine_timezone() -> str:
    """This machine's IANA timezone: $TZ, else what /etc/localtime links to, else UTC."""
    import os
    from zoneinfo import ZoneInfo

    candidates = [os.environ.get("TZ", "").lstrip(":")]
    try:
        candidates.append(str(Path("/etc/localtime").resolve()).split("zoneinfo/", 1)[1])
    except IndexError:
        pass
    for tz in candidates:
        try:
            if tz:
                ZoneInfo(tz)
                return tz
        except (ValueError, KeyError, OSError):
            continue
    return "UTC"


def build_deployments(cfg: PipelineConfig) -> list:
    """The on-demand deployment and, when the config has a cron `schedule`, the scheduled one. Both
    carry the config's own run form (posttrain.flows.form.form_schema: one section per node, everyday knobs
    first, no serve-time fields) and a markdown summary of the DAG as their description."""
    from prefect.schedules import Cron
    from prefect.utilities.callables import ParameterSchema

    from posttrain.flows.form import form_schema, run_parameters, summary

    params, schema = run_parameters(cfg), ParameterSchema(**form_schema(cfg))
    deployments = [post_training.to_deployment(
        name=ON_DEMAND, parameters=params, tags=["posttrain"],
        description="Run the post-training pipeline now; edit the config in the run form.\n\n" + summary(cfg))]
    if cfg.schedule:
        tz = cfg.schedule_timezone or machine_timezone()
        deployments.append(post_training.to_deployment(
            name=SCHEDULED, schedules=[Cron(cfg.schedule, timezone=tz)], parameters=params,
            tags=["posttrain", "scheduled"],
            description=f"Recurring retraining ({cfg.schedule}, {tz}); parameters editable on the deployment.\n\n"
                        + summary(cfg, cfg.schedule, tz)))
    for d in deployments:
        d._parameter_openapi_schema = schema  # the served config's form, not the flow's generic one
    return deployments


def serve(config: str | Path | None = None, overrides: list[str] | None = None) -> None:
    """Register the deployments with the Prefect API and execute their runs until interrupted."""
    from prefect import serve as prefect_serve

    from posttrain.flows.demo import DEMO_CONFIG

    cfg = load_config(PipelineConfig, config or DEMO_CONFIG, overrides or [])
    prefect_serve(*build_deployments(cfg))
