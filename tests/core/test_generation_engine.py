"""The generation engine (posttrain.core.generation): paged KV cache, continuous batching, sampling.

Tiny models from the project's own ModelArgs (and tiny transformers checkpoints for the HF
references); every greedy comparison is exact token equality."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.generation import Engine, RequestParams
from posttrain.core.generation.paged import BlockManager, BlockTable, OutOfBlocks
from posttrain.core.model.args import ModelArgs, MoEArgs
from posttrain.core.model.generate import SamplingParams, generate
from posttrain.core.model.model import build_model

BASE = dict(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
            initializer_range=0.2)  # a large init: peaked logits, so greedy ties are unlikely
CONFIGS = {
    "llama": ModelArgs(**BASE, tie_embeddings=True),
    "qwen2": ModelArgs(**BASE, qkv_bias=True, family="qwen2"),
    "mistral": ModelArgs(**{**BASE, "num_layers": 3}, sliding_window=5, head_dim=24,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "mixtral": ModelArgs(**BASE, family="mixtral", moe=MoEArgs(num_experts=4, top_k=2, intermediate_size=48)),
}
GREEDY = RequestParams(temperature=0, max_tokens=12)


def prompts_of(lengths, seed=0, vocab=97):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    return build_model(CONFIGS[request.param], seed=0).eval()


@pytest.fixture(scope="module")
def llama():
    return build_model(CONFIGS["llama"], seed=0).eval()


def reference(model, prompts, max_tokens=12):
    return [g.tokens for g in generate(model, prompts, SamplingParams(max_new_tokens=max_tokens, temperature=0))]


def tokens(outputs):
    return [o.completions[0].tokens for o in outputs]


def assert_pool_empty(engine):
    bm = engine.blocks
    assert not engine.has_unfinished()
    assert bm.num_free == bm.num_blocks and all(c == 0 for c in bm.refcount)


def test_greedy_matches_core_generate(model):
    """Prompts of different lengths, some longer than a block and a sliding window, at once."""
    prompts = prompts_of([3, 9, 21, 1, 14])
    engine = Engine(model, max_num_seqs=8, block_size=4, num_blocks=64)
    assert tokens(engine.generate(prompts, GREEDY)) == reference(model, prompts)
    assert_pool_empty(engine)


@pytest.mark.parametrize("budget", [1, 5, 16])
def test_chunked_prefill_and_staggered_arrivals(model, budget):
    """Requests join mid-flight while others decode; prompts prefill in chunks of the budget."""
    prompts = prompts_of([11, 4, 19, 7], seed=1)
    engine = Engine(model, max_num_seqs=3, block_size=4, num_blocks=64, max_batch_tokens=budget)
    ids, outs = [], {}
    for p in prompts:
        ids.append(engine.add_request(p, GREEDY))
        for _ in range(3):  # a few steps between arrivals
            outs.update({o.request_id: o for o in engine.step()})
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    assert [outs[i].completions[0].tokens for i in ids] == reference(model, prompts)
    assert_pool_empty(engine)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen2_moe"])
def test_greedy_matches_transformers(family, tmp_path):
    from posttrain.registry.hf import load_pretrained
    from tests.support.hf_models import make_hf_model

    hf = make_hf_model(family, tmp_path)
    ours = load_pretrained(tmp_path).eval()
    prompts = prompts_of([6, 3, 13], seed=4)
    with torch.no_grad():
        refs = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(p):].tolist()
                for p in prompts]
    engine = Engine(ours, max_num_seqs=4, block_size=4, num_blocks=32, max_batch_tokens=8)
    assert tokens(engine.generate(prompts, RequestParams(temperature=0, max_tokens=10))) == refs


def test_n_samples_share_prompt_blocks(llama):
    bs = 4
    prompt = prompts_of([2 * bs + 3])[0]  # two full blocks and a partly filled one
    engine = Engine(llama, max_num_seqs=4, block_size=bs, num_blocks=32)
    engine.add_request(prompt, RequestParams(n=4, max_tokens=6, seed=7))
    engine.step()  # prefill once, fork into 4, each samples its first token
    running = engine.scheduler.running
    assert len(running) == 4 and engine.blocks.num_used == 3
    assert all(s.table.blocks == running[0].table.blocks for s in running)
    assert [engine.blocks.refcount[b] for b in running[0].table.blocks] == [4, 4, 4]
    engine.step()  # every sample writes the shared last block: copy on write for 3 of them
    assert engine.blocks.copies == 3 and engine.blocks.num_used == 2 + 4
    full = running[0].table.blocks[:2]
    assert all(s.table.blocks[:2] == full for s in running)
    assert len({s.table.blocks[2] for s in running}) == 4
    while engine.has_unfinished():
        engine.step()
    assert_pool_empty(engine)


def test_n_greedy_samples_equal_single(llama):
    prompt = prompts_of([10])[0]
    out = Engine(llama, block_size=4, num_blocks=32).generate([prompt], RequestParams(n=3, temperature=0,
                                                                                      max_tokens=12))[0]
    assert [c.tokens for c in out.completions] == reference(llama, [prompt]) * 3


def test_seeded_sample_is_reproducible_and_batch_independent(llama):
    prompt = prompts_of([7])[0]
    params = RequestParams(temperature=1.0, max_tokens=15, seed=123, n=2)
    alone = Engine(llama, block_size=4, num_blocks=64).generate([prompt], params)[0]
    others = prompts_of([5, 12, 3], seed=9)
    crowd_params = [RequestParams(temperature=1.0, max_tokens=9, seed=s) for s in (1, 2, 3)]
    engine = Engine(llama, max_num_seqs=5, block_size=4, num_blocks=64, max_batch_tokens=6)
    engine.add_request(others[0], crowd_params[0])
    engine.step()
    crowd = engine.generate([others[1], prompt, others[2]], [crowd_params[1], params, crowd_params[2]])[1]
    assert [c.tokens for c in crowd.completions] == [c.tokens for c in alone.completions]
    assert alone.completions[0].tokens != alone.completions[1].tokens  # samples differ (seed + index)
    other_seed = Engine(llama, block_size=4, num_blocks=64).generate([prompt], RequestParams(max_tokens=15, seed=5))
    assert other_seed[0].completions[0].tokens != alone.completions[0].tokens


def test_prefix_cache_reuse(llama):
    bs = 4
    shared = prompts_of([13])[0]  # 3 full blocks and one token
    a, b = shared + [5, 6, 7], shared + [9, 9]
    engine = Engine(llama, block_size=bs, num_blocks=32)
    first = engine.generate([a], GREEDY)[0]
    assert first.cached_tokens == 0
    before = engine.blocks.allocations
    second = engine.generate([b], GREEDY)[0]
    assert second.cached_tokens == 12  # the three full blocks of the shared prefix
    fresh_blocks = -(-(len(b) + GREEDY.max_tokens - 1) // bs)
    assert engine.blocks.allocations - before == fresh_blocks - 3
    assert second.completions[0].tokens == reference(llama, [b])[0]
    again = engine.generate([a], GREEDY)[0]  # a whole prompt cached: its last token is recomputed
    assert again.cached_tokens == 12 and again.completions[0].tokens == first.completions[0].tokens
    assert_pool_empty(engine)


def test_prefix_cache_evicts_lru_when_full(llama):
    engine = Engine(llama, block_size=4, num_blocks=8)
    engine.generate(prompts_of([9], seed=2), RequestParams(temperature=0, max_tokens=4))
    assert len(engine.blocks.cached) > 0
    # a request needing the whole pool evicts the cached blocks instead of failing
    out = engine.generate(prompts_of([20], seed=3), RequestParams(temperature=0, max_tokens=12))[0]
    assert out.completions[0].tokens == reference(llama, prompts_of([20], seed=3))[0]
    assert_pool_empty(engine)


@pytest.mark.parametrize("budget", [4, 64])
def test_preemption_under_a_tiny_pool(model, budget):
    prompts = prompts_of([9, 6, 11, 3], seed=5)
    engine = Engine(model, max_num_seqs=4, block_size=4, num_blocks=10, max_batch_tokens=budget)
    out = engine.generate(prompts, RequestParams(temperature=0, max_tokens=16))
    assert engine.scheduler.num_preemptions > 0
    assert tokens(out) == reference(model, prompts, max_tokens=16)
    assert_pool_empty(engine)


def test_filters_and_stops(llama):
    prompt = prompts_of([6], seed=6)[0]
    greedy = reference(llama, [prompt], max_tokens=10)[0]
    engine = Engine(llama, block_size=4, num_blocks=32, decode=lambda ids: "".join(f"<{i}>" for i in ids))
    outs = engine.generate([prompt] * 5, [
        RequestParams(temperature=1.5, top_k=1, max_tokens=10, seed=0),   # top-1 is greedy
        RequestParams(temperature=1.5, min_p=1.0, max_tokens=10, seed=0),  # only the most likely survives
        RequestParams(temperature=1.5, top_p=1e-6, max_tokens=10, seed=0),  # the nucleus of one token
        RequestParams(temperature=0, max_tokens=10, stop_token_ids=(greedy[3],)),
        RequestParams(temperature=0, max_tokens=10, stop=(f"<{greedy[1]}><{greedy[2]}>",)),
    ])
    assert [o.completions[0].tokens for o in outs[:3]] == [greedy] * 3
    stop_at = greedy.index(greedy[3]) + 1
    assert outs[3].completions[0].tokens == greedy[:stop_at] and outs[3].completions[0].finish_reason == "stop"
    assert outs[4].completions[0].tokens == greedy[:3] and outs[4].completions[0].finish_reason == "stop"
    assert outs[0].completions[0].finish_reason == "length"
    # min_p keeps only tokens near the top: every sampled token is at least min_p times as likely
    out = engine.generate([prompt], RequestParams(min_p=0.5, max_tokens=10, seed=1, top_logprobs=5))[0].completions[0]
    for tok, logp, tops in zip(out.tokens, out.logprobs, out.top_logprobs):
        assert logp >= max(tops.values()) + torch.log(torch.tensor(0.5)).item() - 1e-5


def test_logprobs_match_a_full_forward(llama):
    prompts = prompts_of([5, 12], seed=8)
    engine = Engine(llama, block_size=4, num_blocks=32, max_batch_tokens=7)
    outs = engine.generate(prompts, RequestParams(max_tokens=8, seed=3, top_logprobs=3))
    for p, out in zip(prompts, outs):
        c = out.completions[0]
        ids = torch.tensor([p + c.tokens])
        with torch.no_grad():
            logp = llama(ids)[0].float().log_softmax(-1)[len(p) - 1:-1]  # the rows that chose each token
        want = logp.gather(-1, torch.tensor(c.tokens)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(c.logprobs), want, atol=1e-4)
        for row, tops in zip(logp, c.top_logprobs):
            values, top_ids = row.topk(3)
            assert list(tops) == top_ids.tolist()
            assert torch.allclose(torch.tensor(list(tops.values())), values, atol=1e-4)


def test_decoding_sequences_of_short_and_long_contexts_attend_in_two_groups(model):
    """Twelve prompts of 2 to 60 tokens decode in two attention groups (short and long contexts
    apart, each padded to its own longest), and give core.generate's greedy tokens."""
    from posttrain.core.generation.runner import _split_by_context

    lengths = [2, 60, 3, 55, 4, 58, 2, 5, 61, 3, 57, 6]
    groups = _split_by_context(list(range(12)), [n + 1 for n in lengths], 4)
    assert sorted(sum(groups, [])) == list(range(12)) and len(groups) == 2
    assert max(lengths[i] for i in groups[0]) < min(lengths[i] for i in groups[1])
    assert _split_by_context(list(range(12)), [40] * 12, 4) == [list(range(12))]  # nothing to gain: one group
    prompts = prompts_of(lengths, seed=3)
    engine = Engine(model, max_num_seqs=12, block_size=4, num_blocks=256)
    assert tokens(engine.generate(prompts, GREEDY)) == reference(model, prompts)
    assert_pool_empty(engine)


