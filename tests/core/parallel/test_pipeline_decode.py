"""Decoding under pipeline parallelism (posttrain.core.parallel.pipeline_decode) against one process:
pp=4 (one layer per stage), pp=2 x tp=2, and the looped placement (two stages per rank) with
tied embeddings, on 4 ranks. Greedy and seeded sampling give the same tokens, the same
log-probs and the same finish reasons as posttrain.core.model.generate on the whole model."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.losses import cross_entropy
from posttrain.core.model.generate import SamplingParams, generate
from posttrain.core.parallel import parallelize_pipeline
from posttrain.core.parallel.config import ParallelConfig
from posttrain.core.parallel.mesh import ParallelDims, ParallelMesh
from posttrain.core.parallel.pipeline import keep_own_stages
from posttrain.core.parallel.tensor import decode_without_sequence_parallel
from tests.core.parallel._dist import TOL, clone, model_args, reference_model, run_ranks, setup

PROMPTS = [[5, 9, 11], [7], [3, 4, 8, 2, 6]]  # different lengths: left padding in one batch
PARAMS = {"greedy": SamplingParams(max_new_tokens=7, temperature=0.0, stop_token_ids=(17,)),
          "sampled": SamplingParams(max_new_tokens=7, temperature=0.9, top_k=20, top_p=0.95, seed=3)}


def _decode(layouts) -> dict[str, float]:
    setup(4, pp=2, dp_shard=2)
    results = {}
    for name, fields, tie in layouts:
        cfg = ParallelConfig(**fields)
        mesh = ParallelMesh(ParallelDims.from_config(cfg, 4), "cpu")
        args = model_args("debug", num_layers=4, tie_embeddings=tie)
        ref = reference_model(args)
        model = clone(ref)
        pipe = parallelize_pipeline(model, cfg, mesh, cross_entropy, torch.device("cpu"), microbatch_size=1,
                                    seq_len=16)
        keep_own_stages(model, pipe)
        for kind, params in PARAMS.items():
            want = generate(ref, PROMPTS, params)
            with decode_without_sequence_parallel(model):  # as posttrain.stages.training.sampling does
                got = generate(model, PROMPTS, params)
            key = f"{name}/{kind}"
            results[f"{key}/tokens"] = float(sum(g.tokens != w.tokens or g.finish_reason != w.finish_reason
                                                 for g, w in zip(got, want)))
            results[f"{key}/logps"] = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.logprobs, w.logprobs))
            assert all(len(g.tokens) for g in got)
    return results


@pytest.mark.slow
def test_pipeline_decoding_matches_one_process():
    layouts = [("pp4", dict(pp=4), False),
               ("pp2_x_tp2", dict(pp=2, tp=2), False),
               ("pp2_looped_tied", dict(pp=2, dp_replicate=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2),
                True)]
    res = run_ranks(_decode, 4, layouts)
    for rank_res in res:
        bad = {k: v for k, v in rank_res.items() if not v <= TOL}
        assert not bad, f"differences above {TOL}: {bad}"
    print("\n".join(f"{k}: {v:.2e}" for k, v in sorted(res[0].items())))
