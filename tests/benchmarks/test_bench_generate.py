"""posttrain.benchmarks.generate at its smallest (the debug preset, one greedy batch of 3, n = 2, 4 new tokens,
two timed runs a side): the JSON it promises (with the floor of the model's own forwards), and
greedy tokens equal on the three sides (the engine, the static sampler, transformers). The figures
themselves are never compared. Each (case, side) is a process of its own (about 6 s here), so
the test runs two cases, not three: a batch of 3 (prompts of drawn lengths) covers the batch of 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_a_real_model_is_benchmarked_on_its_own_weights_and_a_preset_on_random_ones(tmp_path):
    """--models takes a real model (here an HF directory; a packaged name or `.gguf` resolves the
    same way, through the stages' model references) as it is, and saves a preset's random weights."""
    from posttrain.benchmarks.generate import checkpoint
    from posttrain.core.model import build_model, get_preset
    from posttrain.registry.hf import save_pretrained

    real = tmp_path / "real"
    save_pretrained(build_model(get_preset("debug"), seed=3), real)
    assert checkpoint(str(real), tmp_path / "work") == (real, "pretrained")
    (tmp_path / "work").mkdir()
    path, weights = checkpoint("debug", tmp_path / "work")
    assert (path, weights) == (tmp_path / "work" / "debug", "random (seed 0)") and (path / "config.json").exists()


@pytest.mark.slow
def test_generate_benchmark_reports_three_sides(tmp_path):
    out = tmp_path / "generate.json"
    cmd = [sys.executable, "-m", "posttrain.flows.cli", "bench", "generate", "--models", "debug", "--batches", "3",
           "--samples", "2", "--new-tokens", "4", "--reps", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())["models"]["debug"]
    assert report["weights"] == "random (seed 0)" and report["parameters"] > 0
    cases = report["cases"]
    assert set(cases) == {"greedy_b3", "sampled_b16_n2"}
    for name, case in cases.items():
        for side in ("engine", "static", "transformers", "floor"):
            rows = 16 * 2 if name.startswith("sampled") else int(name[len("greedy_b"):])
            assert case[side]["generated"] == rows * 4 and case[side]["tokens_per_s"] > 0
            reps = case[side]["reps_seconds"]  # two timed runs, the median (their mean) reported
            assert len(reps) == 2 and abs(case[side]["seconds"] - sum(reps) / 2) < 1e-3
        assert case["engine_share_of_floor"] == round(case["engine"]["tokens_per_s"] / case["floor"]["tokens_per_s"], 3)
        assert case["speedup_vs_static"] == round(case["engine"]["tokens_per_s"] / case["static"]["tokens_per_s"], 3)
        if name.startswith("greedy"):
            assert case["tokens_equal"] == {"engine": True, "transformers": True}
