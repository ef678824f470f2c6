"""posttrain.benchmarks.dpo runs end to end at its smallest (--quick: one warmup step and two timed steps per
side, one repetition) and prints the one JSON document it promises.

Slow: a forkserver that imports torch, transformers, peft, trl and datasets, then four processes
forked from it (the export and four measured sides), about half a minute on a loaded 2-core
machine. Timings and memory are never compared with fixed figures; what must hold whatever the
machine: both sides compute the same DPO losses and gradient norms (within the stated
tolerances), throughputs are positive, and the reported ratios and data statistics follow from the
per-side figures and the pairs.
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
from posttrain.benchmarks.dpo import (EXTRA_SIDES, FIRST_LOSS_ATOL, GRAD_NORM_RTOL, QUICK, SECOND_LOSS_RTOL,  # noqa: E402
                            TARGETS, main, step_tokens, steps_of)

pytestmark = pytest.mark.slow
LOG2 = math.log(2)


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "dpo.json"
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
    assert doc["benchmark"] == "dpo" and doc["quick"] is True
    assert doc["device"] == "cpu" and doc["dtype"] == "float32"
    assert {"torch", "transformers", "peft", "trl"} <= doc["versions"].keys()
    cfg = doc["config"]
    assert cfg["model"] == QUICK["model"]
    assert (cfg["warmup"], cfg["steps"], cfg["reps"]) == (QUICK["warmup"], QUICK["steps"], QUICK["reps"])
    assert cfg["lora"]["rank"] == 16 and cfg["lora"]["alpha"] == 32 and cfg["lora"]["targets"] == "all-linear"
    assert cfg["beta"] == 0.1 and cfg["loss_type"] == "sigmoid" and cfg["reference"] == "disable_adapter"
    assert cfg["optim"]["lr"] == 1e-4 and cfg["optim"]["grad_clip"] is None
    assert 0 < cfg["trainable_params"] < cfg["total_params"]
    assert {"tokens_per_s", "peak_mem_mb", "speedup", "memory_ratio", "sft_step_ratio", "loss_check"} \
        <= doc["method"].keys()
    assert doc["wall_s"] > 0


def test_same_dpo_computation_on_both_sides(doc):
    """Step 0: both exactly log 2 (policy == reference) with the same gradient norm; step 1, on the
    same pairs after one AdamW update: the same drop below log 2 and the same gradient norm."""
    lc, ours, trl = doc["loss_check"], doc["ours"], doc["trl"]
    n_steps = doc["config"]["warmup"] + doc["config"]["steps"]
    for side in SIDES:
        assert len(doc[side]["losses"]) == len(doc[side]["grad_norms"]) == n_steps, side
    first = lc["first_step_loss"]
    assert first["ours"] == ours["losses"][0] and first["trl"] == trl["losses"][0]
    assert abs(first["ours"] - LOG2) <= FIRST_LOSS_ATOL and abs(first["trl"] - LOG2) <= FIRST_LOSS_ATOL
    assert first["abs_diff"] == abs(first["ours"] - first["trl"]) and first["met"] is True
    for key, step in (("first_step_grad_norm", 0), ("second_step_grad_norm", 1)):
        g = lc[key]
        assert g["ours"] == ours["grad_norms"][step] > 0 and g["trl"] == trl["grad_norms"][step] > 0, key
        assert g["rel_diff"] == pytest.approx(_rel(g["ours"], g["trl"]), rel=1e-9, abs=1e-15)
        assert g["tolerance"] == GRAD_NORM_RTOL and g["rel_diff"] <= GRAD_NORM_RTOL and g["met"] is True, g
    second = lc["second_step_loss"]
    assert second["ours"] == ours["losses"][1] and second["trl"] == trl["losses"][1]
    assert second["ours"] < LOG2 and second["trl"] < LOG2  # the update lowered the loss on those pairs
    assert second["rel_diff_of_distance_from_log2"] == pytest.approx(
        _rel(second["ours"] - LOG2, second["trl"] - LOG2), rel=1e-9, abs=1e-15)
    assert second["tolerance"] == SECOND_LOSS_RTOL and second["rel_diff_of_distance_from_log2"] <= SECOND_LOSS_RTOL
    assert second["met"] is True and lc["met"] is True
    assert lc["max_rel_diff_all_steps"] == pytest.approx(max(map(_rel, ours["losses"], trl["losses"])),
                                                         rel=1e-9, abs=1e-15)
    # rewards margin: 0 at step 0 on both sides (TRL's from its logs), equal after the update
    assert ours["margins"][0] == 0.0 and trl["margins"][0] == 0.0
    assert ours["margins"][1] == pytest.approx(trl["margins"][1], rel=1e-2)
    # reference 'precomputed': the starting policy's log-probs, computed once, are what disabling
    # the adapter gives live (the base): the same losses and gradients, step after step
    pre = doc["ours_precomputed"]
    assert pre["losses"] == pytest.approx(ours["losses"], rel=1e-5, abs=1e-7)
    assert pre["grad_norms"] == pytest.approx(ours["grad_norms"], rel=1e-4)
    assert pre["reference_precompute_s"] > 0
    # the SFT floor trained the same tokens with cross entropy: near log V at the start
    assert abs(doc["ours_sft"]["losses"][0] - math.log(doc["config"]["model"]["vocab_size"])) < 1.0


def test_throughput_memory_and_ratios_are_consistent(doc):
    cfg = doc["config"]
    timed_tokens = sum(doc["data"]["tokens_per_step"][cfg["warmup"]:])
    for side in SIDES + EXTRA_SIDES:
        s = doc[side]
        assert _positive(s["tokens_per_s"]), (side, s)
        assert len(s["tokens_per_s_reps"]) == len(s["peak_mem_mb_reps"]) == cfg["reps"]
        assert len(s["step_s"]) == cfg["steps"] and all(t > 0 for t in s["step_s"])
        # tokens/s counts the real tokens of the timed steps over their summed step times
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
    pre = [s / p for p, s in zip(doc["ours_precomputed"]["tokens_per_s_reps"], doc["ours_sft"]["tokens_per_s_reps"])]
    assert r["sft_step_ratio_precomputed_reps"] == pytest.approx(pre)
    assert r["sft_step_ratio_precomputed"] == pytest.approx(pre[0])
    if doc["trl"]["peak_mem_mb"] > 0:
        assert r["memory_ratio"] == pytest.approx(doc["ours"]["peak_mem_mb"] / doc["trl"]["peak_mem_mb"])
    for name, (op, value) in TARGETS.items():
        t = doc["targets"][name]
        assert t["value"] == r[name] and t["target"] == f"{op} {value}"
        assert t["met"] is (t["value"] >= value if op == ">=" else t["value"] <= value)


def test_data_follows_from_the_pairs(doc):
    cfg = doc["config"]
    steps = steps_of(cfg)
    per_step = cfg["pairs_per_micro"] * cfg["micro_per_step"]
    assert len(steps) == cfg["warmup"] + cfg["steps"]
    assert all(len(m) == cfg["pairs_per_micro"] for s in steps for m in s)
    assert steps[0] == steps[1]  # the loss check's second step sees the first step's pairs again
    d = doc["data"]
    assert d["pairs"] == per_step * len(steps) and d["pairs_per_step"] == per_step
    assert d["tokens_per_step"] == [step_tokens(s) for s in steps]
    flat = [p for s in steps for m in s for p in m]
    assert all(c[-1] == 0 and r[-1] == 0 and 0 not in p for p, c, r in flat)  # completions end with EOS
    assert len({len(c) for _, c, _ in flat}) > 1  # ragged (lognormal) lengths
    assert d["max_sequence_len"] <= cfg["model"]["max_position_embeddings"]
    # TRL's collator pads each micro-batch to its longest row: some padding on ragged lengths
    padded = doc["trl"]["padded_tokens_per_step"]
    assert all(p >= t for p, t in zip(padded, d["tokens_per_step"]))
    assert 0 < doc["trl"]["padding_fraction"] < 1
