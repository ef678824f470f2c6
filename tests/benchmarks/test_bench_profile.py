"""posttrain.benchmarks.profile at its smallest: one profiled SFT step per side, summed by op category. What
must hold whatever the machine: the categories account for the step (every op's self time in one
category, the rest `unaccounted`), the matrix products are where both sides spend time, the
baseline pads at least the real tokens, and the ratios follow from the figures."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from posttrain.benchmarks.profile import category, main  # noqa: E402


def test_categories():
    assert category("aten::mm") == category("aten::addmm") == "matmul"
    assert category("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention"
    assert category("aten::_log_softmax_backward_data") == "loss"
    assert category("aten::_foreach_mul_") == "optimizer"
    assert category("aten::silu") == category("aten::mul") == "other"


def test_profile_document(tmp_path):
    out = tmp_path / "profile.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(["--quick", "--shapes", "dense", "--out", str(out)]) == 0
    doc = json.loads(stdout.getvalue())
    assert json.loads(out.read_text()) == doc
    dense = doc["shapes"]["dense"]
    for side in ("ours", "baseline"):
        s = dense[side]
        assert s["step_s"] > 0 and s["seconds"]["matmul"] > 0
        assert sum(s["seconds"].values()) >= s["step_s"] * 0.999  # ops' self time + unaccounted
        assert s["share"]["matmul"] == pytest.approx(s["seconds"]["matmul"] / s["step_s"])
        assert any(o["op"] == "aten::mm" for o in s["top_ops"])
    assert dense["baseline"]["padded_tokens"] >= dense["baseline"]["tokens"] == dense["ours"]["tokens"]
    assert dense["baseline_over_ours"]["step"] == pytest.approx(dense["baseline"]["step_s"] / dense["ours"]["step_s"])
