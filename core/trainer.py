"""Training primitives a user can drive by hand; every stage loop is built on them.

    trainer = Trainer(model, optim_cfg, total_steps=100)
    for batch in batches:
        trainer.forward_backward(batch, sft_objective)   # any number of micro-batches
        metrics = trainer.optim_step()                   # clip, step, schedule, zero grads

Losses are accumulated as *sums* over target tokens and divided by the step's total token count
(all-reduced over data-parallel ranks) once, at `optim_step`. So the gradient is the exact
token-weighted mean whatever the micro-batching, accumulation or data-parallel layout: every
layout reproduces the single-process step.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from core.optim import OptimConfig, lr_lambda, param_groups
from core.parallel.grad_norm import clip_grad_norm_ as clip_across_meshes
from core.reliability import all_reduce


@dataclass
class LossOutput:
    loss_sum: torch.Tensor
    """Loss summed over the micro-batch's target tokens (or sequences, for pairwise losses)."""
    num_tokens: int | torch.Tensor
    """What `loss_sum` is a sum over; the step's mean divides by its total."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Extra per-micro-batch numbers (already means), averaged over the step's micro-batches."""


Objective = Callable[[nn.Module, dict[str, Any]], LossOutput]


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        optim: OptimConfig,
        total_steps: int,
        *,
        autocast_dtype: torch.dtype | None = None,
        dp_group: dist.ProcessGroup | None = None,
        grads_are_averaged: bool = False,
        stats_group: dist.ProcessGroup | None = None,
    ):
        """model: already parallelized (core.parallel.parallelize) and on its device.
        dp_group: the data-parallel group over which token counts are summed: the ranks that see
        distinct tokens (mesh.group("dp_cp") under core.parallel; tp ranks share theirs).
        grads_are_averaged: True when the DP wrapper (DDP, FSDP) averages gradients over ranks,
        so the token normalization must undo that division.
        stats_group: where MoE tokens_per_expert are summed; default dp_group (under tp, whose
        ranks route shards of the tokens: mesh.group("dp_cp_tp"))."""
        self.model = model
        self.cfg = optim
        self.total_steps = total_steps
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        self.device = self.params[0].device
        # Sharded layouts make parameters DTensors (TP, FSDP); those that no layout shards (norms
        # under TP) stay plain tensors, and fused AdamW refuses a mix of the two.
        self.dtensors = any(isinstance(p, DTensor) for p in self.params)
        mixed = self.dtensors and not all(isinstance(p, DTensor) for p in self.params)
        fused = self.device.type == "cuda" and not mixed
        self.optimizer = torch.optim.AdamW(
            param_groups(model, optim.weight_decay), lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
            fused=fused or None,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim, total_steps))
        self.autocast_dtype = autocast_dtype
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.grads_are_averaged = grads_are_averaged
        self.stats_group = stats_group if stats_group is not None else dp_group
        self.step = 0
        self.skipped_steps = 0
        self._reset_accum()

    def _reset_accum(self) -> None:
        self._tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        self._loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self._metrics: dict[str, list[float]] = {}

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def forward_backward(self, batch: dict[str, Any], objective: Objective) -> dict[str, float]:
        """Forward and backward one micro-batch; gradients accumulate until `optim_step`."""
        self.model.train()
        with self._autocast():
            out = objective(self.model, batch)
            loss = out.loss_sum
            aux = self.model.aux_loss() if hasattr(self.model, "aux_loss") else None
            if aux is not None:  # MoE balancing: a per-token mean, so weight it by the tokens
                loss = loss + aux * out.num_tokens
        loss.backward()
        n = torch.as_tensor(out.num_tokens, dtype=torch.float64, device=self.device)
        self._tokens += n
        self._loss += out.loss_sum.detach().double()
        for k, v in out.metrics.items():
            self._metrics.setdefault(k, []).append(float(v))
        if aux is not None:
            self._metrics.setdefault("moe/aux_loss", []).append(float(aux.detach()))
        return {"loss": float(out.loss_sum.detach() / n.clamp(min=1)), **out.metrics}

    def optim_step(self, skip_if: Callable[[dict[str, float]], bool] | None = None) -> dict[str, float]:
        """Normalize by the step's token count, clip, step the optimizer and the schedule.

        A step whose gradient norm or loss is not finite, or for whose metrics `skip_if` (e.g. a
        loss-spike screen) says True, is skipped (gradients dropped, schedule not advanced) and
        reported with `skipped=1`. The loss and norm are global, so every rank decides alike."""
        totals = torch.stack([self._tokens, self._loss])
        if self.dp_group is not None:
            all_reduce(totals, group=self.dp_group, name="trainer/tokens_loss")
        tokens, loss_sum = totals.tolist()
        scale = (self.dp_size if self.grads_are_averaged else 1.0) / max(tokens, 1.0)
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(scale)
        max_norm = self.cfg.max_grad_norm or float("inf")
        if self.dtensors:  # gradients on several meshes (TP, FSDP), which torch's clip cannot mix
            grad_norm = float(clip_across_meshes(self.params, max_norm))
        else:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True))
        metrics = {k: sum(v) / len(v) for k, v in self._metrics.items()}
        metrics.update(loss=loss_sum / max(tokens, 1.0), grad_norm=grad_norm, tokens=tokens,
                       lr=self.scheduler.get_last_lr()[0])
        bad = not math.isfinite(grad_norm) or not math.isfinite(metrics["loss"])
        if bad or (skip_if is not None and skip_if(metrics)):
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            self._reset_accum()
            return {**metrics, "skipped": 1.0}
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._after_step(metrics)
        self.step += 1
        self._reset_accum()
        return {**metrics, "skipped": 0.0}

    def _after_step(self, metrics: dict[str, float]) -> None:
        # MoE: log the routing balance, then take one aux-loss-free bias step (DeepSeek-V3).
        moe_layers = self.model.moe_layers() if hasattr(self.model, "moe_layers") else []
        for i, m in enumerate(moe_layers):
            load = m.tokens_per_expert
            if self.stats_group is not None:
                all_reduce(load, group=self.stats_group, name="trainer/moe_load")
            if load.sum() > 0:
                frac = load / load.sum()
                metrics[f"moe/layer{i}_max_load"] = float(frac.max() * len(frac))
            m.update_bias()

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The trainer's own counters (model/optimizer state is saved by core.checkpoint)."""
        return {"step": self.step, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def save_state(self, manager, extra: dict[str, Any] | None = None, force: bool = True):
        """Write a checkpoint of model, optimizer, schedule, trainer counters and `extra`
        (e.g. the data sampler position) through a core.checkpoint.CheckpointManager."""
        extra = {"trainer": self.state_dict(), **(extra or {})}
        return manager.save(self.step, self.model, self.optimizer, self.scheduler, extra=extra, force=force)

    def load_state(self, manager) -> dict[str, Any] | None:
        """Resume from the manager's latest complete checkpoint; returns its `extra` or None."""
        extra = manager.load_latest(self.model, self.optimizer, self.scheduler)
        if extra is not None:
            self.load_state_dict(extra["trainer"])
        return extra
