"""LoRA linear (Hu et al. 2021, arXiv 2106.09685) with the low-rank path fused into the base matmul.

    y = x W^T + b + s * (x A^T) B^T        W (out, in) frozen, A (r, in), B (out, r)

One kernel computes a (BM, BN) tile of y: its K loop accumulates x W^T and, from the same x
tile, x A^T (BM, r); the epilogue adds s * (x A^T) B^T and the bias. x is read once for both
paths and the (N, out) LoRA product never exists in memory. x A^T is recomputed by each column
tile (r/BN extra flops, a few percent) instead of being a separate launch and round trip; the
column-0 tiles store it for backward (dB needs it).

Backward has the same shape with W, A, B transposed, so the same kernel serves it:
    dx = dy W + s * (dy B) A          (stores dy B for dA)
    dA = s * (dy B)^T x,   dB = s * dy^T (x A^T)     (a token-reduction kernel)
W and b are frozen: no gradient (a trainable base takes the reference path).

Multi-adapter (several LoRAs trained in one batch): A (n, r, in), B (n, out, r), scales (n,) and
adapter_ids (N,) route each row to its adapter; ids outside [0, n) (e.g. -1) get none. A tile's
rows may belong to several adapters: each adapter present in the tile contributes a masked dot
(rows of one sequence share an adapter, so a tile rarely holds more than two), and absent ones
are skipped. Adapters of different ranks are zero-padded to one r by the caller.

Layers: kernels (kernels/jit/lora.py) -> `lora_fwd` / `lora_bwd` launchers ->
LoRALinearFunction / LoRALinearMultiFunction -> `posttrain::lora_linear[_multi]` custom ops ->
`lora_linear`, `lora_linear_multi` (dispatch). References: `lora_linear_reference`,
`lora_linear_multi_reference`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from posttrain.kernels import _utils
from posttrain.kernels.dispatch import lean_autograd, use_triton
from posttrain.kernels.swiglu import swiglu, swiglu_backward_torch

LAUNCHES = _utils.counter()
# Tile caps; module-level so tests can shrink them and cover several tiles on tiny shapes.
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32


def _mm(x, w, w_strides, p, p_strides, q, q_strides, rank, bias, scale, scales, ids, out, xp):
    """Launch _lora_mm_kernel: out = x @ w + bias + scale * (x @ p) @ q, xp = x @ p."""
    from posttrain.kernels.jit import lora as jit  # device code, imported on first launch
    (m, k), n = x.shape, out.shape[1]
    bm, bn, bk = _utils.dot_block(m, BLOCK_M), _utils.dot_block(n, BLOCK_N), _utils.dot_block(k, BLOCK_K)
    grid = (_utils.cdiv(m, bm), _utils.cdiv(n, bn))
    jit.lora_mm_kernel[grid](
        x, w, p, q, bias if bias is not None else x, scales if scales is not None else x,
        ids if ids is not None else x, out, xp,
        m, n, k, rank, p.shape[0], scale,
        x.stride(0), x.stride(1), *w_strides, *p_strides, *q_strides, out.stride(0), out.stride(1), xp.stride(0),
        HAS_BIAS=bias is not None, HAS_IDS=ids is not None,
        PRECISION=_utils.dot_precision(x.dtype), BM=bm, BN=bn, BK=bk, BR=_utils.dot_block(rank, 1 << 30),
        num_warps=4 if bm * bn <= 4096 else 8,
    )


def _grad(left, right, ids, scale, scales, out):
    """Launch _lora_grad_kernel: out[a] = scale[a] * left[rows of a]^T @ right[rows of a]."""
    from posttrain.kernels.jit import lora as jit  # device code, imported on first launch
    m, p, q = left.shape[0], out.shape[1], out.shape[2]
    bp, bq, bm = _utils.dot_block(p, BLOCK_N), _utils.dot_block(q, BLOCK_N), _utils.dot_block(m, BLOCK_M)
    jit.lora_grad_kernel[(_utils.cdiv(p, bp), _utils.cdiv(q, bq), out.shape[0])](
        left, right, ids if ids is not None else left, scales if scales is not None else left, out,
        m, p, q, scale, left.stride(0), left.stride(1), right.stride(0), right.stride(1), *out.stride(),
        HAS_IDS=ids is not None, PRECISION=_utils.dot_precision(left.dtype), BM=bm, BP=bp, BQ=bq,
    )


def lora_fwd(x, weight, bias, lora_a, lora_b, scale, scales, ids) -> tuple[Tensor, Tensor]:
    """x (N, in), weight (out, in), lora_a (n, r, in), lora_b (n, out, r) -> y (N, out), xa (N, r)."""
    (m, _), (n_out, rank) = x.shape, lora_b.shape[1:]
    y = x.new_empty(m, n_out)
    xa = x.new_empty(m, rank)
    _mm(x, weight, (weight.stride(1), weight.stride(0)),  # W^T (in, out)
        lora_a, (lora_a.stride(0), lora_a.stride(2), lora_a.stride(1)),  # A^T (n, in, r)
        lora_b, (lora_b.stride(0), lora_b.stride(2), lora_b.stride(1)),  # B^T (n, r, out)
        rank, bias, scale, scales, ids, y, xa)
    LAUNCHES["lora_fwd"] += 1
    return y, xa


def lora_bwd(dy, x, weight, lora_a, lora_b, xa, scale, scales, ids) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dx, dA, dB) of lora_fwd, given the saved x A^T."""
    rank = lora_a.shape[1]
    dy = _utils.as_rows(dy)
    dx = torch.empty_like(x)
    dyb = dy.new_empty(dy.shape[0], rank)
    _mm(dy, weight, (weight.stride(0), weight.stride(1)),  # W (out, in)
        lora_b, (lora_b.stride(0), lora_b.stride(1), lora_b.stride(2)),  # B (n, out, r)
        lora_a, (lora_a.stride(0), lora_a.stride(1), lora_a.stride(2)),  # A (n, r, in)
        rank, None, scale, scales, ids, dx, dyb)
    da, db = torch.empty_like(lora_a), torch.empty_like(lora_b)
    _grad(dyb, x, ids, scale, scales, da)  # dA[a] = s_a (dy B)^T x
    _grad(dy, xa, ids, scale, scales, db)  # dB[a] = s_a dy^T (x A^T)
    LAUNCHES["lora_bwd"] += 1
    return dx, da, db


