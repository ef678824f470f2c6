"""LoRA SFT throughput and memory: posttrain (padding-free packing) beside transformers + peft
(padded batches), on the same weights, adapter, optimizer and documents, in one run.

    python -m posttrain.benchmarks.sft [--quick] [--steps N] [--reps R] [--out file.json]
    posttrain bench sft [--quick] ...

Needs transformers and peft for the baseline side: pip install 'posttrain[bench]' (it says so and
exits with status 2, before any work, when either is missing).

Model: Llama-shaped (hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1408, vocab 8192),
fp32 on CPU, random weights built with posttrain.core.model, exported with posttrain.registry.hf.save_pretrained to a
temporary directory. LoRA rank 16, alpha 32, every linear layer but the output head, with the
SAME initial A/B on both sides (ours exported with posttrain.registry.adapters.save_adapter, loaded into peft's
get_peft_model with set_peft_model_state_dict). AdamW lr 1e-4 (torch's defaults otherwise) on both.

  ours      posttrain.registry.hf.load_pretrained + posttrain.registry.adapters.load_adapter; each step's documents are
            packed (first-fit decreasing) into micro-batches of at most `token_budget` tokens,
            collate_padding_free, Trainer.forward_backward(sft_objective) per micro-batch, then
            Trainer.optim_step (loss normalized once by the step's target tokens).
  baseline  AutoModelForCausalLM.from_pretrained(attn_implementation="sdpa") + get_peft_model(
            LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")); each step's documents,
            in data order, in micro-batches of `seqs_per_micro` sequences, right-padded to the
            longest (attention_mask, labels -100 on padding), loss = model(...).loss weighted by
            the micro-batch's share of the step's target tokens (the same token-weighted mean),
            backward, torch.optim.AdamW step.

Data shapes (fixed seed; labels -100 on a prompt prefix, a quarter of each document):
  dense      every document `dense_len` (512) tokens
  realistic  lengths ~ lognormal(sigma 1) with mean `mean_len` (200), clipped to [16, 1024]
Each step consumes the same `docs_per_step` documents on both sides.

Measures
  tokens_per_s  real (non-padding) tokens per second over the timed steps, after `warmup` steps;
                the median over `reps` repetitions. Repetitions alternate the sides (ours,
                baseline, then baseline, ours, ...) so machine load affects both alike; `speedup`
                is the median of the per-repetition ratios ours / baseline.
  peak_mem_mb   each repetition runs in its own process forked from one forkserver that has
                imported torch, transformers, peft and posttrain and built nothing: the common
                baseline. peak_mem_mb = ru_maxrss of that process (getrusage RUSAGE_SELF) minus
                its RSS when it started, i.e. the peak of what loading the model and training
                added; process_peak_rss_mb is ru_maxrss itself. The max over repetitions.
  loss_check    the first step's loss (before any update) on both sides; equal within 1e-4
                relative, or the comparison is not apples to apples.

Tests never assert on the figures; only on the document's structure and the loss check.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

# Targets: (metric, op, value).
TARGETS = {
    "realistic_speedup": (">=", 2.0),
    "dense_speedup": (">=", 1.0),
    "dense_memory_ratio": ("<=", 0.7),
    "realistic_memory_ratio": ("<=", 0.7),
}
LOSS_RTOL = 1e-4
SHAPES = ("dense", "realistic")
# Imported by the forkserver before any child is forked: the memory baseline both sides share.
PRELOAD = ["torch", "transformers", "transformers.models.llama.modeling_llama", "peft", "peft.tuners.lora",
           "safetensors.torch", "posttrain.core.model.model", "posttrain.core.lora", "posttrain.core.trainer", "posttrain.core.objectives",
           "posttrain.core.data.packing", "posttrain.registry.hf", "posttrain.registry.adapters"]

FULL: dict[str, Any] = dict(
    model=dict(vocab_size=8192, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
               intermediate_size=1408, max_position_embeddings=2048, norm_eps=1e-5, family="llama"),
    dense_len=512, mean_len=200, min_len=16, max_len=1024,
    token_budget=4096, seqs_per_micro=8, docs_per_step=16, warmup=1, steps=2, reps=3,
)
QUICK: dict[str, Any] = dict(
    model=dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
               intermediate_size=176, max_position_embeddings=256, norm_eps=1e-5, family="llama"),
    dense_len=64, mean_len=40, min_len=8, max_len=128,
    token_budget=256, seqs_per_micro=4, docs_per_step=8, warmup=1, steps=2, reps=1,
)
LORA = dict(rank=16, alpha=32, targets="all-linear", dropout=0.0)
OPTIM = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)  # torch.optim.AdamW's defaults
SEED = 0
# The baseline side; not posttrain dependencies (the `bench` extra installs them).
REQUIRED = ("transformers", "peft")
INSTALL_HINT = "pip install 'posttrain[bench]'"


# ------------------------------------------------------------------------------------------ data


def documents(shape: str, cfg: dict[str, Any], n: int, seed: int = SEED) -> list[tuple[list[int], list[int]]]:
    """n (input_ids, labels) pairs, deterministic in (shape, seed); labels -100 on the first quarter."""
    import torch

    gen = torch.Generator().manual_seed(seed + (0 if shape == "dense" else 1))
    if shape == "dense":
        lengths = [cfg["dense_len"]] * n
    else:
        sigma = 1.0
        mu = math.log(cfg["mean_len"]) - sigma**2 / 2  # the unclipped mean is mean_len
        raw = torch.exp(mu + sigma * torch.randn(n, generator=gen, dtype=torch.float64))
        lengths = raw.round().clamp(cfg["min_len"], cfg["max_len"]).long().tolist()
    vocab = cfg["model"]["vocab_size"]
    docs = []
    for n_tok in lengths:
        ids = torch.randint(0, vocab, (n_tok,), generator=gen).tolist()
        prompt = n_tok // 4
        docs.append((ids, [-100] * prompt + ids[prompt:]))
    return docs


def steps_of(shape: str, cfg: dict[str, Any]) -> list[list[tuple[list[int], list[int]]]]:
    docs = documents(shape, cfg, cfg["docs_per_step"] * (cfg["warmup"] + cfg["steps"]))
    d = cfg["docs_per_step"]
    return [docs[i:i + d] for i in range(0, len(docs), d)]


def targets_of(labels: list[int]) -> int:
    """Target tokens of one document under next-token shifting: labels[1:] not ignored."""
    return sum(1 for y in labels[1:] if y != -100)


def pad_batch(docs: list[tuple[list[int], list[int]]], pad_id: int = 0) -> dict[str, Any]:
    """What a plain DataLoader collate does: right padding to the longest, mask 0 and label -100 there."""
    import torch

    width = max(len(ids) for ids, _ in docs)
    input_ids = torch.full((len(docs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(docs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(docs), width), dtype=torch.long)
    for b, (ids, lab) in enumerate(docs):
        input_ids[b, :len(ids)] = torch.tensor(ids)
        labels[b, :len(ids)] = torch.tensor(lab)
        mask[b, :len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


# -------------------------------------------------------------------------- child processes


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _maxrss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def export(cfg: dict[str, Any], model_dir: str, adapter_dir: str) -> dict[str, Any]:
    """Build our model with random weights, save it as an HF checkpoint, add the LoRA adapter and
    save it in PEFT's format: the one set of weights both sides load."""
    import torch

    from posttrain.core.lora import apply_lora, count_trainable
    from posttrain.core.model.args import ModelArgs
    from posttrain.core.model.model import build_model
    from posttrain.registry.adapters import save_adapter
    from posttrain.registry.hf import save_pretrained

    torch.manual_seed(SEED)
    args = ModelArgs(**cfg["model"])
    model = build_model(args, seed=SEED)
    save_pretrained(model, model_dir)
    apply_lora(model, rank=LORA["rank"], alpha=LORA["alpha"], targets=LORA["targets"], dropout=LORA["dropout"])
    save_adapter(model, adapter_dir)
    trainable, total = count_trainable(model)
    return {"params": args.num_params(), "trainable_params": trainable, "total_params": total}


