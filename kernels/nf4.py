"""NF4 (QLoRA, Dettmers et al. 2023, arXiv 2305.14314): the storage format, its torch reference,
and the Triton dequantization and NF4 linear layer whose matmul dequantizes the weight tile by
tile.

Format. A 2-D weight is cut into blocks of `block_size` (64) consecutive values of the
flattened weight (so a block may straddle two rows); each block is scaled by its absmax into
[-1, 1] and every value is replaced by the nearest of the 16 NormalFloat-4 code values
(quantiles of N(0, 1), so a normally distributed weight uses every code equally). Two 4-bit
codes are packed into one byte: `packed` (uint8, element 2i in the high nibble, 2i+1 in the low
one, the flattened weight zero-padded to whole blocks). Double quantization stores the fp32
absmax scales themselves in 8 bits: subtract their mean (an fp32 offset, as bitsandbytes does)
and quantize blocks of 256 with their own fp32 absmax. Storage: 4 + 32/64 = 4.5 bits per weight,
or 4 + 8/64 + 32/(64*256) ~ 4.127 with double quantization. bitsandbytes quantizes the scales
with an 8-bit dynamic-tree code; a linear symmetric int8 code is used here (same size; the
scales are few and well conditioned). posttrain.core.quant holds it as module buffers (NF4Weight).

    w[i] = NF4_CODE[code(i)] * absmax[i // block_size],  in fp32, then cast to the compute dtype

Double quantization (int8 absmax, fp32 scale per 256 blocks, fp32 offset) is decoded by
NF4Tensor's own `block_absmax` (n_blocks floats, 1/64 of the weight, once per call): torch
divides by a scalar as a true division on CPU but as a reciprocal multiply on CUDA, and only
the same torch code gives the same scales on every device. The rest is one fp32 multiply and
a round-to-nearest cast, so `dequantize_nf4` equals `dequantize_nf4_reference` bit for bit.

`nf4_linear`: y = x W^T + b where each program dequantizes its (BK, BN) tile of W^T on the fly;
the dense W never exists. Backward (x only: the base is frozen) runs the same kernel over W
instead of W^T: dx = dy W. Every row tile dequantizes the same weight tiles again: cheap when
tokens are few; for many tokens a dense dequantize + cuBLAS can be faster (benchmark decides).

Layers: kernels (kernels/jit/nf4.py) -> launchers -> NF4LinearFunction -> `posttrain::nf4_linear`
and `posttrain::nf4_dequantize` custom ops -> `nf4_linear`, `dequantize_nf4` (dispatch).
References: `dequantize_nf4_reference` and F.linear on its result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.kernels import _utils
from posttrain.kernels.dispatch import use_triton

# The published NF4 table (QLoRA appendix E, bitsandbytes `NF4` map), in code order 0..15.
NF4_CODE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
])  # fmt: skip
_EPS = torch.finfo(torch.float32).tiny


@dataclass
class NF4Tensor:
    """A quantized 2-D weight: packed codes, block scales, and the logical shape and dtype."""

    packed: torch.Tensor  # uint8 (padded_numel // 2,), code of element 2i in the high nibble
    absmax: torch.Tensor  # fp32 (n_blocks,); int8 (padded n_blocks,) with double quant
    shape: torch.Size
    dtype: torch.dtype  # the dtype the weight had, the default compute dtype
    block_size: int = 64
    absmax_scale: torch.Tensor | None = None  # fp32 (n_dq_blocks,), double quant only
    absmax_offset: torch.Tensor | None = None  # fp32 scalar, double quant only
    dq_block_size: int = 256

    @property
    def double_quant(self) -> bool:
        return self.absmax_scale is not None

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        parts = [self.packed, self.absmax, self.absmax_scale, self.absmax_offset]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.numel

    def block_absmax(self) -> torch.Tensor:
        """The fp32 absmax of each 64-block (undoing double quantization if it was used)."""
        if not self.double_quant:
            return self.absmax
        n_blocks = -(-self.numel // self.block_size)
        q = self.absmax.float().view(-1, self.dq_block_size) / 127
        return (q * self.absmax_scale[:, None]).flatten()[:n_blocks] + self.absmax_offset

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_nf4_reference(self, dtype)


def quantize_nf4(
    weight: torch.Tensor, block_size: int = 64, double_quant: bool = False, dq_block_size: int = 256
) -> NF4Tensor:
    """Block-wise absmax NF4 quantization of a 2-D weight (the tail block is zero-padded)."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_nf4 expects a 2-D weight, got shape {tuple(weight.shape)}")
    if block_size % 2:
        raise ValueError(f"block_size must be even (two codes per byte), got {block_size}")
    w = weight.detach().float().flatten()
    w = F.pad(w, (0, -w.numel() % block_size)).view(-1, block_size)  # (n_blocks, block)
    absmax = w.abs().amax(dim=1)
    scaled = w / absmax.clamp_min(_EPS)[:, None]
    code = NF4_CODE.to(w.device)
    # Nearest code = the bucket between consecutive midpoints.
    idx = torch.bucketize(scaled, (code[1:] + code[:-1]) / 2).to(torch.uint8).flatten()
    packed = (idx[0::2] << 4) | idx[1::2]
    t = NF4Tensor(packed, absmax, weight.shape, weight.dtype, block_size,
                  dq_block_size=dq_block_size)
    if double_quant:
        offset = absmax.mean()
        a = absmax - offset
        a = F.pad(a, (0, -a.numel() % dq_block_size)).view(-1, dq_block_size)
        scale = a.abs().amax(dim=1)
        q = torch.round(a / scale.clamp_min(_EPS)[:, None] * 127).to(torch.int8)
        t.absmax, t.absmax_scale, t.absmax_offset = q.flatten(), scale, offset
    return t


