"""Objectives: what a micro-batch costs for SFT, DPO and distillation, as `Trainer` objectives.

Each returns a LossOutput whose `loss_sum` is summed over target tokens (SFT, distillation) or
preference pairs (DPO), so the trainer's single division by the step's total is exact. The loss
head runs inside the model's forward (`model(..., head=...)`), so the (tokens x vocab) logits are
never materialized and parallel wrappers see a single forward call.

Under tensor parallelism (core.parallel.parallelize with tp > 1) the lm_head is column-parallel:
each rank holds a vocab slice of it. Each head then runs the lm_head module (which gathers
sequence-parallel hidden states) and the vocab-parallel loss of core.parallel.losses on its slice
of the logits, so the full vocabulary is never gathered; the single-process path is untouched.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from core.data.packing import sequence_sums
from core.losses import IGNORE_INDEX, dpo_loss
from core.parallel.losses import (vocab_parallel_cross_entropy, vocab_parallel_distill_loss,
                                  vocab_parallel_token_logps)
from core.trainer import LossOutput
from kernels.fused_linear_ce import fused_linear_cross_entropy
from kernels.fused_linear_kl import fused_linear_distill, fused_linear_logps

CHUNK = 1024  # tokens per logits chunk: bounds the head's memory at CHUNK x vocab


def _tp_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The tp group when parallelize split the lm_head by vocab (column-parallel), else None."""
    return getattr(getattr(model, "lm_head", None), "tp_group", None)


def _head(model: nn.Module, batch: dict[str, Any], fused: Callable, vocab_parallel: Callable) -> Callable:
    """`fused(hidden, weight)` on one process; under tp, `vocab_parallel(logits, group)` on this
    rank's (B, T, V/tp) slice of the logits (the padding `_forward` added stripped again)."""
    group = _tp_group(model)
    if group is None:
        return fused
    T = batch["input_ids"].shape[-1]
    return lambda h, w: vocab_parallel(model.lm_head(h)[:, :T], group)


def _forward(model: nn.Module, batch: dict[str, Any], head: Callable) -> Any:
    ids, pos, mask = batch["input_ids"], batch.get("position_ids"), batch.get("attention_mask")
    lm_head = getattr(model, "lm_head", None)
    # Sequence parallelism splits the tokens over tp, so their number must divide by it. Pad at
    # the end: under causal attention the real tokens never see the padding (`_head` drops it).
    sp = getattr(lm_head, "input_mode", None) == "sequence"
    pad = -ids.shape[-1] % dist.get_world_size(lm_head.tp_group) if sp else 0
    if pad:
        ids = F.pad(ids, (0, pad))
        pos = None if pos is None else F.pad(pos, (0, pad))
        mask = None if mask is None else F.pad(mask, (0, pad))
    return model(ids, pos, mask, head=head)


def token_logps(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """log p(label_{t+1} | ..t) at every position (0 where the label is ignored), (B, T)."""
    labels = batch["labels"]
    return _forward(model, batch, _head(model, batch,
                                        lambda h, w: fused_linear_logps(h, w, labels, chunk_size=CHUNK),
                                        lambda z, g: vocab_parallel_token_logps(z, labels, g)))


def sft_objective(model: nn.Module, batch: dict[str, Any]) -> LossOutput:
    """Next-token cross entropy on the response tokens."""
    labels = batch["labels"]
    loss = _forward(model, batch, _head(
        model, batch, lambda h, w: fused_linear_cross_entropy(h, w, labels, reduction="sum", chunk_size=CHUNK),
        lambda z, g: vocab_parallel_cross_entropy(z, labels, g, reduction="sum")))
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

        def vocab_parallel_head(z: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
            # The teacher is whole on every rank: its logits for this rank's vocab slice only.
            t_w = t_weight.chunk(dist.get_world_size(group))[dist.get_rank(group)]
            t_z = t_hidden.to(z.dtype) @ t_w.to(z.dtype).T
            loss = vocab_parallel_distill_loss(z, t_z, group, kind, temperature, beta, mask, reduction="sum")
            if ce_weight:
                loss = loss + ce_weight * vocab_parallel_cross_entropy(z, labels, group, reduction="sum")
            return loss

        return LossOutput(_forward(model, batch, _head(model, batch, head, vocab_parallel_head)),
                          batch["num_target_tokens"])

    return objective
