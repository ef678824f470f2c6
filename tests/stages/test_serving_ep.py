"""`posttrain serve-model MOE --ep K` (posttrain.stages.serving.tp, layout "ep"): one replica whose MoE layers
hold 1/K of the experts on each of K processes, the other layers whole on each. Fast: flags the
model cannot take are refused before anything starts. On 2 gloo ranks: the split keeps each
rank's half of the experts, and the split model's logits equal the whole model's. A real --ep 2
server (a Mixtral-shaped checkpoint saved here), driven by the official `openai` client: greedy,
streamed, chat and seeded-sampled answers token for token like the one-process engine, the log
naming which experts each rank holds, and SIGTERM stopping both ranks with exit 0."""

from __future__ import annotations

import time

import pytest
import torch

from posttrain.core.generation import RequestParams

# ------------------------------------------------------------------ fast checks


@pytest.mark.parametrize("argv,msg", [
    (["debug", "--ep", "2"], "--ep 2: the model is dense (no experts)"),
    (["debug-moe", "--ep", "3"], "--ep 3: ep=3 does not divide the model's n_experts=4"),
    (["debug-moe", "--ep", "3", "--replicas", "2"], "--ep 3: ep=3 does not divide"),
    (["debug-moe", "--ep", "2", "--tp", "2"], "--tp 2 and --ep 2 do not combine"),
    (["debug-moe", "--ep", "0"], "--ep must be at least 1"),
])
def test_an_ep_the_model_cannot_take_is_refused_before_anything_starts(argv, msg, capsys):
    from posttrain.flows.cli import main

    t0 = time.time()
    assert main(["serve-model", *argv]) == 2
    assert msg in capsys.readouterr().err
    assert time.time() - t0 < 10


def _moe_args():
    from posttrain.core.model import get_preset

    return get_preset("debug-moe", initializer_range=0.2)  # a large init: no greedy ties


def _split_on_each_rank():
    """Rank r of 2: build the model whole, split it as serve-model --ep 2 does, compare."""
    import copy

    import torch.distributed as dist

    from posttrain.core.model import build_model
    from posttrain.core.model.moe import MoE
    from posttrain.core.parallel.config import ParallelConfig
    from posttrain.core.parallel.mesh import init_distributed
    from posttrain.stages.serving.tp import LAYOUTS

    mesh, _ = init_distributed(ParallelConfig(**LAYOUTS["ep"].config(2), device="cpu"))
    whole = build_model(_moe_args(), seed=0).eval()
    model = copy.deepcopy(whole)
    held = LAYOUTS["ep"].split(model, mesh)
    rank = dist.get_rank()
    shards = []
    for (name, moe), ref in zip(((n, m) for n, m in model.named_modules() if isinstance(m, MoE)),
                                (m for m in whole.modules() if isinstance(m, MoE))):
        for w in ("gate_proj", "up_proj", "down_proj"):
            mine, full = getattr(moe.experts, w).to_local(), getattr(ref.experts, w)
            shards.append((f"{name}.{w}", mine.shape[0], full.shape[0], torch.equal(mine, full[2 * rank:2 * rank + 2])))
    ids = torch.randint(0, 512, (3, 11), generator=torch.Generator().manual_seed(0))  # the same on both ranks
    with torch.no_grad():
        diff = (model(ids).float() - whole(ids).float()).abs().max().item()
    return held, shards, diff


@pytest.mark.slow
def test_the_ep_split_keeps_half_the_experts_per_rank_and_the_model_s_outputs():
    from tests.core.parallel._dist import run_ranks

    for rank, (held, shards, diff) in enumerate(run_ranks(_split_on_each_rank, 2)):
        assert held == f"holds experts {2 * rank}..{2 * rank + 1} of 4 in each of 2 MoE layers"
        assert len(shards) == 6  # 2 MoE layers x gate/up/down
        for name, local, total, same in shards:
            assert (local, total, same) == (2, 4, True), (rank, name)
        assert diff < 1e-5, (rank, diff)


