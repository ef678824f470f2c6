"""Training speed and memory per `precision.mode` on this machine's device.

    python -m posttrain.benchmarks.precision [--quick] [--modes full bf16 fp16 fp8] [--lora] [--out file.json]

One process, posttrain.core.trainer.Trainer as the stages drive it (posttrain.core.precision: autocast dtype, fp16's
loss scale, float32 master weights, fp8's Float8Linear), on the Llama shape benchmarks/sft.py
measures (hidden 512, 8 layers, vocab 8192; --quick: the tiny one), the same random token batches
of 2 x 512 tokens for each mode, full fine-tuning (or LoRA r16 all-linear with --lora). Reported
per mode: tokens_per_s (median of the timed steps, after warmup), step_ms, peak_rss_mb (the
process's high-water mark, ru_maxrss, measured in a fresh process per mode), loss_first/last, and
the speedup against `full` (float32). fp8 runs torchao's emulation off CUDA (its speed there says
nothing about fp8 hardware) and is skipped without torchao.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time

from posttrain.benchmarks import emit
from posttrain.benchmarks.sft import FULL, QUICK

MODES = ("full", "bf16", "fp16", "fp8")


def measure(mode: str, quick: bool, lora: bool, steps: int, seq: int) -> dict:
    import resource

    import torch

    from posttrain.core.losses import chunked_cross_entropy, num_target_tokens
    from posttrain.core.lora import apply_lora
    from posttrain.core.model import build_model
    from posttrain.core.model.args import ModelArgs
    from posttrain.core.optim import OptimConfig
    from posttrain.core.precision import (LossScaler, PrecisionConfig, autocast_dtype, convert_fp8, upcast_trainable)
    from posttrain.core.trainer import LossOutput, Trainer

    def objective(model, batch):
        ids = batch["input_ids"]
        loss = model(ids, head=lambda h, w: chunked_cross_entropy(h, w, ids, reduction="sum", chunk_size=256))
        return LossOutput(loss, num_target_tokens(ids).sum())

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = PrecisionConfig(mode=mode, fp8_emulate=device.type != "cuda")
    torch.manual_seed(0)
    model = build_model(ModelArgs(**(QUICK if quick else FULL)["model"]), device=device)
    if lora:
        apply_lora(model, rank=16, alpha=32.0, targets="all-linear")
    if precision.mixed:
        upcast_trainable(model)
    if mode == "fp8":
        convert_fp8(model, precision)
    trainer = Trainer(model, OptimConfig(lr=1e-4, warmup_steps=0, schedule="constant"), steps,
                      autocast_dtype=autocast_dtype(precision, "float32", device),
                      loss_scaler=LossScaler.from_config(precision))
    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, model.args.vocab_size, (2, seq), generator=g).to(device)}
               for _ in range(2)]
    losses, times = [], []
    for k in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        trainer.forward_backward(batches[k % 2], objective)
        m = trainer.optim_step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(m["loss"])
    step = statistics.median(times[2:] if len(times) > 3 else times)
    return {"tokens_per_s": round(2 * seq / step, 1), "step_ms": round(1000 * step, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
            "skipped": trainer.skipped_steps, "device": device.type, "threads": torch.get_num_threads(),
            **({"emulated": True} if mode == "fp8" and precision.fp8_emulate else {})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--quick", action="store_true", help="the tiny model, 4 steps of 2 x 64 tokens")
    ap.add_argument("--lora", action="store_true", help="LoRA r16 all-linear instead of full fine-tuning")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child process: measure this mode, print its JSON
    args = ap.parse_args(argv)
    steps = args.steps or (4 if args.quick else 8)
    seq = 64 if args.quick else 512
    if args.one:
        print(json.dumps(measure(args.one, args.quick, args.lora, steps, seq)))
        return 0
    results = {}
    for mode in args.modes:
        if mode == "fp8" and importlib.util.find_spec("torchao") is None:
            results[mode] = {"skipped": "torchao not installed: pip install 'posttrain[optim]'"}
            continue
        cmd = [sys.executable, "-m", "posttrain.benchmarks.precision", "--one", mode, "--steps", str(steps)]
        cmd += ["--quick"] * args.quick + ["--lora"] * args.lora
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            results[mode] = {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
            continue
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    base = results.get("full", {}).get("tokens_per_s")
    for r in results.values():
        if base and "tokens_per_s" in r:
            r["speedup_vs_fp32"] = round(r["tokens_per_s"] / base, 3)
    doc = {"benchmark": "precision", "command": "python -m posttrain.benchmarks.precision" + " --quick" * args.quick
           + " --lora" * args.lora, "shape": "quick" if args.quick else "d512 L8 V8192", "seq": seq,
           "batch": 2, "steps": steps, "finetune": "lora r16 all-linear" if args.lora else "full", "modes": results}
    return emit(doc, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
