"""LoRA DPO throughput and memory: posttrain's DPO training step beside TRL's DPOTrainer + peft, on
the same weights, adapter, optimizer and preference pairs, in one run; and how close posttrain's
DPO step comes to its floor, an SFT step on the same tokens.

    python -m posttrain.benchmarks.dpo [--quick] [--steps N] [--reps R] [--out file.json]

Needs transformers, peft, trl and datasets for the TRL side (pip install 'posttrain[bench]'); it
says so and exits with status 2, before any work, when one is missing.

Model: posttrain.benchmarks.sft's Llama shapes (full: hidden 512, 8 layers, vocab 8192; --quick: hidden 64,
2 layers, vocab 512), fp32 on CPU, random weights from posttrain.core.model saved once as an HF checkpoint
(posttrain.registry.hf.save_pretrained), LoRA rank 16, alpha 32, dropout 0, every linear layer but the
output head. Both sides start from the SAME adapter: posttrain's initial one (B = 0), written in
PEFT format by posttrain.registry.adapters.save_adapter (posttrain.benchmarks.sft.export) and loaded by both.
AdamW lr 1e-4, betas (0.9, 0.999), eps 1e-8, no weight decay, constant schedule, no clipping (the
gradient norm is still computed: clipping at infinity on both sides). DPO: beta 0.1, sigmoid
loss, reference = the base model, i.e. the policy with its adapter disabled, on both sides.

Data (fixed seed): `pairs_per_micro` x `micro_per_step` pairs per step; prompt, chosen and
rejected lengths each ~ lognormal(sigma 1) of mean `prompt_mean` / `completion_mean`, clipped;
random token ids in [1, vocab), each completion ending in the EOS id 0; every completion token is
a target. Each step takes the same pairs, in the same micro-batches, on both sides; the warmup's
first step repeats the first timed step's pairs (for the loss check, `steps_of`).

  ours      posttrain.registry.hf.load_pretrained + posttrain.registry.adapters.load_adapter; posttrain.core.trainer.Trainer;
            per micro-batch Trainer.forward_backward(collate_preference(pairs), dpo_objective(
            0.1, "sigmoid", reference=posttrain.stages.dpo.live_reference(model))) -- the objective and the
            live 'disable_adapter' reference the DPO stage builds, called directly (no stage
            launch): chosen and rejected packed padding-free in one row, one policy forward +
            backward and one no-grad forward under posttrain.core.lora.disable_adapter; then
            Trainer.optim_step (loss = sum over pairs / the step's pairs).
  trl       AutoModelForCausalLM.from_pretrained(attn_implementation="sdpa", fp32) handed to
            trl.DPOTrainer with peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=
            "all-linear") and ref_model=None, then our adapter loaded into the trainer's PeftModel
            (set_peft_model_state_dict). A PEFT config (not a ready PeftModel) is what makes TRL
            1.16 take its reference with the adapter disabled: handed a PeftModel, it would copy
            the adapter into a second "ref" adapter instead. DPOConfig: per_device_train_batch_size
            = pairs_per_micro, gradient_accumulation_steps = micro_per_step (equal micro-batches,
            so TRL's mean of micro-batch means is posttrain's mean over pairs),
            gradient_checkpointing off, bf16/fp16 off, use_cpu, optim adamw_torch, constant lr,
            max_grad_norm 0 (norm computed, no clip), sequential sampler, max_length None,
            logging every step. The pairs go in as text over a word-level tokenizer whose token
            "t<i>" is id i ("<eos>" is 0); TRL's tokenized dataset is checked to hold exactly our
            ids before training. TRL is driven through its own DPOTrainer.train(): per-step times
            come from a TrainerCallback, the losses and gradient norms from its logs.
  What differs, by design of each library: TRL right-pads each micro-batch's 2 x pairs rows to
  the longest (`padding_fraction`), posttrain packs them padding-free; TRL's fused LM head also
  computes entropy / mean-logit / top-1 metrics, and its Trainer does its own per-step
  bookkeeping; both run the reference as a second, no-grad forward with the adapter disabled.
  ours_sft  ours, but sft_objective on the same tokens: every pair's chosen and rejected
            sequences as SFT documents (prompt not a target), in the same micro-batches, packed
            padding-free. The floor a DPO step is measured against.

Measures
  tokens_per_s   prompt + completion tokens of chosen and rejected (padding not counted) over the
                 timed steps (after `warmup`) / their wall time; the median over `reps`. ours and
                 ours_sft: time around each step (collate, forward/backward, optimizer step). trl:
                 the interval between consecutive on_step_end callbacks, i.e. everything
                 Trainer.train() does per step (its batch fetch and collate, forward/backward,
                 clip-norm, optimizer step, scheduler and its per-step logging); `step_compute_s`
                 also gives on_step_begin..on_step_end (no batch fetch, no logging).
  speedup        median over reps of ours / trl tokens_per_s. Sides alternate order per rep.
  peak_mem_mb    each side and rep in a fresh process forked from one forkserver that imported
                 torch, transformers, peft, trl, datasets and posttrain and built nothing (the
                 common baseline): ru_maxrss minus the process's RSS at its start; max over reps.
                 memory_ratio = ours / trl.
  sft_step_ratio posttrain's DPO step time / posttrain's SFT step time on the same tokens (median
                 over reps); a DPO step is a policy forward + backward on chosen and rejected
                 plus one reference forward, so ideally <= 1.4.
  sft_step_ratio_precomputed
                 the same for a fourth side, `ours_precomputed`: the stage's reference
                 'precomputed' (every step's reference log-probs computed once before training,
                 untimed, as posttrain.stages.dpo does; `reference_precompute_s` is that one-time cost), so a
                 step is the policy's forward + backward alone: ideally <= 1.1.
  loss_check     step 0: policy == reference on both sides, so both losses are log 2 (within
                 FIRST_LOSS_ATOL); that alone proves nothing, so the step-0 gradient norm (the
                 DPO gradient through the LoRA B matrices) must agree within GRAD_NORM_RTOL; and
                 the second step, on the same pairs (`steps_of`) after one AdamW update, must have
                 lowered the loss below log 2 on both sides by amounts within SECOND_LOSS_RTOL
                 (relative), its gradient norm within GRAD_NORM_RTOL.
Tests never assert on the timing or memory figures; only on the document's structure and the
loss check.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Any

from posttrain.benchmarks import emit, peer
from posttrain.benchmarks.sft import FULL as SFT_FULL
from posttrain.benchmarks.sft import LORA, QUICK as SFT_QUICK, _maxrss_mb, _rss_mb

BETA = 0.1
LOSS_TYPE = "sigmoid"
SEED = 0
EOS = 0  # every completion ends with it (TRL appends an EOS to a completion that lacks one)
OPTIM = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
# Both sides start at exactly log 2 (policy == reference); fp32 rounding of the sum only.
FIRST_LOSS_ATOL = 1e-6
# Gradient norms of steps 0 and 1: fp32, but different kernels (padded sdpa + TRL's fused head vs
# packed attention + posttrain's chunked log-prob head) sum in different orders (--quick: ~1e-7).
GRAD_NORM_RTOL = 1e-4
# Step 1 on step 0's pairs: (loss - log 2) on both sides. Adam's first step is sign(g) * lr, so a
# gradient entry at rounding level may flip sign between the sides and move by a full lr
# (--quick: ~2e-5; a wrong beta, lr, reference or pair weighting is off by far more).
SECOND_LOSS_RTOL = 1e-3
TARGETS = {"sft_step_ratio": ("<=", 1.4), "sft_step_ratio_precomputed": ("<=", 1.1)}
EXTRA_SIDES = ("ours_precomputed",)
PRELOAD = ["torch", "transformers", "transformers.models.llama.modeling_llama", "peft", "peft.tuners.lora",
           "datasets", "accelerate", "trl", "trl.trainer.dpo_trainer", "safetensors.torch", "tokenizers",
           "posttrain.core.model.model", "posttrain.core.lora", "posttrain.core.trainer", "posttrain.core.objectives", "posttrain.core.data.packing",
           "posttrain.registry.hf", "posttrain.registry.adapters", "posttrain.stages.dpo"]

FULL: dict[str, Any] = dict(
    model=SFT_FULL["model"], prompt_mean=128, completion_mean=192, min_len=8, prompt_max=512, completion_max=768,
    pairs_per_micro=4, micro_per_step=2, warmup=1, steps=3, reps=3,
)
QUICK: dict[str, Any] = dict(
    model=SFT_QUICK["model"], prompt_mean=16, completion_mean=24, min_len=4, prompt_max=64, completion_max=96,
    pairs_per_micro=2, micro_per_step=2, warmup=1, steps=2, reps=1,
)

Pair = tuple[list[int], list[int], list[int]]  # prompt, chosen, rejected token ids


# ------------------------------------------------------------------------------------------ data


def pairs(cfg: dict[str, Any], n: int, seed: int = SEED) -> list[Pair]:
    """n (prompt, chosen, rejected) id lists, deterministic in seed; completions end with EOS."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def lengths(mean: float, hi: int) -> list[int]:
        sigma = 1.0
        mu = math.log(mean) - sigma**2 / 2  # the unclipped mean is `mean`
        raw = torch.exp(mu + sigma * torch.randn(n, generator=gen, dtype=torch.float64))
        return raw.round().clamp(cfg["min_len"], hi).long().tolist()

    P = lengths(cfg["prompt_mean"], cfg["prompt_max"])
    C = lengths(cfg["completion_mean"], cfg["completion_max"])
    R = lengths(cfg["completion_mean"], cfg["completion_max"])
    vocab = cfg["model"]["vocab_size"]

    def ids(k: int) -> list[int]:
        return torch.randint(1, vocab, (k,), generator=gen).tolist()

    return [(ids(p), ids(c - 1) + [EOS], ids(r - 1) + [EOS]) for p, c, r in zip(P, C, R)]


