"""LoRA online distillation throughput and memory: posttrain's distillation step (a frozen teacher
of the student's shape, forward KL) beside TRL's GKDTrainer + peft, offline (lmbda 0) and
on-policy (lmbda 1), on the same weights, teacher, adapter, optimizer and documents, in one run;
and how close the distillation step comes to its floor, an SFT step on the same tokens.

    python -m posttrain.benchmarks.distill [--quick] [--steps N] [--reps R] [--out file.json]

Needs transformers, peft, trl and datasets (pip install 'posttrain[bench]'); exits 2 at once without.

Models: posttrain.benchmarks.sft's Llama shapes (full: hidden 512, 8 layers, vocab 8192; --quick: hidden 64,
2 layers, vocab 512), fp32 on CPU, random weights from posttrain.core.model saved as HF checkpoints
(posttrain.registry.hf.save_pretrained): the student with seed 0, the teacher, same shape, with seed 1. The
student's LoRA (rank 16, alpha 32, dropout 0, every linear layer but the head; B = 0) is written in
PEFT format by posttrain.registry.adapters.save_adapter (posttrain.benchmarks.sft.export) and loaded by both sides.
AdamW lr 1e-4, betas (0.9, 0.999), eps 1e-8, no weight decay, constant schedule, no clipping (the
norm is still computed). Teacher frozen, in eval mode, run under no_grad on both sides.

The divergence. TRL 1.16 GKDTrainer.compute_loss calls generalized_jsd_loss(student, teacher,
labels, beta=args.beta, num_items_in_batch) WITHOUT a temperature: the loss is at T = 1 whatever
GKDConfig.temperature (the sampling temperature of on-policy generations only). beta = 0 is
special-cased as F.kl_div(log p_S, log p_T, log_target=True) = sum_v p_T (log p_T - log p_S) =
KL(teacher || student), the forward KL (beta = 1: the reverse KL), summed over the positions whose
shifted label is not -100: those predicting a completion token (DataCollatorForChatML labels -100
the prompt, i.e. the chat template rendered without the last assistant message, and the left
padding). Normalization: the transformers Trainer counts the step's target tokens over all its
micro-batches (labels[..., 1:] != -100) as num_items_in_batch (the model's forward accepts loss
kwargs: checked); GKD returns sum / num_items_in_batch, not divided by the accumulation steps
again: the mean over the step's completion tokens. posttrain: distill_objective with
DistillConfig's defaults (forward_kl, T = 1, ce_weight 0) sums over the positions predicting a
target token, and Trainer.optim_step divides by the step's target tokens: the same mean.

Data (fixed seed): `docs_per_micro` x `micro_per_step` SFT documents a step; prompt and completion
lengths each ~ lognormal(sigma 1) of mean `prompt_mean` / `completion_mean`, clipped; random ids in
[1, vocab), each completion ending with the EOS id 0; the completion tokens are the KD targets.
Each step takes the same documents and micro-batches on every side; the warmup step repeats the
first timed one's (`steps_of`).

  ours      posttrain.registry.hf.load_pretrained (student, + posttrain.registry.adapters.load_adapter; teacher,
            requires_grad off, eval) and posttrain.core.trainer.Trainer; per micro-batch Trainer.
            forward_backward(collate_padding_free(docs), distill_objective(teacher, "forward_kl",
            1.0, 0.5, 0.0)) -- the online objective the distill stage builds, called directly (no
            stage launch; the stage's timing hooks are left out): the micro-batch packed padding-
            free in one row, a no-grad teacher forward to its last hidden states, the student
            forward, and the KL chunked over the vocabulary head (no full logits); then optim_step.
  trl       AutoModelForCausalLM.from_pretrained(attn_implementation="sdpa", fp32), student and
            teacher, to trl.experimental.gkd.GKDTrainer with peft_config=LoraConfig(r=16,
            lora_alpha=32, target_modules="all-linear"), our adapter loaded into its PeftModel.
            GKDConfig: lmbda 0, seq_kd off, beta 0, temperature 1, per_device_train_batch_size =
            docs_per_micro, gradient_accumulation_steps = micro_per_step, no gradient
            checkpointing, use_cpu, adamw_torch, constant lr, max_grad_norm 0 (norm computed, no
            clip), sequential sampler, max_length = the context (no truncation). Its default
            collator, DataCollatorForChatML, gets GKD's "messages" format (user: the prompt,
            assistant: the completion) through a chat template joining the contents with spaces,
            over a word-level tokenizer whose "t<i>" is id i ("<eos>" 0); every batch of the
            trainer's own train dataloader is checked to hold exactly our micro-batches' ids and
            labels before training. GKDTrainer.train() runs it: step times from a callback, losses
            and gradient norms from its logs.
  What differs, by design of each library: TRL left-pads each micro-batch to its longest document
  (`padding_fraction`; RoPE positions then start after the padding, which leaves attention scores
  unchanged) and materializes the full (rows, length, vocab) logits of student and teacher, their
  log-softmaxes and the elementwise KL; posttrain packs padding-free and computes the KL chunk by
  chunk from hidden states. Both run one teacher forward and one student forward + backward. With
  lmbda 0 TRL still draws random.random() <= 0 each micro-batch (true with probability ~2^-53).
  ours_sft  ours, but sft_objective (cross entropy on the completion tokens) on the same documents
            and micro-batches, no teacher loaded: the floor of a distillation step.
  ours_on_policy, trl_on_policy  GKD's lmbda 1: each micro-batch's completions replaced by the
            student's own (at most `max_new_tokens`, to EOS), then distilled on. ours: one
            engine_generate call for a step's prompts, as distill's on_policy mode (sampler 'engine'); trl:
            GKDTrainer(lmbda=1), model.generate on the peft model. Both greedy (TRL: temperature 1e-6,
            top_k 0), so both train on the same tokens (a digest per step). TRL divides the summed
            KL by the dataset's completion tokens (counted by the Trainer before sampling), posttrain
            by the sampled ones: `on_policy_check` undoes that.

Measures
  tokens_per_s   prompt + completion tokens (no padding) of the timed steps (after `warmup`) / their
                 wall time; median over `reps`. ours, ours_sft: time around each step; trl: between
                 consecutive on_step_end callbacks (all Trainer.train() does per step);
                 `step_compute_s`: on_step_begin..on_step_end.
  speedup        median over reps of ours / trl tokens_per_s. Sides alternate order per rep.
  peak_mem_mb    each side and rep in a fresh process forked from one forkserver that imported
                 torch, transformers, peft, trl, datasets and posttrain: ru_maxrss minus the RSS at
                 its start; max over reps. memory_ratio = ours / trl.
  speedup_on_policy, memory_ratio_on_policy  the same for the on-policy pair; tokens_per_s there
                 counts the prompt and sampled tokens trained on (each side's own count; equal).
  sft_step_ratio posttrain's distillation step time / its SFT step time on the same tokens (median
                 over reps); a distillation step adds a no-grad teacher forward to the student's
                 forward + backward (and a KL head over the vocabulary for the CE head), so
                 ideally <= 1.4.
  loss_check     step 0 (adapter B = 0, student = its base): the two losses (the mean forward KL of
                 two random models) within FIRST_LOSS_RTOL, the gradient norms within
                 GRAD_NORM_RTOL; step 1, on step 0's documents after one AdamW update: the losses
                 within FIRST_LOSS_RTOL, the loss has dropped on both sides, by amounts within
                 SECOND_LOSS_RTOL of each other, and the gradient norms within GRAD_NORM_RTOL.
Tests assert only on the document's structure and the loss check, never on timings or memory.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Any

from posttrain.benchmarks import emit, peer
from posttrain.benchmarks.dpo import _text, _tokenizer
from posttrain.benchmarks.sft import FULL as SFT_FULL
from posttrain.benchmarks.sft import LORA, QUICK as SFT_QUICK, _maxrss_mb, _median, _rss_mb

SEED, TEACHER_SEED = 0, 1  # the student's (and data's), the teacher's weights
EOS = 0  # every completion ends with it; also the pad id
OPTIM = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
# posttrain's side: DistillConfig's defaults (checked in `main`); TRL's: beta 0 = forward KL
DIVERGENCE, TEMPERATURE, JSD_BETA, CE_WEIGHT = "forward_kl", 1.0, 0.5, 0.0
TRL_BETA, TRL_LMBDA = 0.0, 0.0
# Step 0: the same KL in fp32 by different kernels (padded sdpa + full logits vs packed attention +
# a chunked head) summed in different orders (--quick: ~1e-7).
FIRST_LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-4
# Step 1 on step 0's documents: the drop (loss0 - loss1) on both sides, ~0.3% of the loss (--quick).
# Each loss carries fp32 noise of ~1e-6 of itself (the KL is a small difference of log-probs of
# size log V), i.e. up to ~6e-4 of the drop (--quick, over data variants); a wrong lr, target mask
# or normalization moves the drop by far more than this.
SECOND_LOSS_RTOL = 5e-3
TARGETS = {"sft_step_ratio": ("<=", 1.4)}
PRELOAD = ["torch", "transformers", "transformers.models.llama.modeling_llama", "peft", "peft.tuners.lora",
           "datasets", "accelerate", "trl", "trl.experimental.gkd", "safetensors.torch", "tokenizers",
           "posttrain.core.model.model", "posttrain.core.lora", "posttrain.core.trainer", "posttrain.core.objectives", "posttrain.core.data.packing",
           "posttrain.registry.hf", "posttrain.registry.adapters"]
# The GKD data format: the conversation's text, the contents joined by spaces (no role markers)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"

FULL: dict[str, Any] = dict(
    model=SFT_FULL["model"], prompt_mean=64, completion_mean=160, min_len=8, prompt_max=256, completion_max=768,
    docs_per_micro=4, micro_per_step=4, warmup=1, steps=3, reps=3, max_new_tokens=128)
QUICK: dict[str, Any] = dict(
    model=SFT_QUICK["model"], prompt_mean=12, completion_mean=28, min_len=4, prompt_max=48, completion_max=96,
    docs_per_micro=2, micro_per_step=2, warmup=1, steps=2, reps=1, max_new_tokens=10)
# On-policy (lmbda 1): every micro-batch's completions are the student's, greedy on both sides (TRL:
# do_sample at this temperature, top_k 0: the argmax), so both train on the same tokens.
ON_POLICY_SIDES = ("ours_on_policy", "trl_on_policy")
TRL_GREEDY_TEMPERATURE = 1e-6

Doc = tuple[list[int], list[int]]  # prompt, completion token ids


# ------------------------------------------------------------------------------------------ data


def documents(cfg: dict[str, Any], n: int, seed: int = SEED) -> list[Doc]:
    """n (prompt, completion) id lists, deterministic in seed; completions end with EOS."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def lengths(mean: float, hi: int) -> list[int]:
        mu = math.log(mean) - 0.5  # sigma 1: the unclipped mean is `mean`
        raw = torch.exp(mu + torch.randn(n, generator=gen, dtype=torch.float64))
        return raw.round().clamp(cfg["min_len"], hi).long().tolist()

    P = lengths(cfg["prompt_mean"], cfg["prompt_max"])
    C = lengths(cfg["completion_mean"], cfg["completion_max"])
    vocab = cfg["model"]["vocab_size"]

    def ids(k: int) -> list[int]:
        return torch.randint(1, vocab, (k,), generator=gen).tolist()

    return [(ids(p), ids(c - 1) + [EOS]) for p, c in zip(P, C)]


