"""The MLflow model registry: register the pipeline's final model as an MLflow model (a pyfunc
LoggedModel of the parent run, posttrain.registry.mlflow_model: the HF files, signature, input example,
tokenizer) with its lineage as links (each node's run id and digest, the datasets as the run's
inputs), under alias `candidate`, and move `champion` to it only when its evaluation beats the
current champion's on the configured metric. The decision and its numbers are returned/logged.

register_and_promote's `source` (posttrain.flows.pipeline.registry_source):
    model_dir, model_name, evaluate, metrics   the evaluated model: its directory (HF, a stage
                                               output, or a PEFT adapter), name, evaluate node and
                                               that node's metrics of it
    lineage   {node: content digest}           every node of the pipeline
    runs      {node: MLflow run id}            optional: each node's run (None/absent: no link)
    datasets  [{name, path, digest, context?, node?}]   optional: the data the pipeline used
                                               (context 'training' by default, 'eval' for the
                                               evaluation's: its metrics are logged against it)
    baseline  {name, value} | None             the model the candidate must beat
    base_model                                 optional: the base of an adapter model_dir
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from pathlib import Path
from typing import Any

from pydantic import Field

from posttrain.core.config import ConfigModel

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


def _model_dir(model_dir: Path) -> Path:
    """The HF (or PEFT adapter) directory of a stage output directory or model path."""
    model_dir = Path(model_dir)
    for sub in ("model", "adapter"):
        if not (model_dir / "config.json").exists() and (model_dir / sub).is_dir():
            return model_dir / sub
    return model_dir


def lineage_tags(source: dict[str, Any], parent_run_id: str) -> dict[str, str]:
    """Tags linking a registered model to what made it: each pipeline node's content digest
    (`lineage.<node>` and `lineage.<node>.digest`) and MLflow run id (`lineage.<node>.run_id`),
    the parent run, the evaluate node and the evaluated model's name, and each dataset."""
    from posttrain.core.tracking.params import clean_key

    tags = {}
    for node, digest in (source.get("lineage") or {}).items():
        tags[clean_key(f"lineage.{node}")] = str(digest)  # the key versions before had
        tags[clean_key(f"lineage.{node}.digest")] = str(digest)
    # after the digests: these win over a node of the same name's `lineage.<node>` (as before)
    tags.update({"lineage.parent_run_id": parent_run_id, "lineage.evaluate": str(source["evaluate"]),
                 "lineage.model": str(source["model_name"])})
    for node, run_id in (source.get("runs") or {}).items():
        if run_id:
            tags[clean_key(f"lineage.{node}.run_id")] = str(run_id)
    for ds in source.get("datasets") or []:
        tags[clean_key(f"dataset.{ds['name']}.digest")] = str(ds["digest"])
        if ds.get("path"):
            tags[clean_key(f"dataset.{ds['name']}.path")] = str(ds["path"])[:5000]
    return tags


def dataset_inputs(datasets: list[dict[str, Any]]):
    """MLflow dataset inputs (name, source = the data file, digest) of source["datasets"]. The
    store keeps 36 characters of a digest: the whole one is the input's `digest` tag."""
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    out = []
    for ds in datasets:
        try:  # a local file or directory, s3://..., what MLflow resolves
            with warnings.catch_warnings():  # "can be interpreted in multiple ways": the same class twice
                warnings.simplefilter("ignore")
                src = resolve_dataset_source(str(ds["path"]))
        except Exception:  # noqa: BLE001 - no path, or one no dataset source takes
            src = CodeDatasetSource({"path": str(ds.get("path") or ""), "name": str(ds["name"])})
        meta = MetaDataset(src, name=str(ds["name"]), digest=str(ds["digest"])[:36])
        tags = [InputTag("mlflow.data.context", str(ds.get("context") or "training")),
                InputTag("digest", str(ds["digest"]))]
        tags += [InputTag("node", str(ds["node"]))] if ds.get("node") else []
        out.append(DatasetInput(meta._to_mlflow_entity(), tags))
    return out