def test_inverse_cdf_draws_kept_tokens_only():
    """The token where the cumulative probability passes u * total; never a filtered-out (zero)
    token, also when u * total reaches the total (u = 1 here), where the last kept token is drawn."""
    from posttrain.core.generation.sampling import inverse_cdf

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    assert inverse_cdf(probs, torch.tensor([0.0, 0.0, 0.0])).tolist() == [1, 0, 2]
    assert inverse_cdf(probs, torch.tensor([0.49, 0.5, 0.99])).tolist() == [1, 2, 2]
    assert inverse_cdf(probs, torch.tensor([0.5, 0.79, 0.5])).tolist() == [3, 3, 2]
    assert inverse_cdf(probs, torch.tensor([1.0, 1.0, 1.0])).tolist() == [3, 4, 2]  # past the end: last kept


def test_paged_gather_reads_each_sequences_blocks():
    """PagedKVCache.gather: row s holds sequence s's tokens in its blocks' order (any block ids,
    repeated ones too: forked samples share their prompt's blocks)."""
    from posttrain.core.generation.paged import PagedKVCache

    cache = PagedKVCache(num_layers=2, num_blocks=5, kv_heads=2, block_size=3, head_dim=4, device="cpu",
                         dtype=torch.float32)
    cache.k.copy_(torch.randn_like(cache.k))
    cache.v.copy_(torch.randn_like(cache.v))
    tables = torch.tensor([[4, 0], [2, 4], [1, 1]])
    k, v = cache.gather(1, tables)
    assert k.shape == v.shape == (3, 2, 6, 4)
    for s, blocks in enumerate(tables.tolist()):
        slots = [b * 3 + o for b in blocks for o in range(3)]
        assert torch.equal(k[s], cache.k[1, slots].transpose(0, 1)) and torch.equal(v[s], cache.v[1, slots].transpose(0, 1))


