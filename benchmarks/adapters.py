"""N LoRA adapters trained in one job (one frozen base, each document routed to its adapter) beside
N separate jobs, each training one adapter on the same documents: tokens/s and peak memory.

    python -m posttrain.benchmarks.adapters [--quick] [--adapters 2,4,8] [--steps N] [--out file.json]
    posttrain bench adapters [--quick] ...

Model: Llama-shaped (hidden 256, 4 layers, 4 heads, 2 KV heads, intermediate 704, vocab 4096;
--quick: posttrain.benchmarks.sft's quick shape), fp32 on CPU, random weights from posttrain.core.model saved once as
an HF checkpoint; LoRA rank 16, alpha 32 on every linear layer but the output head. The N adapters
start from the same weights on both sides (saved once in PEFT format by posttrain.registry.adapters, loaded
by posttrain.registry.adapters.load_adapter). AdamW lr 1e-4, weight decay 0.01, constant schedule, no clip.

Data: `docs_per_adapter` documents per adapter per step (posttrain.benchmarks.sft's realistic lengths:
lognormal, mean `mean_len`), `warmup` + `steps` steps; adapter k's documents are the same on
both sides.

  one job    posttrain.core.trainer.Trainer(adapters=[a0..aN-1]): each step packs all N adapters' documents
             (first-fit decreasing) into micro-batches of at most `token_budget` tokens,
             collate_padding_free (per-token adapter ids), posttrain.stages.adapters.routed(sft_objective).
  separate   for each adapter, a fresh process: the base plus that adapter alone, a plain Trainer,
             its own documents packed the same way, sft_objective.

Measures
  tokens_per_s   tokens of the timed steps (after `warmup`) / their wall time; separate: all N
                 jobs' tokens / the sum of their timed seconds (the jobs one after another).
  wall_s         each process from the start of loading to its last step (separate: summed).
  peak_mem_mb    ru_maxrss of the process (forked from a forkserver that imported torch and
                 posttrain: the common baseline) minus its RSS at start. separate: the largest
                 job (`peak_mem_mb_max`, the jobs one after another) and the sum
                 (`peak_mem_mb_sum`, the jobs side by side on one machine).
  loss_check     the one job's first-step loss (before any update) against the token-weighted
                 mean of the separate jobs' first-step losses: the same documents and weights.
Tests never assert on the figures; only on the document's structure and the loss check.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from posttrain.benchmarks.sft import _in_fresh_process, _maxrss_mb, _rss_mb, documents, write_report

LOSS_RTOL = 1e-4
PRELOAD = ["torch", "safetensors.torch", "posttrain.core.model.model", "posttrain.core.lora", "posttrain.core.trainer", "posttrain.core.objectives",
           "posttrain.core.data.packing", "posttrain.registry.hf", "posttrain.registry.adapters", "posttrain.stages.adapters"]
FULL: dict[str, Any] = dict(
    model=dict(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
               intermediate_size=704, max_position_embeddings=2048, norm_eps=1e-5, family="llama"),
    mean_len=200, min_len=16, max_len=1024, token_budget=4096, docs_per_adapter=8, warmup=1, steps=3,
)
QUICK: dict[str, Any] = dict(
    model=dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
               intermediate_size=176, max_position_embeddings=256, norm_eps=1e-5, family="llama"),
    mean_len=40, min_len=8, max_len=128, token_budget=512, docs_per_adapter=4, warmup=1, steps=2,
)
LORA = dict(rank=16, alpha=32, targets="all-linear")
OPTIM = dict(lr=1e-4, weight_decay=0.01, warmup_steps=0, schedule="constant", max_grad_norm=None)
SEED = 0


def steps_of(cfg: dict[str, Any], k: int) -> list[list[tuple[list[int], list[int]]]]:
    """Adapter k's documents, step by step (deterministic in k)."""
    per, n = cfg["docs_per_adapter"], cfg["warmup"] + cfg["steps"]
    docs = documents("realistic", {**cfg, "dense_len": 0}, per * n, seed=SEED + 1000 * (k + 1))
    return [docs[i:i + per] for i in range(0, len(docs), per)]