def steps_of(cfg: dict[str, Any]) -> list[list[list[Doc]]]:
    """Steps -> micro-batches -> documents, the same on every side. Step 0 (warmup, untimed) repeats
    step 1's documents, so step 1's loss is taken where the first update was computed: it drops by
    about lr * |g|_1, far above fp32 rounding."""
    m, k = cfg["docs_per_micro"], cfg["micro_per_step"]
    flat = documents(cfg, m * k * (cfg["warmup"] + cfg["steps"] - 1))
    micro = [flat[i:i + m] for i in range(0, len(flat), m)]
    steps = [micro[i:i + k] for i in range(0, len(micro), k)]
    return steps[:1] + steps


def step_tokens(step: list[list[Doc]]) -> int:
    return sum(len(p) + len(c) for micro in step for p, c in micro)


def step_targets(step: list[list[Doc]]) -> int:
    """KD target positions: one per completion token (the prompt is never empty)."""
    return sum(len(c) for micro in step for _, c in micro)


def labels_of(doc: Doc) -> list[int]:
    return [-100] * len(doc[0]) + list(doc[1])  # the prompt is no target


# -------------------------------------------------------------------------- child processes


def export(cfg: dict[str, Any], model_dir: str, adapter_dir: str, teacher_dir: str) -> dict[str, Any]:
    """The student and its adapter (posttrain.benchmarks.sft.export), and a teacher of the same shape with
    other random weights: the checkpoints both sides load."""
    from posttrain.benchmarks.sft import export as export_student
    from posttrain.core.model.args import ModelArgs
    from posttrain.core.model.model import build_model
    from posttrain.registry.hf import save_pretrained

    out = export_student(cfg, model_dir, adapter_dir)
    save_pretrained(build_model(ModelArgs(**cfg["model"]), seed=TEACHER_SEED), teacher_dir)
    return {**out, "teacher_params": out["params"], "teacher_seed": TEACHER_SEED}