def test_block_manager_refcounts_and_cow():
    bm = BlockManager(num_blocks=6, block_size=4)
    t = BlockTable()
    bm.reserve(t, 0, 6)  # two blocks, the second partly filled
    assert len(t.blocks) == 2 and bm.num_free == 4
    child = bm.fork(t)
    assert [bm.refcount[b] for b in t.blocks] == [2, 2]
    assert bm.blocks_needed(child, 6, 1) == 1  # the shared partial block is copied first
    bm.reserve(child, 6, 1)
    assert child.blocks[0] == t.blocks[0] and child.blocks[1] != t.blocks[1] and bm.copies == 1
    bm.register_full(t, list(range(6)), 6)  # one full block hashed and cached
    first = t.blocks[0]
    bm.free(t)
    bm.free(child)
    assert bm.num_free == 6 and len(bm.evictable) == 1
    hits, _ = bm.lookup(list(range(4)) + [99])
    assert hits == [first]
    # hashes chain over the prefix: an equal block after a different one does not hit
    other = BlockTable()
    bm.reserve(other, 0, 9)
    bm.register_full(other, [7, 7, 7, 7] + list(range(4)) + [1], 9)
    assert len(bm.lookup([7, 7, 7, 7] + list(range(4)) + [1])[0]) == 2
    assert bm.lookup(list(range(4)) + list(range(4)) + [1])[0] == [first]
    bm.free(other)
    with pytest.raises(OutOfBlocks):
        bm.reserve(BlockTable(), 0, 100)