class LoRALinearFunction(torch.autograd.Function):
    """One adapter: lora_a (r, in), lora_b (out, r), a float scale. Outputs (y, xa): x A^T
    rides along as an output so the custom op stays functional; only y is used."""

    @staticmethod
    def forward(x, weight, bias, lora_a, lora_b, scale):
        return lora_fwd(x, weight, bias, lora_a[None], lora_b[None], scale, None, None)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, _, lora_a, lora_b, scale = inputs
        ctx.save_for_backward(x, weight, lora_a, lora_b, output[1])
        ctx.scale = scale

    @staticmethod
    def backward(ctx, dy, _dxa):
        x, weight, lora_a, lora_b, xa = ctx.saved_tensors
        dx, da, db = torch.ops.posttrain.lora_linear_backward(dy, x, weight, lora_a, lora_b, xa, ctx.scale)
        return dx, None, None, da, db, None


class LoRALinearMultiFunction(torch.autograd.Function):
    """Several adapters: lora_a (n, r, in), lora_b (n, out, r), scales (n,), adapter_ids (N,)."""

    @staticmethod
    def forward(x, weight, bias, lora_a, lora_b, scales, adapter_ids):
        return lora_fwd(x, weight, bias, lora_a, lora_b, 1.0, scales, adapter_ids)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, _, lora_a, lora_b, scales, ids = inputs
        ctx.save_for_backward(x, weight, lora_a, lora_b, output[1], scales, ids)

    @staticmethod
    def backward(ctx, dy, _dxa):
        dx, da, db = torch.ops.posttrain.lora_linear_multi_backward(dy, *ctx.saved_tensors)
        return dx, None, None, da, db, None, None


@torch.library.custom_op("posttrain::lora_linear", mutates_args=())
def _lora_linear_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], lora_a: Tensor, lora_b: Tensor,
                    scale: float) -> tuple[Tensor, Tensor]:
    return LoRALinearFunction.forward(x, weight, bias, lora_a, lora_b, scale)


@_lora_linear_op.register_fake
def _(x, weight, bias, lora_a, lora_b, scale):
    return x.new_empty(x.shape[0], weight.shape[0]), x.new_empty(x.shape[0], lora_a.shape[-2])


@torch.library.custom_op("posttrain::lora_linear_backward", mutates_args=())
def _lora_linear_backward_op(dy: Tensor, x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, xa: Tensor,
                             scale: float) -> tuple[Tensor, Tensor, Tensor]:
    dx, da, db = lora_bwd(dy, x, weight, lora_a[None], lora_b[None], xa, scale, None, None)
    return dx, da[0], db[0]


