"""The GPU benchmark: one command, one JSON document, a few minutes on one H100/H200-class GPU.

    python -m posttrain.benchmarks.gpu [--out file.json] [--sections mfu kernels fp8 generate] [--dry-run]

Sections (each a list of cases; a case that cannot run says why instead of failing the rest):

  mfu       full SFT of a ~1.2B Llama shape (Llama 3.2 1B's: hidden 2048, 16 layers, 32 heads,
            8 KV heads, intermediate 8192, vocab 128256, tied embeddings) with precision bf16
            (float32 master weights, fused AdamW), kernels 'auto' (Triton), micro-batch 4 x 2048
            tokens: tokens/s and MFU against the GPU's dense bf16 peak (posttrain.core.monitor.PEAK_FLOPS;
            goal >= 50%), peak CUDA memory.
  kernels   the same model's training step with posttrain's Triton kernels (kernels 'auto'), its
            torch references (kernels 'torch'), the references under torch.compile (each block),
            and transformers' LlamaForCausalLM with Liger-Kernel's patches (`apply_liger_kernel_to_llama`)
            beside plain transformers, where liger_kernel and transformers import: ms/step, peak memory.
  fp8       precision fp8 (torchao Float8Linear, dynamic tensorwise scaling) against bf16 on the same
            model and batch: tokens/s, peak memory, first losses (should agree to ~1e-2).
  generate  posttrain.core.generation.Engine greedy decoding on the 1.2B shape: 64 prompts of 128 tokens, 128
            new tokens each (batch 64), and 16 prompts x n=8 samples: generated tokens/s.

Without CUDA the script stops at once (exit 2) saying so; `--dry-run` runs every section on the CPU
with tiny shapes and 2 steps (fp8 emulated, Liger skipped unless installed) to check the script
itself, its figures meaningless.

On the lent GPU machine (bare: Python 3.12 with torch, triton, transformers; no pydantic, torchao or
liger-kernel), carry their wheels (see /work/.library/device/README.md: `pip download --no-deps
--only-binary=:all: --python-version 3.12 ... -d .whl pydantic pydantic-core annotated-types
typing-inspection torchao liger-kernel`) and run

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \\
    PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 python3 -m posttrain.benchmarks.gpu --out $OUT/gpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

from posttrain.benchmarks import emit

SECTIONS = ("mfu", "kernels", "fp8", "generate")
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                intermediate_size=8192, max_position_embeddings=4096, norm_eps=1e-5, rope_theta=500000.0,
                tie_embeddings=True, family="llama")
TINY = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=176,
            max_position_embeddings=256, norm_eps=1e-5, tie_embeddings=True, family="llama")


class Setup:
    """Shapes and step counts: the real ones on CUDA, tiny ones for --dry-run on the CPU."""

    def __init__(self, dry_run: bool):
        import torch

        self.dry = dry_run
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.model = TINY if dry_run else LLAMA_1B
        self.batch, self.seq = (2, 64) if dry_run else (4, 2048)
        self.warmup, self.steps = (1, 2) if dry_run else (3, 10)
        self.gen = (4, 16, 8, 2) if dry_run else (64, 128, 128, 8)  # prompts, prompt len, new tokens, n

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def reset_memory(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_mb(self) -> float | None:
        import torch

        return round(torch.cuda.max_memory_allocated() / 2**20, 1) if self.device.type == "cuda" else None


def _args(setup: Setup):
    from posttrain.core.model.args import ModelArgs

    known = ModelArgs.__dataclass_fields__
    return ModelArgs(**{k: v for k, v in setup.model.items() if k in known})


def train_case(setup: Setup, mode: str = "bf16", kernels: str = "auto", compile: bool = False) -> dict[str, Any]:
    """Steps of full SFT through posttrain.core.trainer.Trainer as the stages drive it."""
    import torch

    from posttrain.core.losses import chunked_cross_entropy, num_target_tokens
    from posttrain.core.model import build_model
    from posttrain.core.monitor import flops_per_token, peak_flops
    from posttrain.core.optim import OptimConfig
    from posttrain.core.parallel.data_parallel import apply_compile
    from posttrain.core.precision import LossScaler, PrecisionConfig, autocast_dtype, convert_fp8, upcast_trainable
    from posttrain.core.trainer import LossOutput, Trainer
    from posttrain.kernels.dispatch import set_mode

    set_mode(kernels)
    setup.reset_memory()
    precision = PrecisionConfig(mode=mode, fp8_emulate=setup.dry)
    torch.manual_seed(0)
    args = _args(setup)
    model = build_model(args, device=setup.device)
    upcast_trainable(model)
    if mode == "fp8":
        convert_fp8(model, precision)
    if compile:
        apply_compile(list(model.layers))
    trainer = Trainer(model, OptimConfig(lr=1e-5, warmup_steps=0, schedule="constant"), 100,
                      autocast_dtype=autocast_dtype(precision, "float32", setup.device),
                      loss_scaler=LossScaler.from_config(precision))

    def objective(m, batch):
        ids = batch["input_ids"]
        loss = m(ids, head=lambda h, w: chunked_cross_entropy(h, w, ids, reduction="sum", chunk_size=1024))
        return LossOutput(loss, num_target_tokens(ids).sum())

    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, args.vocab_size, (setup.batch, setup.seq), generator=g).to(setup.device)}
    times, losses = [], []
    for k in range(setup.warmup + setup.steps):
        setup.sync()
        t = time.perf_counter()
        trainer.forward_backward(batch, objective)
        losses.append(trainer.optim_step()["loss"])
        setup.sync()
        if k >= setup.warmup:
            times.append(time.perf_counter() - t)
    step = sorted(times)[len(times) // 2]
    tokens = setup.batch * setup.seq
    out = {"ms_per_step": round(1000 * step, 2), "tokens_per_s": round(tokens / step, 1),
           "peak_mem_mb": setup.peak_mb(), "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
           "params": sum(p.numel() for p in model.parameters())}
    peak = peak_flops(setup.device) if setup.device.type == "cuda" else None
    if peak:
        out["mfu"] = round(flops_per_token(args, setup.seq) * tokens / step / peak, 4)
    del trainer, model
    return out


def liger_case(setup: Setup, liger: bool) -> dict[str, Any]:
    """transformers' Llama (its SDPA attention) with or without Liger-Kernel's patches, same shape."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    setup.reset_memory()
    m = setup.model
    cfg = LlamaConfig(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], num_hidden_layers=m["num_layers"],
                      num_attention_heads=m["num_heads"], num_key_value_heads=m["num_kv_heads"],
                      intermediate_size=m["intermediate_size"], max_position_embeddings=m["max_position_embeddings"],
                      rms_norm_eps=m["norm_eps"], tie_word_embeddings=m["tie_embeddings"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(setup.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=setup.device.type == "cuda")
    ids = torch.randint(0, m["vocab_size"], (setup.batch, setup.seq), device=setup.device)
    times = []
    for k in range(setup.warmup + setup.steps):
        setup.sync()
        t = time.perf_counter()
        with torch.autocast(setup.device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        setup.sync()
        if k >= setup.warmup:
            times.append(time.perf_counter() - t)
    step = sorted(times)[len(times) // 2]
    return {"ms_per_step": round(1000 * step, 2), "tokens_per_s": round(setup.batch * setup.seq / step, 1),
            "peak_mem_mb": setup.peak_mb()}


def generate_case(setup: Setup) -> dict[str, Any]:
    import torch

    from posttrain.core.generation import Engine, RequestParams
    from posttrain.core.model import build_model

    prompts_n, prompt_len, new, n = setup.gen
    torch.manual_seed(0)
    args = _args(setup)
    model = build_model(args, device=setup.device, dtype=torch.float32 if setup.dry else torch.bfloat16).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, args.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(prompts_n)]
    out = {}
    for name, count, params in (("batch", prompts_n, RequestParams(max_tokens=new, temperature=0.0)),
                                ("n_samples", max(prompts_n // 4, 1),
                                 RequestParams(max_tokens=new, temperature=1.0, n=n, seed=0))):
        engine = Engine(model, max_num_seqs=prompts_n, max_batch_tokens=4096 if not setup.dry else 256)
        setup.sync()
        t = time.perf_counter()
        with torch.inference_mode():
            results = engine.generate(prompts[:count], params)
        setup.sync()
        seconds = time.perf_counter() - t
        tokens = sum(len(c.tokens) for r in results for c in r.completions)
        out[name] = {"requests": count, "n": params.n, "new_tokens": tokens, "seconds": round(seconds, 3),
                     "tokens_per_s": round(tokens / seconds, 1)}
    return out


def guarded(fn: Callable[[], dict]) -> dict:
    """A case's figures, or why it could not run (the other cases still do)."""
    try:
        return fn()
    except ImportError as e:
        return {"skipped": f"not installed: {e}"}
    except Exception as e:  # noqa: BLE001 - an unattended run reports every case it can
        return {"error": f"{type(e).__name__}: {e}"[:500]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: checks the script, not the GPU")
    p.add_argument("--out")
    args = p.parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("posttrain.benchmarks.gpu: no CUDA GPU here (torch.cuda.is_available() is False); run it on a GPU machine, "
              "or with --dry-run to check the script on the CPU", file=sys.stderr)
        return 2
    setup = Setup(args.dry_run)
    doc: dict[str, Any] = {"benchmark": "gpu", "dry_run": args.dry_run, "torch": torch.__version__,
                           "device": torch.cuda.get_device_name() if setup.device.type == "cuda" else "cpu",
                           "model": "tiny" if args.dry_run else "llama-3.2-1b shape",
                           "batch": setup.batch, "seq": setup.seq, "steps": setup.steps, "sections": {}}
    s = doc["sections"]
    if "mfu" in args.sections:
        s["mfu"] = guarded(lambda: train_case(setup))
    if "kernels" in args.sections:
        s["kernels"] = {"posttrain_triton": guarded(lambda: train_case(setup, kernels="auto")),
                        "posttrain_torch": guarded(lambda: train_case(setup, kernels="torch")),
                        "torch_compile": guarded(lambda: train_case(setup, kernels="torch", compile=True)),
                        "transformers": guarded(lambda: liger_case(setup, liger=False)),
                        "transformers_liger": guarded(lambda: liger_case(setup, liger=True))}
    if "fp8" in args.sections:
        s["fp8"] = {"bf16": guarded(lambda: train_case(setup, mode="bf16")),
                    "fp8": guarded(lambda: train_case(setup, mode="fp8"))}
        if "tokens_per_s" in s["fp8"]["bf16"] and "tokens_per_s" in s["fp8"]["fp8"]:
            s["fp8"]["speedup"] = round(s["fp8"]["fp8"]["tokens_per_s"] / s["fp8"]["bf16"]["tokens_per_s"], 3)
    if "generate" in args.sections:
        s["generate"] = guarded(lambda: generate_case(setup))
    print(json.dumps({"done": list(s)}), file=sys.stderr)
    return emit(doc, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
