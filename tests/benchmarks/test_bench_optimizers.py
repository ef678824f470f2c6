"""posttrain.benchmarks.optimizers runs at its smallest and reports what it promises; AdamW's state is two
fp32 moments per parameter on any machine, the others less (timings are never compared)."""

from __future__ import annotations

import json

from posttrain.benchmarks.optimizers import main


def test_optimizer_benchmark_reports_state_per_parameter(tmp_path, capsys):
    out = tmp_path / "optimizers.json"
    assert main(["--steps", "2", "--seq", "32", "--names", "adamw", "adafactor", "muon", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "optimizers" and set(doc["optimizers"]) == {"adamw", "adafactor", "muon"}
    r = doc["optimizers"]
    assert 8 <= r["adamw"]["bytes_per_param"] < 8.01
    assert r["adafactor"]["bytes_per_param"] < r["muon"]["bytes_per_param"] < r["adamw"]["bytes_per_param"]
    assert all(v["step_ms"] > 0 and v["state_bytes"] > 0 for v in r.values())
