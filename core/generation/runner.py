"""The engine's model call: one forward over a flat, variable-length batch of tokens on a paged
KV cache, reusing the model's own modules (posttrain.core.model.model is not modified).

A step's tokens (prompt chunks of new sequences and one token per decoding sequence) are
concatenated into one row of T tokens. Each layer runs the model's Block pieces itself:
attn_norm, q/k/v projections (qkv bias included), RoPE (the model's rope_cos_sin and the RoPE
kernel, on each token's position), then writes the new keys/values into the cache slots. The
sequences attend in two groups, the decoding ones (one query each) and the prefilling ones, so a
long prompt chunk does not pad every decode query to its length: per group, the sequences'
blocks are gathered into a (S, kv_heads, max_ctx, head_dim) tensor, the queries scattered into
(S, heads, max_q, head_dim), and one SDPA runs with a boolean mask: query i of
sequence s (position ctx_len[s] - q_len[s] + i) sees key j when j <= its position and, on a
sliding-window layer (args.window_of(layer)), position - j < window; unused query rows see key 0
only (never an all-masked row). GQA repeats the KV heads as the model's mask path does. Where
the paged decode kernel runs on Triton (CUDA, or TRITON_INTERPRET=1; `paged_decode_kernel_applies`),
the decode group skips the gather and the mask: posttrain.kernels.paged_attention reads its keys and values
straight from the pools through the block tables (same function; the CPU keeps SDPA). Elsewhere,
when the decoding sequences share leading blocks (the n samples of a prompt) so that reading them
once per family saves a quarter of the blocks, the decode group is one group that takes cascade
attention (posttrain.core.generation.cascade: shared blocks once per family, then each sequence's own, the
two softmaxes merged). A prefill group of prompts that all start in this step, where the varlen
flash-attention kernel runs on Triton, attends through it over this step's own keys (packed one
prompt after another already), with no gather and no mask. Then
o_proj, mlp_norm and the block's mlp (dense or MoE, token-wise either way), the final norm, and
lm_head on the rows that sample only.

Under tensor parallelism (the model split by posttrain.core.parallel's TP plan without sequence
parallelism, as for decoding) the same code runs on each rank of the tp group: the projections
give this rank's heads, so its cache holds its KV heads only; o_proj and the MLP reduce over the
group; the vocab-split logits are gathered, so every rank samples from the same logits (with the
same per-request seeds: the same tokens). `ModelRunner.forward(batch) -> logits` is the one
method a LoRA-aware runner replaces; the engine builds `ForwardBatch` and never touches the
model otherwise.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from posttrain.core.generation.cascade import SharedPrefix, cascade_attention, plan_shared_prefix
from posttrain.core.generation.paged import PagedKVCache
from posttrain.core.lora.model import route_adapters
from posttrain.core.model.model import Transformer
from posttrain.core.model.rope import rope_cos_sin
from posttrain.kernels.flash_attention import flash_attn_varlen, flash_attn_varlen_applies
from posttrain.kernels.paged_attention import paged_decode_attention, paged_decode_kernel_applies
from posttrain.kernels.rope import apply_rope


@dataclass
class AttentionGroup:
    """Sequences of a step whose attention runs as one padded SDPA: S_g sequences, T_g tokens."""

    tokens: torch.Tensor
    """(T_g,) the group's tokens' rows in the flat batch."""
    seq_index: torch.Tensor
    """(T_g,) which of the group's sequences each token belongs to."""
    q_index: torch.Tensor
    """(T_g,) each token's index among its sequence's tokens of this step."""
    q_lens: list[int]
    ctx_lens: list[int]
    """Each sequence's length after this step (cached + new tokens): its keys."""
    block_tables: torch.Tensor
    """(S_g, max_blocks) block ids, padded with block 0 (masked out)."""
    shared: SharedPrefix | None = None
    """A decode group whose sequences share leading blocks: its families, for cascade attention
    (posttrain.core.generation.cascade) where the paged decode kernel does not run."""
    fresh: bool = False
    """A prefill group of prompts computed from their first token in this step: each sequence's
    keys are all this step's, its tokens contiguous in the flat batch (the varlen kernel's packed
    layout, on Triton)."""


