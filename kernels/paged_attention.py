"""Decode attention over a paged KV cache: one query per sequence, keys and values read straight
from the block pool through the sequence's block table (no gathered copy, no padding, no mask
tensor).

Layout (posttrain.core.generation.paged.PagedKVCache, one layer): k_pool, v_pool (num_blocks * block_size,
H_kv, D); block b owns rows b * block_size .. (b + 1) * block_size - 1; token t of sequence s is
row block_tables[s, t // block_size] * block_size + t % block_size. The query of sequence s is
its newest token, at position ctx_lens[s] - 1, so it sees keys j <= ctx_lens[s] - 1 (all of
them: causality adds nothing) and, with a sliding window, only those with ctx - 1 - j < window.

Kernel (kernels/jit/paged_attention.py): one program per (sequence, kv head) holds the
H / H_kv query heads of that kv head's GQA group as the rows of one tile, so each K/V block is
loaded once per group. It walks the sequence's blocks (BLOCK = block_size keys each: the block
size must be a power of two, as tl.arange needs), from the first block the window reaches to
ceil(ctx / block_size): loads the block id from the table, the (BLOCK, D) key and value tiles
(masked by position < ctx and the window, so no slot past ctx_len and no table entry past
ceil(ctx / block_size) is read), and folds them into an online softmax in fp32 (base 2, running
max m, normaliser l and output accumulator, rescaled by exp2(m_old - m_new) per block: Milakov &
Gimelshein 2018, as in FlashAttention). Scores are a broadcast product summed over D, not tl.dot:
one query row per head leaves nothing for a matrix unit. Head dims that are not a power of two
(24, 40, 80, ...) are padded to BLOCK_D with masked loads. The output is cast to q's dtype.

Inference only: the kernel has no backward. When autograd would differentiate the call (grad
enabled and an input requires grad) the torch path runs instead, as it does off CUDA (unless
TRITON_INTERPRET=1), for dtypes other than fp32/bf16/fp16, and for a block size that is not a
power of two.
Reference: `paged_decode_reference` (gather through the table, mask, softmax; fp32).
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.kernels import _utils
from posttrain.kernels.dispatch import use_triton

LAUNCHES = _utils.counter()


def _check(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, ctx_lens: Tensor,
           block_size: int) -> None:
    if q.dim() != 3 or k_pool.dim() != 3 or k_pool.shape != v_pool.shape or k_pool.shape[2] != q.shape[2]:
        raise ValueError(f"expected q (S, H, D) and k_pool, v_pool (slots, H_kv, D); got q {tuple(q.shape)}, "
                         f"k_pool {tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)}")
    if q.shape[1] % k_pool.shape[1]:
        raise ValueError(f"n_heads {q.shape[1]} is not a multiple of n_kv_heads {k_pool.shape[1]}")
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0] or block_tables.is_floating_point():
        raise ValueError(f"block_tables must be integer (S={q.shape[0]}, max_blocks), got "
                         f"{block_tables.dtype} of shape {tuple(block_tables.shape)}")
    if ctx_lens.shape != (q.shape[0],) or ctx_lens.is_floating_point():
        raise ValueError(f"ctx_lens must be integer (S={q.shape[0]},), got {ctx_lens.dtype} of shape "
                         f"{tuple(ctx_lens.shape)}")
    if block_size < 1 or k_pool.shape[0] % block_size:
        raise ValueError(f"pool of {k_pool.shape[0]} slots is not a whole number of blocks of {block_size}")


def paged_decode_reference(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, ctx_lens: Tensor,
                           block_size: int, scale: float | None = None, window: int | None = None) -> Tensor:
    """The same function in plain torch, fp32: gather each sequence's slots through its table,
    mask (j < ctx, and ctx - 1 - j < window), softmax, weighted sum. Table entries past a
    sequence's ceil(ctx / block_size) blocks are replaced by block 0 before the gather (never read
    as ids), and slots past ctx_len contribute nothing even if not finite. Returns (S, H, D) in
    q's dtype."""
    _check(q, k_pool, v_pool, block_tables, ctx_lens, block_size)
    S, H, D = q.shape
    scale = float(scale) if scale is not None else D ** -0.5
    ctx = ctx_lens.to(device=q.device, dtype=torch.long)
    width = _utils.cdiv(int(ctx.max()), block_size) if S else 0
    tables = block_tables[:, :width].to(device=q.device, dtype=torch.long)
    used = torch.arange(width, device=q.device)[None, :] < _utils.cdiv(ctx, block_size)[:, None]
    tables = torch.where(used, tables, 0)
    slots = (tables[:, :, None] * block_size + torch.arange(block_size, device=q.device)).reshape(S, -1)
    group = H // k_pool.shape[1]
    keys = k_pool[slots].float().repeat_interleave(group, dim=2)  # (S, L, H, D)
    values = v_pool[slots].float().repeat_interleave(group, dim=2)
    j = torch.arange(slots.shape[1], device=q.device)[None, :]
    visible = j < ctx[:, None]
    if window is not None:
        visible = visible & (ctx[:, None] - 1 - j < window)
    # an unread slot may hold anything (stale or unwritten): zeroed, so not even a NaN gets through
    keys = torch.where(visible[:, :, None, None], keys, 0.0)
    values = torch.where(visible[:, :, None, None], values, 0.0)
    scores = torch.einsum("shd,slhd->shl", q.float(), keys) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("shl,slhd->shd", scores.softmax(-1), values).to(q.dtype)


