"""Generation throughput: the paged, continuously batched engine (posttrain.core.generation.Engine) beside
the static-cache sampler the stages use today (posttrain.core.model.generate) and transformers' `generate`,
on the same model and prompts.

    python -m posttrain.benchmarks.generate [--models debug smollm2-135m] [--batches 1 16 64] [--samples 4 8]
                                  [--new-tokens 32] [--reps 1] [--dtype float32] [--out file.json]
    posttrain bench generate [...]

Model: a posttrain.core.model preset with random weights (seed 0), saved once as an HF checkpoint that
transformers loads (LlamaForCausalLM, sdpa attention), or a real one (`smollm2-135m-instruct`, a
`.gguf` file or an HF directory: its pretrained weights; "weights" in the JSON says which). Every
side runs it in --dtype (fp32 by default; bfloat16 for the matrix units of CPUs that have them,
where greedy tokens may then differ between sides by rounding). Prompts: random token ids,
lengths uniform in [16, 96] (seeded), distinct per row.

Cases
  greedy, batch B   B prompts, temperature 0, `new_tokens` tokens each (no stop token: every
                    row decodes to the end, the same work on all sides). tokens_equal: the
                    engine's and transformers' tokens against the static sampler's.
  sampled, n = k    16 prompts, k samples each at temperature 1: the engine's `n` (the samples
                    share the prompt's blocks, the prompt computed once), the static sampler on
                    the prompts repeated k times, transformers with num_return_sequences=k.
Per side: tokens_per_s = generated tokens / wall seconds (after one warm-up run of the case; with
--reps R, the median of R timed runs, each run's seconds in `reps_seconds`),
added_mb = ru_maxrss growth of the child process that runs it, after it loaded the model;
speedup = engine tokens/s over the other side's. floor: the model's own forwards that any sampler
runs for the case (`_floor`: every prompt once, then one batched one-token forward per new token,
no cache), timed the same way; engine_share_of_floor = engine tokens/s / floor tokens/s. No
sampler on this machine and precision can beat the floor by much: it is those forwards' matmuls.
Run it alone on the machine: it times things.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from posttrain.benchmarks import emit

SIDES = ("engine", "static", "transformers", "floor")


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 97, (n,), generator=g)
    return [torch.randint(5, vocab, (int(length),), generator=g).tolist() for length in lengths]


def _run(side: str, models: dict, prompts: list[list[int]], new: int, n: int, greedy: bool) -> tuple[list, float]:
    """(token lists, seconds) of one side on one case."""
    import torch

    from posttrain.core.generation import Engine, RequestParams
    from posttrain.core.generation.engine import pool_blocks
    from posttrain.core.model.generate import SamplingParams, generate

    ours, hf = models["ours"], models["hf"]
    temp = 0.0 if greedy else 1.0
    t0 = time.perf_counter()
    if side == "floor":
        return _floor(ours, prompts, new, n)
    if side == "engine":
        engine = Engine(ours, max_num_seqs=len(prompts) * n, block_size=16,
                        num_blocks=pool_blocks([len(p) for p in prompts], [new] * len(prompts), n, 16),
                        max_batch_tokens=4096)
        outs = engine.generate(prompts, RequestParams(max_tokens=new, temperature=temp, n=n, seed=0, logprobs=False))
        tokens = [c.tokens for o in outs for c in o.completions]
    elif side == "static":
        rows = [p for p in prompts for _ in range(n)]
        tokens = [g.tokens for g in generate(ours, rows, SamplingParams(max_new_tokens=new, temperature=temp, seed=0))]
    else:
        tokens = []
        with torch.no_grad():
            width = max(len(p) for p in prompts)
            ids = torch.zeros(len(prompts), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for b, p in enumerate(prompts):  # left padding, as generate wants for decoder-only models
                ids[b, width - len(p):], mask[b, width - len(p):] = torch.tensor(p), 1
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                              do_sample=not greedy, num_return_sequences=n, pad_token_id=0, eos_token_id=None)
            tokens = out[:, width:].tolist()
    return tokens, time.perf_counter() - t0


def _floor(model, prompts, new: int, n: int) -> tuple[list, float]:
    """The model's own forwards that any sampler must run, timed: every prompt once, packed in one
    row as documents (positions restart per prompt, so attention stays within each; the head
    skipped, as a sampler only needs the last token's logits) and `new` forwards of one token for
    each of the len(prompts) * n rows (no cache: attention over one key). What a sampler adds to these
    (attention over the context, the cache, scheduling, sampling) is what it can cut; the matmuls
    in these forwards it cannot, at this precision."""
    import torch

    rows = len(prompts) * n
    head = model.lm_head
    with torch.no_grad():
        t0 = time.perf_counter()
        model.lm_head = torch.nn.Identity()
        try:
            model(torch.tensor([sum(prompts, [])]), torch.tensor([[i for p in prompts for i in range(len(p))]]))
        finally:
            model.lm_head = head
        step = torch.zeros(rows, 1, dtype=torch.long)
        for _ in range(new):
            model(step)
        seconds = time.perf_counter() - t0
    return [[0] * new for _ in range(rows)], seconds


def _child(side, path, prompts, new, n, greedy, reps, dtype, q):
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", os.cpu_count() or 1)))
    models = load(path, dtype)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = _rss_mb()
    _run(side, models, prompts, new, n, greedy)  # warm-up
    runs = [_run(side, models, prompts, new, n, greedy) for _ in range(reps)]
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, before)
    q.put((runs[0][0], [seconds for _, seconds in runs], peak - start))


def measure(side: str, path: Path, prompts, new: int, n: int, greedy: bool, reps: int = 1,
            dtype: str = "float32") -> dict:
    ctx = mp.get_context("spawn")  # a fresh process (a forked one can hang in the parent's OpenMP pool)
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(side, path, prompts, new, n, greedy, reps, dtype, q))
    p.start()
    tokens, times, added = q.get(timeout=3600)
    p.join()
    generated = sum(len(t) for t in tokens)
    seconds = statistics.median(times)
    out = {"tokens_per_s": generated / seconds, "seconds": seconds, "generated": generated,
           "added_mb": round(added, 1), "_tokens": tokens}
    if reps > 1:
        out["reps_seconds"] = [round(t, 3) for t in times]
    return out


def save(name: str, workdir: Path) -> Path:
    """The preset with random weights (seed 0) as an HF checkpoint directory."""
    from posttrain.core.model import build_model, get_preset
    from posttrain.registry.hf import save_pretrained

    save_pretrained(build_model(get_preset(name), seed=0), workdir / name)
    return workdir / name


def checkpoint(name: str, workdir: Path) -> tuple[Path, str]:
    """(HF directory, where its weights come from) for --models NAME: a real model (a packaged
    model's name, a `.gguf` file, an HF directory) as it is, a preset with random weights saved."""
    from posttrain.stages.common import resolve_model_dir

    real, _ = resolve_model_dir(name)
    return (real, "pretrained") if real is not None else (save(name, workdir), "random (seed 0)")


def load(path: Path, dtype: str = "float32") -> dict:
    """The checkpoint as our model and as transformers' (the same weights), in `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.registry.hf import load_pretrained

    dt = getattr(torch, dtype)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dt, attn_implementation="sdpa").eval()
    return {"ours": load_pretrained(path, dtype=dt).eval(), "hf": hf}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["debug", "smollm2-135m"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--samples", nargs="+", type=int, default=[4, 8])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=1, help="timed runs per side and case (median reported)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="every side's weights")
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES,
                   help="which sides to run (speedups and shares only where both sides ran)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    doc: dict = {"command": "python -m posttrain.benchmarks.generate " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "cpus": os.cpu_count(), "new_tokens": args.new_tokens, "dtype": args.dtype, "models": {}}
    from posttrain.registry.hf import args_from_hf_config, read_hf_config

    with tempfile.TemporaryDirectory(prefix="bench_generate.") as tmp:
        for name in args.models:
            path, weights = checkpoint(name, Path(tmp))
            args_ = args_from_hf_config(read_hf_config(path), str(path))
            vocab = args_.vocab_size
            cases: dict = {}
            plan = [(f"greedy_b{b}", _prompts(vocab, b, b), 1, True) for b in args.batches]
            plan += [(f"sampled_b16_n{k}", _prompts(vocab, 16, 100 + k), k, False) for k in args.samples]
            for case, prompts, n, greedy in plan:
                sides = {side: measure(side, path, prompts, args.new_tokens, n, greedy, args.reps, args.dtype)
                         for side in args.sides}
                entry = {}
                for side, r in sides.items():
                    entry[side] = {k: v for k, v in r.items() if not k.startswith("_")}
                if "engine" not in sides:
                    cases[case] = entry
                    continue
                if "floor" in sides:
                    entry["engine_share_of_floor"] = round(sides["engine"]["tokens_per_s"] /
                                                           sides["floor"]["tokens_per_s"], 3)
                for other in ("static", "transformers"):
                    if other in sides:
                        entry[f"speedup_vs_{other}"] = round(sides["engine"]["tokens_per_s"] /
                                                             sides[other]["tokens_per_s"], 3)
                if greedy and {"static", "engine", "transformers"} <= set(sides):
                    ref = sides["static"]["_tokens"]
                    entry["tokens_equal"] = {s: sides[s]["_tokens"] == ref for s in ("engine", "transformers")}
                cases[case] = entry
                print(f"{name} {case}: " + ", ".join(f"{s} {entry[s]['tokens_per_s']:.1f} tok/s" for s in sides),
                      file=sys.stderr)
            doc["models"][name] = {"parameters": args_.num_params(), "weights": weights, "cases": cases}
    return emit(doc, args.out)


if __name__ == "__main__":
    sys.exit(main())
