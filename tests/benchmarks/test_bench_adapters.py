"""posttrain.benchmarks.adapters runs end to end at its smallest (--quick --adapters 2 --steps 1) and prints
the JSON document it promises. Figures are never compared with fixed values; what must hold on
any machine: the one job and the separate jobs start from the same loss (the same documents and
adapters), throughputs and memory are positive, and the ratios follow from the per-side figures."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # forks a forkserver and 3 jobs (~30 s on a loaded 2-core machine)


def test_quick_benchmark_document(tmp_path):
    out = tmp_path / "adapters.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "posttrain.flows.cli", "bench", "adapters", "--quick", "--adapters", "2",
                           "--steps", "1", "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == doc
    assert doc["benchmark"] == "adapters" and list(doc["adapters"]) == ["2"]
    r = doc["adapters"]["2"]
    assert r["loss_check"]["met"] and doc["loss_check"]["met"], r["loss_check"]
    one, sep = r["one_job"], r["separate"]
    for x in (one["tokens_per_s"], one["peak_mem_mb"], sep["tokens_per_s"], sep["peak_mem_mb_max"]):
        assert isinstance(x, float) and math.isfinite(x) and x > 0
    assert len(sep["tokens_per_s_jobs"]) == 2 and sep["peak_mem_mb_sum"] >= sep["peak_mem_mb_max"]
    assert r["ratios"]["speedup"] == pytest.approx(one["tokens_per_s"] / sep["tokens_per_s"])
    assert r["ratios"]["memory_vs_all_separate_jobs"] == pytest.approx(one["peak_mem_mb"] / sep["peak_mem_mb_sum"])