def run_side(side: str, shape: str, cfg: dict[str, Any], model_dir: str, adapter_dir: str) -> dict[str, Any]:
    """One side, one data shape, in a fresh process: load, warm up, time `steps` steps."""
    import torch

    start_rss = _rss_mb()
    torch.manual_seed(SEED)
    steps = steps_of(shape, cfg)
    step_fn, info = (_ours if side == "ours" else _baseline)(cfg, model_dir, adapter_dir)
    setup_rss = _rss_mb()
    losses, times, real = [], [], []
    for docs in steps:
        t0 = time.perf_counter()
        losses.append(step_fn(docs))
        times.append(time.perf_counter() - t0)
        real.append(sum(len(ids) for ids, _ in docs))
    timed = slice(cfg["warmup"], None)
    tokens, seconds = sum(real[timed]), sum(times[timed])
    peak = _maxrss_mb()
    return {
        "tokens_per_s": tokens / seconds,
        "step_s": times[timed],
        "losses": losses,
        "peak_mem_mb": peak - start_rss,
        "process_peak_rss_mb": peak,
        "start_rss_mb": start_rss,
        "setup_rss_mb": setup_rss,
        "threads": torch.get_num_threads(),
        **info,
    }


def _ours(cfg, model_dir, adapter_dir):
    from posttrain.core.optim import OptimConfig
    from posttrain.core.data.encode import Document
    from posttrain.core.data.packing import collate_padding_free, pack
    from posttrain.core.objectives import sft_objective
    from posttrain.core.trainer import Trainer
    from posttrain.registry.adapters import load_adapter
    from posttrain.registry.hf import load_pretrained

    model = load_pretrained(model_dir)
    load_adapter(model, adapter_dir)
    optim = OptimConfig(lr=OPTIM["lr"], betas=OPTIM["betas"], eps=OPTIM["eps"], weight_decay=OPTIM["weight_decay"],
                        warmup_steps=0, schedule="constant", max_grad_norm=None)
    trainer = Trainer(model, optim, total_steps=cfg["warmup"] + cfg["steps"])
    micro_batches: list[int] = []

    def step(docs) -> float:
        documents = [Document(ids, lab) for ids, lab in docs]
        rows = pack([len(d) for d in documents], cfg["token_budget"], "ffd")
        micro_batches.append(len(rows))
        for row in rows:
            trainer.forward_backward(collate_padding_free([documents[i] for i in row]), sft_objective)
        return trainer.optim_step()["loss"]

    return step, {"micro_batches_per_step": micro_batches, "padded_tokens_per_step": []}


