"""posttrain.benchmarks.load_memory runs end to end at its smallest (the `debug` preset, 2 ranks, both
paths, a bf16 checkpoint into an fp32 model) and writes the JSON document it promises. The
memory figures themselves depend on the machine and are never compared with fixed values; what
must hold anywhere: every rank reports, peaks are at least the RSS before loading, and the new
path reads exactly its shards (FSDP splits every tensor), in bf16: half their fp32 bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest



@pytest.mark.slow
def test_load_memory_benchmark_reports_every_rank(tmp_path):
    out = tmp_path / "load_memory.json"
    cmd = [sys.executable, "-m", "posttrain.benchmarks.load_memory", "--models", "debug", "--nproc", "2", "--cases", "bfloat16:float32",
           "--workdir", str(tmp_path / "work"), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["nproc"] == 2 and doc["command"].startswith("python -m posttrain.benchmarks")
    entry = doc["models"]["debug"]["bfloat16:float32"]
    for path in ("old", "new"):
        ranks = entry[path]["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        for r in ranks:
            assert r["peak_rss_mb"] >= r["rss_before_mb"] > 0 and r["seconds"] > 0 and r["peak_anon_mb"] > 0
            assert r["added_mb"] == pytest.approx(r["peak_rss_mb"] - r["rss_before_mb"])
        assert entry[path]["max_peak_rss_mb"] == round(max(r["peak_rss_mb"] for r in ranks), 1)
    assert all(r["read_mb"] == 0 for r in entry["old"]["ranks"])
    assert all(r["read_mb"] == r["shard_mb"] / 2 > 0 for r in entry["new"]["ranks"])
    assert entry["peak_ratio_new_old"] == round(entry["new"]["max_peak_rss_mb"] / entry["old"]["max_peak_rss_mb"], 3)
