"""Training losses as pure functions: cross entropy, the DPO family, distillation.

Nothing here knows about models, parallelism or optimizers: tensors in, tensors out. Each
docstring carries the formula it implements and the paper it comes from. The chunked losses
(from hidden states and the lm_head: chunked_cross_entropy, chunked_token_logps,
chunked_distill_loss) are the torch paths of the fused loss kernels and are defined beside them
in kernels/chunked_losses.py; they are re-exported here. All math runs in at
least fp32 (fp64 inputs stay fp64, so `torch.autograd.gradcheck` works); losses come back in
that dtype, gradients in the inputs' dtype.

Label convention: `labels[..., t]` is the token at position t; with `shift=True` the target at
position t is `labels[..., t + 1]` (the last position has none), as Hugging Face causal LMs do.
Positions whose target equals `ignore_index` contribute nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Shared loss helpers and the chunked losses (re-exported), defined beside the fused kernels.
from posttrain.kernels.chunked_losses import (  # noqa: F401
    DISTILL_KINDS,
    IGNORE_INDEX,
    REDUCTIONS,
    ce_targets,
    check_choice,
    chunked_cross_entropy,
    chunked_distill_loss,
    chunked_token_logps,
    compute_dtype,
    divergence,
    masked_reduce,
    shift_labels,
    token_divergence,
)
# The family (DPO, IPO, SimPO, ..., ORPO, KTO) lives in core/preference.py; re-exported here.
from posttrain.core.preference import (  # noqa: F401
    DPO_LOSS_TYPES,
    DPOOutput,
    dpo_loss,
    kto_kl,
    kto_loss,
    wpo_weights,
)


def num_target_tokens(labels: Tensor, ignore_index: int = IGNORE_INDEX, shift: bool = True) -> Tensor:
    """Per-sequence count of scored tokens (the lengths DPO's IPO/SimPO normalize by)."""
    return ce_targets(labels, ignore_index, shift)[1].sum(-1)


# --------------------------------------------------------------------------- cross entropy


def ce_logits_inputs(logits: Tensor, labels: Tensor, ignore_index: int, reduction: str, shift: bool,
                     softcap: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """The preamble of a cross entropy on logits that exist (here and vocab-parallel in
    posttrain.core.parallel.losses): checks `reduction`; returns z (the logits in fp32+, softcapped as
    z = softcap * tanh(logits / softcap) when softcap is set), the targets (shifted when `shift`)
    and keep, the scored positions (targets != ignore_index)."""
    check_choice("reduction", reduction, REDUCTIONS)
    z = logits.to(compute_dtype(logits.dtype))
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    labels, keep = ce_targets(labels, ignore_index, shift)
    return z, labels, keep


def cross_entropy(logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX, reduction: str = "mean",
                  shift: bool = True, softcap: float | None = None) -> Tensor:
    """Same loss as `chunked_cross_entropy`, for logits (N..., V) that already exist (fp32 math)."""
    z, labels, keep = ce_logits_inputs(logits, labels, ignore_index, reduction, shift, softcap)
    per_token = F.cross_entropy(z.reshape(-1, z.shape[-1]), labels.reshape(-1), ignore_index=ignore_index,
                                reduction="none").view(labels.shape)
    return masked_reduce(per_token, keep, reduction)


def token_logps(logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX, shift: bool = True,
                softcap: float | None = None) -> Tensor:
    """log p(y_t | x_<t) per position, (N...), 0 where the target is ignored."""
    return -cross_entropy(logits, labels, ignore_index, "none", shift, softcap)


def _per_sequence(tok: Tensor, labels: Tensor, ignore_index: int, shift: bool, average: bool) -> Tensor:
    total = tok.sum(-1)
    return total / num_target_tokens(labels, ignore_index, shift).clamp(min=1) if average else total


def sequence_logps(logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX, average: bool = False,
                   shift: bool = True, softcap: float | None = None) -> Tensor:
    """log pi(y | x) = sum_t log p(y_t | x, y_<t) per sequence (B,); the per-token mean if average."""
    return _per_sequence(token_logps(logits, labels, ignore_index, shift, softcap), labels, ignore_index, shift,
                         average)


def chunked_sequence_logps(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX,
                           average: bool = False, chunk_size: int = 1024, shift: bool = True,
                           softcap: float | None = None) -> Tensor:
    """`sequence_logps` from hidden states (B, T, H) and the lm_head (V, H), chunked."""
    tok = chunked_token_logps(hidden, weight, labels, ignore_index, chunk_size, shift, softcap)
    return _per_sequence(tok, labels, ignore_index, shift, average)


# --------------------------------------------------------------------------- distillation


def distill_loss(student_logits: Tensor, teacher_logits: Tensor, kind: str = "forward_kl",
                 temperature: float = 1.0, beta: float = 0.5, mask: Tensor | None = None,
                 reduction: str = "mean", scale_by_t2: bool = True) -> Tensor:
    """Per-token divergence between teacher and student next-token distributions, logits (N..., V).

    p_S = softmax(z_S / T), p_T = softmax(z_T / T); with scale_by_t2 the result is multiplied by
    T^2 so gradient magnitudes do not shrink with T (Hinton et al. 2015, arXiv 1503.02531).

    - forward_kl  KL(p_T || p_S) = sum_v p_T (log p_T - log p_S)   (mass-covering)
    - reverse_kl  KL(p_S || p_T) = sum_v p_S (log p_S - log p_T)   (mode-seeking)
    - jsd         generalized JSD of GKD (Agarwal et al. 2024, arXiv 2306.13649), TRL's convention:
                  M = beta p_T + (1 - beta) p_S,  JSD = beta KL(p_T || M) + (1 - beta) KL(p_S || M).
                  Exactly beta = 0 gives forward KL and beta = 1 reverse KL, special-cased as TRL's
                  `generalized_jsd_loss` does; the formula itself is unnormalized and tends to 0
                  as beta -> 0 or 1, so the endpoints are a jump, not a limit.

    mask (N...) bool marks scored positions; mean averages over them (0 when none are scored).
    """
    check_choice("kind", kind, DISTILL_KINDS)
    check_choice("reduction", reduction, REDUCTIONS)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} != teacher {tuple(teacher_logits.shape)}")
    per_token = token_divergence(student_logits, teacher_logits, kind, temperature, beta, scale_by_t2)
    keep = torch.ones_like(per_token, dtype=torch.bool) if mask is None else mask
    return masked_reduce(per_token, keep, reduction)


def distill_loss_topk(student_logits: Tensor, teacher_topk_ids: Tensor, teacher_topk_logps: Tensor,
                      kind: str = "forward_kl", temperature: float = 1.0, beta: float = 0.5,
                      mask: Tensor | None = None, reduction: str = "mean", scale_by_t2: bool = True) -> Tensor:
    """Offline distillation from a stored teacher top-k: ids and log-probs (N..., k), student (N..., V).

    The teacher is renormalized over its k ids: p~_T = softmax(teacher_topk_logps / T) (any
    per-token constant cancels, so top-k logits work too). The student side depends on `kind`:

    - forward_kl  sum_k p~_T (log p~_T - log p_S[ids]) with p_S normalized over the full vocab.
                  This is CE against p~_T up to a constant, so it also pulls the student's mass
                  off the tokens outside the top-k; it is >= 0 since sum_k p_S[ids] <= 1.
    - reverse_kl, jsd  the student is renormalized over the same k ids too,
                  p~_S = softmax over k of log p_S[ids]; with a sub-normalized p_S these would not
                  be divergences (reverse KL could go negative by moving mass off the support).

    With k = V all kinds equal `distill_loss`. Temperature, T^2, mask and reduction as there.
    """
    check_choice("kind", kind, DISTILL_KINDS)
    check_choice("reduction", reduction, REDUCTIONS)
    ids_shape = teacher_topk_ids.shape
    if ids_shape != teacher_topk_logps.shape or ids_shape[:-1] != student_logits.shape[:-1]:
        raise ValueError(f"teacher top-k ids {tuple(ids_shape)} / logps {tuple(teacher_topk_logps.shape)} "
                         f"do not match student logits {tuple(student_logits.shape)}")
    dt = compute_dtype(student_logits.dtype)
    logp_s = F.log_softmax(student_logits.to(dt) / temperature, dim=-1).gather(-1, teacher_topk_ids)
    return topk_divergence(logp_s, teacher_topk_logps, kind, temperature, beta, mask, reduction, scale_by_t2)


def topk_divergence(student_logps: Tensor, teacher_topk_logps: Tensor, kind: str = "forward_kl",
                    temperature: float = 1.0, beta: float = 0.5, mask: Tensor | None = None,
                    reduction: str = "mean", scale_by_t2: bool = True) -> Tensor:
    """distill_loss_topk from the student's full-vocabulary log-probs (at temperature T) at the
    teacher's k ids, (N..., k): what a vocab-parallel student computes without the full logits."""
    logp_t = F.log_softmax(teacher_topk_logps.to(student_logps.dtype) / temperature, dim=-1)
    logp_s = student_logps
    if kind != "forward_kl":
        logp_s = logp_s - logp_s.logsumexp(-1, keepdim=True)
    per_token = divergence(logp_s, logp_t, kind, beta) * (temperature**2 if scale_by_t2 else 1.0)
    keep = torch.ones_like(per_token, dtype=torch.bool) if mask is None else mask
    return masked_reduce(per_token, keep, reduction)