def _baseline(cfg, model_dir, adapter_dir):
    import warnings

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr stays readable; stdout is the JSON alone
    warnings.filterwarnings("ignore", category=FutureWarning)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
    model = peft_with_adapter(model, adapter_dir)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=OPTIM["lr"],
                            betas=OPTIM["betas"], eps=OPTIM["eps"], weight_decay=OPTIM["weight_decay"])
    micro_batches: list[int] = []
    padded: list[int] = []

    def step(docs) -> float:
        n_step = sum(targets_of(lab) for _, lab in docs)
        chunks = [docs[i:i + cfg["seqs_per_micro"]] for i in range(0, len(docs), cfg["seqs_per_micro"])]
        micro_batches.append(len(chunks))
        padded.append(0)
        loss_sum = 0.0
        for chunk in chunks:
            batch = pad_batch(chunk)
            padded[-1] += int(batch["input_ids"].numel())
            n_mb = sum(targets_of(lab) for _, lab in chunk)
            loss = model(**batch, use_cache=False).loss  # mean over this micro-batch's targets
            (loss * (n_mb / n_step)).backward()
            loss_sum += float(loss.detach()) * n_mb
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss_sum / n_step

    return step, {"micro_batches_per_step": micro_batches, "padded_tokens_per_step": padded}


