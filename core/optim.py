"""OptimConfig and what it means: parameter groups and the learning-rate schedule
(posttrain.core.optimizers.build_optimizer builds the optimizer from them, docs/optimizers.md says which).
Torch-free, like every config module."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable, Literal

from pydantic import Field, ValidationInfo, field_validator

from posttrain.core.config import ConfigModel

if TYPE_CHECKING:
    from torch import nn


OptimizerName = Literal["adamw", "adamw8bit", "adafactor", "muon"]


class OptimConfig(ConfigModel):
    name: OptimizerName = Field(
        "adamw", description="'adamw' (torch), 'adamw8bit' (torchao, 8-bit moments), 'adafactor' (torch, factored "
        "second moment, no first), 'muon' (torch Muon on hidden matrices, AdamW on the rest).")
    fused: bool | None = Field(
        None, description="AdamW's fused kernel: None = fused on CUDA when it can be, foreach elsewhere; "
        "true = fused or refused; false = foreach.")
    offload: bool = Field(False, description="Optimizer state and master weights on CPU (FSDP2 CPUOffloadPolicy); "
                          "needs FSDP.")
    lr: float = Field(3e-4, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay (not on norms and biases).")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW (beta1, beta2).")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    warmup_steps: int = Field(10, ge=0, description="Linear warmup steps from 0 to lr.")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "cosine", description="Decay after warmup, to lr * min_lr_ratio at the last step.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final lr as a fraction of the peak.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip the global grad norm; None = off.")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    muon_lr: float | None = Field(None, gt=0, description="Muon's peak lr; None = lr (with muon_adjust_lr "
                                  "'match_rms_adamw' the AdamW rate carries over).")
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="Muon momentum (Nesterov).")
    muon_ns_steps: int = Field(5, ge=1, lt=100, description="Muon Newton-Schulz iterations.")
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = Field(
        "match_rms_adamw", description="Muon's per-matrix lr scale: 'original' sqrt(max(1, rows/cols)) (Keller "
        "Jordan), 'match_rms_adamw' 0.2 sqrt(max(rows, cols)) (Moonshot: AdamW's lr and decay carry over).")

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"betas must lie in [0, 1), got {v}")
        return v

    @field_validator("fused")
    @classmethod
    def _fused(cls, v: bool | None, info: ValidationInfo) -> bool | None:
        if v and info.data.get("name", "adamw") != "adamw":
            raise ValueError(f"only optim.name='adamw' has a fused kernel, not {info.data['name']!r}")
        return v



def param_groups(model: nn.Module, weight_decay: float, adapters: Sequence[str] = (), lr: float | None = None,
                 adapter_lr: Mapping[str, float] | None = None) -> list[dict[str, Any]]:
    """AdamW groups: decay matrices, never norms, biases or other 1-D parameters. With `adapters`
    (several LoRA adapters trained at once) each adapter's parameters form groups of their own,
    tagged `adapter` (its name), at its learning rate (`adapter_lr`, default `lr`)."""
    if adapters:
        from posttrain.core.lora import lora_parameters

        groups = []
        for name in adapters:
            rate = (adapter_lr or {}).get(name, lr)
            params = [p for p in lora_parameters(model, name) if p.requires_grad]
            for decay, wd in ((True, weight_decay), (False, 0.0)):
                chosen = [p for p in params if (p.ndim >= 2) == decay]
                if chosen:
                    groups.append({"params": chosen, "weight_decay": wd, "lr": rate, "adapter": name})
        own = {id(p) for g in groups for p in g["params"]}
        other = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in own]
        if other:
            raise ValueError(f"{other[:3]} are trained but belong to no adapter; with several adapters only "
                             "adapters train")
        return groups
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def lr_lambda(cfg: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """Linear warmup to 1, then constant, linear or cosine decay to `min_lr_ratio`."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        if cfg.schedule == "linear":
            decay = 1 - progress
        else:
            decay = 0.5 * (1 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay

    return f