def _launch(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, ctx_lens: Tensor,
            block_size: int, scale: float, window: int | None) -> Tensor:
    from posttrain.kernels.jit import paged_attention as jit  # device code, imported on first launch
    S, H, D = q.shape
    kv_heads = k_pool.shape[1]
    q, k_pool, v_pool = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_pool, v_pool))
    tables = block_tables.contiguous()
    ctx_lens = ctx_lens.contiguous()
    out = torch.empty_like(q)
    if S == 0:
        return out
    group = H // kv_heads
    block_d = _utils.next_power_of_2(D)
    jit.decode_kernel[(S, kv_heads)](
        q, k_pool, v_pool, out, tables, ctx_lens, scale, 0 if window is None else int(window), group,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        out.stride(0), out.stride(1), tables.stride(0),
        HEAD_DIM=D, BLOCK=block_size, BLOCK_D=block_d, BLOCK_G=_utils.next_power_of_2(group),
        HAS_WINDOW=window is not None, num_warps=4 if block_size * block_d <= 4096 else 8,
    )
    LAUNCHES["paged_decode"] += 1
    return out


def paged_decode_kernel_applies(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor,
                                ctx_lens: Tensor, block_size: int) -> bool:
    """Whether `paged_decode_attention` with these inputs runs the Triton kernel (rule in the
    module docstring); a caller with a cheaper path of its own for the other case asks this."""
    return (use_triton(q, k_pool, v_pool, block_tables, ctx_lens) and _utils.supported(q, k_pool, v_pool)
            and block_size >= 1 and block_size & (block_size - 1) == 0
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_pool, v_pool))))


def paged_decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, ctx_lens: Tensor,
                           block_size: int, scale: float | None = None, window: int | None = None) -> Tensor:
    """Attention of one query per sequence over its paged keys: q (S, H, D), the newest token of
    each sequence (position ctx_lens[s] - 1); k_pool, v_pool (num_blocks * block_size, H_kv, D)
    one layer's pools, H a multiple of H_kv (query head h reads kv head h // (H // H_kv));
    block_tables (S, max_blocks) integer block ids (entries past a sequence's
    ceil(ctx_lens[s] / block_size) blocks are never read); ctx_lens (S,) integer, each >= 1 (not
    checked: that would sync the device); window: key j visible iff ctx - 1 - j < window (None:
    all); scale defaults to D ** -0.5. Returns (S, H, D) in q's dtype, accumulated in fp32."""
    _check(q, k_pool, v_pool, block_tables, ctx_lens, block_size)
    scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    if not paged_decode_kernel_applies(q, k_pool, v_pool, block_tables, ctx_lens, block_size):
        return paged_decode_reference(q, k_pool, v_pool, block_tables, ctx_lens, block_size, scale, window)
    if k_pool.shape[1] > 65535:
        raise ValueError(f"at most 65535 kv heads per call (CUDA grid limit), got {k_pool.shape[1]}")
    return _launch(q, k_pool, v_pool, block_tables, ctx_lens, block_size, scale, window)