def run_side(side: str, cfg: dict[str, Any], dirs: dict[str, str], work: str) -> dict[str, Any]:
    """One side in a fresh process: load, run warmup + timed steps, report per-step figures."""
    import torch

    start_rss = _rss_mb()
    torch.manual_seed(SEED)
    steps = steps_of(cfg)
    new_tokens = cfg["max_new_tokens"] if side in ON_POLICY_SIDES else 0
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON document alone
        records, info = _trl(cfg, dirs, steps, work, new_tokens) if side.startswith("trl") else \
            _posttrain(dirs, steps, sft=side == "ours_sft", new_tokens=new_tokens)
    peak = _maxrss_mb()
    timed = slice(cfg["warmup"], None)
    seconds = [r["s"] for r in records]
    tokens = [r.get("tokens", step_tokens(s)) for r, s in zip(records, steps)]  # on-policy: what was sampled
    return {"tokens_per_s": sum(tokens[timed]) / sum(seconds[timed]), "tokens_per_step": tokens,
            "step_s": seconds[timed], "losses": [r["loss"] for r in records],
            "grad_norms": [r["grad_norm"] for r in records], "peak_mem_mb": peak - start_rss,
            "process_peak_rss_mb": peak, "start_rss_mb": start_rss, "threads": torch.get_num_threads(), **info}


