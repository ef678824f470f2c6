"""Evaluation: batched KV-cache generation on the held-out prompts, exact match against the
task's verifier, perplexity on held-out responses, a table of samples, and the delta against
the models given in `compare_to`. Prompts are split over the data-parallel ranks (`parallel`:
data parallelism only, on its device and backend; each rank holds the whole model).

    torchrun --nproc-per-node 2 -m stages.evaluate --config spec.json
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from core.model.config import ModelConfig
from stages.config import EvalConfig
from core.data import read_rows
from core.manifest import digest, write_manifest
from core.model.generate import SamplingParams, generate
from core.objectives import sft_objective
from core.tasks import verify
from stages.common import (Dist, StageError, close_distributed, dump_json, load_model, load_tokenizer,
                           parse_spec, progress, stage_run, start_distributed)
from stages.training import DeviceLoader, doc_loader, mean_loss, sft_documents

log = logging.getLogger("posttrain.evaluate")


def eval_rows(cfg: EvalConfig) -> list[dict[str, Any]]:
    rows = read_rows(cfg.data.sources, "sft", cfg.split)
    return rows[: cfg.max_examples] if cfg.max_examples else rows


@torch.no_grad()
def evaluate_model(model_path: str, cfg: EvalConfig, rows: list[dict[str, Any]], d: Dist,
                   advance=lambda n=1, **kw: None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Exact match (mean over prompts and samples) and perplexity of one model; samples on rank 0."""
    model, _ = load_model(ModelConfig(name_or_path=model_path, dtype=cfg.model.dtype), d.device, cfg.seed)
    model.eval()
    tok = load_tokenizer(cfg.model.tokenizer, model_path, *cfg.data.sources)
    mine = rows[d.rank :: d.world]
    correct = total = 0.0
    samples = []
    for i in range(0, len(mine), cfg.batch_size):
        chunk = mine[i : i + cfg.batch_size]
        prompts = [tok.apply_chat_template([m for m in r["messages"] if m["role"] != "assistant"],
                                           add_generation_prompt=True) for r in chunk]
        for k in range(cfg.num_samples):
            # Each (rank, batch, repetition) draws its own stream: the samples of a prompt differ.
            params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                    top_p=cfg.top_p, stop_token_ids=tuple(tok.eos_ids),
                                    seed=sample_seed(cfg.seed, d.rank, i, k))
            for r, g in zip(chunk, generate(model, prompts, params, pad_id=tok.pad_id or 0)):
                text = tok.decode(g.tokens, skip_special_tokens=True)
                ok = verify(r["answer"], text)
                correct += ok
                total += 1
                if len(samples) < 50:
                    samples.append({"task": r.get("task"), "prompt": r["messages"][0]["content"],
                                    "answer": r["answer"], "completion": text, "correct": bool(ok)})
        advance(len(chunk))
    correct, total = d.all_reduce_sum([correct, total])
    metrics = {"exact_match": correct / max(total, 1.0)}
    docs = sft_documents(cfg.data.sources, cfg.split, tok, cfg.data)[: cfg.max_examples or None]
    if docs:
        loader = DeviceLoader(doc_loader(docs, cfg.data, d, epochs=1, evaluation=True), d.device)
        nll = mean_loss(model, loader, sft_objective, d)
        metrics.update(nll=nll, perplexity=math.exp(min(nll, 50.0)))
    return metrics, samples


def sample_seed(seed: int, rank: int, batch: int, repetition: int) -> int:
    """A sampling seed per (stage seed, rank, batch start, repetition), stable across runs."""
    return int(digest([seed, rank, batch, repetition])[:15], 16)


def run(cfg: EvalConfig) -> dict:
    from kernels.dispatch import set_mode

    set_mode(cfg.model.kernels)
    d = start_distributed(cfg.parallel)
    out = Path(cfg.output_dir or "evaluate")
    out.mkdir(parents=True, exist_ok=True)
    rows = eval_rows(cfg)
    if not rows:
        raise StageError(f"evaluate: no {cfg.split!r} rows in {cfg.data.sources}")
    targets = {"model": cfg.model.name_or_path, **{f"compare/{Path(c).name}": c for c in cfg.compare_to}}
    results: dict[str, dict[str, float]] = {}
    with stage_run(cfg, "evaluate", d.is_main) as run_, progress(len(rows) * len(targets), "evaluate",
                                                                  d.is_main) as advance:
        for name, path in targets.items():
            metrics, samples = evaluate_model(path, cfg, rows, d, advance)
            results[name] = metrics
            if d.is_main and cfg.save_samples and name == "model":
                dump_json(out / "samples.json", samples)
        metrics = {f"{k}": v for k, v in results["model"].items()}
        for name, m in results.items():
            if name != "model":
                metrics[f"delta_exact_match/{name.split('/', 1)[1]}"] = results["model"]["exact_match"] - m["exact_match"]
        manifest = None
        if d.is_main:
            dump_json(out / "results.json", {"targets": targets, "results": results})
            outputs = {"results": "results.json"}
            if (out / "samples.json").exists():
                outputs["samples"] = "samples.json"
            manifest = write_manifest(out, "evaluate", outputs, metrics=metrics, config=cfg.model_dump(mode="json"),
                                      inputs=targets, extra={"results": results, "mlflow_run_id": run_.run_id})
            run_.log_metrics(metrics, step=0)
            run_.log_artifact(str(out / "results.json"))
            if (out / "samples.json").exists():
                run_.log_artifact(str(out / "samples.json"))
    close_distributed()
    return manifest or {}


def main(argv: list[str] | None = None) -> None:
    run(parse_spec(EvalConfig, argv))


if __name__ == "__main__":
    main()
