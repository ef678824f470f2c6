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

Layers: kernels (kernels/jit/flash_attention.py) -> launchers (`_forward`, `_backward`) ->
`FlashAttnVarlenFunction` -> `posttrain::flash_attn_varlen_fwd/_bwd` custom ops ->
`flash_attn_varlen` (dispatch).
Reference: `flash_attn_varlen_reference` (per-document SDPA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.kernels import _utils
from posttrain.kernels.dispatch import interpreting, use_triton

LAUNCHES = _utils.counter()


def _meta(q: Tensor, causal: bool) -> dict:
    """Compile-time constants shared by the kernels."""
    return dict(HEAD_DIM=q.shape[-1], BLOCK_D=max(16, _utils.next_power_of_2(q.shape[-1])), CAUSAL=causal,
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
    from posttrain.kernels.jit import flash_attention as jit  # device code, imported on first launch
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    n_tokens, n_heads, _ = q.shape
    n_docs = cu_seqlens.numel() - 1
    out = torch.empty_like(q)
    lse = q.new_empty((n_heads, n_tokens), dtype=torch.float32)
    if n_tokens == 0 or n_docs == 0 or max_seqlen == 0:
        return out, lse
    block_m, block_n = _blocks("fwd")
    grid = (_utils.cdiv(max_seqlen, block_m), n_docs, n_heads)
    jit.fwd_kernel[grid](q, k, v, out, lse, cu_seqlens, scale, n_heads // k.shape[1],
                      q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                      out.stride(0), out.stride(1), lse.stride(0),
                      BLOCK_M=block_m, BLOCK_N=block_n, **_meta(q, causal), num_warps=4 if q.shape[-1] <= 64 else 8)
    LAUNCHES["fwd"] += 1
    return out, lse


def _backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
              max_seqlen: int, causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    from posttrain.kernels.jit import flash_attention as jit  # device code, imported on first launch
    q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))  # dq, dk, dv reuse these strides
    n_tokens, n_heads, head_dim = q.shape
    n_docs = cu_seqlens.numel() - 1
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if n_tokens == 0 or n_docs == 0 or max_seqlen == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    meta = _meta(q, causal)
    delta = torch.empty_like(lse)
    jit.bwd_delta_kernel[(_utils.cdiv(n_tokens, 64), n_heads)](
        out, dout, delta, n_tokens, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), delta.stride(0),
        HEAD_DIM=head_dim, BLOCK_T=64, BLOCK_D=meta["BLOCK_D"])
    group = n_heads // k.shape[1]
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               dout.stride(0), dout.stride(1), lse.stride(0))
    warps = 4 if head_dim <= 64 else 8
    block_m, block_n = _blocks("dkdv")
    jit.bwd_dkdv_kernel[(_utils.cdiv(max_seqlen, block_n), n_docs, k.shape[1])](
        q, k, v, dout, dk, dv, lse, delta, cu_seqlens, scale, group, *strides,
        BLOCK_M=block_m, BLOCK_N=block_n, **meta, num_warps=warps)
    block_m, block_n = _blocks("dq")
    jit.bwd_dq_kernel[(_utils.cdiv(max_seqlen, block_m), n_docs, n_heads)](
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


def flash_attn_varlen_applies(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether `flash_attn_varlen` with these inputs runs the Triton kernel (CUDA, or the CPU under
    TRITON_INTERPRET=1, in a dtype the kernels take), not the per-document reference; a caller
    with a cheaper path of its own for the other case asks this."""
    return use_triton(q, k, v) and _utils.supported(q, k, v)


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
