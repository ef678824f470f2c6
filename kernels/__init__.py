"""posttrain kernels: Triton ops beside their torch references; each public op dispatches on
`posttrain.kernels.dispatch.use_triton` (Triton on CUDA, or on CPU under TRITON_INTERPRET=1; the kernels
mode "torch" forces the torch paths, see kernels/dispatch.py).

A leaf package: it imports torch, the standard library and Triton, never core, stages, flows or
registry (core calls kernels, never the reverse; tests/kernels/test_import_rules_kernels.py checks it).
Triton itself is imported only by the device code in kernels/jit/, on a kernel's first launch,
so everything here imports and runs its torch paths where Triton is not installed."""

from posttrain.kernels.lora import lora_linear, lora_linear_multi
from posttrain.kernels.nf4 import dequantize_nf4, nf4_linear
from posttrain.kernels.rmsnorm import rms_norm
from posttrain.kernels.rope import apply_rope
from posttrain.kernels.swiglu import swiglu
from posttrain.kernels.flash_attention import flash_attn_varlen
from posttrain.kernels.paged_attention import paged_decode_attention
from posttrain.kernels.fused_linear_ce import fused_linear_cross_entropy
from posttrain.kernels.fused_linear_kl import fused_linear_distill, fused_linear_logps
