"""posttrain.benchmarks.qat runs its whole pipeline at its smallest (real stage runs: SFT, SFT with QAT, PTQ
of the float models, evaluation) and reports every model it promises (the numbers of so short a
run mean nothing and are not compared)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from posttrain.benchmarks.qat import main

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")]


def test_qat_benchmark_reports_float_ptq_and_qat(tmp_path):
    out = tmp_path / "qat.json"
    assert main(["--quick", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "qat" and set(doc["exact_match"]) == {"a", "b", "a_more", "b_more", "c"}
    assert all(0.0 <= v <= 1.0 for v in doc["exact_match"].values()) and doc["held_out"] > 0
    assert set(doc["stage_seconds"]) == {"a", "a_more", "c"}
