"""Training losses as pure functions: chunked cross entropy, the DPO family, distillation.

Nothing here knows about models, parallelism or optimizers: tensors in, tensors out. Each
docstring carries the formula it implements and the paper it comes from. All math runs in at
least fp32 (fp64 inputs stay fp64, so `torch.autograd.gradcheck` works); losses come back in
that dtype, gradients in the inputs' dtype.

Label convention: `labels[..., t]` is the token at position t; with `shift=True` the target at
position t is `labels[..., t + 1]` (the last position has none), as Hugging Face causal LMs do.
Positions whose target equals `ignore_index` contribute nothing.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
REDUCTIONS = ("mean", "sum", "none")
DPO_LOSS_TYPES = ("sigmoid", "robust", "ipo", "hinge", "simpo")
DISTILL_KINDS = ("forward_kl", "reverse_kl", "jsd")


def _check_choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(valid)}")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _shift(labels: Tensor, ignore_index: int) -> Tensor:
    """Target at t is labels[t + 1]; padding the end keeps hidden/logits unsliced (no copy)."""
    pad = labels.new_full((*labels.shape[:-1], 1), ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def _reduce(per_token: Tensor, keep: Tensor, reduction: str) -> Tensor:
    """Zero the dropped positions, then mean over kept ones (0, not NaN, when none), sum or none."""
    if keep.shape != per_token.shape:
        raise ValueError(f"mask shape {tuple(keep.shape)} != per-token shape {tuple(per_token.shape)}")
    per_token = torch.where(keep, per_token, 0.0)
    if reduction == "none":
        return per_token
    total = per_token.sum()
    return total / keep.sum().clamp(min=1) if reduction == "mean" else total


def num_target_tokens(labels: Tensor, ignore_index: int = IGNORE_INDEX, shift: bool = True) -> Tensor:
    """Per-sequence count of scored tokens (the lengths DPO's IPO/SimPO normalize by)."""
    if shift:
        labels = _shift(labels, ignore_index)
    return (labels != ignore_index).sum(-1)


# --------------------------------------------------------------------------- cross entropy


def _ce_chunk(h: Tensor, weight: Tensor, target: Tensor, keep: Tensor, softcap: float | None,
              want_grad: bool) -> tuple[Tensor, Tensor | None]:
    """Per-token CE of one chunk and, if asked, dCE/dz (z = pre-softcap logits), both fp32+."""
    z = (h @ weight.T).to(_compute_dtype(h.dtype))  # (c, V): the only vocab-sized buffer
    if softcap is not None:
        tanh = torch.tanh(z / softcap)
        z = tanh * softcap
    lse = torch.logsumexp(z, dim=-1)  # (c,)
    loss = torch.where(keep, lse - z.gather(1, target[:, None]).squeeze(1), 0.0)
    if not want_grad:
        return loss, None
    grad = z.sub_(lse[:, None]).exp_()  # softmax, in place of z
    grad.scatter_add_(1, target[:, None], -torch.ones_like(grad[:, :1]))  # - onehot
    grad.mul_(keep[:, None])
    if softcap is not None:
        grad.mul_(1.0 - tanh * tanh)  # d(c*tanh(z/c))/dz
    return loss, grad


def _accumulate_grads(g: Tensor, h: Tensor, weight: Tensor, grad_h: Tensor | None,
                      grad_w: Tensor | None) -> None:
    """grad_h[chunk] = g @ W (into the given view); grad_w += g^T h, accumulated in fp32+."""
    g_low = g.to(weight.dtype)
    if grad_h is not None:
        torch.mm(g_low, weight, out=grad_h)
    if grad_w is not None:
        if grad_w.dtype == h.dtype:
            grad_w.addmm_(g_low.T, h)
        else:
            grad_w.add_(g_low.T @ h)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """CE from hidden states and the lm_head weight, one token chunk of logits at a time.

    mean/sum: the upstream gradient is a scalar, so forward computes d/dhidden and d/dweight
    chunk by chunk (Liger's fused-linear-CE scheme) and keeps only those; backward scales them.
    none: each token has its own upstream gradient, unknown in forward, so forward keeps only its
    inputs (no copies) and backward recomputes each chunk's logits: same memory bound, one more
    matmul per chunk. This is the path per-sequence log-probs (DPO) take.
    """

    @staticmethod
    def forward(ctx, hidden, weight, target, keep, chunk_size, reduction, softcap, grad_enabled):
        # needs_input_grad stays True under torch.no_grad(); grad_enabled keeps eval passes lean
        need_h, need_w = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        eager = reduction != "none" and (need_h or need_w)
        cdt = _compute_dtype(hidden.dtype)
        scale = keep.sum().clamp(min=1).to(cdt).reciprocal() if reduction == "mean" else None
        losses = hidden.new_empty(hidden.shape[0], dtype=cdt)
        grad_h = torch.empty_like(hidden) if eager and need_h else None
        grad_w = weight.new_zeros(weight.shape, dtype=cdt) if eager and need_w else None
        for s in range(0, hidden.shape[0], chunk_size):
            e = s + chunk_size
            losses[s:e], g = _ce_chunk(hidden[s:e], weight, target[s:e], keep[s:e], softcap, eager)
            if eager:
                g = g if scale is None else g.mul_(scale)
                _accumulate_grads(g, hidden[s:e], weight, None if grad_h is None else grad_h[s:e], grad_w)
        ctx.reduction, ctx.chunk_size, ctx.softcap, ctx.weight_dtype = reduction, chunk_size, softcap, weight.dtype
        if reduction == "none":
            ctx.save_for_backward(hidden, weight, target, keep)
            return losses
        ctx.save_for_backward(grad_h, grad_w)
        total = losses.sum()
        return total if scale is None else total * scale

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        if ctx.reduction != "none":
            grad_h, grad_w = ctx.saved_tensors
            gh = None if grad_h is None else grad_h * grad_out.to(grad_h.dtype)
            gw = None if grad_w is None else (grad_w * grad_out).to(ctx.weight_dtype)
            return gh, gw, None, None, None, None, None, None
        hidden, weight, target, keep = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = weight.new_zeros(weight.shape, dtype=_compute_dtype(weight.dtype)) if need_w else None
        for s in range(0, hidden.shape[0], ctx.chunk_size):
            e = s + ctx.chunk_size
            _, g = _ce_chunk(hidden[s:e], weight, target[s:e], keep[s:e], ctx.softcap, True)
            g.mul_(grad_out[s:e, None].to(g.dtype))
            _accumulate_grads(g, hidden[s:e], weight, None if grad_h is None else grad_h[s:e], grad_w)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None, None


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX,
                          chunk_size: int = 1024, reduction: str = "mean", shift: bool = True,
                          softcap: float | None = None) -> Tensor:
    """Token cross entropy of `hidden @ weight.T` without materializing the (tokens, V) logits.

        CE_t = logsumexp_v z_tv - z_t,y_t,   z = softcap * tanh((h W^T) / softcap) if softcap else h W^T

    hidden (N..., H), weight (V, H) (the lm_head), labels (N...). Peak extra memory is about two
    (chunk_size, V) fp32 buffers plus a (V, H) fp32 grad accumulator, instead of (tokens, V).
    mean divides by the number of scored tokens; `none` returns (N...) with ignored tokens at 0.
    The head runs on the scored tokens only (one host sync to find them).
    """
    _check_choice("reduction", reduction, REDUCTIONS)
    if hidden.shape[:-1] != labels.shape or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"shapes do not match: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
                         f"labels {tuple(labels.shape)}; expected (N..., H), (V, H), (N...)")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if shift:
        labels = _shift(labels, ignore_index)
    keep = labels != ignore_index
    target = torch.where(keep, labels, 0)
    h2, target, keep = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1), keep.reshape(-1)
    rows = None
    if not bool(keep.all()):
        # The head is needed only where a label is scored (prompts are often half of SFT and DPO
        # tokens): gather those rows; gradients scatter back through index_select / index_copy.
        rows = keep.nonzero().squeeze(1)
        h2, target, keep = h2.index_select(0, rows), target[rows], keep[rows]
    out = _ChunkedCrossEntropy.apply(h2, weight, target, keep, chunk_size, reduction, softcap, torch.is_grad_enabled())
    if reduction != "none":
        return out
    if rows is not None:
        out = out.new_zeros(labels.numel()).index_copy(0, rows, out)
    return out.view(labels.shape)


