"""NF4 quantization of frozen base weights, for QLoRA (Dettmers et al. 2023, arXiv 2305.14314).

A 2-D weight is cut into blocks of 64 consecutive values; each block is scaled by its absmax
into [-1, 1] and every value is replaced by the nearest of the 16 NormalFloat-4 code values
(quantiles of N(0, 1), so a normally distributed weight uses every code equally). Two 4-bit codes
are packed into one byte. Double quantization stores the fp32 absmax scales themselves in 8 bits:
subtract their mean (an fp32 offset, as bitsandbytes does) and quantize blocks of 256 with their
own fp32 absmax. Storage: 4 + 32/64 = 4.5 bits per weight, or 4 + 8/64 + 32/(64*256) ~ 4.127
with double quantization. bitsandbytes quantizes the scales with an 8-bit dynamic-tree code; a
linear symmetric int8 code is used here (same size; the scales are few and well conditioned).

This file is the pure-torch reference; a fused Triton dequantize belongs in kernels/nf4.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

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
        return dequantize_nf4(self, dtype)


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


def dequantize_nf4(t: NF4Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense weight, in `dtype` (default: the dtype the weight was quantized from)."""
    idx = torch.stack([t.packed >> 4, t.packed & 0xF], dim=-1).flatten().long()
    values = NF4_CODE.to(t.packed.device)[idx].view(-1, t.block_size)  # (n_blocks, block)
    values = values * t.block_absmax()[:, None]
    return values.flatten()[: t.numel].view(t.shape).to(dtype or t.dtype)


class _NF4Linear(torch.autograd.Function):
    """y = x W^T with W held in NF4; backward dequantizes W again rather than saving it dense."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: NF4Tensor) -> torch.Tensor:
        ctx.weight = weight  # packed buffers only: a quarter of the dense weight's bf16 bytes
        return F.linear(x, weight.dequantize(x.dtype))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        # The base is frozen: only the input gradient is needed.
        return grad_out @ ctx.weight.dequantize(grad_out.dtype), None


def nf4_linear(x: torch.Tensor, weight: NF4Tensor) -> torch.Tensor:
    """F.linear(x, dequantize(weight)) without keeping the dense weight for backward."""
    return _NF4Linear.apply(x, weight)


class NF4Weight(nn.Module):
    """An NF4Tensor held as buffers, so .to(device), state_dict and FSDP see it."""

    def __init__(self, t: NF4Tensor):
        super().__init__()
        self.shape, self.dtype = t.shape, t.dtype
        self.block_size, self.dq_block_size = t.block_size, t.dq_block_size
        self.register_buffer("packed", t.packed)
        self.register_buffer("absmax", t.absmax)
        if t.double_quant:
            self.register_buffer("absmax_scale", t.absmax_scale)
            self.register_buffer("absmax_offset", t.absmax_offset)

    @property
    def tensor(self) -> NF4Tensor:
        # Rebuilt from the buffers on each access so it follows .to() moves.
        return NF4Tensor(
            self.packed, self.absmax, self.shape, self.dtype, self.block_size,
            getattr(self, "absmax_scale", None), getattr(self, "absmax_offset", None),
            self.dq_block_size,
        )

    @property
    def bits_per_weight(self) -> float:
        return self.tensor.bits_per_weight

    def numel(self) -> int:
        return self.shape.numel()

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_nf4(self.tensor, dtype)

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) must not round the fp32 scales: take only the device from fn.
        for name, buf in self._buffers.items():
            if buf is not None:
                self._buffers[name] = buf.to(fn(buf.new_empty(0)).device)
        return self

    def extra_repr(self) -> str:
        dq = ", double_quant" if hasattr(self, "absmax_scale") else ""
        return f"shape={tuple(self.shape)}, dtype={self.dtype}, block={self.block_size}{dq}"