def _posttrain(dirs: dict[str, str], steps, sft: bool, new_tokens: int = 0):
    """new_tokens > 0: on-policy (module doc: ours_on_policy)."""
    import torch

    from posttrain.core.data.encode import Document
    from posttrain.core.data.packing import collate_padding_free
    from posttrain.core.generation.engine import engine_generate
    from posttrain.core.model.generate import SamplingParams
    from posttrain.core.objectives import distill_objective, sft_objective
    from posttrain.core.optim import OptimConfig
    from posttrain.core.trainer import Trainer
    from posttrain.registry.adapters import load_adapter
    from posttrain.registry.hf import load_pretrained
    from posttrain.stages.config import ParallelConfig
    from posttrain.stages.training import sampling

    model = load_pretrained(dirs["model"])
    load_adapter(model, dirs["adapter"])
    trainer = Trainer(model, OptimConfig(**OPTIM, warmup_steps=0, schedule="constant", max_grad_norm=None),
                      total_steps=len(steps))
    if sft:
        objective = sft_objective
    else:  # frozen as posttrain.stages.recipe.parallelize_frozen leaves it on one process
        teacher = load_pretrained(dirs["teacher"]).requires_grad_(False).eval()
        objective = distill_objective(teacher, DIVERGENCE, TEMPERATURE, JSD_BETA, CE_WEIGHT)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, stop_token_ids=(EOS,))

    def documents(step: list[list[Doc]]) -> list[list]:
        if not new_tokens:
            return [[Document(p + c, labels_of((p, c))) for p, c in micro] for micro in step]
        prompts = [p for micro in step for p, _ in micro]  # the step's, in one call (as posttrain.stages.distill)
        with torch.no_grad(), sampling(model, ParallelConfig()):
            gens = iter(engine_generate(model, prompts, params))
        model.train()
        out = [[(p, next(gens).tokens) for p, _ in micro] for micro in step]
        samples.extend([c for _, c in micro] for micro in out)
        return [[Document(p + c, labels_of((p, c))) for p, c in micro] for micro in out]

    records, targets, samples = [], [], []
    for step in steps:
        t0 = time.perf_counter()
        tokens = 0
        for docs in documents(step):
            tokens += sum(len(d.input_ids) for d in docs)
            trainer.forward_backward(collate_padding_free(docs), objective)
        m = trainer.optim_step()
        records.append({"s": time.perf_counter() - t0, "loss": m["loss"], "grad_norm": m["grad_norm"], "tokens": tokens})
        targets.append(int(m["tokens"]))
    info = {"target_tokens_per_step": targets}
    if new_tokens:
        info["samples_digest"] = _digests(samples, len(steps[0]))
    return records, info


