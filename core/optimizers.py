"""The optimizer an OptimConfig names (`optim.name`), built over posttrain.core.optim.param_groups.

- adamw: torch.optim.AdamW. foreach by default; fused on CUDA when every parameter is alike
  (all DTensors or none), or wherever `optim.fused: true` asks (torch 2.13 has the fused kernel
  on CPU too). A DTensor/plain mix (norms under TP) can take neither multi-tensor path: fused is
  refused there and the step runs per tensor.
- adamw8bit: torchao.optim.AdamW8bit (both moments 8-bit, block-wise quantized with a dynamic
  map: ~2 bytes of state per parameter instead of 8). Optional dependency (`pip install
  'posttrain[optim]'`); runs on CPU and CUDA. One process only: its state is a tensor subclass
  whose resharding through DCP under FSDP/TP is not verified here, so sharded layouts refuse it.
- adafactor: torch.optim.Adafactor (Shazeer & Stern 2018 as torch implements it: a factored second
  moment, a row and a column vector per matrix, no first moment; `betas` are unused).
- muon: MuonWithAdamW below, torch.optim.Muon on the hidden matrices and AdamW on the rest.

Every optimizer is one torch.optim.Optimizer with the state layout torch's own have, so
posttrain.core.checkpoint saves and resumes it (flattened by parameter name) and LambdaLR schedules it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from posttrain.core.optim import OptimConfig, param_groups

TORCHAO_HINT = "pip install 'posttrain[optim]' (or: pip install torchao==0.18.0)"


def build_optimizer(model: nn.Module, cfg: OptimConfig, adapters: Sequence[str] = (),
                    adapter_lr: Mapping[str, float] | None = None) -> torch.optim.Optimizer:
    """The optimizer `cfg.name` over `model`'s trainable parameters (param_groups: no decay on
    norms and biases; one set of groups per adapter with several adapters)."""
    groups = param_groups(model, cfg.weight_decay, adapters, cfg.lr, adapter_lr)
    params = [p for g in groups for p in g["params"]]
    dtensors = [isinstance(p, DTensor) for p in params]
    if cfg.name == "adamw":
        mixed = any(dtensors) and not all(dtensors)
        if cfg.fused and mixed:
            raise ValueError("optim.fused: the fused AdamW kernel cannot take DTensor and plain parameters in one "
                             "step (this layout shards some parameters and not others, e.g. norms under TP); "
                             "set optim.fused to null or false")
        fused = cfg.fused if cfg.fused is not None else params[0].device.type == "cuda" and not mixed
        # foreach lists cannot mix DTensors and plain tensors either: that case steps per tensor.
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                 fused=fused or None, foreach=None if fused else not mixed)
    if cfg.name == "adamw8bit":
        if any(dtensors):
            raise ValueError("optim.name: 'adamw8bit' runs in one process only here (its 8-bit state under "
                             "FSDP/TP checkpointing is not verified); use adamw or adafactor under parallel")
        try:
            from torchao.optim import AdamW8bit
        except ImportError as e:
            raise ImportError(f"optim.name='adamw8bit' needs torchao: {TORCHAO_HINT} ({e})") from None
        for g in groups:  # torchao keeps lr a tensor (the schedule fills it in place)
            if "lr" in g:
                g["lr"] = torch.tensor(float(g["lr"]))
        return AdamW8bit(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.name == "adafactor":
        return torch.optim.Adafactor(groups, lr=cfg.lr, foreach=True)
    if cfg.name == "muon":
        if any(dtensors):
            raise ValueError("optim.name: 'muon' orthogonalizes whole matrices and these parameters are sharded "
                             "(FSDP/TP DTensors); muon runs without FSDP/TP (DDP is fine), or use adamw")
        return MuonWithAdamW(muon_groups(model, groups), cfg)
    raise ValueError(f"optim.name: unknown optimizer {cfg.name!r}")


def muon_groups(model: nn.Module, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Split each group into its hidden matrices (`muon: True`) and the rest (`muon: False`):
    Muon takes 2-D weights inside the network; embeddings, the output head (and a tied one),
    norms, biases and stacked (3-D) expert weights stay with AdamW, the standard split."""
    io = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Module):
        io |= {id(p) for p in head.parameters()}
    out = []
    for g in groups:
        for muon in (True, False):
            chosen = [p for p in g["params"] if (p.ndim == 2 and id(p) not in io) == muon]
            if chosen:
                out.append({**g, "params": chosen, "muon": muon})
    return out


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon (Keller Jordan, 2024: github.com/KellerJordan/Muon) on the groups tagged `muon`,
    AdamW on the others, as one optimizer. For a hidden matrix W with gradient G:

        B <- mu B + G                              (momentum buffer)
        U <- G + mu B                              (Nesterov)
        X <- U / ||U||_F, then 5 times:            (quintic Newton-Schulz, in bfloat16)
            A <- X X^T;  X <- a X + (b A + c A A) X,   (a, b, c) = (3.4445, -4.7750, 2.0315)
        W <- W (1 - lr wd) - lr s X                (s: muon_adjust_lr's per-shape scale)

    X approximates U's orthogonal factor (U V^T of the SVD, singular values pushed near 1).
    The update is torch.optim.Muon's own step (the formula above), and AdamW's torch.optim.AdamW's:
    each runs over this optimizer's groups and state, so there is one state dict (the momentum
    buffer of every matrix, the moments of every other parameter) for checkpoints and one set of
    groups for the schedule."""

    def __init__(self, groups: list[dict[str, Any]], cfg: OptimConfig):
        muon_lr = cfg.muon_lr or cfg.lr
        for g in groups:
            if g["muon"] and "lr" in g and cfg.muon_lr is not None:
                g["lr"] = muon_lr * g["lr"] / cfg.lr  # an adapter's own rate, scaled alike
        hidden = [g for g in groups if g["muon"]]
        rest = [g for g in groups if not g["muon"]]
        # The inner optimizers fill in their defaults (momentum, betas, ...) in the same group dicts.
        self._muon = torch.optim.Muon(hidden, lr=muon_lr, momentum=cfg.muon_momentum, nesterov=True,
                                      ns_steps=cfg.muon_ns_steps, adjust_lr_fn=cfg.muon_adjust_lr) if hidden else None
        self._adamw = torch.optim.AdamW(rest, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=True) \
            if rest else None
        super().__init__(groups, {"lr": cfg.lr})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # After load_state_dict the groups and state are new objects: hand the current ones over.
        for inner, muon in ((self._muon, True), (self._adamw, False)):
            if inner is not None:
                inner.param_groups = [g for g in self.param_groups if g["muon"] == muon]
                inner.state = self.state
                inner.step()
        return loss


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state tensors (a quantized subclass counted by its inner tensors;
    scalar step counters included)."""
    seen: set[int] = set()

    def size(t: torch.Tensor) -> int:
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            return sum(size(getattr(t, n)) for n in names)
        if id(t) in seen:
            return 0
        seen.add(id(t))
        return t.numel() * t.element_size()

    return sum(size(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
