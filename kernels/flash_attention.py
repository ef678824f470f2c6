"""Variable-length (packed) causal attention: FlashAttention-2 forward and backward in Triton.

Packed batches put documents back to back in one (total_tokens, heads, head_dim) tensor with
`cu_seqlens` (n_docs + 1,) the prefix sums of their lengths; attention never crosses a document
boundary, and no (T, T) score matrix or padding ever exists. FlashAttention-2 (Dao 2023,
arXiv 2307.08691):

    forward   per (query block, document, head): stream key/value blocks, online softmax in
              base 2, keep O and the row logsumexp L (natural log, fp32, (heads, total_tokens))
    backward  delta = rowsum(dO * O), then with P = exp(scale * Q K^T - L):
              dV = P^T dO,  dS = P * (dO V^T - delta),  dK = scale dS^T Q,  dQ = scale dS K
              one kernel per (key block, document, kv head) accumulates dK, dV over every query
              block and every query head of its GQA group (no atomics, no per-q-head copies);
              a second kernel per (query block, document, head) accumulates dQ.

Head dims that are not a power of two (24, 40, 80, ...) are padded to BLOCK_D with masked loads.
Causal masking is top-left aligned within each document (SDPA's is_causal for equal lengths).

Layers: kernels -> launchers (`_forward`, `_backward`) -> `FlashAttnVarlenFunction` ->
`posttrain::flash_attn_varlen_fwd/_bwd` custom ops -> `flash_attn_varlen` (dispatch).
Reference: `flash_attn_varlen_reference` (per-document SDPA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from kernels import _utils
from kernels.dispatch import interpreting, use_triton

LAUNCHES = _utils.counter()


@triton.jit
def _fwd_kernel(
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
def _bwd_delta_kernel(O, DO, DELTA, n_tokens, stride_ot, stride_oh, stride_dt, stride_dh, stride_lh,
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
def _bwd_dkdv_kernel(
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
def _bwd_dq_kernel(
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


def _meta(q: Tensor, causal: bool) -> dict:
    """Compile-time constants shared by the kernels."""
    return dict(HEAD_DIM=q.shape[-1], BLOCK_D=max(16, triton.next_power_of_2(q.shape[-1])), CAUSAL=causal,
                PREC=_utils.dot_precision(q.dtype))


# (BLOCK_M, BLOCK_N) per kernel: queries x keys. dK/dV hold a (BLOCK_N, D) pair of fp32
# accumulators while streaming queries, so their query blocks are narrow; dQ mirrors that.
BLOCKS = {"fwd": (64, 64), "dkdv": (32, 64), "dq": (64, 32)}
# The interpreter runs each block op in numpy: smaller blocks of the same aspect ratios keep the
# tests fast, make tiny documents span several blocks, and still cover unequal M and N.
INTERPRETER_BLOCKS = {"fwd": (16, 16), "dkdv": (16, 32), "dq": (32, 16)}


def _blocks(kernel: str) -> tuple[int, int]:
    return (INTERPRETER_BLOCKS if interpreting() else BLOCKS)[kernel]


def _forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, causal: bool,
             scale: float) -> tuple[Tensor, Tensor]:
    # contiguous: the kernels index outputs (and dq, dk, dv in backward) with the inputs' strides
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    n_tokens, n_heads, _ = q.shape
    n_docs = cu_seqlens.numel() - 1
    out = torch.empty_like(q)
    lse = q.new_empty((n_heads, n_tokens), dtype=torch.float32)
    if n_tokens == 0 or n_docs == 0 or max_seqlen == 0:
        return out, lse
    block_m, block_n = _blocks("fwd")
    grid = (triton.cdiv(max_seqlen, block_m), n_docs, n_heads)
    _fwd_kernel[grid](q, k, v, out, lse, cu_seqlens, scale, n_heads // k.shape[1],
                      q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                      out.stride(0), out.stride(1), lse.stride(0),
                      BLOCK_M=block_m, BLOCK_N=block_n, **_meta(q, causal), num_warps=4 if q.shape[-1] <= 64 else 8)
    LAUNCHES["fwd"] += 1
    return out, lse


def _backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
              max_seqlen: int, causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))  # dq, dk, dv reuse these strides
    n_tokens, n_heads, head_dim = q.shape
    n_docs = cu_seqlens.numel() - 1
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if n_tokens == 0 or n_docs == 0 or max_seqlen == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    meta = _meta(q, causal)
    delta = torch.empty_like(lse)
    _bwd_delta_kernel[(triton.cdiv(n_tokens, 64), n_heads)](
        out, dout, delta, n_tokens, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), delta.stride(0),
        HEAD_DIM=head_dim, BLOCK_T=64, BLOCK_D=meta["BLOCK_D"])
    group = n_heads // k.shape[1]
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               dout.stride(0), dout.stride(1), lse.stride(0))
    warps = 4 if head_dim <= 64 else 8
    block_m, block_n = _blocks("dkdv")
    _bwd_dkdv_kernel[(triton.cdiv(max_seqlen, block_n), n_docs, k.shape[1])](
        q, k, v, dout, dk, dv, lse, delta, cu_seqlens, scale, group, *strides,
        BLOCK_M=block_m, BLOCK_N=block_n, **meta, num_warps=warps)
    block_m, block_n = _blocks("dq")
    _bwd_dq_kernel[(triton.cdiv(max_seqlen, block_m), n_docs, n_heads)](
        q, k, v, dout, dq, lse, delta, cu_seqlens, scale, group, *strides,
        BLOCK_M=block_m, BLOCK_N=block_n, **meta, num_warps=warps)
    LAUNCHES["bwd"] += 1
    return dq, dk, dv


class FlashAttnVarlenFunction(torch.autograd.Function):
    """(q, k, v, cu_seqlens, max_seqlen, causal, scale) -> (out, lse); lse is not differentiable."""

    @staticmethod
    def forward(q, k, v, cu_seqlens, max_seqlen, causal, scale):
        return _forward(q, k, v, cu_seqlens, max_seqlen, causal, scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, cu_seqlens, max_seqlen, causal, scale = inputs
        ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens)
        ctx.opts = (max_seqlen, causal, scale)

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = torch.ops.posttrain.flash_attn_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens, *ctx.opts)
        return dq, dk, dv, None, None, None, None


@torch.library.custom_op("posttrain::flash_attn_varlen_fwd", mutates_args=())
def _fwd_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, causal: bool,
            scale: float) -> tuple[Tensor, Tensor]:
    return _forward(q, k, v, cu_seqlens, max_seqlen, causal, scale)


@_fwd_op.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, causal, scale):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("posttrain::flash_attn_varlen_bwd", mutates_args=())
def _bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
            max_seqlen: int, causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return _backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, scale)


@_bwd_op.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


torch.library.register_autograd("posttrain::flash_attn_varlen_fwd", FlashAttnVarlenFunction.backward,
                                setup_context=FlashAttnVarlenFunction.setup_context)


def flash_attn_varlen_reference(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, causal: bool = True,
                                softmax_scale: float | None = None) -> Tensor:
    """Per-document SDPA on the same packed layout; GQA by repeating each kv head over its group."""
    group = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens must run from 0 to total_tokens={q.shape[0]}, got {bounds[0]}..{bounds[-1]}")
    parts = [q.new_empty((0, *q.shape[1:]))]
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e == s:
            continue
        qd = q[s:e].transpose(0, 1)  # (heads, L, hd)
        kd = k[s:e].transpose(0, 1).repeat_interleave(group, dim=0)
        vd = v[s:e].transpose(0, 1).repeat_interleave(group, dim=0)
        parts.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=softmax_scale).transpose(0, 1))
    return torch.cat(parts)


def flash_attn_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, causal: bool = True,
                      softmax_scale: float | None = None) -> Tensor:
    """Attention over packed documents: q (total_tokens, n_heads, hd), k/v (total_tokens,
    n_kv_heads, hd) with n_heads a multiple of n_kv_heads, cu_seqlens int32 (n_docs + 1,) from 0
    to total_tokens, max_seqlen >= the longest document (it sizes the grid; not checked, to avoid
    a device sync). softmax_scale defaults to hd ** -0.5. Returns (total_tokens, n_heads, hd).
    """
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"expected q (T, H, D) and k, v (T, H_kv, D); got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"n_heads {q.shape[1]} is not a multiple of n_kv_heads {k.shape[1]}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be 1-D int32, got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    if not (use_triton(q, k, v, cu_seqlens) and _utils.supported(q, k, v)):
        return flash_attn_varlen_reference(q, k, v, cu_seqlens, causal, scale)
    if cu_seqlens.numel() - 1 > 65535:
        raise ValueError(f"at most 65535 documents per call (CUDA grid limit), got {cu_seqlens.numel() - 1}")
    return torch.ops.posttrain.flash_attn_varlen_fwd(q, k, v, cu_seqlens, int(max_seqlen), causal, scale)[0]
