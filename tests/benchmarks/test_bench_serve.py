"""posttrain.benchmarks.serve at its smallest (the debug preset, one replica, concurrency 1 and 2, 4 requests
of 4 tokens): the JSON it promises, every request answered on both sides, and the server's
completion token counts equal to transformers' (greedy parity: the same work on both sides). The
figures themselves are never compared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.benchmarks.serve import parse_layout, percentile



def test_layouts_and_percentiles():
    assert parse_layout("r2") == (2, 1) and parse_layout("r1tp2") == (1, 2)
    for bad in ("2", "r0", "r1tp0", "tp2"):
        with pytest.raises(Exception, match="layout"):
            parse_layout(bad)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0, 2.0], 99) == pytest.approx(1.99)


@pytest.mark.slow
def test_serve_benchmark_reports_both_sides(tmp_path):
    out = tmp_path / "serve.json"
    cmd = [sys.executable, "-m", "posttrain.flows.cli", "bench", "serve", "--models", "debug", "--layouts", "r1",
           "--concurrency", "1", "2", "--requests", "4", "--max-tokens", "4", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=os.environ, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(out.read_text())["models"]["debug"]["cases"]
    assert set(cases) == {"transformers_c1", "transformers_c2", "r1_c1", "r1_c2"}
    for name, case in cases.items():
        assert case["requests"] == 4 and case["failed"] == 0, (name, case)
        assert case["tokens_per_s"] > 0 and case["ttft_p50_s"] <= case["latency_p99_s"], (name, case)
    for c in (1, 2):
        assert cases[f"r1_c{c}"]["completion_tokens"] == cases[f"transformers_c{c}"]["completion_tokens"]
        assert cases[f"r1_c{c}"]["speedup_vs_transformers"] > 0
