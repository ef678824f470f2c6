"""Triton device code of kernels/swiglu.py: SwiGLU forward and backward. Only @triton.jit functions
live here; the launchers, autograd, custom ops and dispatch are in kernels/swiglu.py, which
imports this module on the first launch (see kernels/jit/__init__.py)."""

import triton
import triton.language as tl


@triton.jit
def swiglu_fwd_kernel(G, U, Y, stride_g, stride_u, stride_y, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(
    DY, G, U, DG, DU, stride_dy, stride_g, stride_u, stride_dg, stride_du, n_cols, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(DG + row * stride_dg + cols, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * stride_du + cols, (dy * silu).to(DU.dtype.element_ty), mask=mask)
