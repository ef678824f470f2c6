"""The pipeline end to end on the tiny default, against Prefect's local API and a SQLite MLflow:
every stage runs as a 2-process torchrun job, MLflow holds a parent and a child per stage, the
registry holds the model under its alias; a second run is served from the cache; a config change
reruns only the affected stages; a failing stage is retried and its failure reported."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TINY = [
    "data_prep.synthetic_size=300",
    "sft_teacher.max_steps=6", "sft_teacher.eval_interval=3",
    "sft_student.max_steps=6", "sft_student.eval_interval=3",
    "distill.max_steps=4", "distill.eval_interval=2",
    "dpo.max_steps=4", "dpo.eval_interval=2",
    "evaluate.max_examples=8", "evaluate.max_new_tokens=6",
    "stage_retries=1", "retry_delay_s=0",
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("pipeline")
    old = os.getcwd()
    os.chdir(d)
    yield d
    os.chdir(old)


def config(workdir: Path, *extra: str):
    from core.config import PipelineConfig, load_config
    from flows.demo import DEMO_CONFIG

    sets = TINY + [f"workspace={workdir / 'runs'}", f"tracking.tracking_uri=sqlite:///{workdir / 'mlflow.db'}",
                   "registry.model_name=e2e-model", *extra]
    return load_config(PipelineConfig, DEMO_CONFIG, sets)


@pytest.fixture(scope="module")
def first_run(workdir):
    from flows.pipeline import run_pipeline

    return run_pipeline(config(workdir))


def test_every_stage_ran_and_wrote_its_manifest(first_run):
    assert first_run.ok
    assert list(first_run.stages) == ["data_prep", "sft_teacher", "sft_student", "distill", "dpo", "evaluate"]
    for name, r in first_run.stages.items():
        assert not r.cached, name
        m = json.loads((Path(r.output_dir) / "manifest.json").read_text())
        assert m["digest"] == r.digest and m["files"], name
    sft = first_run.stages["sft_student"].metrics
    assert sft["val/loss"] < sft["val/loss_initial"]
    distill = first_run.stages["distill"].metrics
    assert distill["val/kl"] < distill["val/kl_initial"]
    dpo = first_run.stages["dpo"].metrics
    assert dpo["val/accuracy"] > dpo["val/accuracy_initial"]


def test_mlflow_holds_parent_and_children_and_registry_alias(first_run, workdir):
    import mlflow
    from mlflow import MlflowClient

    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    runs = mlflow.search_runs(experiment_names=["posttrain"], tracking_uri=uri, output_format="list") \
        if "tracking_uri" in mlflow.search_runs.__code__.co_varnames else None
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("posttrain")
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{first_run.parent_run_id}'")
    stages = sorted(r.data.tags["posttrain.stage"] for r in children)
    assert stages == sorted(["data_prep", "sft", "sft", "distill", "dpo", "evaluate"])
    assert all(r.info.status == "FINISHED" for r in children)
    parent = client.get_run(first_run.parent_run_id)
    assert parent.data.tags["prefect.flow_run_id"]
    artifacts = {a.path for a in client.list_artifacts(first_run.parent_run_id, "plots")}
    assert {"plots/loss_curves.png", "plots/eval_comparison.png"} <= artifacts
    version = client.get_model_version_by_alias("e2e-model", "candidate")
    assert version.run_id == first_run.parent_run_id
    assert first_run.registered["promoted"]  # the first model becomes champion
    assert client.get_model_version_by_alias("e2e-model", "champion").version == version.version
    del runs


def test_second_run_is_cached_and_a_change_reruns_only_descendants(first_run, workdir):
    from flows.pipeline import run_pipeline

    again = run_pipeline(config(workdir))
    assert all(r.cached for r in again.stages.values())
    changed = run_pipeline(config(workdir, "dpo.beta=0.2"))
    assert {n for n, r in changed.stages.items() if not r.cached} == {"dpo", "evaluate"}


def test_failing_stage_is_retried_and_reported(first_run, workdir):
    from mlflow import MlflowClient

    from flows.pipeline import run_pipeline

    cfg = config(workdir, "name=broken", "stages.sft_teacher=false", "stages.distill=false",
                 "stages.dpo=false", "stages.evaluate=false",
                 f"sft_student.model.name_or_path={workdir / 'no-such-model'}")
    with pytest.raises(Exception, match="stage sft_student failed"):
        run_pipeline(cfg)
    log = (workdir / "runs" / "broken" / ".launch" / "sft_student" / "launch.log").read_text()
    assert log.count("==> posttrain launch stages.sft") == 2  # the first attempt and one retry
    assert "no such directory" in log
    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("posttrain")
    failed = client.search_runs([exp.experiment_id], "attributes.status = 'FAILED'")
    assert any("stage sft_student failed" in r.data.tags.get("posttrain.error", "") for r in failed)
