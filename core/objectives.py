"""Objectives: what a micro-batch costs for SFT, DPO and distillation, as `Trainer` objectives.

Each returns a LossOutput whose `loss_sum` is summed over target tokens (SFT, distillation) or
preference pairs (DPO), so the trainer's single division by the step's total is exact. The loss
head runs inside the model's forward (`model(..., head=...)`), so the (tokens x vocab) logits are
never materialized and parallel wrappers see a single forward call.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from core.data.packing import sequence_sums
from core.losses import IGNORE_INDEX, dpo_loss
from core.trainer import LossOutput
from kernels.fused_linear_ce import fused_linear_cross_entropy
from kernels.fused_linear_kl import fused_linear_distill, fused_linear_logps

CHUNK = 1024  # tokens per logits chunk: bounds the head's memory at CHUNK x vocab


def _forward(model: nn.Module, batch: dict[str, Any], head: Callable) -> Any:
    return model(batch["input_ids"], batch.get("position_ids"), batch.get("attention_mask"), head=head)


def token_logps(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """log p(label_{t+1} | ..t) at every position (0 where the label is ignored), (B, T)."""
    labels = batch["labels"]
    return _forward(model, batch, lambda h, w: fused_linear_logps(h, w, labels, chunk_size=CHUNK))


def sft_objective(model: nn.Module, batch: dict[str, Any]) -> LossOutput:
    """Next-token cross entropy on the response tokens."""
    labels = batch["labels"]
    loss = _forward(model, batch, lambda h, w: fused_linear_cross_entropy(h, w, labels, reduction="sum",
                                                                          chunk_size=CHUNK))
    return LossOutput(loss, batch["num_target_tokens"])


def pair_logps(model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of every sequence of a preference batch (chosen first, then rejected) and
    the number of target tokens of each, both (2N,)."""
    n_seq = 2 * batch["num_pairs"]
    per_token = token_logps(model, batch)
    targets = torch.zeros_like(batch["labels"], dtype=per_token.dtype)
    targets[..., :-1] = (batch["labels"][..., 1:] != IGNORE_INDEX).to(per_token.dtype)
    return (sequence_sums(per_token, batch["sequence_ids"], n_seq),
            sequence_sums(targets, batch["sequence_ids"], n_seq))


def dpo_objective(beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                  simpo_gamma: float = 0.5, sft_weight: float = 0.0,
                  reference: Callable[[dict[str, Any]], torch.Tensor] | None = None) -> Callable:
    """DPO family over a collate_preference batch; chosen and rejected in one forward.

    reference(batch) -> (2N,) reference log-probs: precomputed ones read from the batch
    (`batch["ref_logps"]`), or computed under `disable_adapter()` for LoRA policies."""

    def objective(model: nn.Module, batch: dict[str, Any]) -> LossOutput:
        n = batch["num_pairs"]
        logps, lengths = pair_logps(model, batch)
        ref = None
        if loss_type != "simpo":
            ref = batch["ref_logps"] if reference is None else reference(batch)
            ref = ref.to(logps.dtype)
        out = dpo_loss(logps[:n], logps[n:], None if ref is None else ref[:n], None if ref is None else ref[n:],
                       beta=beta, loss_type=loss_type, label_smoothing=label_smoothing,
                       simpo_gamma=simpo_gamma, chosen_lengths=lengths[:n], rejected_lengths=lengths[n:],
                       sft_weight=sft_weight)
        metrics = {"rewards/chosen": float(out.chosen_rewards.mean()),
                   "rewards/rejected": float(out.rejected_rewards.mean()),
                   "rewards/margin": float(out.margins.mean()),
                   "rewards/accuracy": float(out.accuracy)}
        return LossOutput(out.losses.sum(), n, metrics)

    return objective


def distill_objective(teacher: nn.Module, kind: str = "forward_kl", temperature: float = 1.0,
                      beta: float = 0.5, ce_weight: float = 0.0) -> Callable:
    """Online distillation: the teacher's hidden states per micro-batch (no grad), the divergence
    to the student's distribution on response positions, computed chunk by chunk."""

    def objective(model: nn.Module, batch: dict[str, Any]) -> LossOutput:
        labels = batch["labels"]
        mask = torch.zeros_like(labels, dtype=torch.bool)
        mask[..., :-1] = labels[..., 1:] != IGNORE_INDEX  # positions that predict a response token
        with torch.no_grad():
            t_hidden, t_weight = _forward(teacher, batch, lambda h, w: (h, w))

        def head(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            # the fused op returns the mean over masked positions; the trainer wants the sum
            loss = fused_linear_distill(h, w, t_hidden.to(h.dtype), t_weight.to(w.dtype), mask, kind=kind,
                                        temperature=temperature, beta=beta, chunk_size=CHUNK) * mask.sum()
            if ce_weight:
                loss = loss + ce_weight * fused_linear_cross_entropy(h, w, labels, reduction="sum",
                                                                     chunk_size=CHUNK)
            return loss

        return LossOutput(_forward(model, batch, head), batch["num_target_tokens"])

    return objective
