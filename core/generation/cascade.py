"""Cascade attention for decoding sequences that share their first KV blocks.

The n samples of a prompt fork from one sequence and share the prompt's full blocks (and
requests whose prompts share a cached prefix share those blocks too). Gathering every
sequence's keys reads the shared blocks once per sequence; here a step's decode queries are
split in two attentions instead (the two-level "cascade" of FlashInfer; the split-softmax merge
of flash-decoding):

1. shared part: each family (sequences whose block tables begin with the same blocks) gathers
   its shared blocks once, and all its members' queries (and, under GQA, all query heads of a
   KV head) attend to them as the rows of one matmul: (F, kv_heads, group * members, head_dim) x
   (F, kv_heads, shared keys, head_dim);
2. own part: each sequence attends to the rest of its blocks (the prompt's partly filled last
   block, copied on write, and its own tokens);

each giving unnormalised outputs o_i = sum_j exp(s_ij - m_i) v_j with their row maxima m_i and
sums l_i = sum_j exp(s_ij - m_i), merged exactly: o = (o_1 e^{m_1 - M} + o_2 e^{m_2 - M}) /
(l_1 e^{m_1 - M} + l_2 e^{m_2 - M}), M = max(m_1, m_2). Both parts compute in fp32; the result
equals softmax attention over all keys up to rounding (tests/core/test_generation_cascade.py: against
dense fp32 attention per sequence, with GQA, sliding windows and mixed families).

Only decode queries take this path (one query per sequence, at its newest position, so every
shared key is causally visible; a sliding window masks per query). `plan_shared_prefix` decides,
per step, whether it pays: it counts the key blocks each way and keeps the plain gather unless
the cascade reads at most three quarters of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SharedPrefix:
    """How a decode group's sequences split into families for cascade attention."""

    tables: torch.Tensor
    """(F + 1, P) the shared blocks of each family (sequences with at least one other sharing its
    first blocks), padded with block 0; row F, for the sequences that share nothing, is empty."""
    lens: torch.Tensor
    """(F + 1,) shared tokens of each family (whole blocks); 0 in row F."""
    family: torch.Tensor
    """(S,) each sequence's family, F for a sequence that shares nothing (no shared part)."""
    slot: torch.Tensor
    """(S,) its index within the family."""
    width: int
    """The largest family's size."""
    own_tables: torch.Tensor
    """(S, R) each sequence's blocks after its family's shared ones, padded with block 0."""
    own_lens: torch.Tensor
    """(S,) its keys in those blocks (its context minus its shared tokens)."""
    ctx: torch.Tensor
    """(S,) each sequence's context (its query sits at ctx - 1)."""