def steps_of(cfg: dict[str, Any]) -> list[list[list[Pair]]]:
    """Steps -> micro-batches -> pairs, the same on every side. Step 0 (warmup, untimed) repeats
    step 1's pairs, so step 1's loss is taken on the pairs the first update was computed from:
    it drops below log 2 by about lr * |g|_1 (Adam's first step is sign(g) * lr), far above fp32
    rounding; on fresh random pairs the change would be near zero and noise-dominated."""
    m, k = cfg["pairs_per_micro"], cfg["micro_per_step"]
    flat = pairs(cfg, m * k * (cfg["warmup"] + cfg["steps"] - 1))
    micro = [flat[i:i + m] for i in range(0, len(flat), m)]
    steps = [micro[i:i + k] for i in range(0, len(micro), k)]
    return steps[:1] + steps


def pair_tokens(pair: Pair) -> int:
    """Tokens the pair puts through the model: prompt + chosen, prompt + rejected."""
    p, c, r = pair
    return 2 * len(p) + len(c) + len(r)


def step_tokens(step: list[list[Pair]]) -> int:
    return sum(pair_tokens(p) for micro in step for p in micro)


# -------------------------------------------------------------------------- child processes


def run_side(side: str, cfg: dict[str, Any], dirs: dict[str, str], work: str) -> dict[str, Any]:
    """One side in a fresh process: load, run warmup + timed steps, report per-step figures."""
    import torch

    model_dir, adapter_dir = dirs["model"], dirs["adapter"]
    start_rss = _rss_mb()
    torch.manual_seed(SEED)
    steps = steps_of(cfg)
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON document alone
        records, info = _trl(cfg, model_dir, adapter_dir, steps, work) if side == "trl" else \
            _posttrain(cfg, model_dir, adapter_dir, steps, side)
    peak = _maxrss_mb()
    timed = slice(cfg["warmup"], None)
    seconds = [r["s"] for r in records]
    tokens = sum(step_tokens(s) for s in steps[timed])
    return {
        "tokens_per_s": tokens / sum(seconds[timed]),
        "step_s": seconds[timed],
        "losses": [r["loss"] for r in records],
        "grad_norms": [r["grad_norm"] for r in records],
        "margins": [r["margin"] for r in records],
        "peak_mem_mb": peak - start_rss,
        "process_peak_rss_mb": peak,
        "start_rss_mb": start_rss,
        "threads": torch.get_num_threads(),
        **info,
    }