def register_model(client, name: str, run_id: str, model_dir: Path, metric: str, value: float,
                   source: dict[str, Any]):
    """Log `model_dir` as a pyfunc MLflow model (posttrain.registry.mlflow_model: signature, input example,
    tokenizer, the project's code) of run `run_id`, with the lineage of `source` as its tags and
    params, the pipeline's datasets as the run's inputs, the evaluation's metrics on the model
    (against the eval dataset, if one is named), and create a model version of it."""
    import time

    from mlflow.entities import Metric
    from mlflow.exceptions import MlflowException

    from posttrain.core.tracking.params import clean_key
    from posttrain.registry.mlflow_model import log_pyfunc_model

    tags = {f"eval.{metric}": str(value), **lineage_tags(source, run_id)}
    params = {"evaluate": str(source["evaluate"]), "model": str(source["model_name"]),
              "promote_metric": metric, "model_dir": str(model_dir)[:6000]}
    logged = log_pyfunc_model(client, run_id, model_dir, name, params, tags, source.get("base_model"))
    datasets = source.get("datasets") or []
    if datasets:
        client.log_inputs(run_id, datasets=dataset_inputs(datasets))
    evals = [d for d in datasets if d.get("context") in ("eval", "evaluation")]
    on = {"dataset_name": str(evals[0]["name"]), "dataset_digest": str(evals[0]["digest"])[:36]} if evals else {}
    now = int(time.time() * 1000)
    metrics = [Metric(clean_key(f"registered/{k}"), float(v), now, 0, model_id=logged.model_id, **on)
               for k, v in (source.get("metrics") or {}).items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if metrics:
        client.log_batch(run_id, metrics=metrics)
    try:
        client.create_registered_model(name, description="Post-trained by posttrain")
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    # Source `models:/<model_id>` (what links the version to its LoggedModel in the UI); a local
    # store resolves it through the global tracking URI, so that is this client's meanwhile.
    try:
        from mlflow.tracking._tracking_service.utils import _use_tracking_uri
    except ImportError:  # a private helper of MLflow 3.x; without it, the global URI as it is
        import contextlib

        def _use_tracking_uri(uri):
            return contextlib.nullcontext()

    with _use_tracking_uri(client.tracking_uri):
        version = client.create_model_version(name, f"models:/{logged.model_id}", run_id=run_id, tags=tags,
                                              model_id=logged.model_id)
    # what mlflow.register_model records: the LoggedModel's page lists its versions
    client.set_logged_model_tags(logged.model_id, {"mlflow.modelVersions": json.dumps(
        [{"name": name, "version": version.version}])})
    return version


def register_and_promote(reg: RegistryConfig, tracking_uri: str,
                         parent_run_id: str | None, source: dict[str, Any]) -> dict[str, Any]:
    """Register the model an evaluate node chose (`source`: its model_dir, model_name, metrics and
    the pipeline's lineage, from posttrain.flows.pipeline.registry_source) and gate `champion` on its metric."""
    if parent_run_id is None:
        raise RuntimeError("registry: no MLflow parent run to attach the model to")
    model_dir = _model_dir(Path(source["model_dir"]))
    metrics = source["metrics"]
    if reg.promote_metric not in metrics:
        raise KeyError(f"registry.promote_metric {reg.promote_metric!r} is not a metric evaluate node "
                       f"{source['evaluate']!r} gave model {source['model_name']!r} (have {sorted(metrics)})")
    value = float(metrics[reg.promote_metric])
    client = _client(tracking_uri)
    version = register_model(client, reg.model_name, parent_run_id, model_dir, reg.promote_metric, value, source)
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
        # the version's storage location: its source `models:/<model_id>` resolves through the
        # global tracking URI, which need not be this one
        uri = client.get_model_version_download_uri(name, mv.version)
        local = Path(download_artifacts(artifact_uri=uri, dst_path=str(dest), tracking_uri=tracking_uri))
        from posttrain.registry.mlflow_model import hf_dir_of

        (dest / ".path").write_text(str(hf_dir_of(local)))
        (dest / ".complete").write_text("")
    return Path((dest / ".path").read_text()), f"{name}/v{mv.version} run {mv.run_id}"
