"""configs/user_data.yaml end to end on the shipped user-style files (steps cut down): a sweep
trained side by side, an evaluate node picking the best member by exact match on the user's eval
file, offline DPO on the user's preference pairs, two rounds of on-policy DPO on prompts-only rows
(round 2 starting from round 1), a final evaluation of every model, and the registry registering
the model the final node selected."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["nodes.prep.vocab_size=256",
         "nodes.sft.max_steps=8", "nodes.sft.eval_interval=4", "nodes.sft.model.overrides.num_layers=2",
         "nodes.pick.max_examples=12", "nodes.final.max_examples=12",
         "nodes.dpo_pairs.max_steps=3", "nodes.dpo_pairs.eval_interval=0",
         "nodes.dpo.max_steps=2", "nodes.dpo.eval_interval=0", "nodes.dpo.num_samples=2",
         "stage_retries=0"]


def test_user_data_dag_runs_end_to_end(tmp_path, monkeypatch):
    from prefect.settings import (PREFECT_SERVER_ANALYTICS_ENABLED, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
                                  temporary_settings)

    from posttrain.core.config import load_config
    from posttrain.core.manifest import read_manifest
    from posttrain.flows.config import PipelineConfig
    from posttrain.flows.pipeline import run_pipeline

    monkeypatch.chdir(ROOT)  # the config names its files relative to the repository root
    cfg = load_config(PipelineConfig, ROOT / "configs" / "user_data.yaml", QUICK + [
        f"workspace={tmp_path / 'runs'}", f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    settings = {s: v for s, v in ((PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, 180),
                                  (PREFECT_SERVER_ANALYTICS_ENABLED, False)) if s.name not in os.environ}
    with temporary_settings(settings):
        result = run_pipeline(cfg)
    assert result.ok
    assert list(result.stages) == ["prep", "sft@lr=0.003", "sft@lr=0.001", "pick", "dpo_pairs", "dpo@r1", "dpo@r2",
                                   "final"]
    run = tmp_path / "runs" / "user-data"
    pick = read_manifest(run / "pick")
    members = {str(run / "sft@lr=0.003"), str(run / "sft@lr=0.001")}
    assert set(pick["models"].values()) == members
    best = max(pick["results"].values(), key=lambda m: m["exact_match"])["exact_match"]
    assert pick["selected"]["model"] in members and pick["selected"]["value"] == best
    # offline DPO started from the picked model; round 2 from round 1
    assert read_manifest(run / "dpo_pairs")["inputs"]["model"] == read_manifest(Path(pick["selected"]["model"]))["digest"]
    assert read_manifest(run / "dpo@r2")["inputs"]["model"] == read_manifest(run / "dpo@r1")["digest"]
    records = (run / "dpo@r1" / "on_policy" / "train.jsonl").read_text().splitlines()
    first = [json.loads(r) for r in records[:3]]
    assert records and all("prompts.jsonl line" in r["where"] and len(r["samples"]) == 2 for r in first)
    final = read_manifest(run / "final")
    assert final["order"] == ["dpo@r2", "dpo@r1", "dpo_pairs", Path(pick["selected"]["model"]).name]
    assert [final["models"][n] for n in final["order"]] == [str(run / "dpo@r2"), str(run / "dpo@r1"),
                                                            str(run / "dpo_pairs"), pick["selected"]["model"]]
    assert set(final["results"]) == set(final["order"])
    for metrics in final["results"].values():
        assert 0 <= metrics["exact_match"] <= 1 and metrics["exact_match/task=add"] >= 0
    assert result.registered["model"] == final["selected"]["name"]
    assert result.registered["candidate_value"] == final["selected"]["value"]