def test_lora_model_in_training_mode():
    """LoRA-wrapped projections run through the engine as modules (dropout off: eval while it runs)."""
    from posttrain.core.lora import apply_lora

    model = build_model(CONFIGS["qwen2"], seed=1)
    apply_lora(model, targets="all-linear", rank=4, dropout=0.5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora" in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    model.train()
    prompts = prompts_of([4, 10], seed=11)
    got = tokens(Engine(model, block_size=4, num_blocks=32).generate(prompts, GREEDY))
    assert model.training
    assert got == reference(model, prompts)


def test_bf16_model_runs_with_a_bf16_cache():
    model = build_model(CONFIGS["mistral"], seed=0, dtype=torch.bfloat16).eval()
    engine = Engine(model, block_size=4, num_blocks=32, max_batch_tokens=6)
    assert engine.runner.cache.k.dtype == torch.bfloat16
    outs = engine.generate(prompts_of([3, 9], seed=12), RequestParams(max_tokens=8, seed=0, n=2))
    assert all(len(c.tokens) == 8 and all(lp <= 0 for lp in c.logprobs) for o in outs for c in o.completions)
    assert_pool_empty(engine)


def test_cpu_decode_keeps_gather_and_sdpa(llama, monkeypatch):
    """Off CUDA (no TRITON_INTERPRET) the decode groups never reach the paged decode kernel's
    entry point: CPU production runs gather + SDPA as before. The kernel path itself is tested
    under the interpreter in tests/kernels/test_paged_attention.py."""
    import posttrain.core.generation.runner as runner
    from posttrain.kernels.dispatch import interpreting

    if interpreting():
        pytest.skip("under TRITON_INTERPRET=1 the CPU decode groups take the kernel")

    def fail(*args, **kwargs):
        raise AssertionError("paged_decode_attention called on the CPU path")

    monkeypatch.setattr(runner, "paged_decode_attention", fail)
    prompts = prompts_of([3, 9, 6], seed=13)
    engine = Engine(llama, max_num_seqs=4, block_size=4, num_blocks=32)
    assert tokens(engine.generate(prompts, RequestParams(temperature=0, max_tokens=5))) == reference(llama, prompts, 5)


def test_forked_samples_preempted_and_chunked(llama):
    """n greedy samples of a prompt prefilled in chunks, in a pool too small for all of them."""
    prompts = prompts_of([9, 13], seed=13)
    engine = Engine(llama, max_num_seqs=6, block_size=4, num_blocks=12, max_batch_tokens=5)
    outs = engine.generate(prompts, [RequestParams(n=4, temperature=0, max_tokens=14),
                                     RequestParams(n=2, temperature=0, max_tokens=14)])
    assert engine.scheduler.num_preemptions > 0
    refs = reference(llama, prompts, max_tokens=14)
    assert [[c.tokens for c in o.completions] for o in outs] == [[refs[0]] * 4, [refs[1]] * 2]
    assert_pool_empty(engine)


def test_without_prefix_cache(llama):
    prompt = prompts_of([13])[0]
    engine = Engine(llama, block_size=4, num_blocks=16, enable_prefix_cache=False)
    first, second = engine.generate([prompt, prompt], GREEDY)
    again = engine.generate([prompt], GREEDY)[0]
    assert first.cached_tokens == second.cached_tokens == again.cached_tokens == 0 and not engine.blocks.cached
    assert tokens([first, second, again]) == reference(llama, [prompt]) * 3
    assert_pool_empty(engine)


def test_requests_that_cannot_fit_are_refused(llama):
    engine = Engine(llama, max_num_seqs=2, block_size=4, num_blocks=4)
    with pytest.raises(ValueError, match="pool"):
        engine.add_request(list(range(1, 10)), RequestParams(max_tokens=8))
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request([1, 2], RequestParams(n=3, max_tokens=2))
    with pytest.raises(ValueError, match="decode"):
        engine.add_request([1, 2], RequestParams(stop=("x",), max_tokens=2))
    with pytest.raises(ValueError):
        engine.add_request([], RequestParams(max_tokens=2))


def test_prompt_of_whole_blocks_cached_twice(llama):
    """Its last block is recomputed into a fresh block (a cached block is never written)."""
    prompt = prompts_of([12], seed=14)[0]
    engine = Engine(llama, block_size=4, num_blocks=16)
    outs = [engine.generate([prompt], GREEDY)[0] for _ in range(2)]
    assert [o.cached_tokens for o in outs] == [0, 8]
    assert tokens(outs) == reference(llama, [prompt]) * 2
    assert_pool_empty(engine)


def test_engine_generate_keeps_generates_contract():
    """engine_generate: n samples a prompt in prompt-major order, greedy equal to generate() on
    the prompts repeated, seeded samples reproducible, finish reasons and log-probs filled; a
    model split by tensor parallelism is refused (its layers are not whole here)."""
    from posttrain.core.generation.engine import engine_generate
    from posttrain.core.model import build_model, get_preset
    from posttrain.core.model.generate import SamplingParams, generate

    model = build_model(get_preset("debug"), seed=0).eval()
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    greedy = SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=(3,))
    want = generate(model, [p for p in prompts for _ in range(2)], greedy)
    got = engine_generate(model, prompts, greedy, n=2)
    assert [(g.tokens, g.finish_reason) for g in got] == [(g.tokens, g.finish_reason) for g in want]
    assert all(abs(a - b) < 1e-4 for g, w in zip(got, want) for a, b in zip(g.logprobs, w.logprobs))
    sampled = SamplingParams(max_new_tokens=6, temperature=1.0, seed=7)
    first, again = engine_generate(model, prompts, sampled, n=3), engine_generate(model, prompts, sampled, n=3)
    assert len(first) == 9 and [g.tokens for g in first] == [g.tokens for g in again]
    model.lm_head.tp_group = object()  # what tensor parallelism leaves on a split head
    with pytest.raises(ValueError, match="under tensor parallelism: sampling needs a seed"):
        engine_generate(model, prompts, SamplingParams(max_new_tokens=2, temperature=1.0))
    del model.lm_head.tp_group
    model.pipeline = object()  # what pipeline parallelism leaves on a model split into stages
    with pytest.raises(ValueError, match="this layout pipelines or shards it"):
        engine_generate(model, prompts, greedy)


