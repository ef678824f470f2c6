"""posttrain.benchmarks.online at its smallest (the debug preset, 4 prompts, 2 samples of 4 tokens): the JSON
it promises, each side the real DPO stage with the steps asked, and the disaggregated side's pairs
the colocated engine's token for token. The figures themselves are never compared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest



@pytest.mark.slow
def test_online_benchmark_reports_three_sides(tmp_path):
    out = tmp_path / "online.json"
    cmd = [sys.executable, "-m", "posttrain.flows.cli", "bench", "online", "--shapes", "debug", "--prompts", "4", "--samples",
           "2", "--new-tokens", "4", "--threads", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shape = json.loads(out.read_text())["shapes"]["debug"]
    assert shape["pairs_equal"] is True
    assert set(shape["sides"]) == {"static", "engine", "disaggregated"}
    for side in shape["sides"].values():
        assert side["steps"] == 1 and side["completions"] >= 4 * 2 and side["wall_s"] > side["sampling_s"] > 0
        assert side["speedup_vs_static"] == round(shape["sides"]["static"]["wall_s"] / side["wall_s"], 3)
    assert shape["sides"]["disaggregated"]["start_s"] > 0