def _digests(samples: list[list[list[int]]], micro_per_step: int) -> list[str]:
    import hashlib  # per step: a fingerprint of its micro-batches' sampled completions

    return [hashlib.sha256(repr(samples[i:i + micro_per_step]).encode()).hexdigest()[:16]
            for i in range(0, len(samples), micro_per_step)]


def _trl(cfg, dirs: dict[str, str], steps, work, new_tokens: int = 0):
    import warnings

    import datasets
    import torch
    from peft import LoraConfig, set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore", category=FutureWarning)
    flat = [doc for step in steps for micro in step for doc in micro]
    data = datasets.Dataset.from_dict({"messages": [
        [{"role": "user", "content": _text(p)}, {"role": "assistant", "content": _text(c)}] for p, c in flat]})
    tok = _tokenizer(cfg["model"]["vocab_size"])
    tok.chat_template = CHAT_TEMPLATE

    def load(path: str):
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)

    model, teacher = load(dirs["model"]), load(dirs["teacher"])
    model.generation_config.eos_token_id = EOS  # as a real checkpoint names it: TRL stops its samples there
    args = GKDConfig(
        output_dir=work, seed=SEED, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=cfg["docs_per_micro"], gradient_accumulation_steps=cfg["micro_per_step"],
        max_steps=len(steps), num_train_epochs=1, train_sampling_strategy="sequential",
        optim="adamw_torch", learning_rate=OPTIM["lr"], adam_beta1=OPTIM["betas"][0], adam_beta2=OPTIM["betas"][1],
        adam_epsilon=OPTIM["eps"], weight_decay=OPTIM["weight_decay"], lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=0.0, beta=TRL_BETA, seq_kd=False,
        **(dict(lmbda=1.0, temperature=TRL_GREEDY_TEMPERATURE, max_new_tokens=new_tokens) if new_tokens else
           dict(lmbda=TRL_LMBDA, temperature=TEMPERATURE)),
        max_length=cfg["model"]["max_position_embeddings"], logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0, dataloader_pin_memory=False)
    begin, end, logged = [], [], []  # perf_counter at each step's begin and end; TRL's logs

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            end.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                logged.append(dict(logs))

    samples, sampled_tokens = [], []  # on-policy: each micro-batch's completions (to EOS) and real tokens

    class Recording(GKDTrainer):
        @staticmethod
        def generate_on_policy_outputs(model, inputs, generation_config):
            ids, mask, labels = GKDTrainer.generate_on_policy_outputs(model, inputs, generation_config)
            samples.append([row[row != -100].tolist() for row in labels])
            sampled_tokens.append(int(mask.sum()))
            return ids, mask, labels

    lora = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                      target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = Recording(model=model, teacher_model=teacher, args=args, train_dataset=data, processing_class=tok,
                         peft_config=lora, callbacks=[Clock()])
    trainer.remove_callback(PrinterCallback)
    adapter = load_file(str(Path(dirs["adapter"]) / "adapter_model.safetensors"))
    loaded = set_peft_model_state_dict(trainer.model, adapter)
    missing = [k for k in loaded.missing_keys if "lora_" in k]
    if loaded.unexpected_keys or missing:
        raise RuntimeError(f"adapter did not load into peft: unexpected {loaded.unexpected_keys[:3]}, "
                           f"missing {missing[:3]}")
    if not trainer.model_accepts_loss_kwargs:  # else no num_items_in_batch: per-micro batchmean / accumulation
        raise RuntimeError("TRL would not normalize by the step's target tokens (num_items_in_batch)")
    # exactly our micro-batches, ids and prompt masks, in our order, from TRL's own loader and collator
    micro = [m for step in steps for m in step]
    batches = list(trainer.get_train_dataloader())
    if len(batches) < len(micro):
        raise RuntimeError(f"TRL's loader has {len(batches)} batches, expected {len(micro)}")
    for want, got in zip(micro, batches):
        rows = [(ids[mask == 1].tolist(), lab[mask == 1].tolist())
                for ids, lab, mask in zip(got["input_ids"], got["labels"], got["attention_mask"])]
        if rows != [(p + c, labels_of((p, c))) for p, c in want]:
            raise RuntimeError("TRL's collated batches differ from the benchmark's token ids / prompt masks")
    del batches
    trainer.train()
    if not (len(begin) == len(end) == len(logged) == len(steps)):
        raise RuntimeError(f"TRL ran {len(end)} steps and logged {len(logged)}, expected {len(steps)}")
    starts = [begin[0]] + end[:-1]  # step i's cost: from the end of step i - 1 to its own end
    records = [{"s": e - s, "loss": float(g["loss"]), "grad_norm": float(g["grad_norm"])}
               for s, e, g in zip(starts, end, logged)]
    # what the collator pads: each micro-batch's rows to its longest document
    padded = [sum(len(m) * max(len(p) + len(c) for p, c in m) for m in step) for step in steps]
    timed = slice(cfg["warmup"], None)
    info = {"step_compute_s": [e - b for b, e in zip(begin, end)][timed], "padded_tokens_per_step": padded}
    if new_tokens:
        k = cfg["micro_per_step"]
        if len(samples) != k * len(steps):
            raise RuntimeError(f"TRL sampled {len(samples)} micro-batches, expected {k * len(steps)} (lmbda 1)")
        for i, r in enumerate(records):
            r["tokens"] = sum(sampled_tokens[i * k:(i + 1) * k])
        info["samples_digest"] = _digests(samples, k)
    return records, info


