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
  `chunked_distill_loss` with its defaults), so the scalar upstream gradient lets forward
  accumulate d/dhidden and d/dweight chunk by chunk; backward rescales them.

The teacher is a constant: its inputs get no gradient (the reference would give one).
Device code: kernels/jit/fused_linear_kl.py. Torch paths and references:
`posttrain.kernels.chunked_losses.chunked_distill_loss` / `chunked_token_logps`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posttrain.kernels import _utils
from posttrain.kernels import fused_linear_ce as _ce
from posttrain.kernels.chunked_losses import DISTILL_KINDS, check_choice, chunked_distill_loss, chunked_token_logps
from posttrain.kernels.dispatch import use_triton

LAUNCHES = _utils.counter()
MAX_BLOCK = 8192  # per-program vocab block; tests shrink it to run the online passes over blocks
_KIND_IDS = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}


def distill_rows_(student: Tensor, teacher: Tensor, keep: Tensor, loss: Tensor, grad_scale: Tensor, kind: str,
                  temperature: float, beta: float, write_grad: bool) -> None:
    """Per row: loss[r] = T^2 D(row) (0 where not keep); if write_grad, student[r] <- grad_scale * dD/dz_S.

    `kind` must already be resolved (jsd at beta 0 / 1 is forward / reverse KL, see `_resolve`).
    """
    from posttrain.kernels.jit import fused_linear_kl as jit  # device code, imported on first launch
    rows, n_cols = student.shape
    assert teacher.shape == student.shape and student.stride(1) == 1 and teacher.stride(1) == 1
    block = min(MAX_BLOCK, _utils.next_power_of_2(n_cols))
    jsd = kind == "jsd"
    jit.distill_rows_kernel[(rows,)](
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
    chunked: `posttrain.kernels.chunked_losses.chunked_distill_loss(..., reduction="mean", scale_by_t2=True)`.

    student_hidden (N..., Hs), student_weight (V, Hs), teacher_hidden (N..., Ht), teacher_weight
    (V, Ht), mask (N...) bool or None (all scored). kind: forward_kl | reverse_kl | jsd (beta
    weighs the teacher in the JSD mixture). Returns an fp32 scalar; only the student gets gradients.
    """
    check_choice("kind", kind, DISTILL_KINDS)
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
    applied chunk by chunk. Same as `posttrain.kernels.chunked_losses.chunked_token_logps` (sum over the last dim for
    DPO's sequence log-probs)."""
    if not (use_triton(hidden, weight, labels) and _utils.supported(hidden, weight)):
        chunk = chunk_size or 1024
        return chunked_token_logps(hidden, weight, labels, ignore_index, chunk, shift)
    return -_ce.fused_linear_cross_entropy(hidden, weight, labels, ignore_index, "none", shift, chunk_size)