def cross_entropy(logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX, reduction: str = "mean",
                  shift: bool = True, softcap: float | None = None) -> Tensor:
    """Same loss as `chunked_cross_entropy`, for logits (N..., V) that already exist (fp32 math)."""
    _check_choice("reduction", reduction, REDUCTIONS)
    z = logits.to(_compute_dtype(logits.dtype))
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if shift:
        labels = _shift(labels, ignore_index)
    keep = labels != ignore_index
    per_token = F.cross_entropy(z.reshape(-1, z.shape[-1]), labels.reshape(-1), ignore_index=ignore_index,
                                reduction="none").view(labels.shape)
    return _reduce(per_token, keep, reduction)


def token_logps(logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX, shift: bool = True,
                softcap: float | None = None) -> Tensor:
    """log p(y_t | x_<t) per position, (N...), 0 where the target is ignored."""
    return -cross_entropy(logits, labels, ignore_index, "none", shift, softcap)


def chunked_token_logps(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX,
                        chunk_size: int = 1024, shift: bool = True, softcap: float | None = None) -> Tensor:
    """`token_logps` from hidden states and the lm_head, never holding more than a chunk of logits.

    Backed by the autograd Function's `none` path: forward saves only its inputs and backward
    recomputes each chunk's logits. We chose that over torch.utils.checkpoint per chunk because it
    keeps no per-chunk autograd graph, reuses the hand-written (and gradchecked) CE gradient, and
    costs the same one extra matmul per chunk that checkpointing would.
    """
    return -chunked_cross_entropy(hidden, weight, labels, ignore_index, chunk_size, "none", shift, softcap)


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
    _check_choice("loss_type", loss_type, DPO_LOSS_TYPES)
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

    dt = _compute_dtype(policy_chosen_logps.dtype)
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


