"""Triton device code of kernels/fused_linear_ce.py: the per-row cross entropy (loss and gradient
over the logits). Only @triton.jit functions live here; the launchers, autograd, custom ops and
dispatch are in kernels/fused_linear_ce.py, which imports this module on the first launch (see
kernels/jit/__init__.py)."""

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # tl has no tanh that also runs in the interpreter; exp form saturates cleanly to +-1.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def ce_rows_kernel(
    logits_ptr, logits_stride, target_ptr, loss_ptr, scale_ptr, scale_stride,
    n_cols, ignore_index, softcap,
    BLOCK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, WRITE_GRAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * logits_stride
    target = tl.load(target_ptr + row)
    cols = tl.arange(0, BLOCK)

    if target == ignore_index:  # no loss, zero gradient
        if WRITE_GRAD:
            for off in range(0, n_cols, BLOCK):
                tl.store(logits_ptr + off + cols, tl.zeros([BLOCK], tl.float32), mask=off + cols < n_cols)
        tl.store(loss_ptr + row, 0.0)
        return

    # pass 1: running max m and sum of exp(z - m), rescaled whenever m grows
    m = float("-inf")
    d = 0.0
    for off in range(0, n_cols, BLOCK):
        mask = off + cols < n_cols
        z = tl.load(logits_ptr + off + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z = softcap * _tanh(z / softcap)
        z = tl.where(mask, z, float("-inf"))  # after the softcap: tanh(-inf) would be finite
        m_new = tl.maximum(m, tl.max(z, 0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
    lse = m + tl.log(d)
    z_y = tl.load(logits_ptr + target).to(tl.float32)  # read before pass 2 overwrites it
    if HAS_SOFTCAP:
        z_y = softcap * _tanh(z_y / softcap)
    tl.store(loss_ptr + row, lse - z_y)

    # pass 2: gradient w.r.t. the pre-softcap logits, over the logits buffer
    if WRITE_GRAD:
        scale = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
        for off in range(0, n_cols, BLOCK):
            mask = off + cols < n_cols
            z = tl.load(logits_ptr + off + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                t = _tanh(z / softcap)
                z = softcap * t
            g = tl.exp(z - lse) - tl.where(off + cols == target, 1.0, 0.0)
            if HAS_SOFTCAP:
                g = g * (1.0 - t * t)  # d(c tanh(z / c))/dz
            tl.store(logits_ptr + off + cols, (g * scale).to(logits_ptr.dtype.element_ty), mask=mask)