# ------------------------------------------------------------------------------------- driver


def loss_check(ours: dict[str, Any], trl: dict[str, Any]) -> dict[str, Any]:
    """The two sides ran the same computation: module docstring, `loss_check`."""
    lo, lt = ours["losses"], trl["losses"]
    first = {"ours": lo[0], "trl": lt[0], "rel_diff": peer.rel(lo[0], lt[0]), "tolerance": FIRST_LOSS_RTOL}
    first["met"] = lo[0] > 0 and first["rel_diff"] <= FIRST_LOSS_RTOL
    do, dt = lo[0] - lo[1], lt[0] - lt[1]
    second = {"ours": lo[1], "trl": lt[1], "ours_drop": do, "trl_drop": dt, "rel_diff_of_drop": peer.rel(do, dt),
              "rel_diff": peer.rel(lo[1], lt[1]), "tolerance": SECOND_LOSS_RTOL, "loss_tolerance": FIRST_LOSS_RTOL}
    second["met"] = (do > 0 and dt > 0 and second["rel_diff_of_drop"] <= SECOND_LOSS_RTOL
                     and second["rel_diff"] <= FIRST_LOSS_RTOL)
    parts = {"first_step_loss": first}
    for key, i in (("first_step_grad_norm", 0), ("second_step_grad_norm", 1)):
        go, gt = ours["grad_norms"][i], trl["grad_norms"][i]
        parts[key] = {"ours": go, "trl": gt, "rel_diff": peer.rel(go, gt), "tolerance": GRAD_NORM_RTOL,
                      "met": go > 0 and peer.rel(go, gt) <= GRAD_NORM_RTOL}
    parts["second_step_loss"] = second
    return {**parts, "max_rel_diff_all_steps": max(map(peer.rel, lo, lt)), "met": all(x["met"] for x in parts.values())}


def data_stats(cfg: dict[str, Any]) -> dict[str, Any]:
    steps = steps_of(cfg)
    flat = [d for s in steps for m in s for d in m]
    return {"documents": len(flat), "docs_per_step": cfg["docs_per_micro"] * cfg["micro_per_step"],
            "mean_prompt_len": sum(len(p) for p, _ in flat) / len(flat),
            "mean_completion_len": sum(len(c) for _, c in flat) / len(flat),
            "max_sequence_len": max(len(p) + len(c) for p, c in flat),
            "tokens_per_step": list(map(step_tokens, steps)), "target_tokens_per_step": list(map(step_targets, steps))}


