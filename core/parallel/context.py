"""Context parallelism: ring attention over the sequence (Liu et al. 2023, arXiv 2310.01889),
exact against full causal attention, packed sequences included.

Layout (load-balanced, as in Megatron-CP and Llama 3): the sequence is cut into 2*cp chunks and
rank i holds chunks i and 2*cp-1-i, so under a causal mask every rank has the same amount of
work. `context_parallel_shard` applies this layout to a batch; labels must be shifted on the full
sequence first (the next token of a chunk's last position lives in another chunk).

Each rank keeps its queries; keys/values travel around the ring, cp-1 hops. At every hop the
local queries attend to the visiting block under the global mask (causal over global slots,
same document), giving a block output normalized within the block and its log-sum-exp; blocks
merge by their log-sum-exps (the online softmax of flash attention). The hop is a
differentiable point-to-point shift (`_RingShift`: forward sends to the next rank, backward sends
the gradient to the previous one), so autograd derives the backward of the whole ring; it keeps
each visiting block for backward (cp x the local K/V memory) where a fused kernel would recompute.

Documents: with packed rows (position_ids restarting at 0), a token's document is the number of
restarts up to it on the *global* sequence. Each rank all-gathers the (small, integer)
position_ids once per forward and derives the document id of every rank's tokens from them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from posttrain.core.model.model import Attention
from posttrain.core.model.rope import apply_rope
from posttrain.core.parallel.mappings import all_gather


def _chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def context_parallel_shard(x: Tensor, rank: int, cp: int, dim: int = 1) -> Tensor:
    """This rank's two chunks of a full-sequence tensor (sequence on `dim`)."""
    if x.shape[dim] % (2 * cp):
        raise ValueError(f"sequence length {x.shape[dim]} must be divisible by 2*cp = {2 * cp}")
    chunks = x.chunk(2 * cp, dim=dim)
    a, b = _chunk_ids(rank, cp)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def context_parallel_unshard(x: Tensor, cp: int, dim: int = 1) -> Tensor:
    """Inverse of sharding on the concatenation of every rank's shard in rank order."""
    pieces = x.chunk(2 * cp, dim=dim)  # rank r holds pieces 2r (chunk r) and 2r+1 (chunk 2cp-1-r)
    order = [0] * (2 * cp)
    for r in range(cp):
        a, b = _chunk_ids(r, cp)
        order[a], order[b] = pieces[2 * r], pieces[2 * r + 1]
    return torch.cat(order, dim=dim)


def shard_slots(rank: int, cp: int, local_len: int, device) -> Tensor:
    """Global sequence index of each of `rank`'s local tokens."""
    c = local_len // 2
    a, b = _chunk_ids(rank, cp)
    ar = torch.arange(c, device=device)
    return torch.cat([a * c + ar, b * c + ar])


@dataclass
class CPBatch:
    """What ring attention needs about the current batch, for every rank's shard."""

    cp: int
    rank: int
    local_len: int
    docs: Tensor | None  # (B, T_global) document id of each global slot; None: one per row

    def slots(self, rank: int, device) -> Tensor:
        return shard_slots(rank, self.cp, self.local_len, device)

    def shard_docs(self, rank: int) -> Tensor | None:
        return None if self.docs is None else context_parallel_shard(self.docs, rank, self.cp)


def cp_batch(position_ids: Tensor | None, local_len: int, group: dist.ProcessGroup) -> CPBatch:
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    if local_len % 2:
        raise ValueError(f"a context-parallel shard has two equal chunks; got local length {local_len}")
    docs = None
    if position_ids is not None:
        full = context_parallel_unshard(all_gather(position_ids, 1, group), cp)
        docs = torch.cumsum(full == 0, dim=1)
    return CPBatch(cp, rank, local_len, docs)