def _engine_under_tp() -> dict:
    import torch.distributed as dist

    from posttrain.core.generation.engine import engine_generate
    from posttrain.core.model import build_model, get_preset
    from posttrain.core.model.generate import SamplingParams
    from posttrain.core.parallel.config import ParallelConfig
    from posttrain.core.parallel.mesh import ParallelDims, ParallelMesh
    from posttrain.core.parallel.plans import apply_plan, transformer_tp_plan

    dist.init_process_group("gloo")
    args = get_preset("debug")
    model = build_model(args, seed=0).eval()
    mesh = ParallelMesh(ParallelDims.from_config(ParallelConfig(tp=2), 2), "cpu")
    apply_plan(model, transformer_tp_plan(args, sequence_parallel=False), mesh["tp"])
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15]]
    greedy = engine_generate(model, prompts, SamplingParams(max_new_tokens=6, temperature=0), n=2)
    sampled = engine_generate(model, prompts, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3), n=2)
    return {"greedy": [g.tokens for g in greedy], "sampled": [g.tokens for g in sampled]}


@pytest.mark.slow
def test_the_engine_runs_a_tensor_parallel_model():
    """2 gloo ranks, the debug model split by the TP plan (no sequence parallelism): greedy tokens
    equal one process's, seeded samples equal on both ranks (the gathered logits are the same)."""
    from posttrain.core.generation.engine import engine_generate
    from posttrain.core.model import build_model, get_preset
    from posttrain.core.model.generate import SamplingParams
    from tests.core.parallel._dist import run_ranks

    a, b = run_ranks(_engine_under_tp, 2)
    model = build_model(get_preset("debug"), seed=0).eval()
    want = engine_generate(model, [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15]],
                           SamplingParams(max_new_tokens=6, temperature=0), n=2)
    assert a["greedy"] == b["greedy"] == [g.tokens for g in want]
    assert a["sampled"] == b["sampled"]


