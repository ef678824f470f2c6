"""posttrain kernels: Triton ops beside their torch references; each public op dispatches on
`kernels.dispatch.use_triton` (Triton on CUDA, or on CPU under TRITON_INTERPRET=1)."""

from kernels.lora import lora_linear, lora_linear_multi
from kernels.nf4 import dequantize_nf4, nf4_linear
from kernels.rmsnorm import rms_norm
from kernels.rope import apply_rope
from kernels.swiglu import swiglu
from kernels.flash_attention import flash_attn_varlen
from kernels.fused_linear_ce import fused_linear_cross_entropy
from kernels.fused_linear_kl import fused_linear_distill, fused_linear_logps
