"""posttrain.core.tracking against a real MLflow backend (sqlite in tmp): params, metrics, nesting, resume,
artifacts, and an outage during which nothing raises and everything is delivered afterwards."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient

from posttrain.core.tracking import TrackingConfig
from posttrain.core.tracking import MASK, NullTracker, Tracker, create_tracker, flatten_params


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    """One sqlite store for the module: creating its tables takes seconds, experiments are cheap."""
    root = tmp_path_factory.mktemp("mlflow")
    return f"sqlite:///{root}/mlflow.db", root


def config(backend, **kw) -> TrackingConfig:
    uri, root = backend
    name = f"exp-{uuid.uuid4().hex[:8]}"
    return TrackingConfig(tracking_uri=uri, experiment=name, artifact_location=str(root / name), **kw)


@pytest.fixture(autouse=True)
def _no_inherited_parent(monkeypatch):
    for var in ("POSTTRAIN_PARENT_RUN_ID", "MLFLOW_PARENT_RUN_ID", "RANK"):
        monkeypatch.delenv(var, raising=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NESTED = {
    "optim": {"lr": 3e-4, "betas": (0.9, 0.95)},
    "data": {"max_tokens": 2048, "batch_tokens": None, "sources": ["a.jsonl", "b.jsonl"]},
    "hub": {"token": "hf_abcdef", "api_key": "sk-123", "tokenizer": "gpt2"},
    "db": {"uri": "postgresql://alice:hunter2@db:5432/mlflow", "s3": "https://s3/x?token=zzz&a=1"},
    "launcher": {"env": {"HF_TOKEN": "hf_xyz", "OMP_NUM_THREADS": "4"},
                 "volumes": [{"name": "v", "password": "pw1"}]},
    "notes": "n" * 7000,
    "empty": {},
}


def test_flatten_params_masks_and_truncates():
    flat = flatten_params(NESTED)
    assert flat["optim.lr"] == "0.0003" and flat["optim.betas"] == "[0.9, 0.95]"
    assert flat["data.max_tokens"] == "2048" and flat["data.batch_tokens"] == "None"  # not secrets
    assert flat["data.sources"] == '["a.jsonl", "b.jsonl"]'
    assert flat["hub.token"] == flat["hub.api_key"] == flat["launcher.env.HF_TOKEN"] == MASK
    assert flat["hub.tokenizer"] == "gpt2" and flat["launcher.env.OMP_NUM_THREADS"] == "4"
    assert flat["db.uri"] == "postgresql://alice:***@db:5432/mlflow"
    assert flat["db.s3"] == "https://s3/x?token=***&a=1"
    assert json.loads(flat["launcher.volumes"]) == [{"name": "v", "password": MASK}]
    assert len(flat["notes"]) == 6000 and flat["notes"].endswith("...[truncated]")
    assert flat["empty"] == "{}"
    assert not any(s in v for v in flat.values() for s in ("hunter2", "hf_abc", "sk-123", "hf_xyz", "pw1", "zzz"))


def test_params_tags_and_metrics_read_back(backend):
    cfg = config(backend, tags={"team": "post"})
    with Tracker(cfg, "sft", tags={"stage": "sft"}, flush_every=50) as tr:
        tr.log_params(NESTED)
        tr.log_params({"tracking": cfg}, prefix="cfg")  # a pydantic model inside
        tr.log_params({"optim": {"lr": 1.0}})  # a changed value is not sent (MLflow params are immutable)
        for step in range(5):
            tr.log_metrics({"loss": 1.0 / (step + 1), "lr": step * 0.1}, step=step)
        tr.log_metrics({"many": float(i) for i in range(3)}, step=7)
        for i in range(1200):  # more than one log_batch
            tr.log_metrics({"tokens": i}, step=i)
        assert tr.flush()
        run_id = tr.run_id
    client = MlflowClient(cfg.tracking_uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "sft"
    assert run.data.tags["team"] == "post" and run.data.tags["stage"] == "sft"
    params = run.data.params
    assert params["optim.lr"] == "0.0003" and params["hub.token"] == MASK
    assert params["db.uri"] == "postgresql://alice:***@db:5432/mlflow"
    assert params["cfg.tracking.experiment"] == cfg.experiment and len(params["notes"]) == 6000
    history = client.get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(s, 1.0 / (s + 1)) for s in range(5)]
    assert [m.step for m in client.get_metric_history(run_id, "many")] == [7]
    assert sorted(m.step for m in client.get_metric_history(run_id, "tokens")) == list(range(1200))


def test_child_nests_under_parent_from_another_client(backend, monkeypatch):
    cfg = config(backend)
    client = MlflowClient(cfg.tracking_uri)
    exp_id = client.create_experiment(cfg.experiment, artifact_location=cfg.artifact_location)
    parent = client.create_run(exp_id, run_name="pipeline").info.run_id  # "the flow's process"

    monkeypatch.setenv("POSTTRAIN_PARENT_RUN_ID", parent)
    with Tracker(cfg, "sft") as child:
        child.log_metrics({"loss": 1.0}, step=0)
    with Tracker(cfg, "dpo", parent_run_id=parent) as explicit:
        assert explicit.child_env() == {"POSTTRAIN_PARENT_RUN_ID": explicit.run_id,
                                        "MLFLOW_TRACKING_URI": cfg.tracking_uri}
    children = client.search_runs([exp_id], filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    assert sorted(r.info.run_name for r in children) == ["dpo", "sft"]
    assert {r.info.run_id for r in children} == {child.run_id, explicit.run_id}


def test_resume_by_run_id(backend):
    cfg = config(backend)
    first = Tracker(cfg, "sft")
    first.log_metrics({"loss": 3.0}, step=0)
    first.end("FAILED")
    client = MlflowClient(cfg.tracking_uri)
    assert client.get_run(first.run_id).info.status == "FAILED"
    with Tracker(cfg, "sft", run_id=first.run_id) as again:
        # a run resumed by id starts without waiting for MLflow; its first delivery resumes it
        assert again.run_id == first.run_id and again.flush(timeout=60)
        assert client.get_run(first.run_id).info.status == "RUNNING"
        again.log_metrics({"loss": 2.0}, step=1)
    assert client.get_run(first.run_id).info.status == "FINISHED"
    assert sorted((m.step, m.value) for m in client.get_metric_history(first.run_id, "loss")) == [(0, 3.0), (1, 2.0)]
    assert len(client.search_runs([again.experiment_id])) == 1


def test_a_run_opened_by_the_flow_is_resumed_by_the_stage(backend, monkeypatch):
    """open_run (the flow, at launch) then stage_run in the stage's process (POSTTRAIN_RUN_ID): one
    run, started when it was opened, nested under the parent, re-tagged with the stage's process."""
    from posttrain.core.tracking import open_run
    from posttrain.core.tracking.recovery import PID_TAG
    from posttrain.stages.common import stage_run
    from posttrain.stages.config import SFTConfig

    cfg = config(backend)
    parent = open_run(cfg, "pipeline")
    run_id = open_run(cfg, "student", parent, {"posttrain.stage": "sft"})
    client = MlflowClient(cfg.tracking_uri)
    opened = client.get_run(run_id)
    assert opened.info.status == "RUNNING" and opened.data.tags["mlflow.parentRunId"] == parent
    assert client.get_experiment(opened.info.experiment_id).tags["mlflow.experimentKind"] == \
        "custom_model_development"
    time.sleep(0.05)
    monkeypatch.setenv("POSTTRAIN_RUN_ID", run_id)
    monkeypatch.setenv("POSTTRAIN_RUN_NAME", "student")
    stage_cfg = SFTConfig(output_dir="unused", tracking=cfg)
    with stage_run(stage_cfg, "sft") as run:
        assert run.run_id == run_id
        run.log_metrics({"train/sft_loss": 1.5}, step=0)
    done = client.get_run(run_id)
    assert done.info.status == "FINISHED" and done.info.start_time == opened.info.start_time
    assert done.data.metrics["train/sft_loss"] == 1.5 and done.data.params["tracking.experiment"] == cfg.experiment
    assert done.data.tags[PID_TAG] == str(os.getpid())
    assert [r.info.run_id for r in client.search_runs([opened.info.experiment_id])
            if r.data.tags.get("mlflow.parentRunId") == parent] == [run_id]


