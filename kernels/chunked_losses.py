"""Losses from hidden states and the lm_head in pure torch, one token chunk of logits at a time:
the torch paths of the fused-linear loss kernels (kernels/fused_linear_ce.py,
kernels/fused_linear_kl.py), which take them wherever the Triton kernels do not run, and their
references in the tests. posttrain.core.losses re-exports them beside its logits-level losses.

All math runs in at least fp32 (fp64 inputs stay fp64, so `torch.autograd.gradcheck` works);
losses come back in that dtype, gradients in the inputs' dtype.

Label convention: `labels[..., t]` is the token at position t; with `shift=True` the target at
position t is `labels[..., t + 1]` (the last position has none), as Hugging Face causal LMs do.
Positions whose target equals `ignore_index` contribute nothing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
REDUCTIONS = ("mean", "sum", "none")
DISTILL_KINDS = ("forward_kl", "reverse_kl", "jsd")


def check_choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(valid)}")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype loss math runs in: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def shift_labels(labels: Tensor, ignore_index: int) -> Tensor:
    """Target at t is labels[t + 1]; padding the end keeps hidden/logits unsliced (no copy)."""
    pad = labels.new_full((*labels.shape[:-1], 1), ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def ce_targets(labels: Tensor, ignore_index: int, shift: bool) -> tuple[Tensor, Tensor]:
    """The label half of every cross entropy's preamble: (targets, keep), the targets shifted
    by one position when `shift` and keep = targets != ignore_index (the scored positions)."""
    if shift:
        labels = shift_labels(labels, ignore_index)
    return labels, labels != ignore_index


def check_linear_ce_args(hidden: Tensor, weight: Tensor, labels: Tensor, reduction: str,
                         chunk_size: int | None) -> None:
    """The argument checks of a cross entropy from hidden states (N..., H), the lm_head (V, H)
    and labels (N...): this module's and the fused kernel's."""
    check_choice("reduction", reduction, REDUCTIONS)
    if hidden.shape[:-1] != labels.shape or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"shapes do not match: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
                         f"labels {tuple(labels.shape)}; expected (N..., H), (V, H), (N...)")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def masked_reduce(per_token: Tensor, keep: Tensor, reduction: str) -> Tensor:
    """Zero the dropped positions, then mean over kept ones (0, not NaN, when none), sum or none."""
    if keep.shape != per_token.shape:
        raise ValueError(f"mask shape {tuple(keep.shape)} != per-token shape {tuple(per_token.shape)}")
    per_token = torch.where(keep, per_token, 0.0)
    if reduction == "none":
        return per_token
    total = per_token.sum()
    return total / keep.sum().clamp(min=1) if reduction == "mean" else total


# --------------------------------------------------------------------------- cross entropy


def _ce_chunk(h: Tensor, weight: Tensor, target: Tensor, keep: Tensor, softcap: float | None,
              want_grad: bool) -> tuple[Tensor, Tensor | None]:
    """Per-token CE of one chunk and, if asked, dCE/dz (z = pre-softcap logits), both fp32+."""
    z = (h @ weight.T).to(compute_dtype(h.dtype))  # (c, V): the only vocab-sized buffer
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
        cdt = compute_dtype(hidden.dtype)
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
        grad_w = weight.new_zeros(weight.shape, dtype=compute_dtype(weight.dtype)) if need_w else None
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
    check_linear_ce_args(hidden, weight, labels, reduction, chunk_size)
    labels, keep = ce_targets(labels, ignore_index, shift)
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


def chunked_token_logps(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX,
                        chunk_size: int = 1024, shift: bool = True, softcap: float | None = None) -> Tensor:
    """log p(y_t | x_<t) per position, (N...), 0 where the target is ignored, from hidden states
    and the lm_head, never holding more than a chunk of logits.

    Backed by the autograd Function's `none` path: forward saves only its inputs and backward
    recomputes each chunk's logits. We chose that over torch.utils.checkpoint per chunk because it
    keeps no per-chunk autograd graph, reuses the hand-written (and gradchecked) CE gradient, and
    costs the same one extra matmul per chunk that checkpointing would.
    """
    return -chunked_cross_entropy(hidden, weight, labels, ignore_index, chunk_size, "none", shift, softcap)


# --------------------------------------------------------------------------- distillation


def _kl(logp: Tensor, logq: Tensor) -> Tensor:
    """KL(p || q) = sum_v p_v (log p_v - log q_v) over the last dim, with 0 log 0 = 0."""
    p = logp.exp()
    return (p * torch.where(p > 0, logp - logq, 0.0)).sum(-1)


def divergence(logp_s: Tensor, logp_t: Tensor, kind: str, beta: float) -> Tensor:
    """Per-position divergence over the last dim between student and teacher log-probs:
    forward KL(p_T || p_S), reverse KL(p_S || p_T) or GKD's generalized JSD (see
    posttrain.core.losses.distill_loss), jsd at beta 0 / 1 being forward / reverse KL."""
    if kind == "forward_kl" or (kind == "jsd" and beta == 0):
        return _kl(logp_t, logp_s)
    if kind == "reverse_kl" or (kind == "jsd" and beta == 1):
        return _kl(logp_s, logp_t)
    if not 0 < beta < 1:
        raise ValueError(f"jsd needs 0 <= beta <= 1, got {beta}")
    log_m = torch.logaddexp(logp_t + math.log(beta), logp_s + math.log1p(-beta))  # log M, stably
    return beta * _kl(logp_t, log_m) + (1 - beta) * _kl(logp_s, log_m)


def token_divergence(student_logits: Tensor, teacher_logits: Tensor, kind: str, temperature: float,
                     beta: float, scale_by_t2: bool) -> Tensor:
    """Unreduced divergence (N...) of softmax(z / T) of two logits tensors (N..., V), in fp32+,
    times T^2 when scale_by_t2."""
    dt = compute_dtype(student_logits.dtype)
    logp_s = F.log_softmax(student_logits.to(dt) / temperature, dim=-1)
    logp_t = F.log_softmax(teacher_logits.to(dt) / temperature, dim=-1)
    return divergence(logp_s, logp_t, kind, beta) * (temperature**2 if scale_by_t2 else 1.0)


def chunked_distill_loss(student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor,
                         teacher_weight: Tensor, kind: str = "forward_kl", temperature: float = 1.0,
                         beta: float = 0.5, mask: Tensor | None = None, reduction: str = "mean",
                         scale_by_t2: bool = True, chunk_size: int = 1024) -> Tensor:
    """`posttrain.core.losses.distill_loss(student_hidden @ student_weight.T, teacher_hidden @
    teacher_weight.T, ...)` computed over token chunks, so neither (tokens, V) logits tensor ever
    exists whole.

    Hidden states are (N..., H_s) and (N..., H_t); the vocabularies must match. Each chunk runs
    under non-reentrant torch.utils.checkpoint: forward keeps only views of the inputs, backward
    recomputes that chunk's logits. Checkpointing reuses the exact per-token math of
    `token_divergence` (no second hand-derived JSD gradient) at the price of one extra forward
    matmul per chunk; kernels/fused_linear_kl.py is the fused Triton form.
    """
    check_choice("kind", kind, DISTILL_KINDS)
    check_choice("reduction", reduction, REDUCTIONS)
    if student_hidden.shape[:-1] != teacher_hidden.shape[:-1] or student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"student hidden {tuple(student_hidden.shape)} / weight {tuple(student_weight.shape)} "
                         f"do not match teacher {tuple(teacher_hidden.shape)} / {tuple(teacher_weight.shape)}")
    sh = student_hidden.reshape(-1, student_hidden.shape[-1])
    th = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])

    def chunk_loss(s_h: Tensor, s_w: Tensor, t_h: Tensor, t_w: Tensor) -> Tensor:
        return token_divergence(s_h @ s_w.T, t_h @ t_w.T, kind, temperature, beta, scale_by_t2)

    parts = []
    for s in range(0, sh.shape[0], chunk_size):
        args = (sh[s:s + chunk_size], student_weight, th[s:s + chunk_size], teacher_weight)
        parts.append(checkpoint(chunk_loss, *args, use_reentrant=False) if torch.is_grad_enabled()
                     else chunk_loss(*args))
    per_token = torch.cat(parts).view(student_hidden.shape[:-1])
    keep = torch.ones_like(per_token, dtype=torch.bool) if mask is None else mask
    return masked_reduce(per_token, keep, reduction)
