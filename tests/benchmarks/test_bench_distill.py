"""posttrain.benchmarks.distill runs end to end at its smallest (--quick: one warmup step and two timed steps
per side, one repetition) and prints the one JSON document it promises.

Slow: a forkserver that imports torch, transformers, peft, trl and datasets, then four processes
forked from it (the export and five measured sides). Timings and memory are never compared with
fixed figures; what must hold whatever the machine: both sides compute the same forward-KL
losses and gradient norms at steps 0 and 1 (within the stated tolerances), normalized by the same
target-token counts, throughputs are positive, and the ratios and data statistics follow from the
per-side figures and the documents.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("trl")
pytest.importorskip("datasets")

from posttrain.benchmarks.peer import SIDES  # noqa: E402
from posttrain.benchmarks.distill import (FIRST_LOSS_RTOL, GRAD_NORM_RTOL, ON_POLICY_SIDES, QUICK,  # noqa: E402
                                SECOND_LOSS_RTOL, TARGETS, main, step_targets, step_tokens, steps_of)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "distill.json"
    stdout = io.StringIO()
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # read by the forkserver main starts: tiny shapes, no contention
    try:
        with contextlib.redirect_stdout(stdout):
            assert main(["--quick", "--out", str(out)]) == 0
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
    printed = json.loads(stdout.getvalue())  # stdout is exactly one JSON document
    assert json.loads(out.read_text()) == printed
    return printed


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_metadata(doc):
    assert doc["benchmark"] == "distill" and doc["quick"] is True
    assert doc["device"] == "cpu" and doc["dtype"] == "float32"
    assert {"torch", "transformers", "peft", "trl"} <= doc["versions"].keys()
    cfg = doc["config"]
    assert cfg["model"] == QUICK["model"]
    assert (cfg["warmup"], cfg["steps"], cfg["reps"]) == (QUICK["warmup"], QUICK["steps"], QUICK["reps"])
    assert cfg["lora"]["rank"] == 16 and cfg["lora"]["alpha"] == 32 and cfg["lora"]["targets"] == "all-linear"
    assert cfg["mode"] == "online" and cfg["divergence"] == "forward_kl" and cfg["temperature"] == 1.0
    assert cfg["ce_weight"] == 0.0
    assert cfg["trl"]["beta"] == 0.0 and cfg["trl"]["lmbda"] == 0.0 and cfg["trl"]["seq_kd"] is False
    assert cfg["optim"]["lr"] == 1e-4 and cfg["optim"]["grad_clip"] is None
    assert 0 < cfg["trainable_params"] < cfg["total_params"]
    assert cfg["teacher_params"] == cfg["params"] and cfg["teacher_seed"] != cfg["seed"]
    assert {"tokens_per_s", "peak_mem_mb", "speedup", "memory_ratio", "sft_step_ratio", "loss_check"} \
        <= doc["method"].keys()
    assert doc["wall_s"] > 0


def test_same_distillation_on_both_sides(doc):
    """Step 0: the same forward KL (teacher || student) and gradient norm; step 1, on the same
    documents after one AdamW update: the same loss, dropped by the same amount, and the same
    gradient norm."""
    lc, ours, trl = doc["loss_check"], doc["ours"], doc["trl"]
    n_steps = doc["config"]["warmup"] + doc["config"]["steps"]
    for side in SIDES:
        assert len(doc[side]["losses"]) == len(doc[side]["grad_norms"]) == n_steps, side
    first = lc["first_step_loss"]
    assert first["ours"] == ours["losses"][0] > 0 and first["trl"] == trl["losses"][0] > 0
    assert first["rel_diff"] == pytest.approx(_rel(first["ours"], first["trl"]), rel=1e-9, abs=1e-15)
    assert first["tolerance"] == FIRST_LOSS_RTOL and first["rel_diff"] <= FIRST_LOSS_RTOL and first["met"] is True
    for key, step in (("first_step_grad_norm", 0), ("second_step_grad_norm", 1)):
        g = lc[key]
        assert g["ours"] == ours["grad_norms"][step] > 0 and g["trl"] == trl["grad_norms"][step] > 0, key
        assert g["rel_diff"] == pytest.approx(_rel(g["ours"], g["trl"]), rel=1e-9, abs=1e-15)
        assert g["tolerance"] == GRAD_NORM_RTOL and g["rel_diff"] <= GRAD_NORM_RTOL and g["met"] is True, g
    second = lc["second_step_loss"]
    assert second["ours"] == ours["losses"][1] and second["trl"] == trl["losses"][1]
    assert second["ours"] < first["ours"] and second["trl"] < first["trl"]  # the update lowered the KL there
    assert second["rel_diff"] <= FIRST_LOSS_RTOL
    assert second["rel_diff_of_drop"] == pytest.approx(
        _rel(first["ours"] - second["ours"], first["trl"] - second["trl"]), rel=1e-9, abs=1e-15)
    assert second["tolerance"] == SECOND_LOSS_RTOL and second["rel_diff_of_drop"] <= SECOND_LOSS_RTOL
    assert second["met"] is True and lc["met"] is True
    assert lc["max_rel_diff_all_steps"] == pytest.approx(max(map(_rel, ours["losses"], trl["losses"])),
                                                         rel=1e-9, abs=1e-15)
    # posttrain normalized each step by its completion tokens (TRL's num_items_in_batch)
    assert ours["target_tokens_per_step"] == doc["data"]["target_tokens_per_step"]
    # the SFT floor trained the same tokens with cross entropy: near log V at the start
    assert abs(doc["ours_sft"]["losses"][0] - math.log(doc["config"]["model"]["vocab_size"])) < 1.0


def test_throughput_memory_and_ratios_are_consistent(doc):
    cfg = doc["config"]
    timed_tokens = sum(doc["data"]["tokens_per_step"][cfg["warmup"]:])
    for side in SIDES:
        s = doc[side]
        assert _positive(s["tokens_per_s"]), (side, s)
        assert len(s["tokens_per_s_reps"]) == len(s["peak_mem_mb_reps"]) == cfg["reps"]
        assert len(s["step_s"]) == cfg["steps"] and all(t > 0 for t in s["step_s"])
        assert s["tokens_per_s"] == pytest.approx(timed_tokens / sum(s["step_s"]), rel=1e-9)
        assert s["peak_mem_mb"] == max(s["peak_mem_mb_reps"]) >= 0
        assert s["process_peak_rss_mb"] >= s["start_rss_mb"] > 0
        assert s["threads"] >= 1
    assert len(doc["trl"]["step_compute_s"]) == cfg["steps"]
    r = doc["ratios"]
    speed = [o / t for o, t in zip(doc["ours"]["tokens_per_s_reps"], doc["trl"]["tokens_per_s_reps"])]
    floor = [s / o for o, s in zip(doc["ours"]["tokens_per_s_reps"], doc["ours_sft"]["tokens_per_s_reps"])]
    assert r["speedup_reps"] == pytest.approx(speed) and r["sft_step_ratio_reps"] == pytest.approx(floor)
    assert r["speedup"] == pytest.approx(speed[0]) and r["sft_step_ratio"] == pytest.approx(floor[0])
    if doc["trl"]["peak_mem_mb"] > 0:
        assert r["memory_ratio"] == pytest.approx(doc["ours"]["peak_mem_mb"] / doc["trl"]["peak_mem_mb"])
    for name, (op, value) in TARGETS.items():
        t = doc["targets"][name]
        assert t["value"] == r[name] and t["target"] == f"{op} {value}"
        assert t["met"] is (t["value"] >= value if op == ">=" else t["value"] <= value)


def test_data_follows_from_the_documents(doc):
    cfg = doc["config"]
    steps = steps_of(cfg)
    per_step = cfg["docs_per_micro"] * cfg["micro_per_step"]
    assert len(steps) == cfg["warmup"] + cfg["steps"]
    assert all(len(m) == cfg["docs_per_micro"] for s in steps for m in s)
    assert steps[0] == steps[1]  # the second step sees the first step's documents again
    d = doc["data"]
    assert d["documents"] == per_step * len(steps) and d["docs_per_step"] == per_step
    assert d["tokens_per_step"] == [step_tokens(s) for s in steps]
    assert d["target_tokens_per_step"] == [step_targets(s) for s in steps]
    flat = [x for s in steps for m in s for x in m]
    assert all(p and c[-1] == 0 and 0 not in p for p, c in flat)  # a prompt, a completion ending with EOS
    assert len({len(c) for _, c in flat}) > 1 and len({len(p) for p, _ in flat}) > 1  # ragged (lognormal)
    assert d["max_sequence_len"] <= cfg["model"]["max_position_embeddings"]
    padded = doc["trl"]["padded_tokens_per_step"]  # TRL pads each micro-batch to its longest document
    assert all(p >= t for p, t in zip(padded, d["tokens_per_step"]))
    assert 0 < doc["trl"]["padding_fraction"] < 1


def test_on_policy_sides_sample_the_same_completions_and_agree(doc):
    """lmbda 1: both sides replace each micro-batch's completions by the student's greedy ones (ours
    through the generation engine, TRL through model.generate), so step 0 trains on the same tokens
    (equal digests) and, with TRL's normalization by the dataset's completion tokens undone, gives
    the same loss and gradient norm. --quick's max_new_tokens is shorter than the data's
    completions, so that normalization differs and the rescaling is exercised."""
    cfg, data = doc["config"], doc["data"]
    ours, trl, check = doc["ours_on_policy"], doc["trl_on_policy"], doc["on_policy_check"]
    n_steps = cfg["warmup"] + cfg["steps"]
    for side in ON_POLICY_SIDES:
        assert len(doc[side]["losses"]) == len(doc[side]["samples_digest"]) == n_steps, side
        assert len(doc[side]["tokens_per_step"]) == n_steps
        assert doc[side]["tokens_per_s"] == pytest.approx(
            sum(doc[side]["tokens_per_step"][cfg["warmup"]:]) / sum(doc[side]["step_s"]), rel=1e-9)
    assert check["same_samples_per_step"][0] is True and ours["samples_digest"][0] == trl["samples_digest"][0]
    assert ours["tokens_per_step"][0] == trl["tokens_per_step"][0]
    sampled = ours["target_tokens_per_step"][0]  # each completion at most max_new_tokens long
    assert 0 < sampled <= cfg["max_new_tokens"] * cfg["docs_per_micro"] * cfg["micro_per_step"]
    assert check["trl_scale"] == pytest.approx(data["target_tokens_per_step"][0] / sampled) != 1.0
    for key in ("first_step_loss", "first_step_grad_norm"):
        c = check[key]
        assert c["trl_rescaled"] == pytest.approx(c["trl"] * check["trl_scale"], rel=1e-12)
        assert c["rel_diff"] == pytest.approx(_rel(c["ours"], c["trl_rescaled"]), rel=1e-9, abs=1e-15)
        assert c["rel_diff"] <= c["tolerance"], (key, c)
    assert check["first_step_loss"]["ours"] == ours["losses"][0] > 0 and check["met"] is True
    r = doc["ratios"]
    speed = [o / t for o, t in zip(ours["tokens_per_s_reps"], trl["tokens_per_s_reps"])]
    assert r["speedup_on_policy_reps"] == pytest.approx(speed) and r["speedup_on_policy"] == pytest.approx(speed[0])
    assert "sft_step_ratio_trl_on_policy" not in r and r["sft_step_ratio_on_policy"] > 0
