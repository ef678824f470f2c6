"""Dense building blocks shared by the dense and MoE blocks."""

from __future__ import annotations

import torch
from torch import nn

from posttrain.core.lora import LoRALinear
from posttrain.kernels.lora import swiglu_lora_linear
from posttrain.kernels.rmsnorm import rms_norm
from posttrain.kernels.swiglu import swiglu


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32, scale in the input dtype (what HF checkpoints were trained with);
        # the Triton kernel on GPUs, its torch reference elsewhere.
        return rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        down = self.down_proj
        lora = down.fusable_lora() if isinstance(down, LoRALinear) else None
        if lora is not None:  # LoRA on down_proj: one op that need not keep silu(gate) * up for backward
            return swiglu_lora_linear(gate, up, *lora)
        return down(swiglu(gate, up))
