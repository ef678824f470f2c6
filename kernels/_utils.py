"""Host-side helpers shared by the kernels: dtype gate, block sizes, launch counting and the
matmul precision rule. Pure Python and torch: no Triton here (only kernels/jit/ imports it)."""

from __future__ import annotations

import collections
import functools

import torch

# The dtypes the Triton paths are written for; anything else (fp64, ints) takes the reference.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Largest row one program holds in registers (rmsnorm); wider rows take the reference.
MAX_FUSED_SIZE = 65536


def supported(*tensors: torch.Tensor | None) -> bool:
    """True when every floating input is in KERNEL_DTYPES."""
    return all(t is None or not t.is_floating_point() or t.dtype in KERNEL_DTYPES for t in tensors)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (0 for n = 0), as triton.next_power_of_2."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, as triton.cdiv."""
    return (a + b - 1) // b


def counter() -> collections.Counter:
    """A per-module launch counter (kernel name -> launches): tests read it to prove the Triton
    path really ran instead of the reference being compared with itself."""
    return collections.Counter()


def row_block(n: int) -> int:
    """Block covering a whole row of n elements (power of two, as tl.arange requires)."""
    block = next_power_of_2(n)
    if block > MAX_FUSED_SIZE:
        raise ValueError(f"row of {n} elements exceeds MAX_FUSED_SIZE={MAX_FUSED_SIZE}")
    return block


def num_warps(block: int) -> int:
    # Liger's rule: one warp per 256-ish elements of a row, capped at 32 warps.
    return 4 if block < 2048 else 8 if block < 8192 else 16 if block < 32768 else 32


def dot_block(n: int, cap: int) -> int:
    """Tile edge for tl.dot: a power of two >= 16 (the MMA minimum), no larger than needed."""
    return max(16, min(cap, next_power_of_2(n)))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def reduction_programs(device: torch.device, rows: int) -> int:
    """Programs for a row-reduction (weight grads): about one per SM on a GPU, a few in the
    interpreter (each program runs sequentially there), never more than rows."""
    n = 4 * _sm_count(device.index or 0) if device.type == "cuda" else 4
    return max(1, min(rows, n))


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: fp32 follows torch's matmul precision ("highest" = IEEE, else
    TF32) so the Triton path rounds as torch's matmul in the same process does; 16-bit inputs
    are exact in either mode."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) as a 2-D (N, D) view with unit stride on D (a copy only when it must)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()
