"""Optimizer state per parameter, step time and loss for each `optim.name`, on one process.

    python -m posttrain.benchmarks.optimizers [--preset debug] [--names adamw adafactor muon adamw8bit]
                                    [--steps 10] [--seq 128] [--out file.json]

Each optimizer trains a fresh model (build_model(preset), seed 0, fp32) for --steps steps through
posttrain.core.trainer.Trainer on the same random token batches (2 x --seq), lr 3e-3 (Adafactor 3e-2: its
step is relative to each weight's RMS), no warmup. Reported per optimizer:
state_bytes = bytes of the optimizer's state tensors after the last step (posttrain.core.optimizers.
state_bytes: torchao's 8-bit state counted by its codes and scales), bytes_per_param = that over
the model's parameter count (AdamW: 8, two fp32 moments), step_ms = median wall time of
Trainer.optim_step after the first (compilation, for adamw8bit) step, loss_first / loss_last.
adamw8bit is skipped (with the reason) when torchao is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch

from posttrain.benchmarks import emit

NAMES = ("adamw", "adafactor", "muon", "adamw8bit")


def measure(name: str, preset: str, steps: int, seq: int) -> dict:
    from posttrain.core.losses import chunked_cross_entropy, num_target_tokens
    from posttrain.core.model import build_model, get_preset
    from posttrain.core.optim import OptimConfig
    from posttrain.core.optimizers import state_bytes
    from posttrain.core.trainer import LossOutput, Trainer

    def objective(model, batch):
        ids = batch["input_ids"]
        loss = model(ids, head=lambda h, w: chunked_cross_entropy(h, w, ids, reduction="sum", chunk_size=64))
        return LossOutput(loss, num_target_tokens(ids).sum())

    torch.manual_seed(0)
    model = build_model(get_preset(preset))
    cfg = OptimConfig(name=name, lr=3e-2 if name == "adafactor" else 3e-3, warmup_steps=0, schedule="constant")
    trainer = Trainer(model, cfg, total_steps=steps)
    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, model.args.vocab_size, (2, seq), generator=g)} for _ in range(4)]
    losses, times = [], []
    for k in range(steps):
        trainer.forward_backward(batches[k % len(batches)], objective)
        t = time.perf_counter()
        losses.append(trainer.optim_step()["loss"])
        times.append(time.perf_counter() - t)
    n = sum(p.numel() for p in model.parameters())
    size = state_bytes(trainer.optimizer)
    return {"params": n, "state_bytes": size, "bytes_per_param": round(size / n, 3),
            "step_ms": round(1000 * statistics.median(times[1:] or times), 2),
            "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="debug")
    ap.add_argument("--names", nargs="+", default=list(NAMES), choices=NAMES)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    results = {}
    for name in args.names:
        if name == "adamw8bit" and importlib.util.find_spec("torchao") is None:
            results[name] = {"skipped": "torchao not installed: pip install 'posttrain[optim]'"}
            continue
        results[name] = measure(name, args.preset, args.steps, args.seq)
    doc = {"benchmark": "optimizers", "command": "python -m posttrain.benchmarks.optimizers", "preset": args.preset,
           "steps": args.steps, "seq": args.seq, "torch": torch.__version__, "device": "cpu",
           "threads": torch.get_num_threads(), "optimizers": results}
    return emit(doc, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
