"""Triton device code of kernels/nf4.py: NF4 dequantization and the dequantize-on-the-fly matmul.
Only @triton.jit functions live here; the launchers, autograd, custom ops and dispatch are in
kernels/nf4.py, which imports this module on the first launch (see kernels/jit/__init__.py)."""

import triton
import triton.language as tl


@triton.jit
def _nf4_values(PACKED, CODE, ABSMAX, flat, mask, BS: tl.constexpr):
    """fp32 weights at flat indices `flat` (int64): nibble -> NF4 code value -> times absmax."""
    byte = tl.load(PACKED + (flat >> 1), mask=mask, other=0).to(tl.int32)
    code = tl.where((flat & 1) == 0, byte >> 4, byte & 0xF)
    return tl.load(CODE + code) * tl.load(ABSMAX + flat // BS, mask=mask, other=0.0)


@triton.jit
def nf4_dequantize_kernel(PACKED, CODE, ABSMAX, OUT, numel, BS: tl.constexpr, BLOCK: tl.constexpr):
    flat = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = flat < numel
    w = _nf4_values(PACKED, CODE, ABSMAX, flat, mask, BS)
    tl.store(OUT + flat, w.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def nf4_matmul_kernel(
    X, PACKED, CODE, ABSMAX, BIAS, C, M, N, K, sxm, sxk, s_k, s_n, scm, scn,
    HAS_BIAS: tl.constexpr, BS: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """C = X @ B (+ bias) with B[k, n] the NF4 weight at flat index k * s_k + n * s_n:
    (s_k, s_n) = (1, in) reads W^T (forward), (in, 1) reads W (input gradient)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_mask, n_mask = rm < M, rn < N
    rm64, rn64 = rm.to(tl.int64), rn.to(tl.int64)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        k_mask = rk < K
        x = tl.load(X + rm64[:, None] * sxm + rk[None, :] * sxk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        flat = rk.to(tl.int64)[:, None] * s_k + rn64[None, :] * s_n
        w = _nf4_values(PACKED, CODE, ABSMAX, flat, k_mask[:, None] & n_mask[None, :], BS)
        # Rounded to x's dtype exactly as dequantize_nf4(t, x.dtype) is, then a 16-bit MMA.
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(C + rm64[:, None] * scm + rn[None, :] * scn, acc.to(C.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])