class _RingShift(torch.autograd.Function):
    """Send to the next rank of the ring, receive from the previous; backward the reverse."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _shift(x.contiguous(), group, +1)

    @staticmethod
    def backward(ctx, g: Tensor):
        return _shift(g.contiguous(), ctx.group, -1), None


def _shift(x: Tensor, group: dist.ProcessGroup, direction: int) -> Tensor:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    dst = dist.get_global_rank(group, (r + direction) % n)
    src = dist.get_global_rank(group, (r - direction) % n)
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, dst, group), dist.P2POp(dist.irecv, out, src, group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return out


def _attend_block(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax attention of q (B, h, Tq, d) on one key block, normalized within the block, and its
    log-sum-exp (B, h, Tq). A row with no allowed key gives output 0 and lse ~ -87 (not -inf, so
    no NaN reaches the gradients; its merge weight exp(lse - total) is then ~0)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    scores = scores.masked_fill(~allowed, float("-inf"))
    m = scores.amax(-1, keepdim=True).detach()  # lse is invariant to m: no gradient needed
    m = torch.where(torch.isinf(m), 0.0, m)
    p = torch.exp(scores - m)
    s = p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
    return (p @ v) / s, (m + torch.log(s)).squeeze(-1)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, batch: CPBatch, group: dist.ProcessGroup) -> Tensor:
    """Exact causal (document-masked) attention of the local queries over the whole sequence.
    q (B, h, T_local, d), k/v (B, h_kv, T_local, d) -> (B, h, T_local, d)."""
    cp, rank = batch.cp, batch.rank
    q_slots, q_docs = batch.slots(rank, q.device), batch.shard_docs(rank)
    kv = torch.stack([k, v])
    out = lse = None
    for step in range(cp):
        src = (rank - step) % cp  # whose keys are visiting
        k_slots, k_docs = batch.slots(src, q.device), batch.shard_docs(src)
        allowed = (k_slots[None, :] <= q_slots[:, None])[None, None]  # (1, 1, Tq, Tk)
        if q_docs is not None:
            allowed = allowed & (q_docs[:, None, :, None] == k_docs[:, None, None, :])
        if step:
            kv = _RingShift.apply(kv, group)
        block_out, block_lse = _attend_block(q, kv[0], kv[1], allowed)
        if out is None:  # step 0: own keys, which always include each query itself
            out, lse = block_out, block_lse
            continue
        total = torch.logaddexp(lse, block_lse)
        out = out * torch.exp(lse - total)[..., None] + block_out * torch.exp(block_lse - total)[..., None]
        lse = total
    return out.to(q.dtype)


class ContextParallelAttention(Attention):
    """Attention whose scores span the whole sequence through the ring. Same parameters and
    projections as Attention (it mirrors its forward; only the SDPA call differs); the mask the
    model builds for the local shard is ignored in favour of the global one in `cp_state`."""

    cp_group: dist.ProcessGroup
    cp_state: dict

    def forward(self, x, cos, sin, mask, cache=None):
        if cache is not None:
            raise NotImplementedError("context parallelism is for training; decode without it")
        batch = self.cp_state.get("batch")
        if batch is None:
            raise RuntimeError("no context-parallel batch: call the model (or hidden_states) with the "
                               "position_ids of this rank's shard")
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, heads, T, hd)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = ring_attention(q, k, v, batch, self.cp_group)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


def apply_context_parallel(model: nn.Module, cp_group: dist.ProcessGroup) -> dict:
    """Swap every Attention for ContextParallelAttention and make the model's `hidden_states`
    (which forward calls) record the batch's CP layout first. Returns the shared state, which a
    pipeline stage fills itself. Inputs must be sharded by `context_parallel_shard`, with
    position_ids (global positions, or packed-document positions) always given."""
    state: dict = {}
    for mod in model.modules():
        if type(mod) is Attention:
            mod.__class__ = ContextParallelAttention
            mod.cp_group, mod.cp_state = cp_group, state
    inner = getattr(model, "hidden_states", None)
    if inner is not None:
        def hidden_states(input_ids, position_ids=None, attention_mask=None, cache=None):
            if position_ids is None or attention_mask is not None:
                raise ValueError("under context parallelism pass position_ids (this rank's shard of the "
                                 "global positions) and no attention_mask (use packing, not padding)")
            state["batch"] = cp_batch(position_ids, input_ids.shape[1], cp_group)
            return inner(input_ids, position_ids, attention_mask, cache)

        model.hidden_states = hidden_states
    return state


# ----------------------------------------------------------------------------- training batches

CP_KEY = "cp_shard"  # in a batch this rank's share was cut from: (rank, cp, padded global length)


def shard_batch(batch: dict, group: dist.ProcessGroup, multiple: int = 1) -> dict:
    """This rank's share of a padding-free training batch (input_ids, position_ids, labels and any
    other (B, T) token tensor such as sequence_ids), for a model under apply_context_parallel.

    Labels are shifted on the whole sequence first (the next token of a chunk's last position
    lives in another chunk), so the loss must then run with shift=False: `batch[CP_KEY]` says so.
    The sequence is padded at the end to a multiple of 2*cp*`multiple` (`multiple`: tp under
    sequence parallelism, whose ranks split each shard again); padding tokens are documents of
    their own (position 0), with ignored labels and sequence id -1, so no real token sees them
    and no loss or per-sequence sum counts them. `num_target_tokens` becomes this shard's count,
    so the counts of the cp ranks add up to the whole batch's."""
    from posttrain.core.losses import IGNORE_INDEX

    if CP_KEY in batch:
        return batch
    if batch.get("attention_mask") is not None:
        raise ValueError("context parallelism needs padding-free batches (one packed row with position_ids); "
                         "this batch is padded (attention_mask): set data.packing to a padding-free mode")
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    ids = batch["input_ids"]
    B, T = ids.shape
    width = 2 * cp * multiple
    pad = -T % width
    labels = torch.cat([batch["labels"][:, 1:], batch["labels"].new_full((B, 1), IGNORE_INDEX)], dim=1)
    fill = {"input_ids": 0, "labels": IGNORE_INDEX, "position_ids": 0, "sequence_ids": -1, "adapter_ids": -1}
    out = {k: v for k, v in batch.items() if k not in ("cu_seqlens", "max_seqlen")}  # whole-sequence only
    out["labels"] = labels
    for key, value in list(out.items()):
        if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[:2] == (B, T):
            if pad:
                value = torch.cat([value, value.new_full((B, pad, *value.shape[2:]), fill.get(key, 0))], dim=1)
            out[key] = context_parallel_shard(value, rank, cp)
    out["num_target_tokens"] = (out["labels"] != IGNORE_INDEX).sum()
    out[CP_KEY] = (rank, cp, T + pad)
    return out


