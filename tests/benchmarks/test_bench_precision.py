"""posttrain.benchmarks.precision runs at its smallest and reports what it promises (timings are never
compared): each mode trains the same batches from the same weights, so the first losses agree to
16-bit rounding, and fp8 says when it was emulated."""

from __future__ import annotations

import importlib.util
import json
import math

from posttrain.benchmarks.precision import main

import pytest


@pytest.mark.slow
def test_precision_benchmark_reports_each_mode(tmp_path):
    out = tmp_path / "precision.json"
    modes = ["full", "bf16", "fp16"] + (["fp8"] if importlib.util.find_spec("torchao") else [])
    assert main(["--quick", "--steps", "2", "--modes", *modes, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "precision" and list(doc["modes"]) == modes
    r = doc["modes"]
    assert r["full"]["speedup_vs_fp32"] == 1.0
    for mode in modes:
        assert r[mode]["tokens_per_s"] > 0 and r[mode]["peak_rss_mb"] > 0 and r[mode]["skipped"] == 0, mode
        assert math.isclose(r[mode]["loss_first"], r["full"]["loss_first"], rel_tol=1e-2), mode
    if "fp8" in r:
        assert r["fp8"]["emulated"] is True  # no CUDA here
