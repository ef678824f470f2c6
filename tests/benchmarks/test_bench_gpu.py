"""benchmarks/gpu.py, the script prepared for a lent GPU: without CUDA it stops at once saying so
(exit 2, nothing else run), and its --dry-run exercises every section on the CPU with tiny shapes
(figures meaningless, never compared): each case reports figures, or why it was skipped."""

from __future__ import annotations

import json

import pytest

from posttrain.benchmarks.gpu import SECTIONS, main


def test_without_cuda_it_fails_fast_and_says_why(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without one, here or on a GPU
    assert main([]) == 2
    assert "no CUDA GPU here" in capsys.readouterr().err


@pytest.mark.slow
def test_dry_run_covers_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    assert main(["--dry-run", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    s = doc["sections"]
    assert doc["dry_run"] is True and set(s) == set(SECTIONS)
    assert s["mfu"]["tokens_per_s"] > 0 and "error" not in json.dumps(s)
    for case in ("posttrain_triton", "posttrain_torch", "torch_compile", "transformers"):
        assert s["kernels"][case]["ms_per_step"] > 0, case
    assert "ms_per_step" in s["kernels"]["transformers_liger"] or "skipped" in s["kernels"]["transformers_liger"]
    first = {k: s["fp8"][k]["loss_first"] for k in ("bf16", "fp8")}
    assert abs(first["fp8"] - first["bf16"]) < 0.05 * first["bf16"], first
    assert s["generate"]["batch"]["new_tokens"] > 0 and s["generate"]["n_samples"]["n"] == 2
