"""QLoRA SFT throughput and memory: posttrain's QLoRA beside transformers + peft + bitsandbytes
4-bit (what a user would otherwise pick), and beside dense LoRA in transformers + peft, on the same
weights, adapter, optimizer and documents, in one run.

    python -m posttrain.benchmarks.qlora [--quick] [--steps N] [--warmup N] [--reps R] [--out file.json]
    posttrain bench qlora [...]

Needs transformers, peft and bitsandbytes: pip install 'posttrain[bench]' (it says so and exits with
status 2, before any work, when one is missing). bitsandbytes 0.50 runs 4-bit on CPU: its
CPU kernels would come from Hugging Face's `kernels` hub package, which `make setup` still removes
(README, "One namespace") and which needs the network. It falls back to its own
torch code, and that fallback is what is measured here.

Model: Llama-shaped (hidden 768, 12 layers, 12 heads, 4 KV heads, intermediate 2048, vocab 16384,
about 103M parameters, 412 MB in fp32), random weights built with posttrain.core.model and exported with
posttrain.registry.hf.save_pretrained. It is larger than benchmarks/sft.py's, so that the base's storage
shows beside the activations. LoRA rank 16, alpha 32, on every linear layer but the output head,
with the same initial A/B on every side (ours exported in PEFT's format). The base is NF4 with
blocksize 64 and no double quantization on both 4-bit sides. The two formats dequantize to the
same values, bit for bit. The compute dtype is fp32. AdamW lr 1e-4.

  ours       posttrain.stages.common.load_quantized: the base is read one linear layer at a time and
             quantized as it is read, never whole and dense. Then the adapter's A/B come from the
             export (posttrain.registry.adapters.read_adapter). Each step's documents are packed
             padding-free into micro-batches of at most `token_budget` tokens.
             Trainer.forward_backward(sft_objective) runs per micro-batch, then Trainer.optim_step.
  bnb        AutoModelForCausalLM.from_pretrained(quantization_config=BitsAndBytesConfig(nf4, fp32
             compute), device_map="cpu") + get_peft_model + the same adapter state. Right-padded
             micro-batches of `seqs_per_micro` documents, each weighted by its share of the step's
             target tokens, then torch.optim.AdamW.
  peft_lora  the same as bnb with the base dense (fp32): the memory a 4-bit base should save.

Documents: posttrain.benchmarks.sft's "realistic" shape (lognormal lengths, mean `mean_len`, labels -100 on a
quarter prompt), `docs_per_step` a step.

Measures (as benchmarks/sft.py): tokens_per_s over the timed steps, median over `reps`, with the
sides alternating order per rep. peak_mem_mb is ru_maxrss of a fresh forkserver child minus its RSS
at start; the load's peak counts too. Ratios: memory_ratio = ours / bnb (goal <= 0.5),
memory_ratio_vs_lora = ours / peft_lora, speedup = ours / bnb, speedup_vs_lora = ours / peft_lora.
loss_check: the first step's loss (before any update) of ours and bnb within LOSS_RTOL (the same
dequantized weights); peft_lora's is the dense model's and differs by the quantization error.
Tests never assert on the timing or memory figures; only on the document's structure and the
loss check.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from posttrain.benchmarks import emit, peer
from posttrain.benchmarks.sft import FULL as SFT_FULL
from posttrain.benchmarks.sft import QUICK as SFT_QUICK
from posttrain.benchmarks.sft import (LORA, OPTIM, SEED, _in_fresh_process, _maxrss_mb, _median, _rss_mb, export,
                            pad_batch, peft_with_adapter, side_figures, steps_of, targets_of)

SIDES = ("ours", "bnb", "peft_lora")
REQUIRED = ("transformers", "peft", "bitsandbytes")
LOSS_RTOL = 1e-4  # the same NF4 values, fp32 compute; padded sdpa vs packed attention sum in other orders
TARGETS = {"memory_ratio": ("<=", 0.5)}
PRELOAD = ["torch", "transformers", "transformers.models.llama.modeling_llama", "peft", "peft.tuners.lora",
           "bitsandbytes", "safetensors.torch", "posttrain.core.model.model", "posttrain.core.lora", "posttrain.core.quant", "posttrain.core.trainer",
           "posttrain.core.objectives", "posttrain.core.data.packing", "posttrain.registry.hf", "posttrain.registry.adapters", "posttrain.stages.common"]

# posttrain.benchmarks.sft's shapes, a larger model (the base's storage beside the activations), fewer
# documents a step
FULL: dict[str, Any] = {**SFT_FULL, "seqs_per_micro": 4, "docs_per_step": 8, "reps": 2, "model": dict(
    SFT_FULL["model"], vocab_size=16384, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=2048)}
# (every linear layer's input a multiple of 64, the NF4 block, as in real models: where a row is
# not, the two formats cut blocks differently and the 4-bit sides start apart)
QUICK: dict[str, Any] = {**SFT_QUICK, "token_budget": 512, "seqs_per_micro": 2, "docs_per_step": 4, "steps": 1,
                         "max_len": 96, "model": dict(SFT_QUICK["model"], intermediate_size=128)}


def run_side(side: str, cfg: dict[str, Any], model_dir: str, adapter_dir: str) -> dict[str, Any]:
    """One side in a fresh process: load, warm up, time `steps` steps."""
    import torch

    start_rss = _rss_mb()
    torch.manual_seed(SEED)
    steps = steps_of("realistic", cfg)
    t0 = time.perf_counter()
    step_fn, info = _ours(cfg, model_dir, adapter_dir) if side == "ours" else \
        _peft(cfg, model_dir, adapter_dir, four_bit=side == "bnb")
    load_s, load_peak = time.perf_counter() - t0, _maxrss_mb()
    losses, times, real = [], [], []
    for docs in steps:
        t0 = time.perf_counter()
        losses.append(step_fn(docs))
        times.append(time.perf_counter() - t0)
        real.append(sum(len(ids) for ids, _ in docs))
    timed = slice(cfg["warmup"], None)
    peak = _maxrss_mb()
    return {
        "tokens_per_s": sum(real[timed]) / sum(times[timed]),
        "step_s": times[timed],
        "losses": losses,
        "load_s": load_s,
        "load_peak_mem_mb": load_peak - start_rss,
        "peak_mem_mb": peak - start_rss,
        "process_peak_rss_mb": peak,
        "start_rss_mb": start_rss,
        "threads": torch.get_num_threads(),
        **info,
    }


def _ours(cfg, model_dir, adapter_dir):
    import torch

    from posttrain.core.data.encode import Document
    from posttrain.core.data.packing import collate_padding_free, pack
    from posttrain.core.lora import LoRAConfig
    from posttrain.core.lora.model import load_adapter_state_dict
    from posttrain.core.model.config import ModelConfig
    from posttrain.core.objectives import sft_objective
    from posttrain.core.optim import OptimConfig
    from posttrain.core.trainer import Trainer
    from posttrain.registry.adapters import read_adapter
    from posttrain.stages.common import load_quantized

    lora = LoRAConfig(enabled=True, quantize_base="nf4", rank=LORA["rank"], alpha=LORA["alpha"],
                      dropout=LORA["dropout"], targets=["all-linear"])
    model, _ = load_quantized(ModelConfig(name_or_path=model_dir, dtype="float32"), lora, torch.device("cpu"))
    _, state, _, _ = read_adapter(model, adapter_dir)
    load_adapter_state_dict(model, state, "default")
    optim = OptimConfig(lr=OPTIM["lr"], betas=OPTIM["betas"], eps=OPTIM["eps"], weight_decay=OPTIM["weight_decay"],
                        warmup_steps=0, schedule="constant", max_grad_norm=None)
    trainer = Trainer(model, optim, total_steps=cfg["warmup"] + cfg["steps"])

    def step(docs) -> float:
        documents = [Document(ids, lab) for ids, lab in docs]
        for row in pack([len(d) for d in documents], cfg["token_budget"], "ffd"):
            trainer.forward_backward(collate_padding_free([documents[i] for i in row]), sft_objective)
        return trainer.optim_step()["loss"]

    return step, {"base_bytes": _held_bytes(model)}


def _held_bytes(model) -> int:
    """The bytes of the model's parameters and buffers but the adapters' (the NF4 codes and
    scales are buffers; RoPE tables count where a side keeps them)."""
    return sum(t.numel() * t.element_size() for name, t in [*model.named_parameters(), *model.named_buffers()]
               if "lora_" not in name)


def _peft(cfg, model_dir, adapter_dir, four_bit: bool):
    import warnings

    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    kw: dict[str, Any] = dict(attn_implementation="sdpa", dtype=torch.float32)
    if four_bit:
        kw.update(quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                         bnb_4bit_compute_dtype=torch.float32,
                                                         bnb_4bit_use_double_quant=False),
                  device_map="cpu")
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kw)
    base_bytes = _held_bytes(model)
    model = peft_with_adapter(model, adapter_dir)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=OPTIM["lr"],
                            betas=OPTIM["betas"], eps=OPTIM["eps"], weight_decay=OPTIM["weight_decay"])

    def step(docs) -> float:
        n_step = sum(targets_of(lab) for _, lab in docs)
        loss_sum = 0.0
        for i in range(0, len(docs), cfg["seqs_per_micro"]):
            chunk = docs[i:i + cfg["seqs_per_micro"]]
            n_mb = sum(targets_of(lab) for _, lab in chunk)
            loss = model(**pad_batch(chunk), use_cache=False).loss
            (loss * (n_mb / n_step)).backward()
            loss_sum += float(loss.detach()) * n_mb
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss_sum / n_step

    return step, {"base_bytes": base_bytes}


def main(argv: list[str] | None = None) -> int:
    import multiprocessing as mp

    a, cfg = peer.parse("qlora", __doc__.split("\n\n")[0], FULL, QUICK, argv, REQUIRED,
                        "transformers + peft + bitsandbytes")
    if cfg is None:
        return 2
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    load_start, t_start = os.getloadavg(), time.time()
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SIDES}
    with tempfile.TemporaryDirectory(prefix="bench_qlora_") as tmp:
        model_dir, adapter_dir = str(Path(tmp) / "model"), str(Path(tmp) / "adapter")
        exported = _in_fresh_process(ctx, export, cfg, model_dir, adapter_dir)
        for rep in range(cfg["reps"]):
            for side in SIDES if rep % 2 == 0 else SIDES[::-1]:
                r = _in_fresh_process(ctx, run_side, side, cfg, model_dir, adapter_dir)
                runs[side].append(r)
                print(f"[bench qlora] rep {rep} {side:9s} {r['tokens_per_s']:8.1f} tok/s peak +{r['peak_mem_mb']:.0f} MB",
                      file=sys.stderr, flush=True)
    doc: dict[str, Any] = {
        "benchmark": "qlora", "quick": a.quick, "device": "cpu", "compute_dtype": "float32",
        "versions": _versions(),
        "config": {**cfg, "lora": LORA, "optim": {**OPTIM, "schedule": "constant", "grad_clip": None},
                   "quant": {"type": "nf4", "blocksize": 64, "double_quant": False}, "seed": SEED, **exported},
        "load_avg": {"start": list(load_start), "end": list(os.getloadavg())},
        "wall_s": time.time() - t_start,
    }
    for side in SIDES:
        rs = runs[side]
        doc[side] = {**side_figures(rs), **{k: v for k, v in rs[0].items()
                                             if k not in ("tokens_per_s", "peak_mem_mb", "process_peak_rss_mb")}}
    ratio = lambda key, a_, b_: [x[key] / y[key] for x, y in zip(runs[a_], runs[b_])]  # noqa: E731
    doc["ratios"] = {
        "memory_ratio": doc["ours"]["peak_mem_mb"] / doc["bnb"]["peak_mem_mb"],
        "memory_ratio_vs_lora": doc["ours"]["peak_mem_mb"] / doc["peft_lora"]["peak_mem_mb"],
        "speedup": _median(ratio("tokens_per_s", "ours", "bnb")),
        "speedup_reps": ratio("tokens_per_s", "ours", "bnb"),
        "speedup_vs_lora": _median(ratio("tokens_per_s", "ours", "peft_lora")),
    }
    first = {s: doc[s]["losses"][0] for s in SIDES}
    rel = abs(first["ours"] - first["bnb"]) / abs(first["bnb"])
    doc["loss_check"] = {"first_step_loss": first, "rel_diff": rel, "tolerance": LOSS_RTOL, "met": rel <= LOSS_RTOL}
    doc["targets"] = {name: {"target": f"{op} {value}", "value": doc["ratios"][name],
                             "met": doc["ratios"][name] >= value if op == ">=" else doc["ratios"][name] <= value}
                      for name, (op, value) in TARGETS.items()}
    return emit(doc, a.out)


def _versions() -> dict[str, str]:
    import bitsandbytes
    import peft
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
            "bitsandbytes": bitsandbytes.__version__}


if __name__ == "__main__":
    sys.exit(main())