def dequantize_nf4_reference(t: NF4Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense weight, in `dtype` (default: the dtype the weight was quantized from): pure torch."""
    idx = torch.stack([t.packed >> 4, t.packed & 0xF], dim=-1).flatten().long()
    values = NF4_CODE.to(t.packed.device)[idx].view(-1, t.block_size)  # (n_blocks, block)
    values = values * t.block_absmax()[:, None]
    return values.flatten()[: t.numel].view(t.shape).to(dtype or t.dtype)


# --------------------------------------------------------------------------- Triton paths

LAUNCHES = _utils.counter()
BLOCK_M, BLOCK_N, BLOCK_K = 128, 64, 64  # tile caps; tests shrink them
DEQUANT_BLOCK = 1024
_CODES: dict[torch.device, Tensor] = {}


def _code_table(device: torch.device) -> Tensor:
    # One host->device copy per device, not per call.
    if device not in _CODES:
        _CODES[device] = NF4_CODE.to(device)
    return _CODES[device]


def nf4_dequantize(packed: Tensor, absmax: Tensor, rows: int, cols: int, block_size: int,
                   dtype: torch.dtype) -> Tensor:
    """packed codes + fp32 per-block absmax -> the dense (rows, cols) weight in `dtype`."""
    from posttrain.kernels.jit import nf4 as jit  # device code, imported on first launch
    out = packed.new_empty((rows, cols), dtype=dtype)
    numel = rows * cols
    block = min(DEQUANT_BLOCK, _utils.next_power_of_2(numel))
    jit.nf4_dequantize_kernel[(_utils.cdiv(numel, block),)](
        packed, _code_table(packed.device), absmax, out, numel, BS=block_size, BLOCK=block)
    LAUNCHES["nf4_dequantize"] += 1
    return out


def nf4_matmul(x: Tensor, packed: Tensor, absmax: Tensor, bias: Tensor | None, n_out: int, n_in: int,
               block_size: int, transpose: bool) -> Tensor:
    """x @ W^T + bias (transpose=True, x (N, in)) or x @ W (transpose=False, x (N, out))."""
    from posttrain.kernels.jit import nf4 as jit  # device code, imported on first launch
    m, k = x.shape
    n = n_out if transpose else n_in
    out = x.new_empty(m, n)
    bm, bn, bk = _utils.dot_block(m, BLOCK_M), _utils.dot_block(n, BLOCK_N), _utils.dot_block(k, BLOCK_K)
    s_k, s_n = (1, n_in) if transpose else (n_in, 1)
    jit.nf4_matmul_kernel[(_utils.cdiv(m, bm), _utils.cdiv(n, bn))](
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


# An NF4 weight as the ops take it: an NF4Tensor, or a holder exposing one as `.tensor` (the
# module posttrain.core.quant.NF4Weight keeps its buffers in).
NF4Like = Union[NF4Tensor, Any]


def _as_nf4(weight: NF4Like) -> NF4Tensor:
    return weight if isinstance(weight, NF4Tensor) else weight.tensor


def dequantize_nf4(weight: NF4Like, dtype: torch.dtype | None = None) -> Tensor:
    """The dense weight in `dtype` (default: the dtype it was quantized from); bit-identical to
    `dequantize_nf4_reference`."""
    t = _as_nf4(weight)
    dtype = dtype or t.dtype
    if not use_triton(t.packed) or dtype not in _utils.KERNEL_DTYPES or t.numel == 0:
        return dequantize_nf4_reference(t, dtype)
    rows, cols = t.shape
    return torch.ops.posttrain.nf4_dequantize(t.packed, t.block_absmax(), rows, cols, t.block_size, dtype)


def nf4_linear_reference(x: Tensor, weight: NF4Like, bias: Tensor | None = None) -> Tensor:
    return F.linear(x, dequantize_nf4_reference(_as_nf4(weight), x.dtype), bias)


def nf4_linear(x: Tensor, weight: NF4Like, bias: Tensor | None = None) -> Tensor:
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
