"""Training primitives a user can drive by hand; every stage loop is built on them.

    trainer = Trainer(model, optim_cfg, total_steps=100)
    for batch in batches:
        trainer.forward_backward(batch, sft_objective)   # any number of micro-batches
        metrics = trainer.optim_step()                   # clip, step, schedule, zero grads

Losses are accumulated as *sums* over target tokens and divided by the step's total token count
(all-reduced over data-parallel ranks) once, at `optim_step`. So the gradient is the exact
token-weighted mean whatever the micro-batching, accumulation or data-parallel layout: every
layout reproduces the single-process step.

Several LoRA adapters trained at once (`adapters`, each example routed to its own: posttrain.core.lora's
route_adapters) are as many trainings in one: every adapter has its own parameter groups (and
learning rate), its gradient is normalized by the tokens routed to it (LossOutput.adapter_tokens)
and clipped on its own, and an adapter that no token of the step reached does not step at all (no
weight decay, no moment update). So an adapter's update depends on its own examples only.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from posttrain.core.optim import OptimConfig, lr_lambda, param_groups  # noqa: F401 (param_groups: re-exported)
from posttrain.core.optimizers import build_optimizer
from posttrain.core.parallel.grad_norm import clip_grad_norm_ as clip_across_meshes
from posttrain.core.precision import LossScaler
from posttrain.core.reliability import all_reduce


@dataclass
class LossOutput:
    loss_sum: torch.Tensor
    """Loss summed over the micro-batch's target tokens (or sequences, for pairwise losses)."""
    num_tokens: int | torch.Tensor
    """What `loss_sum` is a sum over; the step's mean divides by its total."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Extra per-micro-batch numbers (already means), averaged over the step's micro-batches."""
    adapter_tokens: torch.Tensor | None = None
    """With several adapters: what `num_tokens` counts, per adapter (A,), in Trainer.adapters' order."""
    backward_done: bool = False
    """The objective ran the backward itself (a pipeline schedule); loss_sum is then detached."""


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
        adapters: Sequence[str] = (),
        adapter_lr: Mapping[str, float] | None = None,
        aux_group: dist.ProcessGroup | None = None,
        aux_scale: float = 1.0,
        pp_group: dist.ProcessGroup | None = None,
        loss_scaler: LossScaler | None = None,
    ):
        """model: already parallelized (posttrain.core.parallel.parallelize) and on its device.
        dp_group: the data-parallel group over which token counts are summed: the ranks that see
        distinct tokens (mesh.group("dp_cp") under posttrain.core.parallel; tp ranks share theirs).
        grads_are_averaged: True when the DP wrapper (DDP, FSDP) averages gradients over ranks,
        so the token normalization must undo that division.
        stats_group: where MoE tokens_per_expert are summed; default dp_group (under tp, whose
        ranks route shards of the tokens: mesh.group("dp_cp_tp")).
        adapters: several LoRA adapters trained at once (module docstring), at optim.lr or their
        `adapter_lr`; the objective then reports LossOutput.adapter_tokens.
        aux_group, aux_scale: under tp / cp each rank's MoE aux loss is its share of the whole
        sequence's, pre-scaled by cp (posttrain.core.parallel.expert.global_aux_loss): the logged
        moe/aux_loss is the shares summed over aux_group (mesh.group("cp_tp")) / aux_scale (cp).
        pp_group: under pipeline parallelism (model = this rank's stages, posttrain.core.parallel.pipeline.
        keep_own_stages) the objective runs the schedule's forward and backward itself
        (posttrain.core.pipeline_objectives.pipelined_sft: LossOutput.backward_done, the MoE aux loss attached inside)
        and the gradient norm is summed over the stages.
        loss_scaler: fp16's dynamic loss scale (posttrain.core.precision.LossScaler): each loss is scaled
        before backward, the gradients unscaled with the token normalization, and a step whose
        gradients overflowed is skipped with `overflow=1` while the scale backs off."""
        self.model = model
        self.cfg = optim
        self.total_steps = total_steps
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        first = self.params[0]
        # Under FSDP's CPU offload the shards live on CPU; the step's counters go where compute is.
        self.device = torch.device(first.device_mesh.device_type) \
            if isinstance(first, DTensor) and first.device.type != first.device_mesh.device_type else first.device
        # Sharded layouts make parameters DTensors (TP, FSDP); those that no layout shards (norms
        # under TP) stay plain tensors.
        self.dtensors = any(isinstance(p, DTensor) for p in self.params)
        self.adapters = list(adapters)
        self.optimizer = build_optimizer(model, optim, self.adapters, adapter_lr)  # optim.name's
        init_optimizer_state(self.optimizer)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim, total_steps))
        self.autocast_dtype = autocast_dtype
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.grads_are_averaged = grads_are_averaged
        self.stats_group = stats_group if stats_group is not None else dp_group
        self.aux_group, self.aux_scale = aux_group, aux_scale
        self.pp_group = pp_group
        self.scaler = loss_scaler
        self.step = 0
        self.skipped_steps = 0
        self._reset_accum()

    def _reset_accum(self) -> None:
        self._tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        self._loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self._adapter_tokens = torch.zeros(len(self.adapters), dtype=torch.float64, device=self.device)
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
            aux = None
            if not out.backward_done and hasattr(self.model, "aux_loss"):
                aux = self.model.aux_loss()
            if aux is not None:  # MoE balancing: a per-token mean, so weight it by the tokens
                loss = loss + aux * out.num_tokens
        if not out.backward_done:
            (loss * self.scaler.scale if self.scaler is not None else loss).backward()
        elif self.scaler is not None:
            raise ValueError("a loss scale (fp16) cannot reach a backward the objective runs itself (pipeline "
                             "parallelism); use bf16")
        n = torch.as_tensor(out.num_tokens, dtype=torch.float64, device=self.device)
        self._tokens += n
        if self.adapters:
            if out.adapter_tokens is None or out.adapter_tokens.shape != (len(self.adapters),):
                raise ValueError(f"training adapters {self.adapters}: the objective must report adapter_tokens, one "
                                 "count per adapter (posttrain.stages.training.routed wraps an objective so)")
            self._adapter_tokens += out.adapter_tokens.to(self.device, torch.float64)
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
        pipe = getattr(self.model, "pipeline", None)
        if pipe is not None:  # tied embeddings under pipeline parallelism: the two copies' gradients summed
            pipe.reduce_tied_grads()
        totals = torch.cat([torch.stack([self._tokens, self._loss]), self._adapter_tokens])
        if self.dp_group is not None:
            all_reduce(totals, group=self.dp_group, name="trainer/tokens_loss")
        tokens, loss_sum, *per_adapter = totals.tolist()
        dp = self.dp_size if self.grads_are_averaged else 1.0
        scale = self.scaler.scale if self.scaler is not None else 1.0
        dp /= scale  # the gradients of a scaled loss, unscaled with the normalization
        max_norm = self.cfg.max_grad_norm or float("inf")
        if not self.adapters:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(dp / max(tokens, 1.0))
            grad_norm = self._clip(self.params, max_norm)
            adapter_metrics = {}
        else:
            grad_norm, adapter_metrics = self._normalize_adapters(per_adapter, dp, max_norm)
        metrics = {k: sum(v) / len(v) for k, v in self._metrics.items()}
        if self.aux_group is not None and "moe/aux_loss" in metrics:  # the whole sequences' value, as logged alone
            aux = torch.tensor(metrics["moe/aux_loss"], dtype=torch.float64, device=self.device)
            all_reduce(aux, group=self.aux_group, name="trainer/aux_loss")
            metrics["moe/aux_loss"] = float(aux) / self.aux_scale
        metrics.update(loss=loss_sum / max(tokens, 1.0), grad_norm=grad_norm, tokens=tokens,
                       lr=self.scheduler.get_last_lr()[0], **adapter_metrics)
        if self.scaler is not None:  # a non-finite loss is the model's, not the scale's: no update
            metrics["loss_scale"] = scale
            if math.isfinite(metrics["loss"]) and self.scaler.update(math.isfinite(grad_norm)):
                metrics["overflow"] = 1.0  # a routine fp16 skip: the scale backed off
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

    def _clip(self, params: list[nn.Parameter], max_norm: float) -> float:
        if self.dtensors or self.pp_group is not None:  # gradients on several meshes (TP, FSDP) or stages
            pipe = getattr(self.model, "pipeline", None)
            return float(clip_across_meshes(params, max_norm, self.pp_group, pipe.duplicates if pipe else ()))
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True))

    def _normalize_adapters(self, tokens: list[float], dp: float, max_norm: float) -> tuple[float, dict[str, float]]:
        """Each adapter's gradient over its own tokens, clipped on its own; an adapter no token
        reached loses its (zero) gradient, so the optimizer leaves it as it is. Returns the norm of
        all of them (before clipping) and per-adapter metrics."""
        metrics, total = {}, 0.0
        for name, n in zip(self.adapters, tokens):
            params = [p for g in self.optimizer.param_groups if g.get("adapter") == name for p in g["params"]]
            metrics[f"tokens/{name}"] = n
            if n == 0:
                for p in params:
                    p.grad = None
                continue
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(dp / n)
            norm = self._clip(params, max_norm)
            metrics[f"grad_norm/{name}"] = norm
            total += norm * norm
        return math.sqrt(total), metrics

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
        """The trainer's own counters (model/optimizer state is saved by posttrain.core.checkpoint)."""
        state = {"step": self.step, "skipped_steps": self.skipped_steps}
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.scaler is not None and "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])

    def save_state(self, manager, extra: dict[str, Any] | None = None, force: bool = True):
        """Write a checkpoint of model, optimizer, schedule, trainer counters and `extra`
        (e.g. the data sampler position) through a posttrain.core.checkpoint.CheckpointManager."""
        extra = {"trainer": self.state_dict(), **(extra or {})}
        return manager.save(self.step, self.model, self.optimizer, self.scheduler, extra=extra, force=force)

    def load_state(self, manager) -> dict[str, Any] | None:
        """Resume from the manager's latest complete checkpoint; returns its `extra` or None."""
        extra = manager.load_latest(self.model, self.optimizer, self.scheduler)
        if extra is not None:
            self.load_state_dict(extra["trainer"])
        return extra


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter the state the optimizer would create at its first step (for AdamW:
    step 0, zero moments), now, so a checkpoint holds the state of every parameter even before
    each has had a gradient (an adapter no example has reached yet), and a resume finds it all.
    One step with zero gradients at lr 0 creates it (parameters unchanged: p * (1 - 0) + 0), then
    the step counts are set back to 0."""
    params = [p for g in optimizer.param_groups for p in g["params"] if not optimizer.state.get(p)]
    if not params:
        return
    grads = [p.grad for p in params]
    rates = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:  # a tensor lr (torchao's) is changed in place only
        g["lr"] = g["lr"].clone().fill_(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, rates):
        g["lr"] = lr
    for p, grad in zip(params, grads):
        p.grad = grad
        step = optimizer.state[p].get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            optimizer.state[p]["step"] = 0
