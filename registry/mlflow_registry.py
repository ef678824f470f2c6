"""The MLflow model registry: register the pipeline's final model (HF files as artifacts, lineage
in tags) under alias `candidate`, and move `champion` to it only when its evaluation beats the
current champion's on the configured metric. The decision and its numbers are returned/logged."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from pydantic import Field

from core.config import ConfigModel

log = logging.getLogger("posttrain.registry")


class RegistryConfig(ConfigModel):
    enabled: bool = Field(True, description="Register the evaluated model in MLflow.")
    model_name: str = Field("posttrain-demo", description="Registered model name.")
    promote_metric: str = Field("exact_match", description="Evaluation metric gating candidate -> champion.")
    greater_is_better: bool = Field(True, description="Direction of promote_metric.")
    min_delta: float = Field(0.0, ge=0, description="Margin the candidate must beat the champion by.")
    baseline: str | None = Field(
        "auto", description="An evaluated model the candidate must beat to become champion at all: 'auto' = the "
                            "model it was trained from (its furthest ancestor along `model:` that the evaluate node "
                            "also evaluated), a name = that evaluated model, None = no such gate.")
    min_score: float | None = Field(None, description="The promote_metric the candidate must reach to become "
                                                      "champion (a floor; None = none).")
    evaluate: str | None = Field(
        None, description="Evaluate node whose selected (else first) model is registered; None = the last one.")


def _client(tracking_uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def should_promote(candidate: float, champion: float | None, greater_is_better: bool, min_delta: float,
                   baseline: float | None = None, min_score: float | None = None) -> tuple[bool, str]:
    """(promote?, why). The candidate must pass the floors first: beat `baseline` (the model it was
    trained from, evaluated in the same run) and reach `min_score`; then there must be no champion,
    or the candidate must beat it by more than min_delta."""
    better = (lambda a, b: a > b) if greater_is_better else (lambda a, b: a < b)
    if math.isnan(candidate):
        return False, "the candidate's score is NaN"
    if baseline is not None and not math.isnan(baseline) and not better(candidate, baseline):
        return False, f"does not beat its baseline ({candidate:.4g} vs {baseline:.4g})"
    if min_score is not None and better(min_score, candidate):
        return False, f"below min_score ({candidate:.4g} vs {min_score:.4g})"
    if champion is None or math.isnan(champion):
        return True, "no champion yet, and the floors are passed"
    if better(candidate, champion + (min_delta if greater_is_better else -min_delta)):
        return True, f"beats the champion ({candidate:.4g} vs {champion:.4g})"
    return False, f"does not beat the champion by min_delta ({candidate:.4g} vs {champion:.4g})"


def register_model(client, name: str, run_id: str, model_dir: Path, metric: str, value: float,
                   lineage: dict[str, str]):
    """Upload `model_dir` under the run's `model/` artifacts and create a model version of it."""
    from mlflow.exceptions import MlflowException

    client.log_artifacts(run_id, str(model_dir), artifact_path="model")
    try:
        client.create_registered_model(name, description="Post-trained by posttrain")
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    source = f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/model"
    from core.tracking.params import clean_key

    tags = {f"eval.{metric}": str(value), **{clean_key(f"lineage.{k}"): v for k, v in lineage.items()}}
    return client.create_model_version(name, source, run_id=run_id, tags=tags)


def register_and_promote(reg: RegistryConfig, tracking_uri: str,
                         parent_run_id: str | None, source: dict[str, Any]) -> dict[str, Any]:
    """Register the model an evaluate node chose (`source`: its model_dir, model_name, metrics and
    the pipeline's lineage, from flows.pipeline.registry_source) and gate `champion` on its metric."""
    if parent_run_id is None:
        raise RuntimeError("registry: no MLflow parent run to attach the model to")
    model_dir = Path(source["model_dir"])
    model_dir = model_dir / "model" if (model_dir / "model").is_dir() else model_dir
    metrics = source["metrics"]
    if reg.promote_metric not in metrics:
        raise KeyError(f"registry.promote_metric {reg.promote_metric!r} is not a metric evaluate node "
                       f"{source['evaluate']!r} gave model {source['model_name']!r} (have {sorted(metrics)})")
    value = float(metrics[reg.promote_metric])
    client = _client(tracking_uri)
    lineage = {**source["lineage"], "parent_run_id": parent_run_id, "evaluate": source["evaluate"],
               "model": source["model_name"]}
    version = register_model(client, reg.model_name, parent_run_id, model_dir, reg.promote_metric, value, lineage)
    client.set_registered_model_alias(reg.model_name, "candidate", version.version)

    champion_value = champion_version = None
    try:
        champ = client.get_model_version_by_alias(reg.model_name, "champion")
        champion_version = champ.version
        champion_value = float(champ.tags.get(f"eval.{reg.promote_metric}", "nan"))
    except Exception:  # no champion yet
        pass
    baseline = source.get("baseline") or {}
    promote, reason = should_promote(value, champion_value, reg.greater_is_better, reg.min_delta,
                                     baseline.get("value"), reg.min_score)
    if promote:
        client.set_registered_model_alias(reg.model_name, "champion", version.version)
    decision = {
        "model_name": reg.model_name, "version": version.version, "model": source["model_name"], "metric": reg.promote_metric,
        "candidate_value": value, "champion_version": champion_version, "champion_value": champion_value,
        "promoted": promote, "aliases": ["candidate", "champion"] if promote else ["candidate"],
        "baseline": baseline.get("name"), "baseline_value": baseline.get("value"), "min_score": reg.min_score,
        "reason": reason,
    }
    client.set_model_version_tag(reg.model_name, version.version, "promotion",
                                 f"champion: {reason}" if promote else f"candidate: {reason}")
    log.info("registry decision: %s", decision)
    return decision


def fetch_registered(tracking_uri: str, ref: str, cache_root: Path) -> tuple[Path, str]:
    """A local copy of registered model `ref` ('models:/name@alias' or 'models:/name/3') and its
    identity ('name/v3 run <id>': what a cache key should depend on). Downloaded once per version."""
    body = ref.removeprefix("models:/")
    name, sep, alias = body.partition("@")
    client = _client(tracking_uri)
    try:
        if sep:
            mv = client.get_model_version_by_alias(name, alias)
        else:
            name, _, version = body.rpartition("/")
            mv = client.get_model_version(name, version)
    except Exception as e:  # noqa: BLE001 - MlflowException for unknown names, aliases, versions
        raise RuntimeError(f"registry reference {ref!r}: {e}") from None
    dest = Path(cache_root) / name / f"v{mv.version}"
    if not (dest / ".complete").exists():
        from mlflow.artifacts import download_artifacts

        dest.mkdir(parents=True, exist_ok=True)
        local = Path(download_artifacts(artifact_uri=mv.source, dst_path=str(dest), tracking_uri=tracking_uri))
        (dest / ".path").write_text(str(local))
        (dest / ".complete").write_text("")
    return Path((dest / ".path").read_text()), f"{name}/v{mv.version} run {mv.run_id}"