def peft_with_adapter(model, adapter_dir: str):
    """`model` wrapped by peft's LoRA (LORA's settings, every linear layer) holding the exported
    adapter's A/B, in train mode; refuses an adapter that did not load whole."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    model = get_peft_model(model, LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                                             target_modules="all-linear"))
    loaded = set_peft_model_state_dict(model, load_file(str(Path(adapter_dir) / "adapter_model.safetensors")))
    missing = [k for k in loaded.missing_keys if "lora_" in k]
    if loaded.unexpected_keys or missing:
        raise RuntimeError(f"adapter did not load into peft: unexpected {loaded.unexpected_keys[:3]}, "
                           f"missing {missing[:3]}")
    return model.train()


# ------------------------------------------------------------------------------------- driver


def missing_packages(names=REQUIRED) -> list[str]:
    """Those of `names` that cannot be found for import (located, not imported: no side effects)."""
    import importlib.util

    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a finder refusing it, or a broken half-imported module
            found = False
        if not found:
            missing.append(name)
    return missing


def _in_fresh_process(ctx, fn, *args):
    """Run fn(*args) in a new process forked from the forkserver (so the RSS baseline is common)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as ex:
        return ex.submit(fn, *args).result()


def _median(xs):
    return statistics.median(xs) if xs else None


