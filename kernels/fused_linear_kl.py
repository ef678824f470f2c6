"""Fused linear + divergence losses for DPO and distillation, never holding (tokens, V) logits.

- `fused_linear_logps`: per-token log p(y_t) from hidden states and the lm_head (DPO's policy and
  reference log-probs). log p = -CE, so it is the fused-linear-CE op with reduction="none"
  (kernels/fused_linear_ce.py): forward writes only losses, backward recomputes each chunk and
  the kernel scales row t by its own upstream gradient. No second kernel to keep in sync.
- `fused_linear_distill`: teacher/student divergence (forward KL, reverse KL, generalized JSD).
  Per token chunk torch's matmul makes both chunks of logits; one Triton program per row makes
  three passes over the vocabulary:

      pass 1  online logsumexp of s = z_S / T and t = z_T / T
      pass 2  the divergence D and the scalar c its softmax-gradient subtracts (below)
      pass 3  dD/dz_S, written over the student logits in place

  With p = softmax(s), q = softmax(t) and per-token gradient through softmax g - sum_v p_v g_v:
      forward_kl  D = sum q (log q - log p)              dD/ds = p - q
      reverse_kl  D = sum p (log p - log q)              dD/ds = p (log p - log q - D)
      jsd(beta)   m = beta q + (1 - beta) p,  D = beta KL(q||m) + (1 - beta) KL(p||m)
                  dD/ds = (1 - beta) p (log p - log m - KL(p||m))
  and ds/dz_S = 1/T. The loss is the mean over masked tokens of T^2 D (Hinton's T^2, as
  core.losses.chunked_distill_loss with its defaults), so the scalar upstream gradient lets
  forward accumulate d/dhidden and d/dweight chunk by chunk; backward rescales them.

The teacher is a constant: its inputs get no gradient (the reference would give one).
Reference: `core.losses.chunked_distill_loss` / `chunked_token_logps`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from core.losses import DISTILL_KINDS, chunked_distill_loss, chunked_token_logps
from kernels import _utils
from kernels import fused_linear_ce as _ce
from kernels.dispatch import use_triton

LAUNCHES = _utils.counter()
MAX_BLOCK = 8192  # per-program vocab block; tests shrink it to run the online passes over blocks
_KIND_IDS = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}


@triton.jit
def _log_m(logp, logq, log_beta, log1m_beta):
    # log m = log(beta q + (1 - beta) p) as a logaddexp: finite even where q or p underflow
    a = logq + log_beta
    b = logp + log1m_beta
    hi = tl.maximum(a, b)
    return hi + tl.log(1.0 + tl.exp(tl.minimum(a, b) - hi))


@triton.jit
def _log_probs(ptr, cols, n_cols, inv_temp, lse):
    # padded columns load 0 (not -inf: no inf - inf NaNs downstream) and get probability 0
    mask = cols < n_cols
    logp = tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp - lse
    return logp, tl.where(mask, tl.exp(logp), 0.0)


@triton.jit
def _distill_rows_kernel(
    s_ptr, s_stride, t_ptr, t_stride, keep_ptr, loss_ptr, scale_ptr,
    n_cols, inv_temp, loss_scale, beta, log_beta, log1m_beta,
    BLOCK: tl.constexpr, KIND: tl.constexpr, WRITE_GRAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s_ptr += row * s_stride
    t_ptr += row * t_stride
    cols = tl.arange(0, BLOCK)

    if tl.load(keep_ptr + row) == 0:  # unscored token: no loss, zero gradient
        if WRITE_GRAD:
            for off in range(0, n_cols, BLOCK):
                tl.store(s_ptr + off + cols, tl.zeros([BLOCK], tl.float32), mask=off + cols < n_cols)
        tl.store(loss_ptr + row, 0.0)
        return

    # pass 1: both logsumexps, online
    m_s = float("-inf")
    d_s = 0.0
    m_t = float("-inf")
    d_t = 0.0
    for off in range(0, n_cols, BLOCK):
        mask = off + cols < n_cols
        s = tl.load(s_ptr + off + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
        t = tl.load(t_ptr + off + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
        new_s = tl.maximum(m_s, tl.max(s, 0))
        new_t = tl.maximum(m_t, tl.max(t, 0))
        d_s = d_s * tl.exp(m_s - new_s) + tl.sum(tl.exp(s - new_s), 0)
        d_t = d_t * tl.exp(m_t - new_t) + tl.sum(tl.exp(t - new_t), 0)
        m_s = new_s
        m_t = new_t
    lse_s = m_s + tl.log(d_s)
    lse_t = m_t + tl.log(d_t)

    # pass 2: the divergence and c (reverse KL: D; JSD: KL(p||m)); 0 log 0 = 0 via the where()s
    div = 0.0
    c = 0.0
    for off in range(0, n_cols, BLOCK):
        logp, p = _log_probs(s_ptr, off + cols, n_cols, inv_temp, lse_s)
        logq, q = _log_probs(t_ptr, off + cols, n_cols, inv_temp, lse_t)
        if KIND == 0:
            div += tl.sum(tl.where(q > 0, q * (logq - logp), 0.0), 0)
        elif KIND == 1:
            div += tl.sum(tl.where(p > 0, p * (logp - logq), 0.0), 0)
        else:
            logm = _log_m(logp, logq, log_beta, log1m_beta)
            kl_pm = tl.sum(tl.where(p > 0, p * (logp - logm), 0.0), 0)
            kl_qm = tl.sum(tl.where(q > 0, q * (logq - logm), 0.0), 0)
            div += beta * kl_qm + (1.0 - beta) * kl_pm
            c += kl_pm
    if KIND == 1:
        c = div
    tl.store(loss_ptr + row, div * loss_scale)

    # pass 3: dD/dz_S = dD/ds / T, times the mean's T^2 / n (folded into scale by the launcher)
    if WRITE_GRAD:
        scale = tl.load(scale_ptr).to(tl.float32)
        for off in range(0, n_cols, BLOCK):
            logp, p = _log_probs(s_ptr, off + cols, n_cols, inv_temp, lse_s)
            logq, q = _log_probs(t_ptr, off + cols, n_cols, inv_temp, lse_t)
            if KIND == 0:
                g = p - q
            elif KIND == 1:
                g = tl.where(p > 0, p * (logp - logq - c), 0.0)
            else:
                logm = _log_m(logp, logq, log_beta, log1m_beta)
                g = tl.where(p > 0, (1.0 - beta) * p * (logp - logm - c), 0.0)
            tl.store(s_ptr + off + cols, (g * scale).to(s_ptr.dtype.element_ty), mask=off + cols < n_cols)


def distill_rows_(student: Tensor, teacher: Tensor, keep: Tensor, loss: Tensor, grad_scale: Tensor, kind: str,
                  temperature: float, beta: float, write_grad: bool) -> None:
    """Per row: loss[r] = T^2 D(row) (0 where not keep); if write_grad, student[r] <- grad_scale * dD/dz_S.

    `kind` must already be resolved (jsd at beta 0 / 1 is forward / reverse KL, see `_resolve`).
    """
    rows, n_cols = student.shape
    assert teacher.shape == student.shape and student.stride(1) == 1 and teacher.stride(1) == 1
    block = min(MAX_BLOCK, triton.next_power_of_2(n_cols))
    jsd = kind == "jsd"
    _distill_rows_kernel[(rows,)](
        student, student.stride(0), teacher, teacher.stride(0), keep, loss, grad_scale,
        n_cols, 1.0 / temperature, temperature**2, beta,
        math.log(beta) if jsd else 0.0, math.log1p(-beta) if jsd else 0.0,
        BLOCK=block, KIND=_KIND_IDS[kind], WRITE_GRAD=write_grad, num_warps=_utils.num_warps(block),
    )
    LAUNCHES["distill_rows"] += 1


def _resolve(kind: str, beta: float) -> str:
    """The reference special-cases the JSD endpoints (TRL's convention); so do we."""
    if kind == "jsd" and beta == 0:
        return "forward_kl"
    if kind == "jsd" and beta == 1:
        return "reverse_kl"
    if kind == "jsd" and not 0 < beta < 1:
        raise ValueError(f"jsd needs 0 <= beta <= 1, got {beta}")
    return kind


def _forward(sh: Tensor, sw: Tensor, th: Tensor, tw: Tensor, keep: Tensor, kind: str, temperature: float,
             beta: float, chunk_size: int, need_h: bool, need_w: bool) -> tuple[Tensor, Tensor, Tensor]:
    n = sh.shape[0]
    keep = keep.contiguous()  # the kernel reads keep[row] at unit stride
    want_grad = need_h or need_w
    losses = sh.new_empty(n, dtype=torch.float32)
    count = keep.sum().clamp(min=1).float()
    grad_scale = (temperature / count).reshape(1)  # T^2 (Hinton) / T (ds/dz) / n (mean)
    grad_h = torch.empty_like(sh) if need_h else sh.new_empty(0)
    grad_w = sw.new_zeros(sw.shape, dtype=torch.float32) if need_w else None
    for s in range(0, n, chunk_size):
        h = sh[s:s + chunk_size]
        student = h @ sw.T  # (c, V), becomes dD/dz_S in place
        teacher = th[s:s + chunk_size] @ tw.T
        distill_rows_(student, teacher, keep[s:s + chunk_size], losses[s:s + chunk_size], grad_scale, kind,
                      temperature, beta, want_grad)
        if want_grad:
            _ce.accumulate_linear_grads(student, h, sw, grad_h[s:s + chunk_size] if need_h else None, grad_w)
    grad_w = grad_w.to(sw.dtype) if grad_w is not None else sw.new_empty(0)
    return losses.sum() / count, grad_h, grad_w


class FusedLinearDistillFunction(torch.autograd.Function):
    """Inputs: student hidden (N, Hs), student weight (V, Hs), teacher hidden (N, Ht), teacher
    weight (V, Ht), keep (N,) bool, then options. Outputs (loss, grad_sh, grad_sw)."""

    @staticmethod
    def forward(sh, sw, th, tw, keep, kind, temperature, beta, chunk_size, need_h, need_w):
        return _forward(sh, sw, th, tw, keep, kind, temperature, beta, chunk_size, need_h, need_w)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.need = inputs[-2:]
        ctx.save_for_backward(output[1], output[2])

    @staticmethod
    def backward(ctx, grad_loss, _grad_gh, _grad_gw):
        gh, gw = ctx.saved_tensors
        need_h, need_w = ctx.need
        gh = gh * grad_loss.to(gh.dtype) if need_h else None
        gw = gw * grad_loss.to(gw.dtype) if need_w else None
        return gh, gw, None, None, None, None, None, None, None, None, None


@torch.library.custom_op("posttrain::fused_linear_distill", mutates_args=())
def _fused_linear_distill_op(sh: Tensor, sw: Tensor, th: Tensor, tw: Tensor, keep: Tensor, kind: str,
                             temperature: float, beta: float, chunk_size: int, need_h: bool,
                             need_w: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _forward(sh, sw, th, tw, keep, kind, temperature, beta, chunk_size, need_h, need_w)


@_fused_linear_distill_op.register_fake
def _(sh, sw, th, tw, keep, kind, temperature, beta, chunk_size, need_h, need_w):
    return (sh.new_empty((), dtype=torch.float32), torch.empty_like(sh) if need_h else sh.new_empty(0),
            torch.empty_like(sw) if need_w else sw.new_empty(0))


torch.library.register_autograd("posttrain::fused_linear_distill", FusedLinearDistillFunction.backward,
                                setup_context=FusedLinearDistillFunction.setup_context)


def fused_linear_distill(student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor,
                         teacher_weight: Tensor, mask: Tensor | None = None, kind: str = "forward_kl",
                         temperature: float = 1.0, beta: float = 0.5, chunk_size: int | None = None) -> Tensor:
    """Mean over masked tokens of T^2 * D(teacher || student) on `hidden @ weight.T` logits,
    chunked: `core.losses.chunked_distill_loss(..., reduction="mean", scale_by_t2=True)`.

    student_hidden (N..., Hs), student_weight (V, Hs), teacher_hidden (N..., Ht), teacher_weight
    (V, Ht), mask (N...) bool or None (all scored). kind: forward_kl | reverse_kl | jsd (beta
    weighs the teacher in the JSD mixture). Returns an fp32 scalar; only the student gets gradients.
    """
    if kind not in DISTILL_KINDS:
        raise ValueError(f"unknown kind {kind!r}; valid: {', '.join(DISTILL_KINDS)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    lead = student_hidden.shape[:-1]
    if teacher_hidden.shape[:-1] != lead or student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"student hidden {tuple(student_hidden.shape)} / weight {tuple(student_weight.shape)} "
                         f"do not match teacher {tuple(teacher_hidden.shape)} / {tuple(teacher_weight.shape)}")
    if mask is not None and mask.shape != lead:
        raise ValueError(f"mask shape {tuple(mask.shape)} != token shape {tuple(lead)}")
    resolved = _resolve(kind, beta)
    sh = student_hidden.reshape(-1, student_hidden.shape[-1]).contiguous()
    chunk = chunk_size or _ce.default_chunk_size(sh.shape[0], student_weight.shape[0], student_weight.shape[1])
    tensors = (student_hidden, student_weight, teacher_hidden, teacher_weight)
    if not (use_triton(*tensors) and _utils.supported(*tensors)):
        return chunked_distill_loss(student_hidden, student_weight, teacher_hidden, teacher_weight, kind,
                                    temperature, beta, mask, "mean", True, chunk)
    keep = torch.ones(lead, dtype=torch.bool, device=sh.device) if mask is None else mask
    grad = torch.is_grad_enabled()
    loss, _, _ = torch.ops.posttrain.fused_linear_distill(
        sh, student_weight.contiguous(), teacher_hidden.reshape(-1, teacher_hidden.shape[-1]).detach().contiguous(),
        teacher_weight.detach().contiguous(), keep.reshape(-1).contiguous(), resolved, float(temperature),
        float(beta), chunk, grad and student_hidden.requires_grad, grad and student_weight.requires_grad)
    return loss


def fused_linear_logps(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = -100,
                       shift: bool = True, chunk_size: int | None = None) -> Tensor:
    """log p(y_t | x_<t) per position (N...), fp32, 0 where the target is ignored; the lm_head is
    applied chunk by chunk. Same as `core.losses.chunked_token_logps` (sum over the last dim for
    DPO's sequence log-probs)."""
    if not (use_triton(hidden, weight, labels) and _utils.supported(hidden, weight)):
        chunk = chunk_size or 1024
        return chunked_token_logps(hidden, weight, labels, ignore_index, chunk, shift)
    return -_ce.fused_linear_cross_entropy(hidden, weight, labels, ignore_index, "none", shift, chunk_size)
