"""Triton device code of kernels/rope.py: the RoPE rotation (forward and its transpose). Only
@triton.jit functions live here; the launchers, autograd, custom ops and dispatch are in
kernels/rope.py, which imports this module on the first launch (see kernels/jit/__init__.py)."""

import triton
import triton.language as tl


@triton.jit
def rope_kernel(
    X, Y, COS, SIN, stride_b, stride_h, stride_t, sc_b, sc_t, ss_b, ss_t, seq_len, n_heads, half,
    BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // seq_len).to(tl.int64)
    t = (pid % seq_len).to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :]
    heads = tl.arange(0, BLOCK_H)[:, None]
    dmask = d < half
    c1 = tl.load(COS + b * sc_b + t * sc_t + d, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + b * sc_b + t * sc_t + half + d, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + b * ss_b + t * ss_t + d, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + b * ss_b + t * ss_t + half + d, mask=dmask, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose of the forward map is the forward map with (s1, s2) -> (-s2, -s1)
        s1, s2 = -s2, -s1
    mask = (heads < n_heads) & dmask
    off = b * stride_b + t * stride_t + heads * stride_h + d
    x1 = tl.load(X + off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + off + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + off, (c1 * x1 - s1 * x2).to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + off + half, (c2 * x2 + s2 * x1).to(Y.dtype.element_ty), mask=mask)