def test_requests_for_different_adapters_share_a_batch():
    """Several LoRA adapters on one base: each request names its own (or none: the base), they
    run in the same steps, each token routed to its request's adapter; every output equals
    posttrain.core.model.generate with that adapter alone active (or all disabled). The prefix cache keeps
    the adapters apart (the same prompt through another adapter is computed again)."""
    from posttrain.core.generation import Engine, RequestParams
    from posttrain.core.lora import apply_lora, disable_adapter, set_adapter
    from posttrain.core.model import build_model, get_preset
    from posttrain.core.model.generate import SamplingParams, generate

    model = build_model(get_preset("debug"), seed=0).eval()
    torch.manual_seed(1)
    apply_lora(model, rank=4, alpha=8.0, targets="all-linear", adapter_name=["a", "b"])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # a full block and more
    want = {}
    for name in ("a", "b"):
        set_adapter(model, name)
        want[name] = generate(model, [prompt], SamplingParams(max_new_tokens=8, temperature=0))[0].tokens
    with disable_adapter(model):
        want[None] = generate(model, [prompt], SamplingParams(max_new_tokens=8, temperature=0))[0].tokens
    assert len({tuple(v) for v in want.values()}) == 3  # the adapters really differ
    engine = Engine(model, max_num_seqs=4, block_size=16, num_blocks=32)
    outs = engine.generate([prompt] * 3, [RequestParams(max_tokens=8, temperature=0, adapter=a) for a in ("a", "b", None)])
    assert [o.completions[0].tokens for o in outs] == [want["a"], want["b"], want[None]]
    fresh = Engine(model, max_num_seqs=4, block_size=16, num_blocks=32)
    (first,) = fresh.generate([prompt], RequestParams(max_tokens=8, temperature=0, adapter="a"))
    (other,) = fresh.generate([prompt], RequestParams(max_tokens=8, temperature=0, adapter="b"))
    (again,) = fresh.generate([prompt], RequestParams(max_tokens=8, temperature=0, adapter="a"))
    assert (first.cached_tokens, other.cached_tokens, again.cached_tokens) == (0, 0, 16)  # per adapter
    assert other.completions[0].tokens == want["b"] and again.completions[0].tokens == want["a"]
    with pytest.raises(ValueError, match="unknown LoRA adapter 'c'"):
        engine.add_request(prompt, RequestParams(adapter="c"))