def shard_like(batch: dict, x: Tensor, fill: float | int = 0, dim: int = 0) -> Tensor:
    """`x`, laid out along the whole sequence on `dim` (e.g. per-position teacher top-k rows),
    padded and cut like the batch `shard_batch` made."""
    rank, cp, length = batch[CP_KEY]
    pad = length - x.shape[dim]
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.new_full(shape, fill)], dim=dim)
    return context_parallel_shard(x, rank, cp, dim=dim)


class _AllReduceShares(torch.autograd.Function):
    """Sum over ranks forward, and backward too: for a loss computed alike on every rank from the
    sum, each rank taking a 1/n share of it, the gradient of each rank's part is then exact."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g: Tensor):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def sum_over_shards(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Per-sequence sums (log-probs, token counts) of each rank's shard -> the whole sequences',
    on every rank; differentiable for a loss each of the n ranks takes 1/n of."""
    return _AllReduceShares.apply(x, group)


class without_context_parallel:
    """Within it the model attends as an ordinary one, e.g. to sample token by token with a KV
    cache from a policy trained under context parallelism (each rank then runs whole sequences)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self):
        self.swapped = [m for m in self.model.modules() if type(m) is ContextParallelAttention]
        for m in self.swapped:
            m.__class__ = Attention
        self.hidden = self.model.__dict__.pop("hidden_states", None)
        return self.model

    def __exit__(self, *exc):
        for m in self.swapped:
            m.__class__ = ContextParallelAttention
        if self.hidden is not None:
            self.model.hidden_states = self.hidden