@_lora_linear_backward_op.register_fake
def _(dy, x, weight, lora_a, lora_b, xa, scale):
    return torch.empty_like(x), torch.empty_like(lora_a), torch.empty_like(lora_b)


@torch.library.custom_op("posttrain::lora_linear_multi", mutates_args=())
def _lora_linear_multi_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], lora_a: Tensor, lora_b: Tensor,
                          scales: Tensor, adapter_ids: Tensor) -> tuple[Tensor, Tensor]:
    return LoRALinearMultiFunction.forward(x, weight, bias, lora_a, lora_b, scales, adapter_ids)


@_lora_linear_multi_op.register_fake
def _(x, weight, bias, lora_a, lora_b, scales, adapter_ids):
    return x.new_empty(x.shape[0], weight.shape[0]), x.new_empty(x.shape[0], lora_a.shape[-2])


@torch.library.custom_op("posttrain::lora_linear_multi_backward", mutates_args=())
def _lora_linear_multi_backward_op(dy: Tensor, x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor,
                                   xa: Tensor, scales: Tensor, adapter_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return lora_bwd(dy, x, weight, lora_a, lora_b, xa, 1.0, scales, adapter_ids)


@_lora_linear_multi_backward_op.register_fake
def _(dy, x, weight, lora_a, lora_b, xa, scales, adapter_ids):
    return torch.empty_like(x), torch.empty_like(lora_a), torch.empty_like(lora_b)


torch.library.register_autograd("posttrain::lora_linear", LoRALinearFunction.backward,
                                setup_context=LoRALinearFunction.setup_context)
torch.library.register_autograd("posttrain::lora_linear_multi", LoRALinearMultiFunction.backward,
                                setup_context=LoRALinearMultiFunction.setup_context)


def lora_linear_reference(x, weight, bias, lora_a, lora_b, scale, dropout: float = 0.0):
    """What posttrain.core.lora.LoRALinear computes for one adapter (dropout: training-time, on the
    low-rank path's input, as peft applies lora_dropout)."""
    xd = F.dropout(x, dropout) if dropout > 0 else x
    return F.linear(x, weight, bias) + scale * F.linear(F.linear(xd, lora_a), lora_b)


def lora_linear_multi_reference(x, weight, bias, lora_a, lora_b, scales, adapter_ids):
    """Row i gets adapter adapter_ids[i]; ids outside [0, n) get none. One masked LoRA per
    adapter (n small): static shapes, no gather of per-row (r, in) matrices."""
    y = F.linear(x, weight, bias)
    for a in range(lora_a.shape[0]):
        rows = (adapter_ids == a).unsqueeze(-1)
        lora = F.linear(F.linear(x, lora_a[a]), lora_b[a])
        y = y + torch.where(rows, scales[a].to(lora.dtype) * lora, 0)
    return y


def _frozen(weight: Tensor, bias: Tensor | None) -> bool:
    # A trainable base (W or b with requires_grad) needs dW, which neither the kernels nor the
    # torch Functions compute.
    return not weight.requires_grad and (bias is None or not bias.requires_grad)


def _use_kernel(x, weight, bias, lora_a, lora_b) -> bool:
    tensors = (x, weight, lora_a, lora_b) + ((bias,) if bias is not None else ())
    return _frozen(weight, bias) and use_triton(*tensors) and _utils.supported(*tensors) and x.numel() > 0


def _check(x, weight, bias, lora_a, lora_b, n_dims):
    n_out, n_in = weight.shape
    rank = lora_a.shape[-2]
    if (x.shape[-1] != n_in or lora_a.dim() != n_dims or lora_b.dim() != n_dims or lora_a.shape[-1] != n_in
            or lora_b.shape[-2:] != (n_out, rank) or (bias is not None and bias.shape != (n_out,))):
        raise ValueError(f"lora_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}, lora_a "
                         f"{tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)} do not fit (..., in), (out, in), "
                         f"{'(n, ' if n_dims == 3 else '('}r, in), {'(n, ' if n_dims == 3 else '('}out, r)")


def _dropout_mask(x: Tensor, p: float) -> Tensor | None:
    """Which elements of x the LoRA path keeps (bool, 1 byte each), or None without dropout."""
    return torch.empty_like(x, dtype=torch.bool).bernoulli_(1 - p) if p > 0 else None


def _dropped(x: Tensor, keep: Tensor | None, p: float) -> Tensor:
    """Inverted dropout with a given mask: x * keep / (1 - p); x itself without a mask."""
    return x if keep is None else (x * keep).mul_(1 / (1 - p))


def _lora_fwd_torch(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                    scale: float, xd: Tensor) -> tuple[Tensor, Tensor]:
    """x (N, in) -> (x W^T + b + s (xd A^T) B^T, xd A^T), the low-rank term added in place;
    xd is x or its dropped-out copy (the low-rank path's input)."""
    y = F.linear(x, weight, bias)
    xa = xd @ lora_a.T
    return y.addmm_(xa, lora_b.T, alpha=scale), xa


def _lora_bwd_torch(dy: Tensor, xd: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, xa: Tensor,
                    scale: float, needs: tuple[bool, bool, bool], keep: Tensor | None = None, p: float = 0.0
                    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """dx = dy W + s drop((dy B) A),  dA = s (dy B)^T xd,  dB = s dy^T (xd A^T), for the needed
    ones of (x, A, B); dy, xd (N, *) 2-D; drop() applies the forward's mask."""
    need_x, need_a, need_b = needs
    dyb = dy @ lora_b if need_x or need_a else None
    dx = None
    if need_x:
        dx = dy @ weight
        if keep is None:
            dx.addmm_(dyb, lora_a, alpha=scale)
        else:
            dx.add_(_dropped(dyb @ lora_a, keep, p), alpha=scale)
    da = (dyb.T @ xd).mul_(scale) if need_a else None
    db = (dy.T @ xa).mul_(scale) if need_b else None
    return dx, da, db


class LoRALinearTorchFunction(torch.autograd.Function):
    """lora_linear in plain torch where the Triton kernel does not run: the kernel's saved state
    (x and the rank-r x A^T) and in-place accumulation of the low-rank terms, where autograd
    through the reference adds two more (N, out) passes each way. With dropout p, the low-rank
    path sees x * keep / (1 - p) and only the boolean mask is kept for backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scale, p=0.0):
        x2 = x.reshape(-1, x.shape[-1])
        keep = _dropout_mask(x2, p)
        y, xa = _lora_fwd_torch(x2, weight, bias, lora_a, lora_b, scale, _dropped(x2, keep, p))
        ctx.save_for_backward(x2, weight, lora_a, lora_b, xa, keep)
        ctx.scale, ctx.p, ctx.x_shape = scale, p, x.shape
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x2, weight, lora_a, lora_b, xa, keep = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx, da, db = _lora_bwd_torch(dy.reshape(-1, dy.shape[-1]), _dropped(x2, keep, ctx.p), weight, lora_a,
                                     lora_b, xa, ctx.scale, (need[0], need[3], need[4]), keep, ctx.p)
        return None if dx is None else dx.view(ctx.x_shape), None, None, da, db, None, None


class SwiGLULoRALinearTorchFunction(torch.autograd.Function):
    """lora_linear(silu(gate) * up, ...): a LoRA down projection fed by SwiGLU, saving gate and up
    only. The product h, which the projection's low-rank gradient needs (dA = s (dy B)^T h), is
    recomputed in backward from gate and up (elementwise, no matmul), so the MLP keeps 2 of its
    3 intermediate-sized activations (plus a boolean dropout mask when p > 0)."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, lora_a, lora_b, scale, p=0.0):
        g2, u2 = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])
        h = F.silu(g2) * u2
        keep = _dropout_mask(h, p)
        y, xa = _lora_fwd_torch(h, weight, bias, lora_a, lora_b, scale, _dropped(h, keep, p))
        ctx.save_for_backward(g2, u2, weight, lora_a, lora_b, xa, keep)
        ctx.scale, ctx.p, ctx.in_shape = scale, p, gate.shape
        return y.view(*gate.shape[:-1], weight.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        g2, u2, weight, lora_a, lora_b, xa, keep = ctx.saved_tensors
        silu = F.silu(g2)
        h = silu * u2  # the forward's product, recomputed
        need_gate, need_up = ctx.needs_input_grad[:2]
        dh, da, db = _lora_bwd_torch(dy.reshape(-1, dy.shape[-1]), _dropped(h, keep, ctx.p), weight, lora_a, lora_b,
                                     xa, ctx.scale, (need_gate or need_up, *ctx.needs_input_grad[4:6]), keep, ctx.p)
        del h
        dgate = dup = None
        if dh is not None:
            dgate, dup = swiglu_backward_torch(dh, g2, u2, need_gate, need_up, silu)
        return (None if dgate is None else dgate.view(ctx.in_shape), None if dup is None else dup.view(ctx.in_shape),
                None, None, da, db, None, None)


def _lean_torch_path(weight: Tensor, bias: Tensor | None, *tensors: Tensor) -> bool:
    # The torch Functions: frozen base, non-empty input, eager autograd (lean_autograd), outside
    # autocast regions (whose per-op casts the in-place accumulation would bypass).
    x = tensors[0]
    return (_frozen(weight, bias) and x.numel() > 0 and lean_autograd(*tensors)
            and not torch.is_autocast_enabled(x.device.type))


def _as_activations(x: Tensor, lora_a: Tensor, lora_b: Tensor) -> tuple[Tensor, Tensor]:
    """float32 master adapters (mixed precision) on a 16-bit base, outside autocast (validation,
    sampling): the low-rank path runs in the activations' dtype (a differentiable cast)."""
    if lora_a.dtype != x.dtype and x.is_floating_point() and not torch.is_autocast_enabled(x.device.type):
        return lora_a.to(x.dtype), lora_b.to(x.dtype)
    return lora_a, lora_b


def lora_linear(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                scale: float, dropout: float = 0.0) -> Tensor:
    """x W^T + b + scale * (drop(x) A^T) B^T. x (..., in), weight (out, in) frozen, bias (out,)
    or None, lora_a (r, in), lora_b (out, r); dropout: the training-time dropout probability on
    the low-rank path's input (peft's lora_dropout; pass 0 in eval). Gradients flow to x, lora_a
    and lora_b."""
    _check(x, weight, bias, lora_a, lora_b, 2)
    lora_a, lora_b = _as_activations(x, lora_a, lora_b)
    if dropout > 0 or not _use_kernel(x, weight, bias, lora_a, lora_b):
        if _lean_torch_path(weight, bias, x, lora_a, lora_b):
            return LoRALinearTorchFunction.apply(x, weight, bias, lora_a, lora_b, float(scale), float(dropout))
        return lora_linear_reference(x, weight, bias, lora_a, lora_b, scale, dropout)
    y, _ = torch.ops.posttrain.lora_linear(_utils.as_rows(x), weight, bias, lora_a, lora_b, float(scale))
    return y.view(*x.shape[:-1], weight.shape[0])


def swiglu_lora_linear(gate: Tensor, up: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor,
                       lora_b: Tensor, scale: float, dropout: float = 0.0) -> Tensor:
    """lora_linear(silu(gate) * up, weight, bias, lora_a, lora_b, scale, dropout): an MLP's
    SwiGLU and its LoRA down projection. The Triton kernels where they run; elsewhere, in
    training, one torch Function that does not keep the (N, intermediate) product for backward."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu_lora_linear: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    _check(gate, weight, bias, lora_a, lora_b, 2)
    lora_a, lora_b = _as_activations(gate, lora_a, lora_b)
    kernel = dropout == 0 and use_triton(gate, up, weight, lora_a, lora_b)
    if not kernel and _lean_torch_path(weight, bias, gate, up, lora_a, lora_b):
        return SwiGLULoRALinearTorchFunction.apply(gate, up, weight, bias, lora_a, lora_b, float(scale),
                                                   float(dropout))
    return lora_linear(swiglu(gate, up), weight, bias, lora_a, lora_b, scale, dropout)


def lora_linear_multi(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                      scales: Tensor, adapter_ids: Tensor) -> Tensor:
    """Per-row adapters: x (..., in), lora_a (n, r, in), lora_b (n, out, r), scales (n,),
    adapter_ids (...) int, one per row of x; an id outside [0, n) (e.g. -1) means no adapter."""
    _check(x, weight, bias, lora_a, lora_b, 3)
    if adapter_ids.shape != x.shape[:-1] and adapter_ids.numel() != x.numel() // x.shape[-1]:
        raise ValueError(f"adapter_ids {tuple(adapter_ids.shape)} must give one id per row of x {tuple(x.shape)}")
    if scales.shape != (lora_a.shape[0],):
        raise ValueError(f"scales {tuple(scales.shape)} must be ({lora_a.shape[0]},), one per adapter")
    ids = adapter_ids.reshape(x.shape[:-1])
    if not _use_kernel(x, weight, bias, lora_a, lora_b):
        return lora_linear_multi_reference(x, weight, bias, lora_a, lora_b, scales, ids)
    y, _ = torch.ops.posttrain.lora_linear_multi(
        _utils.as_rows(x), weight, bias, lora_a, lora_b, scales.float().contiguous(),
        ids.reshape(-1).to(torch.int32).contiguous())
    return y.view(*x.shape[:-1], weight.shape[0])