def test_step_tokens_report_each_appended_token(llama):
    """`step_tokens` lists every token the last step appended (request, sample, token, log-probs),
    so a streaming server sees tokens as they come; together they rebuild each completion."""
    engine = Engine(llama, max_num_seqs=4, block_size=8, num_blocks=32)
    p0, p1 = prompts_of([5, 11], seed=3)
    r0 = engine.add_request(p0, RequestParams(temperature=0, max_tokens=6, top_logprobs=2))
    r1 = engine.add_request(p1, RequestParams(temperature=1.0, max_tokens=4, n=2, seed=7, logprobs=False))
    seen: dict[tuple[int, int], list[int]] = {}
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
        for rid, index, token, logp, tops in engine.step_tokens:
            seen.setdefault((rid, index), []).append(token)
            if rid == r0:
                assert isinstance(logp, float) and len(tops) == 2
            else:
                assert logp is None and tops is None
    assert seen == {(o.request_id, c.index): c.tokens for o in outs.values() for c in o.completions}
    assert len(seen) == 3 and outs[r0].completions[0].tokens == tokens(engine.generate([p0], GREEDY))[0][:6]


def test_abort_frees_a_request_and_leaves_the_others_alone(llama):
    """Abort one mid chunked prefill, running ones (one forked) and a waiting one: their blocks come
    back, they give no output, the request that stays gets its greedy tokens."""
    long, keep, forked, waiting = prompts_of([40, 5, 9, 4], seed=3)
    engine = Engine(llama, max_num_seqs=4, block_size=4, num_blocks=64, max_batch_tokens=24)
    sched, ids = engine.scheduler, lambda seqs: {s.request.request_id for s in seqs}
    lng = engine.add_request(long, GREEDY)
    k = engine.add_request(keep, GREEDY)
    f = engine.add_request(forked, RequestParams(n=2, max_tokens=12, seed=1))
    w = engine.add_request(waiting, GREEDY)  # seats: 1 + 1 + 2 = 4, none left for it
    engine.step()  # 24 of the long prompt's 40 tokens
    assert ids(sched.running) == {lng} and sched.running[0].pending == 16 and engine.blocks.num_used == 6
    assert engine.abort(lng)
    assert engine.blocks.num_used == 0  # (its full blocks stay cached, evictable)
    engine.step()
    engine.step()
    assert len(sched.running) == 4 and ids(sched.running) == {k, f, w}  # f forked into 2
    late = engine.add_request(prompts_of([7], seed=4)[0], GREEDY)
    engine.step()
    assert ids(sched.waiting) == {late}  # no seat
    assert engine.abort(late) and engine.abort(f) and engine.abort(w)
    assert not engine.abort(f) and not engine.abort(12345)  # gone / never there
    assert ids((*sched.running, *sched.waiting)) == {k}
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.request_id for o in outs] == [k] and not engine.requests
    assert outs[0].completions[0].tokens == reference(llama, [keep])[0]
    assert_pool_empty(engine)
