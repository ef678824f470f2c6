"""Cascade attention (posttrain.core.generation.cascade) and the two-level inverse CDF of the engine's
sampler, each against a direct fp32 computation; and the engine taking the cascade for the
samples of a prompt."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.generation import Engine, RequestParams
from posttrain.core.generation.cascade import cascade_attention, plan_shared_prefix
from posttrain.core.generation.sampling import inverse_cdf
from posttrain.core.model.args import ModelArgs
from posttrain.core.model.generate import SamplingParams, generate
from posttrain.core.model.model import build_model


def _forked_tables(prompt_lens, samples, own_tokens, block_size, first_block=1):
    """Block tables and contexts laid out as the engine forks them: a prompt's whole blocks shared
    by its samples, its partly filled last block copied per sample, then each sample's own blocks.
    Block ids are handed out in a shuffled order, so no test relies on them being contiguous."""
    tables, ctx, next_id = [], [], [first_block]

    def take(n):
        out = list(range(next_id[0], next_id[0] + n))
        next_id[0] += n
        return out

    for length, n, extra in zip(prompt_lens, samples, own_tokens):
        shared = take(length // block_size)
        for i in range(n):
            c = length + extra + i  # the samples of a prompt at different lengths (some stopped later)
            tables.append(shared + take(-(-c // block_size) - len(shared)))
            ctx.append(c)
    perm = torch.randperm(next_id[0] - first_block, generator=torch.Generator().manual_seed(1)) + first_block
    tables = [[int(perm[b - first_block]) for b in t] for t in tables]
    return tables, ctx, next_id[0]


def _dense(q, k_pool, v_pool, tables, ctx, block_size, window):
    """Per sequence, softmax attention of its one query (at position ctx - 1) over its keys read
    token by token through its table, in fp32 (GQA by repeating KV heads)."""
    out = []
    heads, kv = q.shape[1], k_pool.shape[1]
    for s, (table, c) in enumerate(zip(tables, ctx)):
        slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(c)])
        k = k_pool[slots].float().repeat_interleave(heads // kv, 1)  # (c, heads, hd)
        v = v_pool[slots].float().repeat_interleave(heads // kv, 1)
        scores = torch.einsum("hd,thd->ht", q[s].float(), k) * q.shape[-1] ** -0.5
        if window is not None:
            scores[:, torch.arange(c) <= c - 1 - window] = float("-inf")
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("heads,kv_heads,dtype,window", [
    (6, 2, torch.float32, None),  # GQA
    (4, 4, torch.float32, 19),  # MHA; a window that ends inside the shared blocks
    (6, 2, torch.float32, 5),  # a window inside each sequence's own blocks: nothing shared visible
    (6, 3, torch.bfloat16, None),
])
def test_cascade_equals_softmax_attention_over_all_keys(heads, kv_heads, dtype, window):
    """Families of 3 and 2 samples, a prompt with one sample, a prompt shorter than a block (no
    whole block to share) and sequences of a family at different lengths, against dense fp32
    attention per sequence. Unwritten pool slots hold large garbage, so attending to one would
    show (finite garbage: the pools start as zeros and hold finite keys, as the gather + SDPA path
    also assumes; a masked key's weight is an exact 0)."""
    bs, hd = 4, 16
    tables, ctx, blocks = _forked_tables([13, 9, 10, 3], [3, 2, 1, 2], [2, 5, 1, 4], bs)
    g = torch.Generator().manual_seed(0)
    k_pool = (torch.randn(blocks * bs, kv_heads, hd, generator=g) * 1e3).to(dtype)
    v_pool = (torch.randn(blocks * bs, kv_heads, hd, generator=g) * 1e3).to(dtype)
    for table, c in zip(tables, ctx):
        slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(c)])
        k_pool[slots] = torch.randn(c, kv_heads, hd, generator=g).to(dtype)
        v_pool[slots] = torch.randn(c, kv_heads, hd, generator=g).to(dtype)
    shared_first = {}  # shared blocks must hold the same keys for every sample: write them once
    for table, c in zip(tables, ctx):
        for b in table[:(c - 1) // bs]:
            shared_first.setdefault(b, (k_pool[b * bs:(b + 1) * bs].clone(), v_pool[b * bs:(b + 1) * bs].clone()))
            k_pool[b * bs:(b + 1) * bs], v_pool[b * bs:(b + 1) * bs] = shared_first[b]
    q = torch.randn(len(tables), heads, hd, generator=g).to(dtype)
    plan = plan_shared_prefix(tables, ctx, bs, plain_blocks=10 ** 6, device="cpu")
    assert plan is not None and plan.tables.shape[0] == 2 + 1  # the 3- and 2-sample families, and the empty one
    got = cascade_attention(q, k_pool, v_pool, plan, bs, window=window)
    want = _dense(q, k_pool, v_pool, tables, ctx, bs, window)
    assert got.dtype == dtype and not got.isnan().any()
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=8e-3)
    torch.testing.assert_close(got.float(), want, **tol)