def test_artifacts(backend, tmp_path):
    cfg = config(backend)
    (tmp_path / "report.md").write_text("# eval\n")
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "rank0.json").write_text("{}")
    with Tracker(cfg, "eval") as tr:
        tr.log_artifact(tmp_path / "report.md")
        tr.log_artifact(tmp_path / "traces", "profiler")
        tr.log_dict({"acc": 0.5}, "metrics/summary.json")
        tr.log_dict({"a": [1, 2]}, "config.yaml")
        tr.log_text("hello", "notes.txt")
        tr.log_artifact(tmp_path / "gone.txt")  # missing: warned about, never blocks the rest
    client = MlflowClient(cfg.tracking_uri)
    top = {a.path for a in client.list_artifacts(tr.run_id)}
    assert top == {"report.md", "profiler", "metrics", "config.yaml", "notes.txt"}
    assert [a.path for a in client.list_artifacts(tr.run_id, "profiler")] == ["profiler/rank0.json"]
    local = client.download_artifacts(tr.run_id, "metrics/summary.json", str(tmp_path / "dl"))
    assert json.loads(Path(local).read_text()) == {"acc": 0.5}
    assert Path(client.download_artifacts(tr.run_id, "config.yaml", str(tmp_path / "dl"))).read_text() == "a:\n- 1\n- 2\n"


