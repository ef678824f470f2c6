"""NF4 dequantization (QLoRA, Dettmers et al. 2023, arXiv 2305.14314) and an NF4 linear layer
whose matmul dequantizes the weight tile by tile.

Storage is core.quant's NF4Tensor, read as is: `packed` (uint8, element 2i in the high nibble,
2i+1 in the low one, the flattened weight zero-padded to whole blocks) and one absmax per block of
`block_size` consecutive elements of the flattened weight (so a block may straddle two rows).

    w[i] = NF4_CODE[code(i)] * absmax[i // block_size],  in fp32, then cast to the compute dtype

Double quantization (int8 absmax, fp32 scale per 256 blocks, fp32 offset) is decoded by
core.quant's own `block_absmax` (n_blocks floats, 1/64 of the weight, once per call): torch
divides by a scalar as a true division on CPU but as a reciprocal multiply on CUDA, and only
the same torch code gives the same scales on every device. The rest is one fp32 multiply and
a round-to-nearest cast, so `dequantize_nf4` equals core.quant.dequantize_nf4 bit for bit.

`nf4_linear`: y = x W^T + b where each program dequantizes its (BK, BN) tile of W^T on the fly;
the dense W never exists. Backward (x only: the base is frozen) runs the same kernel over W
instead of W^T: dx = dy W. Every row tile dequantizes the same weight tiles again: cheap when
tokens are few; for many tokens a dense dequantize + cuBLAS can be faster (benchmark decides).

Layers: kernels -> launchers -> NF4LinearFunction -> `posttrain::nf4_linear` and
`posttrain::nf4_dequantize` custom ops -> `nf4_linear`, `dequantize_nf4` (dispatch).
References: core.quant.dequantize_nf4 and F.linear on its result.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from core.quant import NF4_CODE, NF4Tensor, NF4Weight
from core.quant import dequantize_nf4 as _dequantize_reference
from kernels import _utils
from kernels.dispatch import use_triton

LAUNCHES = _utils.counter()
BLOCK_M, BLOCK_N, BLOCK_K = 128, 64, 64  # tile caps; tests shrink them
DEQUANT_BLOCK = 1024
_CODES: dict[torch.device, Tensor] = {}


@triton.jit
def _nf4_values(PACKED, CODE, ABSMAX, flat, mask, BS: tl.constexpr):
    """fp32 weights at flat indices `flat` (int64): nibble -> NF4 code value -> times absmax."""
    byte = tl.load(PACKED + (flat >> 1), mask=mask, other=0).to(tl.int32)
    code = tl.where((flat & 1) == 0, byte >> 4, byte & 0xF)
    return tl.load(CODE + code) * tl.load(ABSMAX + flat // BS, mask=mask, other=0.0)


@triton.jit
def _nf4_dequantize_kernel(PACKED, CODE, ABSMAX, OUT, numel, BS: tl.constexpr, BLOCK: tl.constexpr):
    flat = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = flat < numel
    w = _nf4_values(PACKED, CODE, ABSMAX, flat, mask, BS)
    tl.store(OUT + flat, w.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _nf4_matmul_kernel(
    X, PACKED, CODE, ABSMAX, BIAS, C, M, N, K, sxm, sxk, s_k, s_n, scm, scn,
    HAS_BIAS: tl.constexpr, BS: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """C = X @ B (+ bias) with B[k, n] the NF4 weight at flat index k * s_k + n * s_n:
    (s_k, s_n) = (1, in) reads W^T (forward), (in, 1) reads W (input gradient)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_mask, n_mask = rm < M, rn < N
    rm64, rn64 = rm.to(tl.int64), rn.to(tl.int64)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        k_mask = rk < K
        x = tl.load(X + rm64[:, None] * sxm + rk[None, :] * sxk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        flat = rk.to(tl.int64)[:, None] * s_k + rn64[None, :] * s_n
        w = _nf4_values(PACKED, CODE, ABSMAX, flat, k_mask[:, None] & n_mask[None, :], BS)
        # Rounded to x's dtype exactly as dequantize_nf4(t, x.dtype) is, then a 16-bit MMA.
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(C + rm64[:, None] * scm + rn[None, :] * scn, acc.to(C.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def _code_table(device: torch.device) -> Tensor:
    # One host->device copy per device, not per call.
    if device not in _CODES:
        _CODES[device] = NF4_CODE.to(device)
    return _CODES[device]


def nf4_dequantize(packed: Tensor, absmax: Tensor, rows: int, cols: int, block_size: int,
                   dtype: torch.dtype) -> Tensor:
    """packed codes + fp32 per-block absmax -> the dense (rows, cols) weight in `dtype`."""
    out = packed.new_empty((rows, cols), dtype=dtype)
    numel = rows * cols
    block = min(DEQUANT_BLOCK, triton.next_power_of_2(numel))
    _nf4_dequantize_kernel[(triton.cdiv(numel, block),)](
        packed, _code_table(packed.device), absmax, out, numel, BS=block_size, BLOCK=block)
    LAUNCHES["nf4_dequantize"] += 1
    return out


def nf4_matmul(x: Tensor, packed: Tensor, absmax: Tensor, bias: Tensor | None, n_out: int, n_in: int,
               block_size: int, transpose: bool) -> Tensor:
    """x @ W^T + bias (transpose=True, x (N, in)) or x @ W (transpose=False, x (N, out))."""
    m, k = x.shape
    n = n_out if transpose else n_in
    out = x.new_empty(m, n)
    bm, bn, bk = _utils.dot_block(m, BLOCK_M), _utils.dot_block(n, BLOCK_N), _utils.dot_block(k, BLOCK_K)
    s_k, s_n = (1, n_in) if transpose else (n_in, 1)
    _nf4_matmul_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, packed, _code_table(x.device), absmax, bias if bias is not None else x, out,
        m, n, k, x.stride(0), x.stride(1), s_k, s_n, out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, BS=block_size, PRECISION=_utils.dot_precision(x.dtype),
        BM=bm, BN=bn, BK=bk, num_warps=4 if bm * bn <= 4096 else 8,
    )
    LAUNCHES["nf4_matmul_fwd" if transpose else "nf4_matmul_bwd"] += 1
    return out


class NF4LinearFunction(torch.autograd.Function):
    """y = x W^T + b, W in NF4; saves the packed codes and fp32 block scales (~4.5 bits/weight),
    never a dense W; backward re-dequantizes tile by tile. No gradient for W or b (frozen)."""

    @staticmethod
    def forward(x, packed, absmax, bias, n_out, block_size):
        return nf4_matmul(x, packed, absmax, bias, n_out, x.shape[1], block_size, transpose=True)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, packed, absmax, _, _, block_size = inputs
        ctx.save_for_backward(packed, absmax)
        ctx.n_in, ctx.block_size = x.shape[1], block_size

    @staticmethod
    def backward(ctx, dy):
        packed, absmax = ctx.saved_tensors
        dx = torch.ops.posttrain.nf4_linear_backward(dy, packed, absmax, ctx.n_in, ctx.block_size)
        return dx, None, None, None, None, None


@torch.library.custom_op("posttrain::nf4_linear", mutates_args=())
def _nf4_linear_op(x: Tensor, packed: Tensor, absmax: Tensor, bias: Optional[Tensor], n_out: int,
                   block_size: int) -> Tensor:
    return NF4LinearFunction.forward(x, packed, absmax, bias, n_out, block_size)


@_nf4_linear_op.register_fake
def _(x, packed, absmax, bias, n_out, block_size):
    return x.new_empty(x.shape[0], n_out)


@torch.library.custom_op("posttrain::nf4_linear_backward", mutates_args=())
def _nf4_linear_backward_op(dy: Tensor, packed: Tensor, absmax: Tensor, n_in: int, block_size: int) -> Tensor:
    dy = _utils.as_rows(dy)
    return nf4_matmul(dy, packed, absmax, None, dy.shape[1], n_in, block_size, transpose=False)


@_nf4_linear_backward_op.register_fake
def _(dy, packed, absmax, n_in, block_size):
    return dy.new_empty(dy.shape[0], n_in)


@torch.library.custom_op("posttrain::nf4_dequantize", mutates_args=())
def _nf4_dequantize_op(packed: Tensor, absmax: Tensor, rows: int, cols: int, block_size: int,
                       dtype: torch.dtype) -> Tensor:
    return nf4_dequantize(packed, absmax, rows, cols, block_size, dtype)


@_nf4_dequantize_op.register_fake
def _(packed, absmax, rows, cols, block_size, dtype):
    return packed.new_empty((rows, cols), dtype=dtype)


torch.library.register_autograd("posttrain::nf4_linear", NF4LinearFunction.backward,
                                setup_context=NF4LinearFunction.setup_context)


def _as_nf4(weight: Union[NF4Tensor, NF4Weight]) -> NF4Tensor:
    return weight.tensor if isinstance(weight, NF4Weight) else weight


def dequantize_nf4(weight: Union[NF4Tensor, NF4Weight], dtype: torch.dtype | None = None) -> Tensor:
    """The dense weight in `dtype` (default: the dtype it was quantized from); bit-identical to
    core.quant.dequantize_nf4."""
    t = _as_nf4(weight)
    dtype = dtype or t.dtype
    if not use_triton(t.packed) or dtype not in _utils.KERNEL_DTYPES or t.numel == 0:
        return _dequantize_reference(t, dtype)
    rows, cols = t.shape
    return torch.ops.posttrain.nf4_dequantize(t.packed, t.block_absmax(), rows, cols, t.block_size, dtype)


def nf4_linear_reference(x: Tensor, weight: Union[NF4Tensor, NF4Weight], bias: Tensor | None = None) -> Tensor:
    return F.linear(x, _dequantize_reference(_as_nf4(weight), x.dtype), bias)


def nf4_linear(x: Tensor, weight: Union[NF4Tensor, NF4Weight], bias: Tensor | None = None) -> Tensor:
    """F.linear(x, dequantize_nf4(weight, x.dtype), bias) for x (..., in) without a dense weight
    in memory, forward or backward. Gradients flow to x only."""
    t = _as_nf4(weight)
    n_out, n_in = t.shape
    if x.shape[-1] != n_in or (bias is not None and bias.shape != (n_out,)):
        raise ValueError(f"nf4_linear: x {tuple(x.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not fit a ({n_out}, {n_in}) weight")
    tensors = (x, t.packed) + ((bias,) if bias is not None else ())
    if (not use_triton(*tensors) or not _utils.supported(x, bias) or x.numel() == 0
            or (bias is not None and bias.requires_grad)):
        return nf4_linear_reference(x, t, bias)
    y = torch.ops.posttrain.nf4_linear(_utils.as_rows(x), t.packed, t.block_absmax(), bias, n_out, t.block_size)
    return y.view(*x.shape[:-1], n_out)
