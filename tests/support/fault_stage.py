"""A tiny training job for fault-injection tests, built like the training stages: the debug model,
a Trainer with data-parallel gradient sync, posttrain.core.loop.fit with a CheckpointManager and
posttrain.core.reliability, on deterministic synthetic data (a resumable BatchSampler). Faults come from env:

    FAULT_KILL_AT=STEP[:RANK]   SIGKILL the rank (default 1) in its forward of step STEP; with
                                FAULT_MARKER=PATH only while PATH does not exist (created first),
                                so a restarted attempt runs clean
    FAULT_HANG_AT=STEP[:RANK]   sleep forever in the forward of step STEP, i.e. before the step's
                                all-reduce; writes <out>/hang-started (a timestamp) first
    FAULT_NAN_BATCHES=5,6       the loss of this rank's 5th and 6th micro-batch is NaN
    FAULT_SPIKE_BATCHES=9       ... is multiplied by 1000
    FAULT_STEP_SLEEP=0.3        seconds of sleep in every step (a signal then lands mid-run)

    torchrun --nproc-per-node 2 tests/support/fault_stage.py --out DIR --steps 8 --save-every 2

Rank 0 prints "step N loss L" after every applied step, appends every metrics/events dict to
<out>/events.jsonl, and at the end writes the weights to <out>/final.safetensors.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from posttrain.core.checkpoint import CheckpointManager
from posttrain.core.optim import OptimConfig
from posttrain.core.reliability.config import ReliabilityConfig
from posttrain.core.data.sampler import BatchSampler, StatefulLoader
from posttrain.core.loop import fit
from posttrain.core.losses import chunked_cross_entropy, num_target_tokens
from posttrain.core.model import build_model, get_preset
from posttrain.core.reliability import Reliability
from posttrain.core.reliability import all_reduce
from posttrain.core.trainer import LossOutput, Trainer

SEQ, BATCH, UNITS, VOCAB = 24, 2, 64, 512


def _steps(var: str) -> set[int]:
    return {int(x) for x in os.environ.get(var, "").split(",") if x.strip()}


def _at(var: str) -> tuple[int, int] | None:
    """FAULT_X=STEP[:RANK] -> (step, rank)."""
    raw = os.environ.get(var)
    if not raw:
        return None
    step, _, rank = raw.partition(":")
    return int(step), int(rank or 1)


def make_loader(rank: int, world: int, seed: int = 0) -> StatefulLoader:
    """Endless, deterministic micro-batches: unit u is always the same tokens; each batch carries
    `batch_no`, its 1-based position in this rank's stream (what FAULT_*_BATCHES refer to)."""
    sampler = BatchSampler([SEQ] * UNITS, micro_batch_size=BATCH, rank=rank, world_size=world, seed=seed,
                           num_epochs=None)
    per_epoch = len(sampler)

    def collate(units: list[int]) -> dict[str, Any]:
        ids = torch.stack([torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(1000 + u))
                           for u in units])
        labels = ids.clone()
        labels[:, : SEQ // 4] = -100  # a "prompt" that is not scored
        return {"input_ids": ids, "labels": labels, "batch_no": sampler.epoch * per_epoch + sampler.index}

    return StatefulLoader(sampler, collate)


class Faults:
    """The env's faults, applied from inside the objective (mid-step, before any collective)."""

    def __init__(self, out: Path, rank: int):
        self.out, self.rank = out, rank
        self.kill, self.hang = _at("FAULT_KILL_AT"), _at("FAULT_HANG_AT")
        self.nan, self.spike = _steps("FAULT_NAN_BATCHES"), _steps("FAULT_SPIKE_BATCHES")
        self.sleep = float(os.environ.get("FAULT_STEP_SLEEP", "0") or 0)
        self.marker = os.environ.get("FAULT_MARKER")
        self.step = 0  # the step being attempted (set by fit's before_step)

    def before_step(self, completed: int) -> None:
        self.step = completed + 1
        if self.sleep:
            time.sleep(self.sleep)

    def in_forward(self) -> None:
        if self.kill == (self.step, self.rank) and not (self.marker and Path(self.marker).exists()):
            if self.marker:
                Path(self.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        if self.hang == (self.step, self.rank):
            _hang(self.out)

    def scale(self, batch_no: int) -> float:
        return float("nan") if batch_no in self.nan else 1000.0 if batch_no in self.spike else 1.0


def _hang(out: Path) -> None:
    (out / "hang-started").write_text(repr(time.time()))
    while True:  # a rank stuck before its all-reduce; only the watchdog ends this
        time.sleep(3600)


def make_objective(faults: Faults | None = None):
    def objective(model, batch: dict[str, Any]) -> LossOutput:
        if faults is not None:
            faults.in_forward()
        labels = batch["labels"]
        loss = model(batch["input_ids"], None,
                     head=lambda h, w: chunked_cross_entropy(h, w, labels, reduction="sum", chunk_size=64))
        if faults is not None:
            loss = loss * faults.scale(batch["batch_no"])
        return LossOutput(loss, num_target_tokens(labels).sum())

    return objective


class ReplicatedTrainer(Trainer):
    """Plain data parallelism with no wrapper: each step first sums the gradients over the ranks in
    one collective that the flight recorder sees ('trainer/grads'), then steps as usual (the
    token-count normalization makes the sum the global mean)."""

    def optim_step(self, skip_if=None):
        if self.dp_group is not None and self.dp_size > 1:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            all_reduce(flat, group=self.dp_group, name="trainer/grads")
            for p, g in zip(self.params, flat.split([g.numel() for g in grads])):
                p.grad = g.view_as(p)
        return super().optim_step(skip_if)


def make_trainer(steps: int, seed: int = 0, lr: float = 3e-3) -> Trainer:
    torch.manual_seed(seed)
    model = build_model(get_preset("debug"), seed=seed)
    world = dist.get_world_size() if dist.is_initialized() else 1
    optim = OptimConfig(lr=lr, warmup_steps=2, schedule="cosine", max_grad_norm=1.0)
    return ReplicatedTrainer(model, optim, steps, dp_group=dist.group.WORLD if world > 1 else None)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def train(out: str | Path, steps: int = 8, save_every: int = 2, *, seed: int = 0, hang_timeout: float = 0.0,
          collective_timeout: float = 120.0, grace: float = 30.0, spike_zscore: float = 6.0,
          spike_window: int = 8, max_bad_steps: int = 3, preemption: bool = True) -> dict[str, Any]:
    """Run the job (resuming from <out>/checkpoints); returns the final step and rank 0's events."""
    from posttrain.stages.common import start_distributed

    torch.set_num_threads(1)  # bit-exact comparisons between runs need the same reduction order
    torch.use_deterministic_algorithms(True)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rel_cfg = ReliabilityConfig(spike_zscore=spike_zscore, spike_window=spike_window, max_bad_steps=max_bad_steps,
                                hang_timeout_s=hang_timeout, collective_timeout_s=collective_timeout,
                                preempt_grace_s=grace)
    d = start_distributed(timeout_s=rel_cfg.collective_timeout_s)
    trainer = make_trainer(steps, seed)
    loader = make_loader(d.rank, d.world, seed)
    faults = Faults(out, d.rank)
    manager = CheckpointManager(out / "checkpoints", keep_last=3, interval_steps=save_every)
    events: list[dict[str, Any]] = []

    def on_metrics(metrics: dict[str, float], step: int) -> None:
        if d.is_main:
            events.append({"step": step, **metrics})
            with open(out / "events.jsonl", "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
            if "loss" in metrics and not metrics.get("skipped"):
                print(f"step {step} loss {metrics['loss']:.6f}", flush=True)

    rel = Reliability.from_config(rel_cfg, out / "watchdog", preemption=preemption)
    try:
        fit(trainer, loader, make_objective(faults), max_steps=steps, manager=manager, on_metrics=on_metrics,
            log_every=1, before_step=faults.before_step, reliability=rel)
    finally:
        manager.close()
    if d.is_main:
        save_file(weights(trainer.model), str(out / "final.safetensors"))
    d.barrier()
    return {"step": trainer.step, "events": events}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--hang-timeout", type=float, default=0.0)
    p.add_argument("--collective-timeout", type=float, default=120.0)
    p.add_argument("--grace", type=float, default=30.0)
    a = p.parse_args(argv)
    train(a.out, a.steps, a.save_every, hang_timeout=a.hang_timeout, collective_timeout=a.collective_timeout,
          grace=a.grace)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