def plan_shared_prefix(tables: list[list[int]], ctx_lens: list[int], block_size: int, plain_blocks: int,
                       device: torch.device | str) -> SharedPrefix | None:
    """Families of decode sequences (their block tables, their contexts including this step's
    token) by common leading blocks, or None when the cascade would not read at most 3/4 of the
    `plain_blocks` key blocks that gathering every sequence's keys reads. A block counts as shared
    only when it is whole and before every member's newest token, so its keys are visible to all."""
    by_first: dict[int, list[int]] = {}
    for s, (table, ctx) in enumerate(zip(tables, ctx_lens)):
        if ctx > block_size:  # at least one whole block before the newest token
            by_first.setdefault(table[0], []).append(s)
    families: list[tuple[list[int], int]] = []  # (members, shared blocks)
    for members in by_first.values():
        if len(members) < 2:
            continue
        limit = min((ctx_lens[s] - 1) // block_size for s in members)
        first = tables[members[0]]
        shared = 0
        while shared < limit and all(tables[s][shared] == first[shared] for s in members):
            shared += 1
        families.append((members, shared))
    if not families:
        return None
    family, slot, skip = [len(families)] * len(tables), [0] * len(tables), [0] * len(tables)
    for f, (members, shared) in enumerate(families):
        for i, s in enumerate(members):
            family[s], slot[s], skip[s] = f, i, shared
    own = [-(-c // block_size) - k for c, k in zip(ctx_lens, skip)]
    widest = max(shared for _, shared in families)
    cost = len(families) * widest + len(tables) * max(own)
    if cost > 0.75 * plain_blocks:
        return None

    def tensor(x):
        return torch.tensor(x, dtype=torch.long, device=device)

    R = max(own)
    return SharedPrefix(
        tables=tensor([tables[m[0]][:k] + [0] * (widest - k) for m, k in families] + [[0] * widest]),
        lens=tensor([k * block_size for _, k in families] + [0]),
        family=tensor(family), slot=tensor(slot), width=max(len(m) for m, _ in families),
        own_tables=tensor([t[k:k + n] + [0] * (R - n) for t, k, n in zip(tables, skip, own)]),
        own_lens=tensor([c - k * block_size for c, k in zip(ctx_lens, skip)]), ctx=tensor(ctx_lens))


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """Unnormalised attention of q (kv, B, rows, hd) over k, v (kv, B, N, hd) where mask
    (broadcast to (kv, B, rows, N)) allows: (outputs, row maxima, row sums), fp32. A row that
    may see no key gets zeros (and maximum 0), so it adds nothing when merged."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).masked_fill_(~mask, float("-inf"))
    m = scores.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = scores.sub_(m).exp_()
    return torch.matmul(p, v), m, p.sum(-1, keepdim=True)


def _gather(pool: torch.Tensor, tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """The keys (or values) of tables' blocks (B, n) from one layer's pool (slots, kv, hd), as
    (kv, B, n * block_size, hd) in one strided copy: KV-head major, so the matmuls over (kv, B)
    need no further copy. (One index_select per KV head: on the whole permuted pool it would first
    copy the pool contiguous.)"""
    kv, hd = pool.shape[1:]
    B, n = tables.shape
    blocks = pool.view(-1, block_size, kv, hd)
    out = pool.new_empty(kv, B * n, block_size, hd)
    for h in range(kv):
        torch.index_select(blocks[:, :, h], 0, tables.reshape(-1), out=out[h])
    return out.view(kv, B, n * block_size, hd).float()


def cascade_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: SharedPrefix,
                      block_size: int, window: int | None = None) -> torch.Tensor:
    """Attention of decode queries q (S, heads, hd) over their sequences' keys in one layer's pools
    (slots, kv_heads, hd), split per `plan` into the families' shared blocks and each sequence's
    own; (S, heads, hd) in q's dtype. window: a sliding window (query at position p sees keys
    j with p - j < window)."""
    S, H, hd = q.shape
    kv = k_pool.shape[1]
    g = H // kv
    scale = hd ** -0.5
    qf = q.float().view(S, kv, g, hd)
    # own part: every sequence, one query row per head of its KV head's group
    j = torch.arange(plan.own_tables.shape[1] * block_size, device=q.device)[None]
    allowed = j < plan.own_lens[:, None]
    if window is not None:
        allowed &= (plan.own_lens - 1)[:, None] - j < window  # the query is its own keys' last
    o2, m2, l2 = _partial(qf.permute(1, 0, 2, 3), _gather(k_pool, plan.own_tables, block_size),
                          _gather(v_pool, plan.own_tables, block_size), allowed[None, :, None], scale)
    # shared part: a family's members side by side, rows (g, width) per KV head; family F (the
    # sequences that share nothing) has no keys, so its rows come out zero
    F, W = plan.tables.shape[0] - 1, plan.width
    rows = qf.new_zeros(F + 1, W, kv, g, hd)
    rows[plan.family, plan.slot] = qf
    j = torch.arange(plan.tables.shape[1] * block_size, device=q.device)
    allowed = (j[None] < plan.lens[:, None])[None, :, None, None, :]  # (1, F + 1, 1, 1, N)
    if window is not None:
        qpos = torch.zeros(F + 1, W, dtype=torch.long, device=q.device)
        qpos[plan.family, plan.slot] = plan.ctx - 1
        allowed = (allowed & (qpos[None, :, None, :, None] - j < window)).expand(-1, -1, g, -1, -1)  # g rows each
    o1, m1, l1 = _partial(rows.permute(2, 0, 3, 1, 4).reshape(kv, F + 1, g * W, hd),
                          _gather(k_pool, plan.tables, block_size), _gather(v_pool, plan.tables, block_size),
                          allowed.flatten(2, 3), scale)

    def per_seq(t):  # (kv, F + 1, g * W, c) -> (S, kv, g, c): each sequence's rows
        return t.view(kv, F + 1, g, W, -1)[:, plan.family, :, plan.slot]

    o1, m1, l1 = per_seq(o1), per_seq(m1), per_seq(l1)
    o2, m2, l2 = o2.transpose(0, 1), m2.transpose(0, 1), l2.transpose(0, 1)  # (kv, S, g, c) -> (S, kv, g, c)
    m1 = torch.where(l1 > 0, m1, m2)  # nothing shared (or all of it outside the window): weight 0 below
    m = torch.maximum(m1, m2)
    a1, a2 = (m1 - m).exp(), (m2 - m).exp()
    out = (o1 * a1 + o2 * a2) / (l1 * a1 + l2 * a2)
    return out.reshape(S, H, hd).to(q.dtype)
