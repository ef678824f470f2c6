"""GRPO (Shao et al. 2024, DeepSeekMath): group-relative advantages and the clipped per-token
policy-gradient loss, as pure functions and as a `Trainer` objective.

For a prompt's group of G sampled completions with rewards r_1..r_G the advantage of completion i
is A_i = (r_i - mean(r)) / (std(r) + eps), or r_i - mean(r) without the std division
(`scale=False`: Dr. GRPO, Liu et al. 2025); std is the unbiased one and eps 1e-4, as TRL's
GRPOTrainer. Every token of a completion shares its advantage. The per-token loss is

    -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A) + beta * KL_t
    rho_t = exp(logp_t - old_logp_t)               old: the log-probs when the group was sampled
    KL_t  = exp(ref_t - logp_t) - (ref_t - logp_t) - 1     (the k3 estimator, >= 0)

and `loss_type` says how tokens are averaged (TRL's names):
    grpo     each completion's token mean, then the mean over completions (the paper's)
    bnpo     the token mean over the batch's completion tokens
    dapo     the same here: the trainer divides by the step's token count over every rank (DAPO's
             token-level loss, Yu et al. 2025, usually with epsilon_high > epsilon: clip-higher)
    dr_grpo  the token sum divided by (completions x max_completion_length), a constant

As every objective (core/objectives.py) the loss is returned as a sum plus what it is a sum of
(tokens, or completions), so the trainer's one division by the step's total over micro-batches and
data-parallel ranks gives the global mean of the step whatever the layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from posttrain.core.data.packing import sequence_sums
from posttrain.core.objectives import response_mask, token_logps
from posttrain.core.trainer import LossOutput

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
ADVANTAGE_EPS = 1e-4


def group_advantages(rewards: Tensor, scale: bool = True, eps: float = ADVANTAGE_EPS) -> Tensor:
    """Advantages of (groups, G) rewards: centred on each group's mean, divided by its (unbiased)
    std + eps when `scale`. A group whose rewards are all equal gets zero advantages."""
    rewards = rewards.double()
    adv = rewards - rewards.mean(-1, keepdim=True)
    if scale:
        adv = adv / (rewards.std(-1, keepdim=True) + eps)
    return adv


def zero_std_share(rewards: Tensor) -> float:
    """The share of groups (rows) whose rewards are all the same (they teach nothing)."""
    same = (rewards == rewards[..., :1]).all(-1)
    return float(same.double().mean()) if same.numel() else 0.0


def grpo_token_loss(logps: Tensor, old_logps: Tensor, advantages: Tensor, ref_logps: Tensor | None = None,
                    epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0
                    ) -> tuple[Tensor, Tensor, Tensor | None]:
    """(per-token loss, clipped, per-token KL or None), all shaped as `logps`; `advantages`
    broadcasts against it. `clipped` marks the tokens whose gradient the clip removed: ratio under
    1 - epsilon with a negative advantage, or over 1 + epsilon_high with a positive one."""
    high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(logps - old_logps)
    bounded = torch.clamp(ratio, 1 - epsilon, 1 + high)
    loss = -torch.minimum(ratio * advantages, bounded * advantages)
    clipped = ((ratio < 1 - epsilon) & (advantages < 0)) | ((ratio > 1 + high) & (advantages > 0))
    kl = None
    if beta:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probs")
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        loss = loss + beta * kl
    return loss, clipped, kl


def reduce_loss(per_token: Tensor, mask: Tensor, sequence_ids: Tensor, num_sequences: int, loss_type: str,
                max_completion_length: int) -> tuple[Tensor, Tensor | int]:
    """(loss sum, what it sums over) of a micro-batch for `loss_type` (module doc): summed
    per-completion means over completions (grpo, dr_grpo) or token losses over tokens (bnpo, dapo).
    `sequence_ids` gives each position's completion (padding-free batches, posttrain.core.data.packing)."""
    m = mask.to(per_token.dtype)
    v = per_token * m
    if loss_type in ("bnpo", "dapo"):
        return v.sum(), m.sum()
    if loss_type == "dr_grpo":
        return v.sum() / max_completion_length, num_sequences
    if loss_type != "grpo":
        raise ValueError(f"loss_type={loss_type!r}: one of {', '.join(LOSS_TYPES)}")
    sums = sequence_sums(v, sequence_ids, num_sequences)
    lengths = sequence_sums(m, sequence_ids, num_sequences)
    return (sums / lengths.clamp(min=1)).sum(), num_sequences


def grpo_objective(loss_type: str = "dapo", epsilon: float = 0.2, epsilon_high: float | None = None,
                   beta: float = 0.0, max_completion_length: int = 64):
    """The GRPO objective on a padding-free batch of completions (prompt tokens unlabelled) with
    `advantages` (one per completion), optionally `old_logps` (absent: the policy's own, detached:
    ratio 1, the plain policy gradient) and `ref_logps` (beta > 0), both (1, T) per position as
    token_logps gives them, and `rollout_metrics` passed through to the step's metrics."""

    def objective(model: nn.Module, batch: dict[str, Any]) -> LossOutput:
        logps = token_logps(model, batch).float()
        mask = response_mask(batch)
        old = batch.get("old_logps")
        old = logps.detach() if old is None else old.to(logps)
        ref = batch.get("ref_logps")
        seq = batch["sequence_ids"].clamp(min=0)
        adv = batch["advantages"].to(logps)[seq]
        per_token, clipped, kl = grpo_token_loss(logps, old, adv, None if ref is None else ref.to(logps),
                                                 epsilon, epsilon_high, beta)
        n = int(batch["num_sequences"])
        loss_sum, count = reduce_loss(per_token, mask, seq, n, loss_type, max_completion_length)
        tokens = mask.sum().clamp(min=1)
        metrics = {"clip_fraction": float((clipped & mask).sum() / tokens), **batch.get("rollout_metrics", {})}
        if kl is not None:
            metrics["kl"] = float((kl.detach() * mask).sum() / tokens)
        return LossOutput(loss_sum, count, metrics)

    return objective
