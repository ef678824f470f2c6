"""Vocab-parallel losses: cross entropy, token log-probs (DPO) and the distillation divergences on
logits split by vocab over tp (the column-parallel lm_head's output), without ever gathering the
full vocabulary (Megatron's `vocab_parallel_cross_entropy`, extended to log-softmax and KL).

Everything reduces to two vocab-wide reductions, each one small collective per token:

    logsumexp_v z_v = m + log sum_r sum_{v on r} exp(z_v - m),   m = max over all ranks (all-reduce MAX, SUM)
    sum_v f(z)_v    = all-reduce of each rank's partial sum      (reduce_from_tp)

`_VocabParallelLogSumExp` has a hand-written backward (softmax of the local slice: no
communication); the rest is differentiable torch on the local slice, so gradients are exact and
land on each rank's own columns. Semantics, arguments and reductions match posttrain.core.losses exactly;
with a tp group of one rank every function equals its posttrain.core.losses counterpart.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from posttrain.core.losses import (
    DISTILL_KINDS,
    IGNORE_INDEX,
    REDUCTIONS,
    _per_sequence,
    ce_logits_inputs,
    check_choice,
    compute_dtype,
    divergence,
    masked_reduce,
    topk_divergence,
)
from posttrain.core.parallel.mappings import copy_to_tp, reduce_from_tp


class _VocabParallelLogSumExp(torch.autograd.Function):
    """logsumexp over the last dim of a tensor split by its last dim over `group`."""

    @staticmethod
    def forward(ctx, z: Tensor, group: dist.ProcessGroup) -> Tensor:
        m = z.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        s = torch.exp(z - m[..., None]).sum(-1)
        dist.all_reduce(s, group=group)
        lse = m + torch.log(s)
        ctx.save_for_backward(z, lse)
        return lse

    @staticmethod
    def backward(ctx, g: Tensor):
        z, lse = ctx.saved_tensors
        return g[..., None] * torch.exp(z - lse[..., None]), None


def vocab_parallel_logsumexp(z: Tensor, group: dist.ProcessGroup) -> Tensor:
    if dist.get_world_size(group) == 1:
        return torch.logsumexp(z, dim=-1)
    return _VocabParallelLogSumExp.apply(z, group)


def vocab_parallel_log_softmax(z: Tensor, group: dist.ProcessGroup) -> Tensor:
    """log softmax over the full vocab, returned split like `z` (..., V/tp). Each rank's
    gradient into the shared lse sums only its own columns' terms: copy_to_tp all-reduces it."""
    return z - copy_to_tp(vocab_parallel_logsumexp(z, group), group)[..., None]


def _vocab_start(z: Tensor, group: dist.ProcessGroup) -> int:
    return dist.get_rank(group) * z.shape[-1]


def vocab_parallel_cross_entropy(logits: Tensor, labels: Tensor, group: dist.ProcessGroup,
                                 ignore_index: int = IGNORE_INDEX, reduction: str = "mean", shift: bool = True,
                                 softcap: float | None = None) -> Tensor:
    """posttrain.core.losses.cross_entropy for logits (N..., V/tp) split by vocab over `group`:

        CE_t = logsumexp_v z_tv - z_t,y_t,   the target logit taken on the rank that owns y_t.
    """
    z, labels, keep = ce_logits_inputs(logits, labels, ignore_index, reduction, shift, softcap)
    rel = labels - _vocab_start(z, group)
    mine = keep & (rel >= 0) & (rel < z.shape[-1])
    z_mine = z.gather(-1, torch.where(mine, rel, 0)[..., None]).squeeze(-1)
    z_target = reduce_from_tp(torch.where(mine, z_mine, 0.0), group)
    per_token = vocab_parallel_logsumexp(z, group) - z_target
    return masked_reduce(per_token, keep, reduction)


def vocab_parallel_token_logps(logits: Tensor, labels: Tensor, group: dist.ProcessGroup,
                               ignore_index: int = IGNORE_INDEX, shift: bool = True,
                               softcap: float | None = None) -> Tensor:
    """log p(y_t | x_<t) per position (N...), 0 where ignored: posttrain.core.losses.token_logps, vocab-parallel."""
    return -vocab_parallel_cross_entropy(logits, labels, group, ignore_index, "none", shift, softcap)


