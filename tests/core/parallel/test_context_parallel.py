"""Context parallelism: ring attention against full attention (causal and packed, GQA, forward and
backward), then the models trained under cp=2 (dense, packed, MoE) and cp=2 x tp=2, against one
process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from posttrain.core.parallel.config import ParallelConfig
from posttrain.core.losses import IGNORE_INDEX, cross_entropy
from posttrain.core.losses import shift_labels as _shift
from posttrain.core.model.model import build_attention_mask
from posttrain.core.parallel import context_parallel_shard, context_parallel_unshard, parallelize
from posttrain.core.parallel.context import cp_batch, ring_attention
from posttrain.core.parallel.losses import vocab_parallel_cross_entropy
from posttrain.core.parallel.mesh import ParallelDims, ParallelMesh
from tests.core.parallel._dist import (
    TOL, all_reduce, batch, clone, compare_training, loss_of, model_args, reference_model, run_ranks, setup,
)


def test_shard_unshard_roundtrip():
    x = torch.arange(2 * 16).view(2, 16)
    for cp in (1, 2, 4):
        shards = [context_parallel_shard(x, r, cp) for r in range(cp)]
        assert torch.equal(context_parallel_unshard(torch.cat(shards, 1), cp), x)
    assert context_parallel_shard(x, 0, 2)[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]  # chunks 0 and 3


def _ring_vs_full(group) -> dict[str, float]:
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, T, D = 2, 4, 2, 16, 8
    q, k, v = (torch.randn(B, h, T, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv))
    out = {}
    for packed in (False, True):
        pos = torch.arange(T)[None].repeat(B, 1)
        if packed:
            pos[0] = torch.cat([torch.arange(3), torch.arange(6), torch.arange(T - 9)])
            pos[1] = torch.cat([torch.arange(11), torch.arange(T - 11)])
        docs = torch.cumsum(pos == 0, 1)
        slots = torch.arange(T)[None]
        mask = build_attention_mask(slots, slots, None, docs, docs)
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*ref_in[:1], ref_in[1].repeat_interleave(2, 1),
                                             ref_in[2].repeat_interleave(2, 1), attn_mask=mask)
        dy = torch.randn(ref.shape, generator=g, dtype=ref.dtype)
        (ref * dy).sum().backward()
        loc = [context_parallel_shard(t, r, cp, dim=2).clone().requires_grad_() for t in (q, k, v)]
        batch = cp_batch(context_parallel_shard(pos, r, cp) if packed else None, T // cp, group)
        y = ring_attention(*loc, batch, group)
        (y * context_parallel_shard(dy, r, cp, dim=2)).sum().backward()
        diffs = [(y - context_parallel_shard(ref, r, cp, dim=2)).abs().max()]
        diffs += [(a.grad - context_parallel_shard(b.grad, r, cp, dim=2)).abs().max() for a, b in zip(loc, ref_in)]
        out[f"ring/{'packed' if packed else 'causal'}"] = max(d.item() for d in diffs)
    return out


def cp_loss_fn(mesh, ids, pos):
    """Each rank scores its shard of the (globally shifted) labels; normalized by the global token
    count and multiplied by cp, since data parallelism averages gradients over the cp ranks."""
    cp, r = mesh.size("cp"), mesh.local_rank("cp")
    labels = _shift(ids, IGNORE_INDEX)
    n_tokens = (labels != IGNORE_INDEX).sum()
    sh = [context_parallel_shard(t, r, cp) for t in (ids, pos, labels)]

    def f(m):
        logits = m(sh[0], position_ids=sh[1])
        if mesh.size("tp") > 1:
            local = vocab_parallel_cross_entropy(logits, sh[2], mesh.group("tp"), reduction="sum", shift=False)
        else:
            local = cross_entropy(logits, sh[2], reduction="sum", shift=False)
        loss = local / n_tokens * cp
        aux = m.aux_loss()
        shown = all_reduce(local, mesh.group("cp")) / n_tokens
        if aux is not None:  # each rank holds cp x its share of the global aux loss
            loss = loss + aux
            shown = shown + all_reduce(aux, mesh.group("cp_tp")) / cp
        return loss, shown

    return f


def _cp_models(world: int, cp_fields: dict, cases) -> dict[str, float]:
    _, mesh0, _ = setup(world, **cp_fields)
    results = _ring_vs_full(mesh0.group("cp")) if world == 2 else {}
    cfg = ParallelConfig(**cp_fields)
    mesh = ParallelMesh(ParallelDims.from_config(cfg, world), "cpu")
    for preset, packed, ac, *lora in cases:
        args = model_args(preset)
        ids, pos = batch(args, B=2, T=16, packed=packed)
        if pos is None:
            pos = torch.arange(16)[None].repeat(2, 1)
        ref = reference_model(args, lora=dict(rank=4, alpha=8.0, targets="all-linear") if lora else None)
        par = parallelize(clone(ref), cfg, mesh, activation_checkpointing=ac)
        ref_loss = (lambda m, i=ids, p=pos, pk=packed: loss_of(m, i, p if pk else None))
        res = compare_training(ref, par, ref_loss, cp_loss_fn(mesh, ids, pos), stats_group=mesh.group("dp_cp_tp"))
        key = f"{preset}/{'packed' if packed else 'causal'}{'+ac' if ac else ''}{'+lora' if lora else ''}"
        results.update({f"{key}/{k}": v for k, v in res.items()})
    return results


@pytest.mark.slow
def test_context_parallel_matches_single_process():
    cases = [("debug", False, False), ("debug", True, False), ("debug-moe", True, True)]
    res = run_ranks(_cp_models, 2, 2, dict(cp=2), cases)
    for rank_res in res:
        bad = {k: v for k, v in rank_res.items() if not v <= TOL}
        assert not bad, f"differences above {TOL}: {bad}"
    print("\n".join(f"{k}: {v:.2e}" for k, v in sorted(res[0].items())))


@pytest.mark.slow
def test_context_x_tensor_parallel_matches_single_process():
    cases = [("debug", True, False, "lora"), ("debug-moe", False, False)]
    res = run_ranks(_cp_models, 4, 4, dict(cp=2, tp=2), cases)
    for rank_res in res:
        bad = {k: v for k, v in rank_res.items() if not v <= TOL}
        assert not bad, f"differences above {TOL}: {bad}"
    print("\n".join(f"{k}: {v:.2e}" for k, v in sorted(res[0].items())))