def _kl(logp: Tensor, logq: Tensor) -> Tensor:
    """KL(p || q) = sum_v p_v (log p_v - log q_v) over the last dim, with 0 log 0 = 0."""
    p = logp.exp()
    return (p * torch.where(p > 0, logp - logq, 0.0)).sum(-1)


def _divergence(logp_s: Tensor, logp_t: Tensor, kind: str, beta: float) -> Tensor:
    if kind == "forward_kl" or (kind == "jsd" and beta == 0):
        return _kl(logp_t, logp_s)
    if kind == "reverse_kl" or (kind == "jsd" and beta == 1):
        return _kl(logp_s, logp_t)
    if not 0 < beta < 1:
        raise ValueError(f"jsd needs 0 <= beta <= 1, got {beta}")
    log_m = torch.logaddexp(logp_t + math.log(beta), logp_s + math.log1p(-beta))  # log M, stably
    return beta * _kl(logp_t, log_m) + (1 - beta) * _kl(logp_s, log_m)


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
    _check_choice("kind", kind, DISTILL_KINDS)
    _check_choice("reduction", reduction, REDUCTIONS)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} != teacher {tuple(teacher_logits.shape)}")
    dt = _compute_dtype(student_logits.dtype)
    logp_s = F.log_softmax(student_logits.to(dt) / temperature, dim=-1)
    logp_t = F.log_softmax(teacher_logits.to(dt) / temperature, dim=-1)
    per_token = _divergence(logp_s, logp_t, kind, beta) * (temperature**2 if scale_by_t2 else 1.0)
    keep = torch.ones_like(per_token, dtype=torch.bool) if mask is None else mask
    return _reduce(per_token, keep, reduction)


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
    _check_choice("kind", kind, DISTILL_KINDS)
    _check_choice("reduction", reduction, REDUCTIONS)
    ids_shape = teacher_topk_ids.shape
    if ids_shape != teacher_topk_logps.shape or ids_shape[:-1] != student_logits.shape[:-1]:
        raise ValueError(f"teacher top-k ids {tuple(ids_shape)} / logps {tuple(teacher_topk_logps.shape)} "
                         f"do not match student logits {tuple(student_logits.shape)}")
    dt = _compute_dtype(student_logits.dtype)
    logp_t = F.log_softmax(teacher_topk_logps.to(dt) / temperature, dim=-1)
    logp_s = F.log_softmax(student_logits.to(dt) / temperature, dim=-1).gather(-1, teacher_topk_ids)
    if kind != "forward_kl":
        logp_s = logp_s - logp_s.logsumexp(-1, keepdim=True)
    per_token = _divergence(logp_s, logp_t, kind, beta) * (temperature**2 if scale_by_t2 else 1.0)
    keep = torch.ones_like(per_token, dtype=torch.bool) if mask is None else mask
    return _reduce(per_token, keep, reduction)


def chunked_distill_loss(student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor,
                         teacher_weight: Tensor, kind: str = "forward_kl", temperature: float = 1.0,
                         beta: float = 0.5, mask: Tensor | None = None, reduction: str = "mean",
                         scale_by_t2: bool = True, chunk_size: int = 1024) -> Tensor:
    """`distill_loss(student_hidden @ student_weight.T, teacher_hidden @ teacher_weight.T, ...)`
    computed over token chunks, so neither (tokens, V) logits tensor ever exists whole.

    Hidden states are (N..., H_s) and (N..., H_t); the vocabularies must match. Each chunk runs
    under non-reentrant torch.utils.checkpoint: forward keeps only views of the inputs, backward
    recomputes that chunk's logits. Checkpointing reuses the exact `distill_loss` math (no second
    hand-derived JSD gradient) at the price of one extra forward matmul per chunk; a fused kernel
    belongs in kernels/.
    """
    _check_choice("kind", kind, DISTILL_KINDS)
    _check_choice("reduction", reduction, REDUCTIONS)
    if student_hidden.shape[:-1] != teacher_hidden.shape[:-1] or student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"student hidden {tuple(student_hidden.shape)} / weight {tuple(student_weight.shape)} "
                         f"do not match teacher {tuple(teacher_hidden.shape)} / {tuple(teacher_weight.shape)}")
    sh = student_hidden.reshape(-1, student_hidden.shape[-1])
    th = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])

    def chunk_loss(s_h: Tensor, s_w: Tensor, t_h: Tensor, t_w: Tensor) -> Tensor:
        return distill_loss(s_h @ s_w.T, t_h @ t_w.T, kind, temperature, beta, None, "none", scale_by_t2)

    parts = []
    for s in range(0, sh.shape[0], chunk_size):
        args = (sh[s:s + chunk_size], student_weight, th[s:s + chunk_size], teacher_weight)
        parts.append(checkpoint(chunk_loss, *args, use_reentrant=False) if torch.is_grad_enabled()
                     else chunk_loss(*args))
    per_token = torch.cat(parts).view(student_hidden.shape[:-1])
    keep = torch.ones_like(per_token, dtype=torch.bool) if mask is None else mask
    return _reduce(per_token, keep, reduction)