def _posttrain(cfg, model_dir, adapter_dir, steps, side: str):
    import torch

    from posttrain.core.data.encode import PreferencePair
    from posttrain.core.data.packing import collate_padding_free, collate_preference
    from posttrain.core.objectives import dpo_objective, sft_objective
    from posttrain.core.optim import OptimConfig
    from posttrain.core.trainer import Trainer
    from posttrain.registry.adapters import load_adapter
    from posttrain.registry.hf import load_pretrained
    from posttrain.stages.dpo import live_reference

    model = load_pretrained(model_dir)
    load_adapter(model, adapter_dir)
    optim = OptimConfig(**OPTIM, warmup_steps=0, schedule="constant", max_grad_norm=None)
    trainer = Trainer(model, optim, total_steps=len(steps))
    sft, precomputed = side == "ours_sft", side == "ours_precomputed"
    # the stage's objective with reference 'disable_adapter' or 'precomputed' (posttrain.stages.dpo.DPO.setup)
    reference = live_reference(model)
    objective = sft_objective if sft else dpo_objective(BETA, LOSS_TYPE, reference=None if precomputed else reference)
    built = [[[PreferencePair(p, c, list(c), r, list(r)) for p, c, r in micro] for micro in step] for step in steps]
    info: dict[str, Any] = {}
    if precomputed:  # once, before training (untimed): the reference is the starting policy
        t0 = time.perf_counter()
        with torch.no_grad():
            refs = [[reference(collate_preference(micro)) for micro in step] for step in built]
        info["reference_precompute_s"] = time.perf_counter() - t0

    def collate(micro: list) -> dict:
        if sft:  # the same sequences as SFT documents: chosen then rejected, one packed row
            return collate_padding_free([x.chosen for x in micro] + [x.rejected for x in micro])
        return collate_preference(micro)

    records = []
    for i, step in enumerate(built):
        t0 = time.perf_counter()
        for j, micro in enumerate(step):
            batch = collate(micro)
            if precomputed:
                batch["ref_logps"] = refs[i][j]
            trainer.forward_backward(batch, objective)
        m = trainer.optim_step()
        records.append({"s": time.perf_counter() - t0, "loss": m["loss"], "grad_norm": m["grad_norm"],
                        "margin": m.get("rewards/margin")})
    return records, info