def export(cfg: dict[str, Any], root: str, n: int) -> dict[str, Any]:
    """The base as an HF checkpoint and n adapters (same init on both sides) in PEFT format."""
    import torch

    from posttrain.core.lora import apply_lora, count_trainable
    from posttrain.core.model.args import ModelArgs
    from posttrain.core.model.model import build_model
    from posttrain.registry.adapters import save_adapter
    from posttrain.registry.hf import save_pretrained

    torch.manual_seed(SEED)
    args = ModelArgs(**cfg["model"])
    model = build_model(args, seed=SEED)
    save_pretrained(model, Path(root) / "model")
    names = [f"a{k}" for k in range(n)]
    apply_lora(model, adapter_name=names, **LORA)
    with torch.no_grad():  # B != 0, so every adapter changes the loss from the first step
        for p in model.parameters():
            if p.requires_grad and p.ndim == 2 and (p == 0).all():
                p.normal_(0, 0.01)
    for name in names:
        save_adapter(model, Path(root) / name, name=name)
    trainable, total = count_trainable(model)
    return {"params": args.num_params(), "trainable_params_per_adapter": trainable // n}


def run_job(cfg: dict[str, Any], root: str, adapters: list[int]) -> dict[str, Any]:
    """One process training `adapters` (indices): all at once when several, else that one alone."""
    import torch

    from posttrain.core.data.encode import Document
    from posttrain.core.data.packing import collate_padding_free, pack
    from posttrain.core.objectives import sft_objective
    from posttrain.core.optim import OptimConfig
    from posttrain.core.trainer import Trainer
    from posttrain.registry.adapters import load_adapter
    from posttrain.registry.hf import load_pretrained
    from posttrain.stages.adapters import routed

    t_start, start_rss = time.perf_counter(), _rss_mb()
    torch.manual_seed(SEED)
    model = load_pretrained(Path(root) / "model")
    names = [f"a{k}" for k in adapters]
    for name in names:
        load_adapter(model, Path(root) / name, name=name)
    multi = len(names) > 1
    trainer = Trainer(model, OptimConfig(**OPTIM), cfg["warmup"] + cfg["steps"], adapters=names if multi else ())
    objective = routed(sft_objective, names) if multi else sft_objective
    per_adapter = [steps_of(cfg, k) for k in adapters]
    losses, times, tokens = [], [], []
    for step in range(cfg["warmup"] + cfg["steps"]):
        docs = [Document(ids, lab, i if multi else None) for i, steps in enumerate(per_adapter)
                for ids, lab in steps[step]]
        t0 = time.perf_counter()
        for row in pack([len(d) for d in docs], cfg["token_budget"], "ffd"):
            trainer.forward_backward(collate_padding_free([docs[i] for i in row]), objective)
        metrics = trainer.optim_step()
        times.append(time.perf_counter() - t0)
        losses.append(metrics["loss"])
        tokens.append(sum(len(d) for d in docs))
    timed = slice(cfg["warmup"], None)
    return {"tokens": sum(tokens[timed]), "seconds": sum(times[timed]), "losses": losses,
            "target_tokens_first_step": metrics_tokens(per_adapter),
            "wall_s": time.perf_counter() - t_start, "peak_mem_mb": _maxrss_mb() - start_rss,
            "threads": torch.get_num_threads()}


def metrics_tokens(per_adapter) -> int:
    """Target tokens of the first step (what its loss is a mean over)."""
    return sum(sum(1 for y in lab[1:] if y != -100) for steps in per_adapter for _, lab in steps[0])


def measure(ctx, cfg: dict[str, Any], n: int) -> dict[str, Any]:
    from posttrain.benchmarks import adapters as this  # by module name, so the children can unpickle the functions

    with tempfile.TemporaryDirectory(prefix="bench_adapters_") as root:
        exported = _in_fresh_process(ctx, this.export, cfg, root, n)
        one = _in_fresh_process(ctx, this.run_job, cfg, root, list(range(n)))
        jobs = [_in_fresh_process(ctx, this.run_job, cfg, root, [k]) for k in range(n)]
    sep_tokens, sep_seconds = sum(j["tokens"] for j in jobs), sum(j["seconds"] for j in jobs)
    separate = {"tokens_per_s": sep_tokens / sep_seconds, "wall_s": sum(j["wall_s"] for j in jobs),
                "peak_mem_mb_max": max(j["peak_mem_mb"] for j in jobs),
                "peak_mem_mb_sum": sum(j["peak_mem_mb"] for j in jobs),
                "tokens_per_s_jobs": [j["tokens"] / j["seconds"] for j in jobs],
                "first_step_losses": [j["losses"][0] for j in jobs]}
    one_job = {"tokens_per_s": one["tokens"] / one["seconds"], "wall_s": one["wall_s"],
               "peak_mem_mb": one["peak_mem_mb"], "losses": one["losses"]}
    weights = [j["target_tokens_first_step"] for j in jobs]
    mixed = sum(j["losses"][0] * w for j, w in zip(jobs, weights)) / sum(weights)
    rel = abs(one["losses"][0] - mixed) / max(abs(mixed), 1e-12)
    print(f"[bench adapters] N={n}: one job {one_job['tokens_per_s']:.0f} tok/s +{one['peak_mem_mb']:.0f} MB, "
          f"separate {separate['tokens_per_s']:.0f} tok/s +{separate['peak_mem_mb_max']:.0f} MB each",
          file=sys.stderr, flush=True)
    return {
        "tokens_per_step": one["tokens"] // cfg["steps"], **exported, "one_job": one_job, "separate": separate,
        "ratios": {"speedup": one_job["tokens_per_s"] / separate["tokens_per_s"],
                   "wall_speedup": separate["wall_s"] / one_job["wall_s"],
                   "memory_vs_one_separate_job": one_job["peak_mem_mb"] / separate["peak_mem_mb_max"],
                   "memory_vs_all_separate_jobs": one_job["peak_mem_mb"] / separate["peak_mem_mb_sum"]},
        "loss_check": {"one_job": one["losses"][0], "separate_weighted": mixed, "rel_diff": rel,
                       "tolerance": LOSS_RTOL, "met": rel <= LOSS_RTOL},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m posttrain.benchmarks.adapters", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (for the tests)")
    p.add_argument("--adapters", default="2,4,8", help="comma-separated adapter counts N")
    p.add_argument("--steps", type=int, help="timed steps per job (after the warmup)")
    p.add_argument("--out", help="also write the JSON document here")
    a = p.parse_args(argv)
    cfg = dict(QUICK if a.quick else FULL)
    if a.steps is not None:
        if a.steps < 1:
            p.error("--steps must be >= 1")
        cfg["steps"] = a.steps
    try:
        counts = [int(x) for x in a.adapters.split(",") if x]
    except ValueError:
        counts = []
    if not counts or min(counts) < 2:
        p.error("--adapters takes comma-separated counts >= 2")

    import multiprocessing as mp

    import torch

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    load_start, t_start = os.getloadavg(), time.time()
    results = {str(n): measure(ctx, cfg, n) for n in counts}
    doc = {
        "benchmark": "adapters", "quick": a.quick, "device": "cpu", "dtype": "float32",
        "versions": {"torch": torch.__version__},
        "config": {**cfg, "lora": LORA, "optim": OPTIM, "seed": SEED},
        "method": {
            "tokens_per_s": "tokens of the timed steps / their wall time; separate: all N jobs' tokens / the sum "
                            "of their timed seconds",
            "peak_mem_mb": "ru_maxrss of a fresh process forked from a forkserver that preloaded torch and posttrain, "
                           "minus its RSS at start; separate: the largest job and the sum of all",
            "loss_check": f"one job's first-step loss vs the token-weighted mean of the separate jobs' first-step "
                          f"losses, relative difference <= {LOSS_RTOL}",
        },
        "load_avg": {"start": list(load_start), "end": list(os.getloadavg())},
        "wall_s": time.time() - t_start,
        "adapters": results,
        "loss_check": {"met": all(r["loss_check"]["met"] for r in results.values()), "tolerance": LOSS_RTOL},
    }
    return write_report(doc, a.out)


if __name__ == "__main__":
    sys.exit(main())