# ------------------------------------------------------------------ a real --ep 2 server

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """debug-moe (Mixtral-shaped: 4 experts, top-2) with the byte tokenizer, saved as an HF checkpoint."""
    from posttrain.core.model import build_model
    from posttrain.registry.byte_tokenizer import byte_tokenizer
    from posttrain.registry.hf import save_pretrained

    path = tmp_path_factory.mktemp("moe") / "model"
    save_pretrained(build_model(_moe_args(), seed=0), path)
    byte_tokenizer(512).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The one-process engine on the same checkpoint: (token lists, log-prob lists, texts)."""
    from posttrain.core.generation import Engine
    from posttrain.registry.hf import load_pretrained
    from posttrain.registry.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(checkpoint)
    engine = Engine(load_pretrained(checkpoint).eval(), max_num_seqs=4, block_size=16,
                    decode=lambda ids: tok.decode(ids, skip_special_tokens=True))

    def run(prompt_ids, max_tokens, temperature=0.0, seed=None, n=1):
        (out,) = engine.generate([prompt_ids], RequestParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                                                             n=n, stop_token_ids=tuple(tok.eos_ids)))
        return ([c.tokens for c in out.completions], [c.logprobs for c in out.completions],
                [tok.decode(c.tokens, skip_special_tokens=True) for c in out.completions])

    run.tok = tok
    return run


@pytest.mark.slow
def test_an_ep2_server_answers_token_for_token_like_one_process(checkpoint, reference, tmp_path):
    from tests.stages.test_serving_tp import TPServer, running

    s = TPServer(checkpoint, tmp_path / "serve.log", flags=("--ep", "2"))
    try:
        followers = s.followers()
        assert len(followers) == 1
        log = s.text()
        assert "expert-parallel rank 0 holds experts 0..1 of 4 in each of 2 MoE layers" in log, log[-3000:]
        assert "expert-parallel rank 1 holds experts 2..3 of 4 in each of 2 MoE layers" in log, log[-3000:]
        assert "expert-parallel replica of 2 ranks ready" in log

        client = s.client()
        tok = reference.tok
        for p in ("the quick brown fox", "experts spread over ranks: "):
            tokens, logps, texts = reference(tok.encode(p, add_special_tokens=False), 12)
            got = client.completions.create(model="debug", prompt=p, max_tokens=12, temperature=0,
                                            logprobs=0).choices[0]
            assert got.text == texts[0]
            assert len(got.logprobs.token_logprobs) == len(tokens[0])
            assert max(abs(a - b) for a, b in zip(got.logprobs.token_logprobs, logps[0])) < 1e-4

        p = "streamed "
        _, _, texts = reference(tok.encode(p, add_special_tokens=False), 16)
        chunks = client.completions.create(model="debug", prompt=p, max_tokens=16, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks) == texts[0]

        messages = [{"role": "user", "content": "hi there"}]
        _, _, texts = reference(tok.apply_chat_template(messages, add_generation_prompt=True), 10)
        chat = client.chat.completions.create(model="debug", messages=messages, max_tokens=10, temperature=0)
        assert chat.choices[0].message.content == texts[0]

        p = "sample me twice "  # n=2 in one batch: two rows routed their own ways
        tokens, logps, texts = reference(tok.encode(p, add_special_tokens=False), 10, temperature=1.0, seed=7, n=2)
        got = client.completions.create(model="debug", prompt=p, max_tokens=10, temperature=1.0, seed=7, n=2,
                                        logprobs=0)
        by_index = sorted(got.choices, key=lambda c: c.index)
        assert [c.text for c in by_index] == texts and texts[0] != texts[1]
        for c, want in zip(by_index, logps):
            assert max(abs(a - b) for a, b in zip(c.logprobs.token_logprobs, want)) < 1e-4
    finally:
        rc = s.stop()
    log = s.text()
    assert rc == 0, log[-3000:]
    assert "Traceback" not in log and "stopped:" not in log, log[-5000:]
    time.sleep(0.5)
    assert not [p for p in followers if running(p)], "a follower outlived SIGTERM on rank 0"
