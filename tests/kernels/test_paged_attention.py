"""posttrain.kernels.paged_attention: the Triton decode kernel (interpreter) against the fp32 torch
reference, the reference against dense SDPA over contiguous keys, and the generation engine with
the kernel in its decode steps against the engine on the torch paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import assert_close, launched

from posttrain.kernels import paged_attention as K
from posttrain.kernels.dispatch import kernels_mode

TOL = {
    # Both sides accumulate in fp32 from the same values; only the summation order differs
    # (measured <= 6e-7 on |out| <= 3).
    torch.float32: (2e-6, 1e-5),
    # Inputs are bf16 on both sides (the reference gets their exact fp32 upcast), so what remains
    # is the kernel's one output rounding to bf16 (u = 2^-8): atol u * max|v| (~3.9e-3 * 4), rtol 2u.
    torch.bfloat16: (1.6e-2, 8e-3),
}
PAD = 10 ** 6  # table entries past a sequence's blocks: an out-of-range id, so reading one would fail


def make_case(ctx_lens, block_size, heads, kv_heads, head_dim, dtype=torch.float32, seed=0, spare=3):
    """Per-sequence contiguous keys/values (for the dense check) scattered into a pool of
    shuffled blocks; unused slots hold NaN, so a slot read past ctx_len would show."""
    g = torch.Generator().manual_seed(seed)
    S = len(ctx_lens)
    n_blocks = [-(-c // block_size) for c in ctx_lens]
    total = sum(n_blocks) + spare
    ids = torch.randperm(total, generator=g)
    width = max(n_blocks) + 1  # one padded column even for the longest sequence
    tables = torch.full((S, width), PAD, dtype=torch.long)
    k_pool = torch.full((total * block_size, kv_heads, head_dim), float("nan"))
    v_pool = k_pool.clone()
    dense_k, dense_v, start = [], [], 0
    for s, (ctx, n) in enumerate(zip(ctx_lens, n_blocks)):
        tables[s, :n] = ids[start:start + n]
        start += n
        kd = torch.randn(ctx, kv_heads, head_dim, generator=g).to(dtype)
        vd = torch.randn(ctx, kv_heads, head_dim, generator=g).to(dtype)
        slots = (tables[s, :n, None] * block_size + torch.arange(block_size)).flatten()[:ctx]
        k_pool[slots], v_pool[slots] = kd.float(), vd.float()
        dense_k.append(kd)
        dense_v.append(vd)
    q = torch.randn(S, heads, head_dim, generator=g).to(dtype)
    return q, k_pool.to(dtype), v_pool.to(dtype), tables, torch.tensor(ctx_lens), dense_k, dense_v


# ctx lengths with block size 4: a single token, exactly one block, partial last blocks, longer.
CTX = [1, 4, 7, 13, 8]
SHAPES = {"gqa-d16": (6, 2, 16), "mha-d24": (3, 3, 24)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_kernel_matches_fp32_reference(shape, window, dtype):
    heads, kv_heads, head_dim = SHAPES[shape]
    q, k_pool, v_pool, tables, ctx, _, _ = make_case(CTX, 4, heads, kv_heads, head_dim, dtype)
    with launched(K.LAUNCHES, "paged_decode"):
        out = K.paged_decode_attention(q, k_pool, v_pool, tables, ctx, 4, window=window)
    assert out.dtype == dtype and out.shape == q.shape
    ref = K.paged_decode_reference(q.float(), k_pool.float(), v_pool.float(), tables, ctx, 4, window=window)
    assert torch.isfinite(out).all()
    assert_close(out, ref, TOL[dtype], f"{shape} window={window}")


def test_kernel_larger_blocks_int32_tables_and_scale():
    """Block size 8, int32 tables and ctx lens, an explicit scale, a window longer than every
    context (the same as none)."""
    q, k_pool, v_pool, tables, ctx, _, _ = make_case([3, 8, 17], 8, 4, 1, 16, seed=1)
    tables, ctx = tables.int(), ctx.int()
    with launched(K.LAUNCHES, "paged_decode"):
        out = K.paged_decode_attention(q, k_pool, v_pool, tables, ctx, 8, scale=0.3)
        wide = K.paged_decode_attention(q, k_pool, v_pool, tables, ctx, 8, scale=0.3, window=100)
    ref = K.paged_decode_reference(q, k_pool, v_pool, tables, ctx, 8, scale=0.3)
    assert_close(out, ref, TOL[torch.float32], "bs8")
    assert_close(wide, ref, TOL[torch.float32], "wide window")


def dense(q, dense_k, dense_v, window, scale=None):
    """Independent of the paged layout: SDPA of each sequence's last query over its contiguous
    keys (those the window leaves), GQA by enable_gqa."""
    outs = []
    for s, (kd, vd) in enumerate(zip(dense_k, dense_v)):
        lo = 0 if window is None else max(0, kd.shape[0] - window)
        qs = q[s, :, None, :].float()  # (H, 1, D)
        ks, vs = kd[lo:].float().transpose(0, 1), vd[lo:].float().transpose(0, 1)  # (H_kv, L, D)
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=qs.shape[0] != ks.shape[0])
        outs.append(o[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("window", [None, 1, 5])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_reference_matches_dense_sdpa(shape, window):
    heads, kv_heads, head_dim = SHAPES[shape]
    q, k_pool, v_pool, tables, ctx, dk, dv = make_case(CTX, 4, heads, kv_heads, head_dim, seed=2)
    with kernels_mode("torch"):  # the public function on its torch path is the reference
        out = K.paged_decode_attention(q, k_pool, v_pool, tables, ctx, 4, window=window)
    assert_close(out, dense(q, dk, dv, window), (2e-6, 1e-5), f"{shape} window={window}")
    assert_close(K.paged_decode_reference(q, k_pool, v_pool, tables, ctx, 4, scale=0.5, window=window),
                 dense(q, dk, dv, window, scale=0.5), (2e-6, 1e-5), "scale 0.5")


def test_dispatch_rules_and_errors():
    q, k_pool, v_pool, tables, ctx, dk, dv = make_case([5, 9], 3, 4, 2, 8, seed=3)  # block size 3
    before = K.LAUNCHES["paged_decode"]
    out = K.paged_decode_attention(q, k_pool, v_pool, tables, ctx, 3)  # not a power of two: reference
    assert_close(out, dense(q, dk, dv, None), (2e-6, 1e-5), "block size 3")
    q2, k2, v2, t2, c2, _, _ = make_case([5, 9], 4, 4, 2, 8, seed=3)
    qg = q2.clone().requires_grad_()
    K.paged_decode_attention(qg, k2, v2, t2, c2, 4).sum().backward()  # autograd: the torch path
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    with kernels_mode("torch"):
        K.paged_decode_attention(q2, k2, v2, t2, c2, 4)
    assert K.LAUNCHES["paged_decode"] == before
    with pytest.raises(ValueError, match="multiple"):
        K.paged_decode_attention(q2[:, :3], k2, v2, t2, c2, 4)
    with pytest.raises(ValueError, match="ctx_lens"):
        K.paged_decode_attention(q2, k2, v2, t2, c2[:1], 4)
    with pytest.raises(ValueError, match="window"):
        K.paged_decode_attention(q2, k2, v2, t2, c2, 4, window=0)


# --- the engine's decode steps on the kernel --------------------------------------------------

def _engine_tokens(model, prompts, max_tokens):
    from posttrain.core.generation import Engine, RequestParams

    engine = Engine(model, max_num_seqs=4, block_size=4, num_blocks=32)
    params = RequestParams(temperature=0, max_tokens=max_tokens)
    return [o.completions[0].tokens for o in engine.generate(prompts, params)]


@pytest.mark.parametrize("family", ["llama", "sliding"])
@pytest.mark.slow
def test_engine_greedy_tokens_equal_the_sdpa_path(family):
    """Every kernel of the model runs on Triton here (interpreter), the decode groups on the paged
    kernel; kernels_mode("torch") is today's CPU engine (gather + SDPA). Same greedy tokens."""
    from posttrain.core.model.args import ModelArgs
    from posttrain.core.model.model import build_model

    base = dict(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
                initializer_range=0.2)  # a large init: peaked logits, so greedy ties are unlikely
    if family == "sliding":  # head_dim 12 (padded to 16 in the kernel), a window on layer 0
        base.update(head_dim=12, sliding_window=5, layer_types=["sliding_attention", "full_attention"])
    model = build_model(ModelArgs(**base), seed=0).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (3, 8, 5)]
    with kernels_mode("torch"):
        expected = _engine_tokens(model, prompts, 6)
    with launched(K.LAUNCHES, "paged_decode"):
        got = _engine_tokens(model, prompts, 6)
    assert got == expected


