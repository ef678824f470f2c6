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

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

# Shared loss helpers and the chunked losses (re-exported), defined beside the fused kernels.
from kernels.chunked_losses import (  # noqa: F401
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

DPO_LOSS_TYPES = ("sigmoid", "robust", "ipo", "hinge", "simpo")


def num_target_tokens(labels: Tensor, ignore_index: int = IGNORE_INDEX, shift: bool = True) -> Tensor:
    """Per-sequence count of scored tokens (the lengths DPO's IPO/SimPO normalize by)."""
    return ce_targets(labels, ignore_index, shift)[1].sum(-1)


# --------------------------------------------------------------------------- cross entropy


def ce_logits_inputs(logits: Tensor, labels: Tensor, ignore_index: int, reduction: str, shift: bool,
                     softcap: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """The preamble of a cross entropy on logits that exist (here and vocab-parallel in
    core.parallel.losses): checks `reduction`; returns z (the logits in fp32+, softcapped as
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


# --------------------------------------------------------------------------- preference (DPO family)


class DPOOutput(NamedTuple):
    loss: Tensor  # scalar: mean of `losses`
    chosen_rewards: Tensor  # (B,), detached
    rejected_rewards: Tensor  # (B,), detached
    margins: Tensor  # (B,) chosen_rewards - rejected_rewards
    accuracy: Tensor  # scalar: fraction with chosen_rewards > rejected_rewards
    losses: Tensor  # (B,) per-example loss, SFT term included


def dpo_loss(policy_chosen_logps: Tensor, policy_rejected_logps: Tensor, ref_chosen_logps: Tensor | None = None,
             ref_rejected_logps: Tensor | None = None, beta: float = 0.1, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, simpo_gamma: float = 0.5, chosen_lengths: Tensor | None = None,
             rejected_lengths: Tensor | None = None, sft_weight: float = 0.0,
             policy_chosen_nll: Tensor | None = None) -> DPOOutput:
    """Preference losses on per-sequence log-probs (B,). With h the log-ratio margin

        h = (log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x)),   s = logsigmoid,

    - sigmoid  DPO, Rafailov et al. 2023 (arXiv 2305.18290):  -s(b h). With eps = label_smoothing
               it is conservative DPO (cDPO):  -(1 - eps) s(b h) - eps s(-b h),  0 <= eps <= 0.5.
    - robust   rDPO, Chowdhury et al. 2024 (arXiv 2403.00409), unbiased under label-flip rate eps:
               ((1 - eps) (-s(b h)) + eps s(-b h)) / (1 - 2 eps),  0 <= eps < 0.5.
    - ipo      IPO, Azar et al. 2023 (arXiv 2310.12036), eq. 17 with tau = b:  (h - 1 / (2 b))^2.
               Like TRL, h is built from length-averaged log-probs (policy and reference alike).
    - hinge    SLiC-HF, Zhao et al. 2023 (arXiv 2305.10425):  relu(1 - b h).
    - simpo    SimPO, Meng et al. 2024 (arXiv 2405.14734), reference-free:
               -s(b (avg log pi(y_w|x) - avg log pi(y_l|x)) - gamma),  gamma = simpo_gamma;
               label_smoothing applies as in cDPO (TRL's CPO trainer does the same).

    Length normalization (ipo, simpo): pass sums of token log-probs plus `chosen_lengths` and
    `rejected_lengths` (token counts, see `num_target_tokens`), or pass already-averaged log-probs
    and no lengths. Other loss types use the log-probs as given and ignore the lengths.

    Rewards: b (log pi - log ref) per response (from the averaged log-probs for ipo); b avg log pi
    for simpo. With sft_weight > 0 the per-example loss gains sft_weight * NLL(y_w) as in RPO
    (Pang et al. 2024, arXiv 2404.19733): `policy_chosen_nll` (scalar or (B,)) or, if absent,
    -policy_chosen_logps / chosen_lengths (the token-mean NLL of the chosen response).
    """
    check_choice("loss_type", loss_type, DPO_LOSS_TYPES)
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    eps = float(label_smoothing)
    if loss_type in ("ipo", "hinge") and eps != 0:
        raise ValueError(f"label_smoothing must be 0 for loss_type={loss_type!r}, got {eps}")
    if not 0 <= eps <= 0.5 or (loss_type == "robust" and eps == 0.5):
        bound = "< 0.5" if loss_type == "robust" else "<= 0.5"
        raise ValueError(f"label_smoothing must satisfy 0 <= label_smoothing {bound} for {loss_type!r}, got {eps}")
    if policy_chosen_logps.dim() != 1 or policy_chosen_logps.shape != policy_rejected_logps.shape:
        raise ValueError(f"policy log-probs must both be (B,), got {tuple(policy_chosen_logps.shape)} and "
                         f"{tuple(policy_rejected_logps.shape)}")
    if (chosen_lengths is None) != (rejected_lengths is None):
        raise ValueError("pass both chosen_lengths and rejected_lengths, or neither")
    reference_free = loss_type == "simpo"
    if not reference_free and (ref_chosen_logps is None or ref_rejected_logps is None):
        raise ValueError(f"loss_type={loss_type!r} needs ref_chosen_logps and ref_rejected_logps "
                         "(only 'simpo' is reference-free)")

    dt = compute_dtype(policy_chosen_logps.dtype)
    pc, pr = policy_chosen_logps.to(dt), policy_rejected_logps.to(dt)
    rc = None if reference_free else ref_chosen_logps.to(dt)
    rr = None if reference_free else ref_rejected_logps.to(dt)
    if loss_type in ("ipo", "simpo") and chosen_lengths is not None:
        nc, nr = chosen_lengths.to(dt).clamp(min=1), rejected_lengths.to(dt).clamp(min=1)
        pc, pr = pc / nc, pr / nr
        rc, rr = (None, None) if reference_free else (rc / nc, rr / nr)

    if reference_free:
        chosen_rewards, rejected_rewards = beta * pc, beta * pr
        logits = beta * (pc - pr) - simpo_gamma
    else:
        chosen_rewards, rejected_rewards = beta * (pc - rc), beta * (pr - rr)
        h = (pc - rc) - (pr - rr)
        logits = beta * h
    if loss_type in ("sigmoid", "simpo"):
        losses = -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)
    elif loss_type == "robust":
        losses = ((1 - eps) * -F.logsigmoid(logits) + eps * F.logsigmoid(-logits)) / (1 - 2 * eps)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:  # hinge
        losses = torch.relu(1 - logits)

    if sft_weight:
        if policy_chosen_nll is None:
            if chosen_lengths is None:
                raise ValueError("sft_weight > 0 needs policy_chosen_nll or chosen_lengths")
            policy_chosen_nll = -policy_chosen_logps.to(dt) / chosen_lengths.to(dt).clamp(min=1)
        losses = losses + sft_weight * policy_chosen_nll.to(dt)

    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return DPOOutput(loss=losses.mean(), chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards,
                     margins=chosen_rewards - rejected_rewards,
                     accuracy=(chosen_rewards > rejected_rewards).to(dt).mean(), losses=losses)


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
