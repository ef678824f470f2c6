"""posttrain.benchmarks.qlora runs end to end at its smallest (--quick: one warmup step and one timed step per
side, one repetition) and prints the one JSON document it promises: posttrain's QLoRA beside
transformers + peft + bitsandbytes NF4 and beside dense peft LoRA, from the same exported weights
and adapter.

Slow: a forkserver importing torch, transformers, peft and bitsandbytes, then four forked
processes. Timings and memory are never compared with fixed figures. What must hold whatever the
machine: the two 4-bit sides start from the same loss (both NF4 formats dequantize to the same
values), the dense side's start differs by the quantization error only, the 4-bit bases hold
fewer bytes than the dense one, and the ratios follow from the per-side figures."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from posttrain.benchmarks.qlora import LOSS_RTOL, QUICK, SIDES, TARGETS, main  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "qlora.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(["--quick", "--out", str(out)]) == 0
    printed = json.loads(stdout.getvalue())
    assert json.loads(out.read_text()) == printed
    return printed


def test_same_start_on_the_4bit_sides(doc):
    lc = doc["loss_check"]
    first = lc["first_step_loss"]
    assert first == {s: doc[s]["losses"][0] for s in SIDES}
    assert lc["rel_diff"] == abs(first["ours"] - first["bnb"]) / abs(first["bnb"]) <= LOSS_RTOL and lc["met"]
    # near log V at the start (random weights); the dense model's loss is another one (no NF4 error)
    assert abs(first["ours"] - math.log(QUICK["model"]["vocab_size"])) < 1.0
    assert first["peft_lora"] != first["ours"] and abs(first["peft_lora"] - first["ours"]) < 0.05
    n = doc["config"]["warmup"] + doc["config"]["steps"]
    for side in SIDES:
        assert len(doc[side]["losses"]) == n and all(math.isfinite(x) for x in doc[side]["losses"])


def test_figures_and_ratios(doc):
    assert doc["benchmark"] == "qlora" and doc["quick"] is True
    assert {"torch", "transformers", "peft", "bitsandbytes"} <= doc["versions"].keys()
    assert doc["config"]["quant"] == {"type": "nf4", "blocksize": 64, "double_quant": False}
    for side in SIDES:
        s = doc[side]
        assert s["tokens_per_s"] > 0 and s["peak_mem_mb"] == max(s["peak_mem_mb_reps"]) >= 0
        assert s["load_peak_mem_mb"] <= s["peak_mem_mb"] and s["base_bytes"] > 0
    # both 4-bit bases are smaller than the dense one (the embedding and head stay dense everywhere)
    assert doc["ours"]["base_bytes"] < doc["peft_lora"]["base_bytes"]
    assert doc["bnb"]["base_bytes"] < doc["peft_lora"]["base_bytes"]
    r = doc["ratios"]
    assert r["memory_ratio"] == pytest.approx(doc["ours"]["peak_mem_mb"] / doc["bnb"]["peak_mem_mb"])
    assert r["memory_ratio_vs_lora"] == pytest.approx(doc["ours"]["peak_mem_mb"] / doc["peft_lora"]["peak_mem_mb"])
    assert r["speedup"] == pytest.approx(doc["ours"]["tokens_per_s"] / doc["bnb"]["tokens_per_s"])
    for name, (op, value) in TARGETS.items():
        t = doc["targets"][name]
        assert t["value"] == r[name] and t["met"] is (t["value"] <= value if op == "<=" else t["value"] >= value)
