"""Triton device code of kernels/flash_attention.py: varlen FlashAttention-2 forward and backward.
Only @triton.jit functions live here; the launchers, autograd, custom ops and dispatch are in
kernels/flash_attention.py, which imports this module on the first launch (see
kernels/jit/__init__.py)."""

import triton
import triton.language as tl


@triton.jit
def fwd_kernel(
    Q, K, V, O, LSE, CU, sm_scale, group,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, PREC: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    doc = tl.program_id(1)
    head = tl.program_id(2)
    bos = tl.load(CU + doc)
    seq_len = tl.load(CU + doc + 1) - bos
    if start_m >= seq_len:  # grid is sized by max_seqlen; shorter documents stop here
        return
    kv_head = head // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_mask = offs_m < seq_len
    rows = (bos + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    qk_scale = sm_scale * 1.4426950408889634  # exp(x) = exp2(x log2 e)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = seq_len
    if CAUSAL:  # key blocks past this query block's last row are fully masked: skip them
        hi = tl.minimum(seq_len, start_m + BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        n_mask = cols < seq_len
        kv_rows = (bos + cols).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + kv_rows[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + kv_rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        valid = n_mask[None, :]
        if CAUSAL:
            valid = valid & (cols[None, :] <= offs_m[:, None])
        s = tl.where(valid, s, float("-inf"))
        # block 0 always holds key 0, visible to every row, so m_new is finite from there on
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(O + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :], acc.to(O.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])
    tl.store(LSE + head * stride_lh + rows, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=m_mask)


@triton.jit
def bwd_delta_kernel(O, DO, DELTA, n_tokens, stride_ot, stride_oh, stride_dt, stride_dh, stride_lh,
                      HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_t < n_tokens)[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = offs_t.to(tl.int64)[:, None]
    o = tl.load(O + rows * stride_ot + head * stride_oh + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + rows * stride_dt + head * stride_dh + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + head * stride_lh + offs_t, tl.sum(o * do, 1), mask=offs_t < n_tokens)


@triton.jit
def bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, CU, sm_scale, group,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, PREC: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    doc = tl.program_id(1)
    kv_head = tl.program_id(2)
    bos = tl.load(CU + doc)
    seq_len = tl.load(CU + doc + 1) - bos
    if start_n >= seq_len:
        return
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    n_mask = cols < seq_len
    kv_rows = (bos + cols).to(tl.int64)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(K + kv_rows[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + kv_rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    lo = 0
    if CAUSAL:  # queries before this key block never see it
        lo = (start_n // BLOCK_M) * BLOCK_M
    for g in range(0, group):  # every query head sharing this kv head (GQA)
        head = kv_head * group + g
        for start_m in range(lo, seq_len, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            m_mask = offs_m < seq_len
            rows = (bos + offs_m).to(tl.int64)
            q_mask = m_mask[:, None] & d_mask[None, :]
            q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
            do = tl.load(DO + rows[:, None] * stride_dot + head * stride_doh + offs_d[None, :], mask=q_mask,
                         other=0.0)
            lse = tl.load(LSE + head * stride_lh + rows, mask=m_mask, other=0.0)
            delta = tl.load(DELTA + head * stride_lh + rows, mask=m_mask, other=0.0)
            # transposed scores (keys x queries): dV and dK then need no transpose of P
            s_t = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale
            p_t = tl.exp2(s_t - lse[None, :] * 1.4426950408889634)
            valid = n_mask[:, None] & m_mask[None, :]
            if CAUSAL:
                valid = valid & (cols[:, None] <= offs_m[None, :])
            p_t = tl.where(valid, p_t, 0.0)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=PREC)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PREC)
    tl.store(DK + kv_rows[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, CU, sm_scale, group,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, PREC: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    doc = tl.program_id(1)
    head = tl.program_id(2)
    bos = tl.load(CU + doc)
    seq_len = tl.load(CU + doc + 1) - bos
    if start_m >= seq_len:
        return
    kv_head = head // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_mask = offs_m < seq_len
    rows = (bos + offs_m).to(tl.int64)
    q_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + rows[:, None] * stride_dot + head * stride_doh + offs_d[None, :], mask=q_mask, other=0.0)
    lse = tl.load(LSE + head * stride_lh + rows, mask=m_mask, other=0.0)
    delta = tl.load(DELTA + head * stride_lh + rows, mask=m_mask, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    hi = seq_len
    if CAUSAL:
        hi = tl.minimum(seq_len, start_m + BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        n_mask = cols < seq_len
        kv_rows = (bos + cols).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + kv_rows[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + kv_rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        p = tl.exp2(s - lse[:, None] * 1.4426950408889634)
        valid = m_mask[:, None] & n_mask[None, :]
        if CAUSAL:
            valid = valid & (cols[None, :] <= offs_m[:, None])
        p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    tl.store(DQ + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)