@dataclass
class ForwardBatch:
    """One step's T tokens, flattened, and the attention groups over them: the decoding
    sequences (one query each) in one group, the prefilling ones in another, so a long prompt
    chunk does not pad every decode query to its length."""

    input_ids: torch.Tensor
    """(T,) token ids."""
    positions: torch.Tensor
    """(T,) each token's position in its sequence."""
    slots: torch.Tensor
    """(T,) flat cache slot (block * block_size + offset) each token's KV is written to."""
    groups: list[AttentionGroup]
    logit_rows: torch.Tensor
    """(R,) rows of the flat batch whose logits are wanted: the last token of each sequence that
    samples this step (not of a prompt chunk that leaves more to prefill)."""
    adapter_ids: torch.Tensor | None = None
    """(T,) each token's LoRA adapter, an index into adapter_names (-1: the base); None: no routing."""
    adapter_names: list[str] | None = None

    @classmethod
    def build(cls, seqs: list[tuple[list[int], int, list[int], list[int], bool]], block_size: int,
              device: torch.device | str) -> "ForwardBatch":
        """seqs: per sequence (its new token ids, its number of cached tokens, its new tokens'
        slots, its block table, whether its last new token gets logits)."""
        def tensor(x):
            return torch.tensor(x, dtype=torch.long, device=device)

        ids, pos, slots, rows, starts = [], [], [], [], []
        for tokens, cached, token_slots, _, wants_logits in seqs:
            starts.append(len(ids))
            ids += tokens
            pos += range(cached, cached + len(tokens))
            slots += token_slots
            if wants_logits:
                rows.append(len(ids) - 1)
        def group(members: list[int], shared: SharedPrefix | None = None, fresh: bool = False) -> AttentionGroup:
            tok, seq_index, q_index, q_lens, ctx_lens = [], [], [], [], []
            for local, s in enumerate(members):
                n, cached = len(seqs[s][0]), seqs[s][1]
                tok += range(starts[s], starts[s] + n)
                seq_index += [local] * n
                q_index += range(n)
                q_lens.append(n)
                ctx_lens.append(cached + n)
            width = max(-(-c // block_size) for c in ctx_lens)
            tables = [seqs[s][3][:width] + [0] * (width - len(seqs[s][3][:width])) for s in members]
            return AttentionGroup(tensor(tok), tensor(seq_index), tensor(q_index), q_lens, ctx_lens, tensor(tables),
                                  shared, fresh)

        decoding = [s for s, e in enumerate(seqs) if len(e[0]) == 1]
        ctx = [seqs[s][1] + 1 for s in decoding]
        split = _split_by_context(decoding, ctx, block_size)
        blocks = {s: -(-c // block_size) for s, c in zip(decoding, ctx)}
        shared = plan_shared_prefix([seqs[s][3] for s in decoding], ctx, block_size,
                                    sum(len(m) * max(blocks[s] for s in m) for m in split), device) \
            if len(decoding) > 1 else None
        groups = [group(decoding, shared)] if shared is not None else [group(m) for m in split if m]
        prefilling = [s for s, e in enumerate(seqs) if len(e[0]) > 1]
        if prefilling:
            groups.append(group(prefilling, fresh=all(seqs[s][1] == 0 for s in prefilling)))
        return cls(tensor(ids), tensor(pos), tensor(slots), groups, tensor(rows))


def _split_by_context(members: list[int], ctx_lens: list[int], block_size: int) -> list[list[int]]:
    """The decoding sequences in one attention group, or two when that gathers at least a quarter
    fewer key blocks: a group's keys are padded to its longest context, so short and long
    contexts apart pad less (the sequences sorted by context, cut where sum over groups of
    size x longest blocks is least)."""
    if len(members) < 8:
        return [members]
    blocks = [-(-c // block_size) for c in ctx_lens]
    order = sorted(range(len(members)), key=blocks.__getitem__)
    b = [blocks[i] for i in order]
    n = len(b)
    cost, cut = min((k * b[k - 1] + (n - k) * b[-1], k) for k in range(1, n))
    if cost > 0.75 * n * b[-1]:
        return [members]
    return [[members[i] for i in order[:cut]], [members[i] for i in order[cut:]]]


def _varlen_at(g: AttentionGroup, cu: torch.Tensor | None, window: int | None) -> bool:
    """Whether group g (its cu_seqlens from ModelRunner._varlen_prefill, or None) attends through
    the varlen kernel on a layer with this sliding window: the kernel has no window, so a window
    shorter than the group's longest prompt takes gather + SDPA."""
    return cu is not None and (window is None or max(g.q_lens) <= window)


def attention_mask(q_lens: list[int], ctx_lens: list[int], max_ctx: int, window: int | None,
                   device: torch.device | str) -> torch.Tensor:
    """(S, 1, max_q, max_ctx) boolean, True = may attend (see the module docstring)."""
    q_len = torch.tensor(q_lens, device=device)[:, None, None]
    ctx = torch.tensor(ctx_lens, device=device)[:, None, None]
    i = torch.arange(max(q_lens), device=device)[None, :, None]
    j = torch.arange(max_ctx, device=device)[None, None, :]
    qpos = ctx - q_len + i
    allowed = j <= qpos
    if window is not None:
        allowed = allowed & (qpos - j < window)
    allowed = torch.where(i < q_len, allowed, j == 0)
    return allowed[:, None]


class ModelRunner:
    """Runs a posttrain.core.model Transformer (every layer on this process) over ForwardBatches."""

    def __init__(self, model: Transformer, num_blocks: int, block_size: int):
        self.model, self.args = model, model.args
        p = model.embed.weight
        self.device, self.dtype = p.device, p.dtype
        self.head_dim = self.args.head_dim
        # KV heads this process holds (a tensor-parallel shard holds fewer)
        self.kv_heads = model.layers[0].attn.k_proj.out_features // self.head_dim
        self.cache = PagedKVCache(len(model.layers), num_blocks, self.kv_heads, block_size, self.head_dim,
                                  self.device, self.dtype)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """fp32 logits (R, vocab) of batch.logit_rows, the model in eval mode (no LoRA dropout)."""
        route = contextlib.nullcontext() if batch.adapter_ids is None else \
            route_adapters(self.model, batch.adapter_ids[None], batch.adapter_names)
        training = self.model.training
        if training:
            self.model.eval()
        try:
            with route:
                return self._forward(batch)
        finally:
            if training:
                self.model.train(True)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        model, cache = self.model, self.cache
        T = batch.input_ids.shape[0]
        windows = {self.args.window_of(i) for i in range(len(model.layers))}
        kernel = [self._paged_decode(g) for g in batch.groups]  # None: the group runs gather + SDPA
        varlen = [self._varlen_prefill(g) for g in batch.groups]  # None: likewise
        # masks only where a group gathers + SDPA (not on a kernel, the cascade, or the varlen kernel)
        masks = [{} if ctx is not None or g.shared is not None else
                 {w: attention_mask(g.q_lens, g.ctx_lens, g.block_tables.shape[1] * cache.block_size, w,
                                    self.device) for w in windows if not _varlen_at(g, cu, w)}
                 for g, ctx, cu in zip(batch.groups, kernel, varlen)]
        x = model.embed(batch.input_ids[None])  # (1, T, hidden)
        cos, sin = rope_cos_sin(model.inv_freq, batch.positions[None], model.rope_scale, x.dtype)
        for i, block in enumerate(model.layers):
            h = block.attn_norm(x)
            attn = block.attn
            q = attn.q_proj(h).view(1, T, -1, self.head_dim).transpose(1, 2)  # (1, H, T, hd)
            k = attn.k_proj(h).view(1, T, -1, self.head_dim).transpose(1, 2)  # (1, H_kv, T, hd)
            v = attn.v_proj(h).view(1, T, -1, self.head_dim).transpose(1, 2)
            q, k = apply_rope(q, k, cos, sin)
            k, v = k[0].transpose(0, 1), v[0].transpose(0, 1)  # (T, H_kv, hd)
            cache.write(i, batch.slots, k, v)
            q = q[0].transpose(0, 1)  # (T, H, hd)
            out = torch.empty_like(q) if len(batch.groups) > 1 else None
            window = self.args.window_of(i)
            for g, mask, ctx, cu in zip(batch.groups, masks, kernel, varlen):
                if _varlen_at(g, cu, window):  # fresh prompts on Triton: this step's keys, no gather
                    o = flash_attn_varlen(q[g.tokens], k[g.tokens], v[g.tokens], cu, max(g.q_lens))
                elif ctx is not None:  # a decode group on Triton: K/V read from the pool through the tables
                    o = paged_decode_attention(q[g.tokens], cache.k[i], cache.v[i], g.block_tables, ctx,
                                               cache.block_size, window=window)
                elif g.shared is not None:  # decode queries whose sequences share their first blocks
                    o = cascade_attention(q[g.tokens], cache.k[i], cache.v[i], g.shared, cache.block_size,
                                          window=window)
                else:
                    o = self._attend(i, q[g.tokens], g, mask[window])
                if out is None:
                    out = o  # one group: its tokens are the batch's, in order
                else:
                    out[g.tokens] = o
            x = x + attn.o_proj(out.reshape(1, T, -1))
            x = x + block.mlp(block.mlp_norm(x))
        hidden = model.norm(x[0, batch.logit_rows])
        logits = model.lm_head(hidden).float()
        group = getattr(model.lm_head, "tp_group", None)
        if group is not None:  # tensor parallelism: each rank's vocab slice, gathered (the same on every rank)
            from posttrain.core.parallel.mappings import all_gather

            logits = all_gather(logits, -1, group)
        return logits

    def _paged_decode(self, g: AttentionGroup) -> torch.Tensor | None:
        """The group's ctx_lens as a tensor when it is a decode group (one query per sequence) and
        the paged decode kernel would run on Triton (CUDA, or the interpreter); None otherwise,
        and the group takes gather + SDPA (the CPU path). The kernel's default scale, head_dim ** -0.5,
        is the model's (SDPA's default in posttrain.core.model.model)."""
        if not all(n == 1 for n in g.q_lens):
            return None
        ctx = torch.tensor(g.ctx_lens, dtype=torch.int32, device=self.device)
        q = self.cache.k.new_empty((0, self.kv_heads, self.head_dim))  # stands for q: same device and dtype
        pool = self.cache.k[0]
        if not paged_decode_kernel_applies(q, pool, pool, g.block_tables, ctx, self.cache.block_size):
            return None
        return ctx

    def _varlen_prefill(self, g: AttentionGroup) -> torch.Tensor | None:
        """The group's cu_seqlens (int32) when it is a fresh prefill group and the varlen
        flash-attention kernel would run on Triton (CUDA, or the interpreter); None otherwise, and
        the group takes gather + SDPA (and, per layer, see _varlen_at)."""
        if not g.fresh:
            return None
        x = self.cache.k[0][:0]  # stands for q, k, v: same device and dtype
        if not flash_attn_varlen_applies(x, x, x):
            return None
        return torch.tensor([0, *itertools.accumulate(g.q_lens)], dtype=torch.int32, device=self.device)

    def _attend(self, layer: int, q: torch.Tensor, g: AttentionGroup, mask: torch.Tensor) -> torch.Tensor:
        """Attention of one group's queries q (T_g, H, hd) over its sequences' cached keys."""
        keys, values = self.cache.gather(layer, g.block_tables)  # (S_g, H_kv, max_ctx, hd)
        heads = q.shape[1]
        qs = q.new_zeros(len(g.q_lens), max(g.q_lens), heads, self.head_dim)
        qs[g.seq_index, g.q_index] = q
        # GQA: each KV head serves heads // kv_heads query heads (SDPA repeats them itself)
        out = F.scaled_dot_product_attention(qs.transpose(1, 2), keys, values, attn_mask=mask,
                                             enable_gqa=heads != keys.shape[1])
        return out.transpose(1, 2)[g.seq_index, g.q_index]  # (T_g, H, hd)
