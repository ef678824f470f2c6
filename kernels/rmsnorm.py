"""RMSNorm (Zhang & Sennrich 2019, arXiv 1910.07467), optionally fused with the residual add.

    h = x (+ residual)                 the new residual stream, in the input dtype
    y = weight * (h * rsqrt(mean(h^2) + eps)).to(h.dtype)

The numerics follow posttrain.core.model.layers.RMSNorm (HF's convention): normalize in fp32, cast to the
input dtype, then scale by the weight. The fused add rounds h to its dtype *before* normalizing,
so `rms_norm(x, w, eps, r)` equals `RMSNorm(x + r)` of the unfused model, not a more accurate
variant that would drift from it.

Backward, with n = h * rstd and dn = dy * weight (the cast treated as identity):
    dh = rstd * (dn - n * mean(dn * n))     (+ the gradient flowing into the residual output)
    dweight = sum_rows dy * n.to(dtype)     (fp32 partial sums per program, then one torch sum)

Layers: kernels (kernels/jit/rmsnorm.py) -> launchers -> RMSNormFunction / AddRMSNormFunction
-> `posttrain::rms_norm`, `posttrain::add_rms_norm` custom ops -> `rms_norm` (dispatch).
Reference: `rms_norm_reference`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from posttrain.kernels import _utils
from posttrain.kernels.dispatch import lean_autograd, use_triton

LAUNCHES = _utils.counter()


def rms_norm_fwd(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
    """x, residual (N, D) with unit stride on D -> y (N, D), h (N, D) or None, rstd (N,) fp32."""
    from posttrain.kernels.jit import rmsnorm as jit  # device code, imported on first launch
    n_rows, n_cols = x.shape
    h_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    y = x.new_empty(x.shape, dtype=torch.promote_types(h_dtype, weight.dtype))
    h = None if residual is None else x.new_empty(x.shape, dtype=h_dtype)
    rstd = x.new_empty(n_rows, dtype=torch.float32)
    block = _utils.row_block(n_cols)
    r, hh = (x, x) if residual is None else (residual, h)  # placeholders, unused without residual
    jit.rms_norm_fwd_kernel[(n_rows,)](
        x, r, hh, y, weight, rstd, x.stride(0), r.stride(0), hh.stride(0), y.stride(0), n_cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_utils.num_warps(block),
    )
    LAUNCHES["rms_norm_fwd"] += 1
    return y, h, rstd


def rms_norm_bwd(dy: Tensor, dh_next: Tensor | None, h: Tensor, weight: Tensor, rstd: Tensor):
    """Gradients (dx, dweight) given dy, the gradient of the residual output (or None), the
    normalized input h and rstd saved by forward."""
    from posttrain.kernels.jit import rmsnorm as jit  # device code, imported on first launch
    n_rows, n_cols = h.shape
    dy = _utils.as_rows(dy)
    dx = torch.empty_like(h)
    programs = _utils.reduction_programs(h.device, n_rows)
    dw_part = h.new_empty((programs, n_cols), dtype=torch.float32)
    dhn = dy if dh_next is None else _utils.as_rows(dh_next)
    block = _utils.row_block(n_cols)
    jit.rms_norm_bwd_kernel[(programs,)](
        dy, dhn, h, weight, rstd, dx, dw_part, dy.stride(0), dhn.stride(0), h.stride(0), dx.stride(0),
        n_rows, n_cols, _utils.cdiv(n_rows, programs),
        HAS_DRES=dh_next is not None, BLOCK=block, num_warps=_utils.num_warps(block),
    )
    LAUNCHES["rms_norm_bwd"] += 1
    return dx, dw_part.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """y = rms_norm(x); saves x and the fp32 rstd (one float per row), not the normalized x."""

    @staticmethod
    def forward(x, weight, eps):
        y, _, rstd = rms_norm_fwd(x, weight, eps)
        return y, rstd

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, _ = inputs
        ctx.save_for_backward(x, weight, output[1])

    @staticmethod
    def backward(ctx, dy, _drstd):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = torch.ops.posttrain.rms_norm_backward(dy, None, x, weight, rstd)
        return dx, dw, None


class AddRMSNormFunction(torch.autograd.Function):
    """(y, h) = rms_norm(x + residual); x and residual receive the same gradient dh."""

    @staticmethod
    def forward(x, residual, weight, eps):
        return rms_norm_fwd(x, weight, eps, residual)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, _, weight, _ = inputs
        ctx.save_for_backward(output[1], weight, output[2])

    @staticmethod
    def backward(ctx, dy, dh, _drstd):
        h, weight, rstd = ctx.saved_tensors
        dx, dw = torch.ops.posttrain.rms_norm_backward(dy, dh, h, weight, rstd)
        return dx, dx, dw, None


@torch.library.custom_op("posttrain::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return RMSNormFunction.forward(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return (x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)),
            x.new_empty(x.shape[0], dtype=torch.float32))


@torch.library.custom_op("posttrain::add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return AddRMSNormFunction.forward(x, residual, weight, eps)


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    h_dtype = torch.promote_types(x.dtype, residual.dtype)
    return (x.new_empty(x.shape, dtype=torch.promote_types(h_dtype, weight.dtype)),
            x.new_empty(x.shape, dtype=h_dtype), x.new_empty(x.shape[0], dtype=torch.float32))


@torch.library.custom_op("posttrain::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(dy: Tensor, dh_next: Optional[Tensor], h: Tensor, weight: Tensor,
                          rstd: Tensor) -> tuple[Tensor, Tensor]:
    return rms_norm_bwd(dy, dh_next, h, weight, rstd)


@_rms_norm_backward_op.register_fake
def _(dy, dh_next, h, weight, rstd):
    return torch.empty_like(h), torch.empty_like(weight)


torch.library.register_autograd("posttrain::rms_norm", RMSNormFunction.backward,
                                setup_context=RMSNormFunction.setup_context)
torch.library.register_autograd("posttrain::add_rms_norm", AddRMSNormFunction.backward,
                                setup_context=AddRMSNormFunction.setup_context)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
    """Pure torch, the numerics of posttrain.core.model.layers.RMSNorm (and of x + residual before it)."""
    h = x if residual is None else x + residual
    hf = h.to(torch.promote_types(h.dtype, torch.float32))  # fp32 math, or fp64 for fp64 inputs
    y = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return y if residual is None else (y, h)


class RMSNormTorchFunction(torch.autograd.Function):
    """The reference's numerics in plain torch, for devices without the Triton kernel, with the
    kernel's memory: saves x and rstd (one fp32 per row), where autograd through the reference
    keeps x, the normalized x and rstd. Backward (xh = x * rstd, g = dy * weight in fp32):
        dx = rstd * (g - xh * mean(g * xh)),   dweight = sum over rows of dy * xh."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        xh = x.to(rstd.dtype) * rstd
        dx = dw = None
        if ctx.needs_input_grad[0]:
            g = (dy * weight).to(rstd.dtype)
            dx = (rstd * (g - xh * (g * xh).mean(-1, keepdim=True))).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = (dy * xh.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        return dx, dw, None


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
    """RMSNorm over the last dim of x (..., D) with weight (D,). With `residual` (same shape as
    x), normalizes h = x + residual and returns (y, h): h is the new residual stream."""
    if x.shape[-1] != weight.shape[-1] or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)}, residual "
                         f"{None if residual is None else tuple(residual.shape)} do not match")
    inputs = (x, weight) if residual is None else (x, weight, residual)
    if (not use_triton(*inputs) or not _utils.supported(*inputs)
            or x.shape[-1] > _utils.MAX_FUSED_SIZE or x.numel() == 0):
        if residual is None and lean_autograd(x, weight):
            return RMSNormTorchFunction.apply(x, weight, eps)
        return rms_norm_reference(x, weight, eps, residual)
    x2 = _utils.as_rows(x)
    if residual is None:
        y, _ = torch.ops.posttrain.rms_norm(x2, weight.contiguous(), eps)
        return y.view(x.shape)
    y, h, _ = torch.ops.posttrain.add_rms_norm(x2, _utils.as_rows(residual), weight.contiguous(), eps)
    return y.view(x.shape), h.view(x.shape)
