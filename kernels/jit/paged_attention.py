"""Triton device code of kernels/paged_attention.py: single-query (decode) attention over a
paged KV pool. Only @triton.jit functions live here; the launcher and dispatch are in
kernels/paged_attention.py, which imports this module on the first launch (see
kernels/jit/__init__.py)."""

import triton
import triton.language as tl


@triton.jit
def decode_kernel(
    Q, K, V, O, TABLES, CTX, sm_scale, window, group,
    stride_qs, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_os, stride_oh, stride_ts,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """One program per (sequence, kv head): the `group` query heads sharing that kv head (rows
    of a (BLOCK_G, BLOCK_D) tile) stream the sequence's blocks, BLOCK keys at a time."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx = tl.load(CTX + seq).to(tl.int32)
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < group
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * group + offs_g
    q = tl.load(Q + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # exp(x) = exp2(x log2 e)

    lo = 0
    if HAS_WINDOW:  # blocks wholly before the window hold no visible key: skip them
        lo = tl.maximum(ctx - window, 0) // BLOCK
    hi = tl.cdiv(ctx, BLOCK)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for b in range(lo, hi):
        block_id = tl.load(TABLES + seq.to(tl.int64) * stride_ts + b).to(tl.int64)
        pos = b * BLOCK + offs_n
        valid = pos < ctx
        if HAS_WINDOW:
            valid = valid & (ctx - 1 - pos < window)
        rows = block_id * BLOCK + offs_n
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(K + rows[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(V + rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)
        # one query row per head: a broadcast product, not tl.dot (no 16-row minimum, no MMA to fill)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * qk_scale  # (BLOCK_G, BLOCK), log2 units
        s = tl.where(valid[None, :], s, float("-inf"))
        # the first block of the loop holds key max(ctx - window, 0), visible: m_new is finite from there
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(O + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