@pytest.mark.parametrize("family,budget,launches", [
    ("llama", 512, 2),  # every prompt fresh in one step: the varlen kernel on both layers
    ("sliding", 512, 1),  # layer 0's window (5) is shorter than the 8-token prompt: it gathers
    ("llama", 4, None),  # chunked prefill: first chunks are fresh, later ones read the cache
])
@pytest.mark.slow
def test_engine_prefill_of_fresh_prompts_takes_the_varlen_kernel(family, budget, launches):
    """A prefill group whose prompts all start in this step attends through
    posttrain.kernels.flash_attention.flash_attn_varlen over the step's own keys (no gather); the greedy
    tokens equal the torch path's (gather + SDPA), also with a second request for a prompt already
    cached (its prefill reads cached blocks, so it gathers)."""
    from posttrain.core.generation import Engine, RequestParams
    from posttrain.core.model.args import ModelArgs
    from posttrain.core.model.model import build_model
    from posttrain.kernels import flash_attention as FA

    base = dict(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
                initializer_range=0.2)
    if family == "sliding":
        base.update(head_dim=12, sliding_window=5, layer_types=["sliding_attention", "full_attention"])
    model = build_model(ModelArgs(**base), seed=0).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (3, 8, 5)]

    def run():
        engine = Engine(model, max_num_seqs=4, block_size=4, num_blocks=32, max_batch_tokens=budget)
        params = RequestParams(temperature=0, max_tokens=5)
        first = [o.completions[0].tokens for o in engine.generate(prompts, params)]
        again = engine.generate([prompts[1] + [7, 9]], params)[0]  # its first 8 tokens' blocks are cached
        assert again.cached_tokens == 8
        return first, again.completions[0].tokens

    with kernels_mode("torch"):
        expected = run()
    before = FA.LAUNCHES["fwd"]
    with launched(FA.LAUNCHES, "fwd"):
        got = run()
    assert got == expected
    if launches is not None:  # the first generate's one prefill step only: the cached request gathers
        assert FA.LAUNCHES["fwd"] - before == launches