def test_plan_shares_whole_blocks_before_every_newest_token_only():
    bs = 4
    # two samples of a 9-token prompt (2 whole blocks), one token each: contexts 10
    tables, ctx = [[1, 2, 3], [1, 2, 4]], [10, 10]
    plan = plan_shared_prefix(tables, ctx, bs, plain_blocks=6, device="cpu")
    assert plan.tables.tolist() == [[1, 2], [0, 0]] and plan.lens.tolist() == [8, 0]
    assert plan.own_tables.tolist() == [[3], [4]] and plan.own_lens.tolist() == [2, 2]
    assert plan.family.tolist() == [0, 0] and plan.slot.tolist() == [0, 1]
    # a block the newest token sits in is never shared, even with equal ids (contexts 8: block 2 holds them)
    plan = plan_shared_prefix([[1, 2], [1, 2]], [8, 8], bs, plain_blocks=100, device="cpu")
    assert plan.lens.tolist() == [4, 0] and plan.own_tables.tolist() == [[2], [2]]
    # nothing shared (different first blocks, or every context within one block): no plan
    assert plan_shared_prefix([[1, 2], [3, 4]], [6, 6], bs, 4, "cpu") is None
    assert plan_shared_prefix([[1], [1]], [4, 4], bs, 2, "cpu") is None
    # sharing that saves less than a quarter of the plain gather's blocks: no plan
    assert plan_shared_prefix([[1, 2, 3, 5, 6], [1, 7, 8, 9, 10]], [20, 20], bs, 10, "cpu") is None


def test_engine_samples_of_a_prompt_take_the_cascade(monkeypatch):
    """n greedy samples of prompts longer than a few blocks: the decode steps run the cascade,
    and every sample equals posttrain.core.model.generate's greedy tokens (Llama and a sliding-window
    model)."""
    import posttrain.core.generation.runner as runner

    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return cascade_attention(*args, **kwargs)

    monkeypatch.setattr(runner, "cascade_attention", spy)
    base = dict(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
                initializer_range=0.2)
    for args in (ModelArgs(**base), ModelArgs(**base, sliding_window=6, layer_types=["sliding_attention",
                                                                                      "full_attention"])):
        model = build_model(args, seed=0).eval()
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (19, 26, 13)]
        calls.clear()
        outs = Engine(model, max_num_seqs=12, block_size=4, num_blocks=128).generate(
            prompts, RequestParams(n=4, temperature=0, max_tokens=10))
        ref = [r.tokens for r in generate(model, prompts, SamplingParams(max_new_tokens=10, temperature=0))]
        assert [[c.tokens for c in o.completions] for o in outs] == [[r] * 4 for r in ref]
        assert len(calls) >= 9 * args.num_layers  # every decode step after the fork, every layer


def test_two_level_inverse_cdf_equals_one_cumulative_sum():
    """Against the plain searchsorted on one float64 cumulative sum, over vocabularies a block
    size divides and one it does not (padded), rows filtered to a few tokens and rows with most
    mass in one token; draws within 1e-6 of a boundary are left out (rounding may go either way)."""
    g = torch.Generator().manual_seed(0)
    for V in (512, 1000, 1536):
        logits = torch.randn(64, V, generator=g) * torch.linspace(0.5, 8, 64)[:, None]
        logits[:16, :] = logits[:16, :].masked_fill(torch.rand(16, V, generator=g) < 0.97, float("-inf"))
        probs = logits.softmax(-1)
        u = torch.rand(64, generator=g)
        cdf = probs.double().cumsum(-1)
        target = u.double() * cdf[:, -1]
        want = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
        margin = (cdf - target[:, None]).abs().min(-1).values > 1e-6
        got = inverse_cdf(probs, u)
        assert margin.sum() > 56 and torch.equal(got[margin], want[margin])
        assert bool((probs[torch.arange(64), got] > 0).all())  # never a filtered-out token


def test_cascade_with_scores_far_below_zero():
    """A sequence that shares nothing, whose query scores every key near -1000: its (empty) shared
    part must weigh 0, not swamp the merge (exp(-1000) underflows to 0 in fp32)."""
    bs, hd = 4, 8
    tables, ctx, blocks = _forked_tables([9, 6], [2, 1], [1, 2], bs)
    k_pool = torch.ones(blocks * bs, 1, hd)
    v_pool = torch.randn(blocks * bs, 1, hd, generator=torch.Generator().manual_seed(2))
    q = torch.full((len(tables), 2, hd), -1000.0 / hd ** 0.5)  # scores exactly -1000 for every key
    plan = plan_shared_prefix(tables, ctx, bs, plain_blocks=10 ** 6, device="cpu")
    got = cascade_attention(q, k_pool, v_pool, plan, bs)
    torch.testing.assert_close(got, _dense(q, k_pool, v_pool, tables, ctx, bs, None), atol=2e-6, rtol=1e-5)