def side_figures(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's repetitions: median tokens/s, peak memory, and each repetition's figures."""
    return {
        "tokens_per_s": _median([r["tokens_per_s"] for r in rs]),
        "peak_mem_mb": max(r["peak_mem_mb"] for r in rs),
        "process_peak_rss_mb": max(r["process_peak_rss_mb"] for r in rs),
        "tokens_per_s_reps": [r["tokens_per_s"] for r in rs],
        "peak_mem_mb_reps": [r["peak_mem_mb"] for r in rs],
    }


def _summarize(shape: str, cfg: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for side in ("ours", "baseline"):
        rs = runs[side]
        first = rs[0]
        out[side] = {
            **side_figures(rs),
            "start_rss_mb": first["start_rss_mb"],
            "setup_rss_mb": first["setup_rss_mb"],
            "micro_batches_per_step": first["micro_batches_per_step"],
            "losses": first["losses"],
            "threads": first["threads"],
        }
        if side == "baseline":
            padded = sum(first["padded_tokens_per_step"][cfg["warmup"]:])
            real = sum(sum(len(ids) for ids, _ in docs) for docs in steps_of(shape, cfg)[cfg["warmup"]:])
            out[side]["padding_fraction"] = 1 - real / padded
    o, b = out["ours"], out["baseline"]
    per_rep = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(runs["ours"], runs["baseline"])]
    out["ratios"] = {
        "speedup": _median(per_rep),
        "speedup_reps": per_rep,
        "memory_ratio": o["peak_mem_mb"] / b["peak_mem_mb"],
        "process_rss_ratio": o["process_peak_rss_mb"] / b["process_peak_rss_mb"],
    }
    lo, lb = o["losses"][0], b["losses"][0]
    rel = abs(lo - lb) / max(abs(lb), 1e-12)
    traj = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(o["losses"], b["losses"]))
    out["loss_check"] = {"ours": lo, "baseline": lb, "rel_diff": rel, "tolerance": LOSS_RTOL, "met": rel <= LOSS_RTOL,
                         "max_rel_diff_all_steps": traj}
    return out


def _data_stats(shape: str, cfg: dict[str, Any]) -> dict[str, Any]:
    steps = steps_of(shape, cfg)
    lengths = [len(ids) for docs in steps for ids, _ in docs]
    return {"documents": len(lengths), "mean_len": sum(lengths) / len(lengths), "min_len": min(lengths),
            "max_len": max(lengths), "real_tokens_per_step": [sum(len(ids) for ids, _ in d) for d in steps]}


def _targets(shapes: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, (op, value) in TARGETS.items():
        shape, metric = name.split("_", 1)
        if shape not in shapes:
            continue
        key = "speedup" if metric == "speedup" else "memory_ratio"
        got = shapes[shape]["ratios"][key]
        out[name] = {"target": f"{op} {value}", "value": got, "met": got >= value if op == ">=" else got <= value}
    out["all_met"] = all(t["met"] for t in out.values())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m posttrain.benchmarks.sft", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (for the tests)")
    p.add_argument("--steps", type=int, help="timed steps per repetition (after the warmup)")
    p.add_argument("--warmup", type=int, help="untimed steps first")
    p.add_argument("--reps", type=int, help="repetitions per side and shape, alternating the sides")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: dense,realistic")
    p.add_argument("--token-budget", type=int, help="ours: tokens per packed micro-batch")
    p.add_argument("--out", help="also write the JSON document here")
    a = p.parse_args(argv)
    cfg = dict(QUICK if a.quick else FULL)
    for key in ("steps", "warmup", "reps", "token_budget"):
        if getattr(a, key) is not None:
            cfg[key] = getattr(a, key)
    if cfg["steps"] < 1 or cfg["reps"] < 1 or cfg["warmup"] < 0:
        p.error("--steps and --reps must be >= 1, --warmup >= 0")
    shapes = [s for s in a.shapes.split(",") if s]
    if not shapes or set(shapes) - set(SHAPES):
        p.error(f"--shapes takes a comma-separated subset of {SHAPES}")
    missing = missing_packages()
    if missing:  # before any work: the forkserver would only fail on them minutes later
        print(f"posttrain.benchmarks.sft compares against transformers + peft; not installed: {', '.join(missing)}. "
              f"Install them with: {INSTALL_HINT}", file=sys.stderr)
        return 2

    import multiprocessing as mp

    from posttrain.benchmarks import sft as this  # by module name, so the children can unpickle the functions

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    load_start = os.getloadavg()
    t_start = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_sft_") as tmp:
        model_dir, adapter_dir = str(Path(tmp) / "model"), str(Path(tmp) / "adapter")
        exported = _in_fresh_process(ctx, this.export, cfg, model_dir, adapter_dir)
        runs = {s: {"ours": [], "baseline": []} for s in shapes}
        for rep in range(cfg["reps"]):
            order = ("ours", "baseline") if rep % 2 == 0 else ("baseline", "ours")
            for shape in shapes:
                for side in order:
                    r = _in_fresh_process(ctx, this.run_side, side, shape, cfg, model_dir, adapter_dir)
                    runs[shape][side].append(r)
                    print(f"[bench sft] rep {rep} {shape:9s} {side:8s} {r['tokens_per_s']:9.1f} tok/s "
                          f"peak +{r['peak_mem_mb']:.0f} MB", file=sys.stderr, flush=True)

    results = {s: {"data": _data_stats(s, cfg), **_summarize(s, cfg, runs[s])} for s in shapes}
    import peft
    import torch
    import transformers

    doc = {
        "benchmark": "sft",
        "quick": a.quick,
        "device": "cpu",
        "dtype": "float32",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
        "config": {**cfg, "lora": LORA, "optim": {**OPTIM, "schedule": "constant", "grad_clip": None},
                   "seed": SEED, **exported},
        "method": {
            "tokens_per_s": "real (non-padding) tokens / wall time of the timed steps (after warmup); median over "
                            "reps; sides alternate per rep; speedup = median of per-rep ours/baseline",
            "peak_mem_mb": "ru_maxrss (getrusage RUSAGE_SELF) of a fresh process forked from a forkserver that "
                           "preloaded torch/transformers/peft/posttrain (the common baseline), minus that "
                           "process's RSS at start; max over reps. process_peak_rss_mb: ru_maxrss itself",
            "loss_check": f"first step's token-weighted mean loss before any update, |ours-baseline|/|baseline| "
                          f"<= {LOSS_RTOL}",
        },
        "load_avg": {"start": list(load_start), "end": list(os.getloadavg())},
        "wall_s": time.time() - t_start,
        "shapes": results,
        "targets": _targets(results),
        "loss_check": {"met": all(r["loss_check"]["met"] for r in results.values()), "tolerance": LOSS_RTOL,
                       **{s: r["loss_check"]["rel_diff"] for s, r in results.items()}},
    }
    return write_report(doc, a.out)


def write_report(doc: dict[str, Any], out: str | None) -> int:
    """Print a benchmark's JSON document (and write it to `out`); the exit status 0."""
    text = json.dumps(doc, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
