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

STAGE_NAMES = ["prep", "teacher", "student", "distill", "dpo", "evaluate"]

TINY = [
    "nodes.prep.synthetic_size=300",
    "nodes.teacher.max_steps=6", "nodes.teacher.eval_interval=3",
    "nodes.student.max_steps=6", "nodes.student.eval_interval=3",
    "nodes.distill.max_steps=4", "nodes.distill.eval_interval=2",
    "nodes.dpo.max_steps=4", "nodes.dpo.eval_interval=2",
    "nodes.dpo.rounds=1", "nodes.evaluate.models=[dpo, distill, student]",
    "nodes.evaluate.max_examples=8", "nodes.evaluate.max_new_tokens=6",
    "stage_retries=1", "retry_delay_s=0",
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("pipeline")
    old = os.getcwd()
    os.chdir(d)
    # stage runs sample system metrics (on by default) every second here, so short stages have some
    sampling = os.environ.get("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL")
    os.environ["MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"] = "1"
    from prefect.settings import (PREFECT_SERVER_ANALYTICS_ENABLED, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
                                  temporary_settings)

    # What `posttrain run` sets (posttrain.flows.cli.main): Prefect's ephemeral API server takes longer than
    # its default patience to start on a busy 2-core machine. A user's own setting wins. (As
    # settings, not env: prefect may have been imported, and its settings read, already.)
    settings = {s: v for s, v in ((PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, 180),
                                  (PREFECT_SERVER_ANALYTICS_ENABLED, False)) if s.name not in os.environ}
    with temporary_settings(settings):
        yield d
    os.chdir(old)
    if sampling is None:
        os.environ.pop("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL")
    else:
        os.environ["MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"] = sampling


def config(workdir: Path, *extra: str):
    from posttrain.core.config import load_config
    from posttrain.flows.config import PipelineConfig
    from posttrain.flows.demo import DEMO_CONFIG

    sets = TINY + [f"workspace={workdir / 'runs'}", f"tracking.tracking_uri=sqlite:///{workdir / 'mlflow.db'}",
                   "registry.model_name=e2e-model", *extra]
    return load_config(PipelineConfig, DEMO_CONFIG, sets)


@pytest.fixture(scope="module")
def first_run(workdir):
    from posttrain.flows.pipeline import run_pipeline

    return run_pipeline(config(workdir))


def test_every_stage_ran_and_wrote_its_manifest(first_run):
    assert first_run.ok
    assert list(first_run.stages) == STAGE_NAMES
    for name, r in first_run.stages.items():
        assert not r.cached, name
        m = json.loads((Path(r.output_dir) / "manifest.json").read_text())
        assert m["digest"] == r.digest and m["files"], name
    sft = first_run.stages["student"].metrics
    assert sft["val/loss"] < sft["val/loss_initial"]
    distill = first_run.stages["distill"].metrics
    assert distill["val/kl"] < distill["val/kl_initial"]
    dpo = first_run.stages["dpo"].metrics
    assert dpo["val/accuracy"] > dpo["val/accuracy_initial"]




def _client(workdir: Path):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    return client, client.get_experiment_by_name("posttrain").experiment_id


def _children(client, exp_id: str, parent_id: str) -> list:
    return client.search_runs([exp_id], f"tags.mlflow.parentRunId = '{parent_id}'")


def test_mlflow_holds_parent_and_children_and_registry_alias(first_run, workdir):
    client, exp_id = _client(workdir)
    parent = client.get_run(first_run.parent_run_id)
    # named by the pipeline and the Prefect flow run, so two runs of one config are told apart
    assert parent.info.status == "FINISHED"
    assert parent.info.run_name == f"demo ({parent.data.tags['prefect.flow_run_name']})"
    # a model-development experiment: the MLflow UI opens on the runs table, not on GenAI traces
    assert client.get_experiment(exp_id).tags["mlflow.experimentKind"] == "custom_model_development"
    assert parent.data.tags["posttrain.pipeline"] == "demo"
    assert parent.data.tags["prefect.flow_run_id"]
    assert "mlflow.parentRunId" not in parent.data.tags  # the pipeline run is top-level
    # Everything the first pipeline run logged: one top-level run, a child per node, and under the
    # evaluate node's run one run per evaluated model (rows MLflow compares side by side).
    during = [r for r in client.search_runs([exp_id], max_results=1000)
              if r.info.start_time <= parent.info.end_time]
    assert [r.info.run_id for r in during if "mlflow.parentRunId" not in r.data.tags] == [first_run.parent_run_id]
    children = _children(client, exp_id, first_run.parent_run_id)
    assert len(children) == len(STAGE_NAMES)
    eval_run = next(r for r in children if r.info.run_name == "evaluate")
    per_model = _children(client, exp_id, eval_run.info.run_id)
    assert sorted(r.data.tags["posttrain.eval_model"] for r in per_model) == ["distill", "dpo", "student"]
    assert all({"exact_match", "perplexity", "preference_accuracy"} <= set(r.data.metrics) for r in per_model)
    assert len(during) == 1 + len(children) + len(per_model)
    # One child per node, named after the node, tagged with the stage program it ran.
    by_name = {r.info.run_name: r for r in children}
    assert sorted(by_name) == sorted(STAGE_NAMES)
    programs = {n: r.data.tags["posttrain.stage"] for n, r in by_name.items()}
    assert programs == {"prep": "data_prep", "teacher": "sft", "student": "sft",
                        "distill": "distill", "dpo": "dpo", "evaluate": "evaluate"}
    for name, r in by_name.items():
        assert r.info.status == "FINISHED", name
        assert r.info.experiment_id == parent.info.experiment_id, name
        assert parent.info.start_time <= r.info.start_time <= r.info.end_time <= parent.info.end_time, name
        assert "posttrain.error" not in r.data.tags, name
        # the flow opens the run as it launches the stage: MLflow's duration is the launch's, not
        # only the part after the stage's process reached MLflow (model loading included)
        took = (r.info.end_time - r.info.start_time) / 1000
        # (the rest: torchrun and the processes exiting after the run ended; before, runs started
        # after the stage's imports and model load, 15% of the launch for sft)
        assert 0.6 * first_run.stages[name].seconds <= took <= first_run.stages[name].seconds + 1, (name, took)
        # system metrics of every stage run, on by default
        assert any(k.startswith("system/cpu_utilization") for k in r.data.metrics), (name, sorted(r.data.metrics))
        # the manifest points at the child run that produced it
        recorded = first_run.stages[name].mlflow_run_id
        assert recorded in (None, r.info.run_id), name
    recording = {n for n in STAGE_NAMES if first_run.stages[n].mlflow_run_id is not None}
    assert recording == set(STAGE_NAMES)  # data prep too
    # The parent carries each stage's final metrics under the stage's name.
    sft = by_name["student"].data.metrics
    assert sft["val/loss"] == pytest.approx(first_run.stages["student"].metrics["val/loss"])
    assert parent.data.metrics["student/val/loss"] == pytest.approx(sft["val/loss"])
    assert parent.data.params["registry.model_name"] == "e2e-model"
    artifacts = {a.path for a in client.list_artifacts(first_run.parent_run_id, "plots")}
    assert {"plots/loss_curves.png", "plots/eval_comparison_evaluate.png"} <= artifacts
    assert first_run.registered["model"] == "dpo"  # the evaluate node's first model (it selects none)
    version = client.get_model_version_by_alias("e2e-model", "candidate")
    assert version.run_id == first_run.parent_run_id
    # an MLflow model (posttrain.registry.mlflow_model), its lineage as links to every node's run, and the
    # prepared data as the parent run's dataset inputs, by content digest
    assert version.source.startswith("models:/m-")
    for name in recording:
        assert version.tags[f"lineage.{name}.run_id"] == first_run.stages[name].mlflow_run_id, name
        assert version.tags[f"lineage.{name}.digest"] == first_run.stages[name].digest, name
    prep = json.loads((Path(first_run.stages["prep"].output_dir) / "manifest.json").read_text())
    inputs = {d.dataset.name: d for d in parent.inputs.dataset_inputs}
    assert {"prep/sft_train", "prep/preference_train", "prep/sft_test"} <= set(inputs), sorted(inputs)
    train = inputs["prep/sft_train"]
    assert {t.key: t.value for t in train.tags}["mlflow.data.context"] == "training"
    assert prep["files"][prep["outputs"]["sft_train"]].startswith(train.dataset.digest)
    # Champion only past the floor: beating the model it was trained from (registry.baseline
    # 'auto': dpo <- distill <- student, the furthest one the evaluate node evaluated).
    reg = first_run.registered
    scores = eval_results_of(first_run)
    assert reg["baseline"] == "student" and reg["baseline_value"] == scores["student"]["exact_match"]
    assert reg["promoted"] == (scores["dpo"]["exact_match"] > scores["student"]["exact_match"]), reg
    if reg["promoted"]:  # no champion before: the floor is the only gate
        assert client.get_model_version_by_alias("e2e-model", "champion").version == version.version


def eval_results_of(run):
    from posttrain.flows.report import eval_results

    return eval_results(run.stages["evaluate"])


def test_second_run_is_cached_and_a_change_reruns_only_descendants(first_run, workdir):
    from posttrain.flows.pipeline import run_pipeline

    again = run_pipeline(config(workdir))
    assert all(r.cached for r in again.stages.values())
    changed = run_pipeline(config(workdir, "nodes.dpo.beta=0.2"))
    assert {n for n, r in changed.stages.items() if not r.cached} == {"dpo", "evaluate"}
    # Each pipeline run is its own parent run; only the stages that ran have child runs.
    client, exp_id = _client(workdir)
    parents = {first_run.parent_run_id, again.parent_run_id, changed.parent_run_id}
    assert len(parents) == 3
    for run in (again, changed):
        assert client.get_run(run.parent_run_id).info.status == "FINISHED"
    # A cached node still gets a child run in the new pipeline run, marked cached and pointing at
    # the run that produced its result, so every pipeline run can be followed to what it reused.
    made = {n: r.mlflow_run_id for n, r in first_run.stages.items()}
    cached = {r.data.tags["posttrain.node"]: r for r in _children(client, exp_id, again.parent_run_id)}
    assert sorted(cached) == sorted(STAGE_NAMES)
    again_tags = client.get_run(again.parent_run_id).data.tags
    for name, r in cached.items():
        assert r.info.run_name == f"{name} (cached)" and r.info.status == "FINISHED", name
        assert r.data.tags["posttrain.cached"] == "true", name
        if made[name]:
            assert r.data.tags["posttrain.cached_from"] == made[name], name
            assert r.data.tags["posttrain.cached_artifacts"] == client.get_run(made[name]).info.artifact_uri
            assert again_tags[f"posttrain.reused.{name}"] == made[name]
            assert again.stages[name].cached_run_id == r.info.run_id
    assert cached["student"].data.metrics["val/loss"] == pytest.approx(first_run.stages["student"].metrics["val/loss"])
    children = _children(client, exp_id, changed.parent_run_id)
    reran = [r for r in children if "posttrain.cached" not in r.data.tags]
    assert sorted(r.info.run_name for r in reran) == ["dpo", "evaluate"]
    assert sorted(r.data.tags["posttrain.node"] for r in children if "posttrain.cached" in r.data.tags) == \
        sorted(set(STAGE_NAMES) - {"dpo", "evaluate"})
    assert all(r.info.status == "FINISHED" for r in children)
    # Prefect: task runs named after their nodes, a node served from the cache in Prefect's own
    # Cached state; and each flow run's artifact: every node, cached or not, with its MLflow run.
    flow_run = lambda run: client.get_run(run.parent_run_id).data.tags["prefect.flow_run_id"]  # noqa: E731
    states = prefect_task_states(flow_run(changed))
    assert states == {**{n: "Cached" for n in STAGE_NAMES}, "dpo": "Completed", "evaluate": "Completed"}
    summary = prefect_markdown(flow_run(changed))
    assert f"`{changed.parent_run_id}`" in summary
    assert "| student | sft | cached |" in summary and "| dpo | dpo | ran |" in summary
    assert f"`{changed.stages['dpo'].mlflow_run_id}`" in summary  # the run that made it (sqlite: its id)
    student = changed.stages["student"]
    assert f"`{student.cached_run_id}`, from `{student.mlflow_run_id}`" in summary  # cached: this run's, the original
    assert "Registered e2e-model v" in summary


def prefect_task_states(flow_run_id: str) -> dict[str, str]:
    """{task run name: state name} of a flow run, from the Prefect API the flow ran against."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as c:
        runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name: r.state.name for r in runs}


def prefect_markdown(flow_run_id: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as c:
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    (art,) = [a for a in arts if a.type == "markdown"]
    return art.data


def test_failing_stage_is_retried_and_reported(first_run, workdir):
    from mlflow import MlflowClient

    from posttrain.flows.pipeline import run_pipeline

    from posttrain.core.config import load_config
    from posttrain.flows.config import PipelineConfig

    not_a_model = workdir / "not-a-model"
    not_a_model.mkdir(exist_ok=True)  # exists (so the config is valid) but holds no checkpoint
    path = workdir / "broken.yaml"
    path.write_text(f"""
name: broken
workspace: {workdir / 'runs'}
tracking: {{tracking_uri: "sqlite:///{workdir / 'mlflow.db'}"}}
registry: {{enabled: false}}
stage_retries: 1
retry_delay_s: 0
nodes:
  prep: {{kind: data_prep, synthetic_size: 300}}
  student: {{kind: sft, model: "{not_a_model}", data: prep, max_steps: 2}}
""")
    cfg = load_config(PipelineConfig, path)
    with pytest.raises(Exception, match="node student failed"):
        run_pipeline(cfg)
    log = (workdir / "runs" / "broken" / ".launch" / "student" / "launch.log").read_text()
    assert log.count("==> posttrain launch posttrain.stages.sft") == 2  # the first attempt and one retry
    assert "checkpoint" in log.lower()
    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("posttrain")
    (parent,) = client.search_runs([exp.experiment_id], "tags.`posttrain.pipeline` = 'broken'")
    assert parent.info.status == "FAILED"
    assert "node student failed" in parent.data.tags["posttrain.error"]
    children = _children(client, exp.experiment_id, parent.info.run_id)
    # data prep succeeded; the student fails loading its model, before or after opening its run
    # (an attempt's child run, where there is one, is FAILED with the error): never a FINISHED one
    assert [(r.info.run_name, r.info.status) for r in children if r.info.run_name != "student"] \
        == [("prep", "FINISHED")]
    attempts = [r for r in children if r.info.run_name == "student"]
    assert len(attempts) <= 2
    for r in attempts:
        assert r.info.status == "FAILED" and r.data.tags["posttrain.error"]

