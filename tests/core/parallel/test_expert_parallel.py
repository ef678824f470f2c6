"""Expert parallelism: the all-to-all dispatcher against the model's own routing (single process,
dropless and with a capacity factor), then debug-moe trained on 4 ranks with ep borrowed from
dp_shard (ep=2 and ep=4, with LoRA, and ep x tp) against one process."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.parallel.config import ParallelConfig
from posttrain.core.model.args import MoEArgs
from posttrain.core.model.moe import MoE, routed_experts
from posttrain.core.parallel import parallelize
from posttrain.core.parallel.expert import AllToAllDispatcher, apply_expert_parallel
from posttrain.core.parallel.mesh import ParallelDims, ParallelMesh
from tests.core.parallel._dist import (
    TOL, batch, clone, compare_training, dp_reference_loss, model_args, par_loss_fn, reference_model, run_ranks,
    setup,
)


def _moe(seed=0):
    torch.manual_seed(seed)
    moe = MoE(16, MoEArgs(num_experts=4, top_k=2, intermediate_size=8))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def test_local_dispatcher_equals_routed_experts():
    moe = _moe()
    x = torch.randn(2, 9, 16)
    ref = moe(x)
    moe.dispatch = AllToAllDispatcher(None, 4)
    torch.testing.assert_close(moe(x), ref, atol=1e-6, rtol=0)


def test_capacity_factor_drops_the_overflow_in_token_order():
    moe = _moe()
    x = torch.randn(1, 12, 16)
    flat = x.view(-1, 16)
    _, _, weights, ids = moe.router(flat)
    counts = torch.bincount(ids.flatten(), minlength=4)
    cf = 0.5  # capacity = ceil(0.5 * 24 / 4) = 3 pairs per expert
    out = AllToAllDispatcher(None, 4, capacity_factor=cf)(moe.experts, flat, weights, ids, counts)
    kept = torch.zeros_like(ids, dtype=torch.bool)
    seen = [0] * 4
    for t in range(ids.shape[0]):  # the rule, spelled out: first 3 (token, slot) pairs per expert
        for j in range(2):
            e = int(ids[t, j])
            kept[t, j] = seen[e] < 3
            seen[e] += 1
    expected = routed_experts(moe.experts, flat, weights * kept, ids, counts)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    assert (counts > 3).any()  # the test does drop something


LAYOUTS = {  # name: (ParallelConfig fields, lora, capacity factor)
    "ep2_fsdp4": (dict(dp_shard=4, ep=2), False, None),
    "ep4_fsdp4": (dict(dp_shard=4, ep=4), False, None),
    "ep2_fsdp4+lora": (dict(dp_shard=4, ep=2), True, None),
    "ep2_fsdp4+capacity": (dict(dp_shard=4, ep=2), False, 1.0),
    "ep2_x_tp2": (dict(dp_shard=2, tp=2, ep=2), False, None),
}


def _ep_matrix():
    setup(4, dp_shard=4, ep=2)
    results = {}
    args = model_args("debug-moe")
    ids, _ = batch(args, B=4, T=16)
    for name, (fields, lora, cf) in LAYOUTS.items():
        cfg = ParallelConfig(**fields)
        mesh = ParallelMesh(ParallelDims.from_config(cfg, 4, args), "cpu")
        ref = reference_model(args, lora=dict(rank=4, alpha=8.0, targets="all-linear") if lora else None)
        par = parallelize(clone(ref), cfg, mesh, capacity_factor=cf)
        if cf is not None:  # the reference drops by the same rule, per data shard, in one process
            for m in ref.modules():
                if isinstance(m, MoE):
                    apply_expert_parallel(m, None, cf)
        local = par.layers[0].mlp.experts.gate_proj.to_local()
        assert local.shape[0] * mesh.size("dp_shard_mod_ep") <= args.moe.num_experts // mesh.size("ep")
        res = compare_training(ref, par, dp_reference_loss(ids, None, mesh.size("dp")), par_loss_fn(mesh, ids),
                               stats_group=mesh.group("dp_cp_tp"))
        results.update({f"{name}/{k}": v for k, v in res.items()})
    return results


@pytest.mark.slow
def test_expert_parallel_matches_single_process():
    res = run_ranks(_ep_matrix, 4, timeout=240)
    for rank_res in res:
        bad = {k: v for k, v in rank_res.items() if not v <= TOL}
        assert not bad, f"differences above {TOL}: {bad}"
    print("\n".join(f"{k}: {v:.2e}" for k, v in sorted(res[0].items())))
