"""Triton device code of kernels/lora.py: the fused LoRA matmul and the adapter-gradient reduction.
Only @triton.jit functions live here; the launchers, autograd, custom ops and dispatch are in
kernels/lora.py, which imports this module on the first launch (see kernels/jit/__init__.py)."""

import triton
import triton.language as tl


@triton.jit
def lora_mm_kernel(
    X, W, P, Q, BIAS, SCALES, IDS, C, XP,
    M, N, K, R, n_adapters, scale,
    sxm, sxk, swk, swn, spa, spk, spr, sqa, sqr, sqn, scm, scn, sxpm,
    HAS_BIAS: tl.constexpr, HAS_IDS: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
):
    """C = X W + bias + scale[id] * (X P[id]) Q[id] per row; X (M, K), W (K, N), P (n, K, R),
    Q (n, R, N), all by strides. XP (M, R) receives X P[id]."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rr = tl.arange(0, BR)
    m_mask, n_mask, r_mask = rm < M, rn < N, rr < R
    if HAS_IDS:
        ids = tl.load(IDS + rm, mask=m_mask, other=-1)
    else:
        ids = tl.zeros([BM], dtype=tl.int32)
    rm64 = rm.to(tl.int64)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    xp = tl.zeros([BM, BR], dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        k_mask = rk < K
        x = tl.load(X + rm64[:, None] * sxm + rk[None, :] * sxk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(W + rk[:, None] * swk + rn[None, :] * swn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
        for a in range(0, n_adapters):
            sel = ids == a
            if tl.max(sel.to(tl.int32), axis=0) > 0:  # adapter a has rows in this tile
                p = tl.load(P + a * spa + rk[:, None] * spk + rr[None, :] * spr,
                            mask=k_mask[:, None] & r_mask[None, :], other=0.0)
                part = tl.dot(x, p.to(x.dtype), input_precision=PRECISION)
                xp += tl.where(sel[:, None], part, 0.0)
    # Rounded to the input dtype like F.linear(x, A) would be, then a 16-bit MMA with B.
    xp_lo = xp.to(X.dtype.element_ty)
    if pid_n == 0:  # every column tile has the same xp; one stores it
        tl.store(XP + rm64[:, None] * sxpm + rr[None, :], xp_lo, mask=m_mask[:, None] & r_mask[None, :])
    for a in range(0, n_adapters):
        sel = ids == a
        if tl.max(sel.to(tl.int32), axis=0) > 0:
            if HAS_IDS:
                s = tl.load(SCALES + a)
            else:
                s = scale
            q = tl.load(Q + a * sqa + rr[:, None] * sqr + rn[None, :] * sqn, mask=r_mask[:, None] & n_mask[None, :],
                        other=0.0)
            part = tl.dot(xp_lo, q.to(xp_lo.dtype), input_precision=PRECISION)
            acc += tl.where(sel[:, None], part * s, 0.0)
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(C + rm64[:, None] * scm + rn[None, :] * scn, acc.to(C.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def lora_grad_kernel(
    L, RT, IDS, SCALES, OUT, M, P, Q, scale, slm, slp, srm, srq, soa, sop, soq,
    HAS_IDS: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr, BQ: tl.constexpr,
):
    """OUT[a] (P, Q) = scale[a] * sum over rows m routed to a of L[m]^T RT[m]; L (M, P), RT (M, Q)."""
    pid_p, pid_q, a = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rp = pid_p * BP + tl.arange(0, BP)
    rq = pid_q * BQ + tl.arange(0, BQ)
    p_mask, q_mask = rp < P, rq < Q
    acc = tl.zeros([BP, BQ], dtype=tl.float32)
    for m0 in range(0, M, BM):
        rm = m0 + tl.arange(0, BM)
        if HAS_IDS:
            sel = tl.load(IDS + rm, mask=rm < M, other=-1) == a
        else:
            sel = rm < M
        if tl.max(sel.to(tl.int32), axis=0) > 0:  # skip token blocks without this adapter
            rm64 = rm.to(tl.int64)
            lt = tl.load(L + rm64[:, None] * slm + rp[None, :] * slp, mask=sel[:, None] & p_mask[None, :], other=0.0)
            rt = tl.load(RT + rm64[:, None] * srm + rq[None, :] * srq, mask=sel[:, None] & q_mask[None, :], other=0.0)
            acc = tl.dot(tl.trans(lt), rt.to(lt.dtype), acc, input_precision=PRECISION)
    if HAS_IDS:
        s = tl.load(SCALES + a)
    else:
        s = scale
    tl.store(OUT + a * soa + rp[:, None] * sop + rq[None, :] * soq, (acc * s).to(OUT.dtype.element_ty),
             mask=p_mask[:, None] & q_mask[None, :])
