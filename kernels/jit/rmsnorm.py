"""Triton device code of kernels/rmsnorm.py: RMSNorm forward (optionally fused with the residual
add) and backward. Only @triton.jit functions live here; the launchers, autograd, custom ops and
dispatch are in kernels/rmsnorm.py, which imports this module on the first launch (see
kernels/jit/__init__.py)."""

import triton
import triton.language as tl


@triton.jit
def rms_norm_fwd_kernel(
    X, R, H, Y, W, RSTD, stride_x, stride_r, stride_h, stride_y, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        h_stored = h.to(H.dtype.element_ty)
        tl.store(H + row * stride_h + cols, h_stored, mask=mask)
        h = h_stored.to(tl.float32)  # normalize exactly what the residual stream holds
    rstd = tl.math.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    # Cast to the input dtype before the weight, as the model does (H has the input dtype).
    n = (h * rstd).to(H.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (n * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_bwd_kernel(
    DY, DHN, H, W, RSTD, DX, DW_PART, stride_dy, stride_dhn, stride_h, stride_dx,
    n_rows, n_cols, rows_per_program,
    HAS_DRES: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_program  # int64 rows: row * stride may pass 2**31
    end = tl.minimum(start + rows_per_program, n_rows)
    for row in range(start, end):
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        h = tl.load(H + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        n = h * rstd
        dw += dy * n.to(H.dtype.element_ty).to(tl.float32)
        dn = dy * w
        dh = rstd * (dn - n * (tl.sum(dn * n, axis=0) / n_cols))
        if HAS_DRES:  # h is also an output (the residual stream): its gradient adds here
            dh += tl.load(DHN + row * stride_dhn + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, dh.to(DX.dtype.element_ty), mask=mask)
    # One fp32 partial per program: a deterministic reduction, no atomics.
    tl.store(DW_PART + pid * n_cols + cols, dw, mask=mask)