def _tokenizer(vocab: int):
    """Word-level: "t<i>" is id i, "<eos>" is EOS (also the pad token); no BOS, no post-processing."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<eos>": EOS, **{f"t{i}": i for i in range(1, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def _text(ids: list[int]) -> str:
    return " ".join("<eos>" if i == EOS else f"t{i}" for i in ids)


def _trl(cfg, model_dir, adapter_dir, steps, work):
    import warnings

    import datasets
    import torch
    from peft import LoraConfig, set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import DPOConfig, DPOTrainer

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore", category=FutureWarning)
    flat = [pair for step in steps for micro in step for pair in micro]
    data = datasets.Dataset.from_dict({"prompt": [_text(p) for p, _, _ in flat],
                                       "chosen": [" " + _text(c) for _, c, _ in flat],
                                       "rejected": [" " + _text(r) for _, _, r in flat]})
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
    args = DPOConfig(
        output_dir=work, seed=SEED, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=cfg["pairs_per_micro"], gradient_accumulation_steps=cfg["micro_per_step"],
        max_steps=len(steps), num_train_epochs=1, train_sampling_strategy="sequential",
        optim="adamw_torch", learning_rate=OPTIM["lr"], adam_beta1=OPTIM["betas"][0], adam_beta2=OPTIM["betas"][1],
        adam_epsilon=OPTIM["eps"], weight_decay=OPTIM["weight_decay"], lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=0.0, beta=BETA, loss_type=[LOSS_TYPE], max_length=None, precompute_ref_log_probs=False,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
        dataloader_pin_memory=False)
    begin: list[float] = []
    end: list[float] = []
    logged: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            end.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                logged.append(dict(logs))

    lora = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                      target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = DPOTrainer(model=model, ref_model=None, args=args, train_dataset=data,
                         processing_class=_tokenizer(cfg["model"]["vocab_size"]), peft_config=lora,
                         callbacks=[Clock()])
    trainer.remove_callback(PrinterCallback)  # no per-step print of the logs (stderr stays readable)
    loaded = set_peft_model_state_dict(trainer.model, load_file(str(Path(adapter_dir) / "adapter_model.safetensors")))
    missing = [k for k in loaded.missing_keys if "lora_" in k]
    if loaded.unexpected_keys or missing:
        raise RuntimeError(f"adapter did not load into peft: unexpected {loaded.unexpected_keys[:3]}, "
                           f"missing {missing[:3]}")
    if trainer.ref_model is not None or "ref" in trainer.model.peft_config:
        raise RuntimeError("TRL would not take the reference with the adapter disabled")
    got = [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in trainer.train_dataset]
    if got != [tuple(x) for x in flat]:
        raise RuntimeError("TRL's tokenized pairs differ from the benchmark's token ids")
    trainer.train()
    if not (len(begin) == len(end) == len(logged) == len(steps)):
        raise RuntimeError(f"TRL ran {len(end)} steps and logged {len(logged)}, expected {len(steps)}")
    # step i's cost: from the end of step i - 1 (the first: from its own begin) to its end
    starts = [begin[0]] + end[:-1]
    records = [{"s": e - s, "loss": float(g["loss"]), "grad_norm": float(g["grad_norm"]),
                "margin": float(g["rewards/margins"])} for s, e, g in zip(starts, end, logged)]
    padded = [0] * len(steps)
    for i, step in enumerate(steps):  # what TRL's collator pads: 2 rows a pair, to the micro-batch's longest
        padded[i] = sum(2 * len(micro) * max(len(p) + max(len(c), len(r)) for p, c, r in micro) for micro in step)
    timed = slice(cfg["warmup"], None)
    return records, {"step_compute_s": [e - b for b, e in zip(begin, end)][timed], "padded_tokens_per_step": padded}


# ------------------------------------------------------------------------------------- driver


def loss_check(ours: dict[str, Any], trl: dict[str, Any]) -> dict[str, Any]:
    """The two sides ran the same computation: module docstring, `loss_check`."""
    log2 = math.log(2)
    lo, lt = ours["losses"], trl["losses"]
    first = {"ours": lo[0], "trl": lt[0], "abs_diff": abs(lo[0] - lt[0]), "tolerance": FIRST_LOSS_ATOL,
             "ours_minus_log2": lo[0] - log2, "trl_minus_log2": lt[0] - log2}
    first["met"] = max(first["abs_diff"], abs(lo[0] - log2), abs(lt[0] - log2)) <= FIRST_LOSS_ATOL
    go, gt = ours["grad_norms"][0], trl["grad_norms"][0]
    grad = {"ours": go, "trl": gt, "rel_diff": peer.rel(go, gt), "tolerance": GRAD_NORM_RTOL}
    grad["met"] = go > 0 and grad["rel_diff"] <= GRAD_NORM_RTOL
    do, dt = lo[1] - log2, lt[1] - log2
    second = {"ours": lo[1], "trl": lt[1], "ours_minus_log2": do, "trl_minus_log2": dt,
              "rel_diff_of_distance_from_log2": peer.rel(do, dt), "rel_diff": peer.rel(lo[1], lt[1]),
              "tolerance": SECOND_LOSS_RTOL}
    # the same pairs after one update: the loss must have dropped, by the same amount on both sides
    second["met"] = do < 0 and dt < 0 and second["rel_diff_of_distance_from_log2"] <= SECOND_LOSS_RTOL
    go1, gt1 = ours["grad_norms"][1], trl["grad_norms"][1]
    grad1 = {"ours": go1, "trl": gt1, "rel_diff": peer.rel(go1, gt1), "tolerance": GRAD_NORM_RTOL}
    grad1["met"] = grad1["rel_diff"] <= GRAD_NORM_RTOL
    parts = {"first_step_loss": first, "first_step_grad_norm": grad, "second_step_loss": second,
             "second_step_grad_norm": grad1}
    return {**parts, "max_rel_diff_all_steps": max(map(peer.rel, lo, lt)), "met": all(x["met"] for x in parts.values())}


def data_stats(cfg: dict[str, Any]) -> dict[str, Any]:
    steps = steps_of(cfg)
    flat = [p for s in steps for m in s for p in m]

    def mean(xs: list[int]) -> float:
        return sum(xs) / len(xs)

    return {"pairs": len(flat), "pairs_per_step": cfg["pairs_per_micro"] * cfg["micro_per_step"],
            "mean_prompt_len": mean([len(p) for p, _, _ in flat]),
            "mean_chosen_len": mean([len(c) for _, c, _ in flat]),
            "mean_rejected_len": mean([len(r) for _, _, r in flat]),
            "max_sequence_len": max(len(p) + max(len(c), len(r)) for p, c, r in flat),
            "tokens_per_step": [step_tokens(s) for s in steps]}


def main(argv: list[str] | None = None) -> int:
    a, cfg = peer.parse("dpo", __doc__.split("\n\n")[0], FULL, QUICK, argv)
    if cfg is None:
        return 2
    from posttrain.benchmarks import dpo as this  # by module name, so the children can unpickle the functions
    from posttrain.benchmarks import sft

    sides = peer.run_sides("dpo", cfg, PRELOAD, sft.export, ("model", "adapter"), this.run_side, EXTRA_SIDES)
    timed = sum(step_tokens(s) for s in steps_of(cfg)[cfg["warmup"]:])
    doc = {
        "benchmark": "dpo",
        "quick": a.quick,
        "device": "cpu",
        "dtype": "float32",
        "versions": peer.versions(),
        "config": {**cfg, "lora": LORA, "optim": {**OPTIM, "schedule": "constant", "grad_clip": None},
                   "beta": BETA, "loss_type": LOSS_TYPE, "reference": "disable_adapter", "seed": SEED,
                   **sides["exported"]},
        "method": {
            "tokens_per_s": "prompt+completion tokens of chosen and rejected (no padding) / wall time of the timed "
                            "steps (after warmup); median over reps; ours/ours_sft: time around each step; trl: "
                            "between consecutive on_step_end callbacks of DPOTrainer.train()",
            "peak_mem_mb": "ru_maxrss of a fresh process forked from a forkserver that preloaded torch/transformers/"
                           "peft/trl/datasets/posttrain, minus that process's RSS at start; max over reps",
            "speedup": "median over reps of ours/trl tokens_per_s",
            "memory_ratio": "ours peak_mem_mb / trl peak_mem_mb",
            "sft_step_ratio": "posttrain DPO step time / posttrain SFT step time on the same tokens (chosen and "
                              "rejected as SFT documents); median over reps",
            "sft_step_ratio_precomputed": "the same with reference 'precomputed' (ours_precomputed: reference "
                                          "log-probs computed once before the steps, untimed)",
            "loss_check": f"step 0 loss = log 2 on both sides (abs <= {FIRST_LOSS_ATOL}); step 0 grad norm rel diff "
                          f"<= {GRAD_NORM_RTOL}; step 1 (step 0's pairs after one update): loss < log 2 on both sides, "
                          f"(loss - log 2) rel diff <= {SECOND_LOSS_RTOL}, grad norm rel diff <= {GRAD_NORM_RTOL}",
        },
        "load_avg": sides["load_avg"],
        "wall_s": sides["wall_s"],
        "data": data_stats(cfg),
        **peer.summarize(sides["runs"], cfg["warmup"], timed, loss_check, TARGETS),
    }
    return emit(doc, a.out)


if __name__ == "__main__":
    sys.exit(main())