def vocab_parallel_sequence_logps(logits: Tensor, labels: Tensor, group: dist.ProcessGroup,
                                  ignore_index: int = IGNORE_INDEX, average: bool = False, shift: bool = True,
                                  softcap: float | None = None) -> Tensor:
    """log pi(y | x) per sequence (B,): the policy / reference terms of every DPO-family loss."""
    tok = vocab_parallel_token_logps(logits, labels, group, ignore_index, shift, softcap)
    return _per_sequence(tok, labels, ignore_index, shift, average)


def vocab_parallel_distill_loss(student_logits: Tensor, teacher_logits: Tensor, group: dist.ProcessGroup,
                                kind: str = "forward_kl", temperature: float = 1.0, beta: float = 0.5,
                                mask: Tensor | None = None, reduction: str = "mean",
                                scale_by_t2: bool = True) -> Tensor:
    """posttrain.core.losses.distill_loss (forward KL, reverse KL, generalized JSD) for student and teacher
    logits both split by vocab over `group` the same way. Each divergence is a vocab sum of
    elementwise terms of the two log-softmaxes: summed per rank, then all-reduced."""
    check_choice("kind", kind, DISTILL_KINDS)
    check_choice("reduction", reduction, REDUCTIONS)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} != teacher {tuple(teacher_logits.shape)}")
    dt = compute_dtype(student_logits.dtype)
    logp_s = vocab_parallel_log_softmax(student_logits.to(dt) / temperature, group)
    logp_t = vocab_parallel_log_softmax(teacher_logits.to(dt) / temperature, group)
    per_token = reduce_from_tp(divergence(logp_s, logp_t, kind, beta), group)
    per_token = per_token * (temperature**2 if scale_by_t2 else 1.0)
    keep = torch.ones_like(per_token, dtype=torch.bool) if mask is None else mask
    return masked_reduce(per_token, keep, reduction)


def vocab_parallel_distill_topk(logits: Tensor, teacher_topk_ids: Tensor, teacher_topk_logps: Tensor,
                                group: dist.ProcessGroup, kind: str = "forward_kl", temperature: float = 1.0,
                                beta: float = 0.5, reduction: str = "mean") -> Tensor:
    """posttrain.core.losses.distill_loss_topk for student logits (N, V/tp) split by vocab over `group`:
    log p_S at each teacher id is its logit (taken on the rank that owns the id) minus the
    vocab-parallel logsumexp. The loss is then whole, and equal, on every rank."""
    check_choice("kind", kind, DISTILL_KINDS)
    z = logits.to(compute_dtype(logits.dtype)) / temperature
    rel = teacher_topk_ids - _vocab_start(z, group)
    mine = (rel >= 0) & (rel < z.shape[-1])
    z_ids = reduce_from_tp(torch.where(mine, z.gather(-1, torch.where(mine, rel, 0)), 0.0), group)
    logp_s = z_ids - vocab_parallel_logsumexp(z, group)[..., None]  # whole on every rank, as CE's
    return topk_divergence(logp_s, teacher_topk_logps, kind, temperature, beta, None, reduction)


@torch.no_grad()
def vocab_parallel_topk(logits: Tensor, k: int, group: dist.ProcessGroup) -> tuple[Tensor, Tensor]:
    """(ids, log-probs) of the k most likely tokens over the full vocabulary, (N, k), from logits
    (N, V/tp) split by vocab: each rank's top k of its slice (global ids), gathered, then the top k
    of those; the same on every rank."""
    lp = logits.float() - vocab_parallel_logsumexp(logits.float(), group)[..., None]
    top = lp.topk(k, dim=-1)
    n = dist.get_world_size(group)
    ids = [torch.empty_like(top.indices) for _ in range(n)]
    vals = [torch.empty_like(top.values) for _ in range(n)]
    dist.all_gather(ids, top.indices + _vocab_start(lp, group), group=group)
    dist.all_gather(vals, top.values, group=group)
    best = torch.cat(vals, -1).topk(k, dim=-1)
    return torch.cat(ids, -1).gather(-1, best.indices), best.values
