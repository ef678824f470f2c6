"""posttrain.benchmarks.kernels runs end to end on CPU and prints the JSON document it promises.

It runs as a subprocess without TRITON_INTERPRET (the interpreter would take minutes), so every
posttrain op takes its torch reference and says so in `path`. Wall-clock values are never
asserted on, only their presence and types.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.benchmarks.kernels import OPS

IMPL_STATUSES = {"ok", "missing", "unavailable", "skipped", "error"}
# Ops whose kernels ship with the benchmark: these may never be reported missing.
CORE_OPS = {"fused_linear_cross_entropy", "fused_linear_logps", "fused_linear_distill", "flash_attn_varlen"}


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "kernels.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"  # tiny shapes: threads only add contention on a shared machine
    proc = subprocess.run([sys.executable, "-m", "posttrain.benchmarks.kernels", "--device", "cpu", "--quick", "--out", str(out)],
                          cwd=out.parent, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout)  # stdout is exactly one JSON document
    assert json.loads(out.read_text()) == printed
    return printed


def test_metadata(doc):
    assert doc["device"] == "cpu" and doc["quick"] is True
    assert "not measured" in doc["peak_mem"]  # CPU peak memory is reported as null, and says so


def test_every_op_has_records(doc):
    ops = {r["op"] for r in doc["records"]}
    assert ops == set(OPS), f"ops without a record: {set(OPS) - ops}"
    missing = {r["op"]: r["note"] for r in doc["records"] if r["status"] == "missing"}
    assert not CORE_OPS & missing.keys(), missing


def test_record_structure(doc):
    for r in doc["records"]:
        assert {"op", "shape", "dtype", "impl", "status"} <= r.keys(), r
        assert r["status"] in IMPL_STATUSES, r
        if r["status"] == "missing":
            assert r["impl"] == "posttrain" and r["note"], r
            continue
        if r["status"] != "ok":
            assert r["note"], r  # a reason for every record without a number
            continue
        assert isinstance(r["ms"], float) and r["ms"] > 0, r
        assert r["peak_mem_bytes"] is None, r  # CPU: not measured
        for key in ("ms_vs_eager", "mem_vs_eager", "ms_vs_compile", "mem_vs_compile"):
            assert key in r, (key, r)


def test_each_present_op_compares_against_eager(doc):
    by_op: dict[str, dict[str, dict]] = {}
    for r in doc["records"]:
        by_op.setdefault(r["op"], {})[r["impl"]] = r
    for op, impls in by_op.items():
        if impls.get("posttrain", {}).get("status") == "missing":
            continue
        assert impls["posttrain"]["status"] == "ok", impls["posttrain"]
        # no interpreter and no GPU: the dispatch must have taken the reference, and said so
        assert impls["posttrain"]["path"] == "torch-reference"
        assert impls["eager"]["status"] == "ok" and impls["eager"]["ms_vs_eager"] == 1.0
        assert impls["compile"]["status"] == "skipped"  # --quick on CPU
        assert impls["liger"]["status"] == "unavailable"  # needs CUDA, or has no equivalent
        assert impls["posttrain"]["ms_vs_eager"] > 0 and impls["posttrain"]["ms_vs_compile"] is None
