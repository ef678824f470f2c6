"""Pipeline parallelism against one process: every schedule on 2 ranks (dense, MoE, packed
positions, LoRA), pp=2 x tp=2 and pp=2 x FSDP 2 on 4 ranks; the loss, each stage's gradients,
the global gradient norm and the updated weights."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from posttrain.core.parallel.config import ParallelConfig
from posttrain.core.losses import cross_entropy
from posttrain.core.parallel import parallelize_pipeline
from posttrain.core.parallel.losses import vocab_parallel_cross_entropy
from posttrain.core.parallel.mesh import ParallelDims, ParallelMesh
from posttrain.core.parallel.pipeline import split_layers
from tests.core.parallel._dist import (
    TOL, all_reduce, batch, clone, compare_training, dp_reference_loss, dp_shard, model_args, reference_model,
    run_ranks, setup,
)


def test_split_layers():
    assert split_layers(5, 2) == [[0, 1, 2], [3, 4]]
    assert split_layers(4, 4) == [[0], [1], [2], [3]]


class _Stages:
    """This rank's stage modules seen as one model (names are the full model's)."""

    def __init__(self, modules):
        self.mods = modules

    def named_parameters(self):
        return itertools.chain.from_iterable(m.named_parameters() for m in self.mods)

    def parameters(self):
        return (p for _, p in self.named_parameters())


def _run(world: int, layouts) -> dict[str, float]:
    setup(world, pp=2, dp_shard=world // 2)
    results = {}
    for name, fields, preset, packed, *lora in layouts:
        cfg = ParallelConfig(**fields)
        mesh = ParallelMesh(ParallelDims.from_config(cfg, world), "cpu")
        args = model_args(preset, num_layers=4, tie_embeddings=False)
        ids, pos = batch(args, B=4, T=16, packed=packed)
        ref = reference_model(args, lora=dict(rank=4, alpha=8.0, targets="all-linear") if lora else None)
        tp = mesh.group("tp")

        def loss_fn(logits, target):
            if mesh.size("tp") > 1:
                return vocab_parallel_cross_entropy(logits, target, tp)
            return cross_entropy(logits, target)

        mb, dp = cfg.pp_microbatches or cfg.pp, mesh.size("dp")
        pipe = parallelize_pipeline(clone(ref), cfg, mesh, loss_fn, torch.device("cpu"),
                                    microbatch_size=4 // (mb * dp), seq_len=16, packed=packed)
        my_ids, my_pos = dp_shard(ids, mesh), dp_shard(pos, mesh)

        def step(_):
            loss = pipe.step(*((my_ids, my_pos) if packed else (my_ids,)), target=my_ids)
            shown = (loss.mean() if pipe.is_last else torch.zeros(())) + pipe.aux_loss()  # microbatches' mean
            if mesh.size("tp") > 1:  # each tp rank holds a share of the aux loss (token-sharded MoE)
                shown = shown + all_reduce(pipe.aux_loss(), mesh.group("tp")) - pipe.aux_loss()
            return all_reduce(all_reduce(shown, mesh.group("pp")), mesh.group("dp")).item() / dp

        res = compare_training(ref, _Stages(pipe.modules), dp_reference_loss(ids, pos, mb * dp), step_fn=step,
                               pp_group=mesh.group("pp"))
        key = f"{name}/{preset}{'/packed' if packed else ''}{'/lora' if lora else ''}"
        results.update({f"{key}/{k}": v for k, v in res.items()})
    dist.barrier()
    return results


@pytest.mark.slow
def test_pipeline_schedules_match_single_process():
    layouts = [
        ("gpipe", dict(pp=2, pp_schedule="gpipe", pp_microbatches=2), "debug", False),
        ("1f1b", dict(pp=2, pp_schedule="1f1b", pp_microbatches=4), "debug-moe", False),
        ("1f1b", dict(pp=2, pp_schedule="1f1b", pp_microbatches=2), "debug", True, "lora"),
        ("interleaved_1f1b", dict(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2, pp_microbatches=4),
         "debug", False),
    ]
    res = run_ranks(_run, 2, 2, layouts)
    for rank_res in res:
        bad = {k: v for k, v in rank_res.items() if not v <= TOL}
        assert not bad, f"differences above {TOL}: {bad}"
    print("\n".join(f"{k}: {v:.2e}" for k, v in sorted(res[0].items())))


@pytest.mark.slow
def test_pipeline_x_tensor_and_data_parallel_match_single_process():
    layouts = [("pp_x_tp", dict(pp=2, tp=2, pp_schedule="1f1b", pp_microbatches=2), "debug", False),
               ("pp_x_tp", dict(pp=2, tp=2, pp_schedule="gpipe", pp_microbatches=2), "debug-moe", False),
               ("pp_x_fsdp", dict(pp=2, dp_shard=2, pp_schedule="1f1b", pp_microbatches=2), "debug-moe", False)]
    res = run_ranks(_run, 4, 4, layouts)
    for rank_res in res:
        bad = {k: v for k, v in rank_res.items() if not v <= TOL}
        assert not bad, f"differences above {TOL}: {bad}"
    print("\n".join(f"{k}: {v:.2e}" for k, v in sorted(res[0].items())))


def _accumulate_around_eval(world: int) -> float:
    """pp=2 x FSDP 2: two training steps accumulated into one gradient, with and without a
    forward-only step before each (what DPO's disable_adapter reference runs); the largest
    difference of any gradient."""
    from tests.core.parallel._dist import full

    cfg, mesh, device = setup(world, pp=2, dp_shard=2, pp_microbatches=2)
    args = model_args("debug", num_layers=4, tie_embeddings=False)
    ids, _ = batch(args, B=8, T=16)
    ref = reference_model(args)
    grads = []
    for with_eval in (False, True):
        pipe = parallelize_pipeline(clone(ref), cfg, mesh, cross_entropy, device, microbatch_size=1, seq_len=16)
        for half in dp_shard(ids, mesh).chunk(2):
            if with_eval:
                with torch.no_grad():
                    pipe.step(half, target=half, backward=False)
            pipe.step(half, target=half)
        grads.append({n: full(p.grad) for m in pipe.modules for n, p in m.named_parameters()})
    assert grads[0].keys() == grads[1].keys() and all(g is not None for g in grads[0].values())
    return max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0])


@pytest.mark.slow
def test_a_forward_only_step_keeps_the_gradients_accumulated_under_fsdp():
    """torch clears an FSDP stage's gradients whenever a schedule switches between eval and
    training (posttrain.core.parallel.pipeline._Stage keeps them): accumulated micro-batches must survive
    a forward-only pass between them."""
    assert run_ranks(_accumulate_around_eval, 4, 4) == [0.0] * 4