def test_outage_buffers_then_delivers(backend, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    cfg = config(backend)
    down = cfg.model_copy(update={"tracking_uri": f"http://127.0.0.1:{free_port()}"})  # nothing listens
    with caplog.at_level(logging.WARNING, logger="posttrain.core.tracking"):
        tr = Tracker(down, "sft", max_buffer=8, connect_timeout_s=30)
        assert tr.run_id is None
        tr.log_params({"optim": {"lr": 0.1}})
        for step in range(10):  # never raises; the two oldest points fall out of the bounded buffer
            tr.log_metrics({"loss": float(step)}, step=step)
        assert tr.flush(timeout=30) is False and tr.flush(timeout=30) is False
        # pending: 8 metric points, the param, and the 3 tags saying where the run runs (host, pid, start)
        assert tr.dropped == 2 and tr.pending() == 8 + 1 + 3
        assert caplog.text.count("unreachable or failing") == 1  # once per outage

        tr.tracking_uri = cfg.tracking_uri  # the backend is there again (here: failover to sqlite)
        assert tr.flush(timeout=60)
        assert "is back" in caplog.text
    client = MlflowClient(cfg.tracking_uri)
    history = client.get_metric_history(tr.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(2, 10))
    assert client.get_run(tr.run_id).data.params == {"optim.lr": "0.1"}
    tr.end()
    assert client.get_run(tr.run_id).info.status == "FINISHED"


def test_only_rank_zero_tracks(backend, monkeypatch):
    cfg = config(backend)
    assert isinstance(create_tracker(cfg, "sft", rank=1), NullTracker)
    assert isinstance(create_tracker(cfg.model_copy(update={"enabled": False}), "sft", rank=0), NullTracker)
    monkeypatch.setenv("RANK", "3")
    null = create_tracker(cfg, "sft")
    assert type(null) is NullTracker
    with null:
        null.log_metrics({"loss": 1.0}, step=0)
        null.log_params({"a": 1})
        assert null.flush()
    assert MlflowClient(cfg.tracking_uri).get_experiment_by_name(cfg.experiment) is None


# ---------------------------------------------------------------------------------- a real server

def _start_server(store: str, artifacts: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store, "--default-artifact-root",
         str(artifacts), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("mlflow server did not start")


def _stop_server(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, 15)  # the server's own process group: it and its workers, nothing else
    proc.wait(timeout=30)


@pytest.mark.slow
def test_server_outage_mid_run(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # a refused connection fails at once
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")  # a busy CI box answers slowly
    port, store = free_port(), f"sqlite:///{tmp_path}/server.db"
    uri = f"http://127.0.0.1:{port}"
    server = _start_server(store, tmp_path / "art", port)
    try:
        tr = Tracker(TrackingConfig(tracking_uri=uri, experiment="outage"), "sft")
        for step in range(5):
            tr.log_metrics({"loss": float(step)}, step=step)
        assert tr.flush(timeout=30)
        _stop_server(server)
        with caplog.at_level(logging.WARNING, logger="posttrain.core.tracking"):
            for step in range(5, 10):
                tr.log_metrics({"loss": float(step)}, step=step)
            assert tr.flush(timeout=30) is False
            assert "unreachable or failing" in caplog.text
            server = _start_server(store, tmp_path / "art", port)
            assert tr.flush(timeout=60)
        tr.end()
        history = MlflowClient(uri).get_metric_history(tr.run_id, "loss")
        assert sorted(m.step for m in history) == list(range(10))
        assert MlflowClient(uri).get_run(tr.run_id).info.status == "FINISHED"
    finally:
        if server.poll() is None:
            _stop_server(server)