def main(argv: list[str] | None = None) -> int:
    a, cfg = peer.parse("distill", __doc__.split("\n\n")[0], FULL, QUICK, argv)
    if cfg is None:
        return 2

    from posttrain.benchmarks import distill as this  # by module name, so the children can unpickle the functions
    from posttrain.stages.config import DistillConfig

    if tuple(DistillConfig.model_fields[k].default for k in ("divergence", "temperature", "ce_weight")) != \
            (DIVERGENCE, TEMPERATURE, CE_WEIGHT):  # the stage's defaults are what is benchmarked
        raise RuntimeError("DistillConfig's defaults moved: update the benchmark's divergence settings")
    sides = peer.run_sides("distill", cfg, PRELOAD, this.export, ("model", "adapter", "teacher"), this.run_side,
                           extra=ON_POLICY_SIDES)
    timed = sum(step_tokens(s) for s in steps_of(cfg)[cfg["warmup"]:])
    doc = {
        "benchmark": "distill",
        "quick": a.quick,
        "device": "cpu",
        "dtype": "float32",
        "versions": peer.versions(),
        "config": {**cfg, "lora": LORA, "optim": {**OPTIM, "schedule": "constant", "grad_clip": None}, "seed": SEED,
                   "mode": "online", "divergence": DIVERGENCE, "temperature": TEMPERATURE, "ce_weight": CE_WEIGHT,
                   "trl": {"trainer": "trl.experimental.gkd.GKDTrainer", "beta": TRL_BETA, "lmbda": TRL_LMBDA,
                           "seq_kd": False, "loss_temperature": 1.0},
                   "normalization": "mean over the step's completion (target) tokens, both sides", **sides["exported"]},
        "method": {
            "tokens_per_s": "prompt+completion tokens (no padding) / wall time of the timed steps (after warmup); "
                            "median over reps; ours/ours_sft: time around each step; trl: between consecutive "
                            "on_step_end callbacks of GKDTrainer.train()",
            "peak_mem_mb": "ru_maxrss of a fresh process forked from a forkserver that preloaded torch/transformers/"
                           "peft/trl/datasets/posttrain, minus that process's RSS at start; max over reps",
            "speedup": "median over reps of ours/trl tokens_per_s",
            "memory_ratio": "ours peak_mem_mb / trl peak_mem_mb",
            "sft_step_ratio": "posttrain distillation step time / posttrain SFT step time on the same documents and "
                              "micro-batches; median over reps",
            "loss_check": f"step 0 loss rel diff <= {FIRST_LOSS_RTOL}, grad norm rel diff <= {GRAD_NORM_RTOL}; step 1 "
                          f"(step 0's documents after one update): loss rel diff <= {FIRST_LOSS_RTOL}, loss dropped "
                          f"on both sides, drops rel diff <= {SECOND_LOSS_RTOL}, grad norms rel diff <= "
                          f"{GRAD_NORM_RTOL}",
        },
        "load_avg": sides["load_avg"],
        "wall_s": sides["wall_s"],
        "data": data_stats(cfg),
        **peer.summarize(sides["runs"], cfg["warmup"], timed, loss_check, TARGETS),
    }
    ours, trl = sides["runs"]["ours_on_policy"], sides["runs"]["trl_on_policy"]
    speed = [o["tokens_per_s"] / t["tokens_per_s"] for o, t in zip(ours, trl)]
    doc["ratios"].update(speedup_on_policy=_median(speed), speedup_on_policy_reps=speed, memory_ratio_on_policy=(
        max(r["peak_mem_mb"] for r in ours) / max(r["peak_mem_mb"] for r in trl)))
    doc["on_policy_check"] = on_policy_check(doc["ours_on_policy"], doc["trl_on_policy"],
                                             doc["data"]["target_tokens_per_step"])
    return emit(doc, a.out)


def on_policy_check(ours: dict[str, Any], trl: dict[str, Any], data_targets: list[int]) -> dict[str, Any]:
    """Step 0 of the on-policy pair: equal samples, and TRL's loss and gradient norm times data /
    sampled target tokens (its normalization undone: module doc) equal posttrain's. Later steps may
    part where two logits of a sample nearly tie after an update: reported only."""
    same = [a == b for a, b in zip(ours["samples_digest"], trl["samples_digest"])]
    scale = data_targets[0] / ours["target_tokens_per_step"][0]
    out: dict[str, Any] = {"same_samples_per_step": same, "trl_scale": scale}
    for key, field, tol in (("first_step_loss", "losses", FIRST_LOSS_RTOL),
                            ("first_step_grad_norm", "grad_norms", GRAD_NORM_RTOL)):
        o, t = ours[field][0], trl[field][0]
        out[key] = {"ours": o, "trl": t, "trl_rescaled": t * scale, "rel_diff": peer.rel(o, t * scale), "tolerance": tol}
    out["met"] = same[0] and all(out[k]["rel_diff"] <= out[k]["tolerance"] for k in ("first_step_loss",
                                                                                   "first_step_grad_norm"))
    return out

if __name__ == "__main__":
    sys.exit(main())
