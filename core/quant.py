"""NF4 quantization of frozen base weights, for QLoRA (Dettmers et al. 2023, arXiv 2305.14314).

The storage format (the NF4 code table, `NF4Tensor`, `quantize_nf4` and the pure-torch
`dequantize_nf4`) is defined beside its Triton kernels in kernels/nf4.py, which explains it, and
is re-exported here. This module adds what the model needs on top: `NF4Weight`, an NF4Tensor held
as module buffers, and `nf4_linear`, a linear layer that keeps no dense weight for backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.nf4 import NF4_CODE, NF4Tensor, quantize_nf4  # noqa: F401
from kernels.nf4 import dequantize_nf4_reference as dequantize_nf4


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
