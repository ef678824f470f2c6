"""A node can start from a registered MLflow model (`model: models:/name@alias`): the flow fetches
that version's files once into the run dir, the node trains from the local copy, and the version
counts for the node's cache key (a new champion reruns the node)."""

from __future__ import annotations

from pathlib import Path


def test_a_registry_reference_is_fetched_and_keys_the_cache(tmp_path):
    from mlflow import MlflowClient

    from posttrain.flows.config import PipelineConfig
    from posttrain.flows.dag import PipelineDAG
    from posttrain.flows.pipeline import plan_node

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    exp = client.create_experiment("x", artifact_location=str(tmp_path / "artifacts"))
    client.create_registered_model("champ")

    def register(text: str) -> str:
        src = tmp_path / f"model-{text}"
        (src / "model").mkdir(parents=True)
        (src / "model" / "config.json").write_text(text)
        run = client.create_run(exp)
        client.log_artifacts(run.info.run_id, str(src / "model"), artifact_path="model")
        mv = client.create_model_version("champ", f"{run.info.artifact_uri}/model", run_id=run.info.run_id)
        client.set_registered_model_alias("champ", "champion", mv.version)
        return mv.version

    register("v1")
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    cfg = PipelineConfig.model_validate({
        "workspace": str(tmp_path / "runs"), "tracking": {"tracking_uri": uri},
        "nodes": {"ft": {"kind": "sft", "model": "models:/champ@champion", "data": str(data)}}})
    dag = PipelineDAG(cfg)
    assert dag.nodes["ft"].external == {"model": "models:/champ@champion"}
    spec, key1 = plan_node(dag, "ft", {})
    local = Path(spec.model.name_or_path)
    assert (local / "config.json").read_text() == "v1" and str(tmp_path / "runs") in str(local)
    assert plan_node(dag, "ft", {})[1] == key1  # same version: same key, fetched once
    register("v2")  # a new champion
    spec2, key2 = plan_node(dag, "ft", {})
    assert (Path(spec2.model.name_or_path) / "config.json").read_text() == "v2" and key2 != key1
