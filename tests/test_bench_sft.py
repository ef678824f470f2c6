"""benchmarks.sft runs end to end (--quick) and prints the JSON document it promises.

Slow: the benchmark forks every measurement from a forkserver that imports torch, transformers
and peft first (about a minute and a half on a loaded 2-core machine). Wall-clock and memory
figures are never asserted on, only their presence and types; the loss check is asserted on,
because without it the throughput comparison would not be of the same computation.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from benchmarks.sft import LOSS_RTOL, SHAPES, TARGETS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "sft.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny shapes: threads only add contention
    proc = subprocess.run([sys.executable, "-m", "benchmarks.sft", "--quick", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout)  # stdout is exactly one JSON document
    assert json.loads(out.read_text()) == printed
    return printed


def _positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_metadata(doc):
    assert doc["benchmark"] == "sft" and doc["quick"] is True
    assert doc["device"] == "cpu" and doc["dtype"] == "float32"
    cfg = doc["config"]
    assert cfg["lora"]["rank"] == 16 and cfg["lora"]["alpha"] == 32 and cfg["optim"]["lr"] == 1e-4
    assert 0 < cfg["trainable_params"] < cfg["total_params"]
    assert {"tokens_per_s", "peak_mem_mb", "loss_check"} <= doc["method"].keys()


def test_every_shape_has_both_sides_and_ratios(doc):
    assert set(doc["shapes"]) == set(SHAPES)
    for shape, r in doc["shapes"].items():
        for side in ("ours", "baseline"):
            s = r[side]
            assert _positive(s["tokens_per_s"]), (shape, side, s)
            assert isinstance(s["peak_mem_mb"], float), (shape, side, s)
            assert _positive(s["process_peak_rss_mb"]), (shape, side, s)
            assert len(s["tokens_per_s_reps"]) == doc["config"]["reps"]
            assert len(s["losses"]) == doc["config"]["warmup"] + doc["config"]["steps"]
        assert _positive(r["ratios"]["speedup"]) and isinstance(r["ratios"]["memory_ratio"], float)
        assert r["data"]["documents"] > 0


def test_same_documents_on_both_sides(doc):
    dense, realistic = doc["shapes"]["dense"], doc["shapes"]["realistic"]
    assert dense["data"]["min_len"] == dense["data"]["max_len"]  # every sequence the same length
    assert dense["baseline"]["padding_fraction"] == 0.0
    assert realistic["data"]["min_len"] < realistic["data"]["max_len"]
    assert realistic["baseline"]["padding_fraction"] > 0.0  # ragged lengths: padded batches waste tokens


def test_loss_equal_before_any_update(doc):
    for shape, r in doc["shapes"].items():
        lc = r["loss_check"]
        assert lc["tolerance"] == LOSS_RTOL
        assert lc["met"] and lc["rel_diff"] <= LOSS_RTOL, (shape, lc)
        assert math.isclose(lc["ours"], lc["baseline"], rel_tol=LOSS_RTOL)
        # a random model over V tokens starts near log V
        assert abs(lc["ours"] - math.log(doc["config"]["model"]["vocab_size"])) < 1.0, lc
    assert doc["loss_check"]["met"] is True


def test_targets_reported(doc):
    assert set(TARGETS) <= doc["targets"].keys()
    for name in TARGETS:
        t = doc["targets"][name]
        assert isinstance(t["met"], bool) and isinstance(t["value"], float), (name, t)
    assert doc["targets"]["all_met"] == all(doc["targets"][n]["met"] for n in TARGETS)
