"""Tensor + sequence parallelism on 2 ranks against one process: the model matrix (dense / MoE,
with / without sequence parallelism, with / without LoRA) trained two AdamW steps, and the
vocab-parallel losses against posttrain.core.losses."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from posttrain.core import losses as L
from posttrain.core.parallel.config import ParallelConfig
from posttrain.core.parallel import parallelize
from posttrain.core.parallel import losses as VP
from posttrain.core.parallel import mappings as M
from posttrain.core.parallel.tensor import ColumnParallelLinear, RowParallelLoRALinear, VocabParallelEmbedding
from tests.core.parallel._dist import (
    TOL, batch, clone, compare_training, loss_of, model_args, reference_model, run_ranks, setup,
)

LORA = dict(rank=4, alpha=8.0, targets="all-linear")


def _vocab_losses(tp_group) -> dict[str, float]:
    r, n = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    g = torch.Generator().manual_seed(1)
    z = torch.randn(3, 7, 40, generator=g, dtype=torch.float64)
    zt = torch.randn(3, 7, 40, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 40, (3, 7), generator=g)
    labels[0, 2] = L.IGNORE_INDEX
    mask = torch.rand(3, 7, generator=g) > 0.3
    out = {}

    def pair(name, full_fn, par_fn, inputs):
        full_in = [t.clone().requires_grad_() for t in inputs]
        loc_in = [t.chunk(n, -1)[r].clone().requires_grad_() for t in inputs]
        ref, par = full_fn(*full_in), par_fn(*loc_in)
        ref.sum().backward()
        par.sum().backward()
        gdiff = max((a.grad.chunk(n, -1)[r] - b.grad).abs().max().item() for a, b in zip(full_in, loc_in))
        out[name] = max((ref - par).abs().max().item(), gdiff)

    for red in ("mean", "sum", "none"):
        pair(f"ce_{red}", lambda x: L.cross_entropy(x, labels, reduction=red, softcap=30.0),
             lambda x: VP.vocab_parallel_cross_entropy(x, labels, tp_group, reduction=red, softcap=30.0), [z])
    pair("seq_logps", lambda x: L.sequence_logps(x, labels, average=True),
         lambda x: VP.vocab_parallel_sequence_logps(x, labels, tp_group, average=True), [z])
    for kind in L.DISTILL_KINDS:
        pair(f"distill_{kind}", lambda s, t: L.distill_loss(s, t, kind, temperature=2.0, beta=0.3, mask=mask),
             lambda s, t: VP.vocab_parallel_distill_loss(s, t, tp_group, kind, temperature=2.0, beta=0.3, mask=mask),
             [z, zt])
    # offline distillation: the teacher's top-k over the split vocab, and the loss against it
    flat_t = zt.flatten(0, 1)
    want = flat_t.log_softmax(-1).topk(5, dim=-1)
    ids, lps = VP.vocab_parallel_topk(flat_t.chunk(n, -1)[r], 5, tp_group)
    out["topk_ids"] = float(not torch.equal(ids, want.indices))
    out["topk_logps"] = (lps - want.values).abs().max().item()
    for kind in L.DISTILL_KINDS:
        pair(f"distill_topk_{kind}",
             lambda s: L.distill_loss_topk(s.flatten(0, 1), ids, lps, kind, temperature=2.0, beta=0.3,
                                           reduction="sum"),
             lambda s: VP.vocab_parallel_distill_topk(s.flatten(0, 1), ids, lps, tp_group, kind, temperature=2.0,
                                                      beta=0.3, reduction="sum"), [z])
    return out


def _mapping_pairs(group) -> dict[str, float]:
    """Each collective's forward and backward against its definition, with every rank's input
    generated on every rank (so the expectation needs no communication)."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(2, 4, 3, generator=g, dtype=torch.float64) for _ in range(n)]  # rank i's input
    full_gs = [torch.randn(2, 4 * n, 3, generator=g, dtype=torch.float64) for _ in range(n)]
    gs = [t[:, :4] for t in full_gs]
    cat = lambda ts: torch.cat(ts, 1)  # noqa: E731
    chunk = lambda t: t.chunk(n, 1)[r]  # noqa: E731
    total = lambda ts: sum(ts)  # noqa: E731
    cases = {  # name: (fn, upstream grads per rank, expected forward, expected backward)
        "copy_to_tp": (M.copy_to_tp, gs, xs[r], total(gs)),
        "reduce_from_tp": (M.reduce_from_tp, gs, total(xs), gs[r]),
        "gather_from_sp": (M.gather_from_sp, full_gs, cat(xs), chunk(total(full_gs))),
        "reduce_scatter_to_sp": (M.reduce_scatter_to_sp, [t[:, :4 // n] for t in gs], chunk(total(xs)),
                                 cat([t[:, :4 // n] for t in gs])),
        "scatter_to_sp": (M.scatter_to_sp, [t[:, :4 // n] for t in gs], chunk(xs[r]),
                          cat([t[:, :4 // n] for t in gs])),
        "gather_from_sp_replicated": (M.gather_from_sp_replicated, full_gs, cat(xs), chunk(full_gs[r])),
    }
    out = {}
    for name, (fn, grads, fwd, bwd) in cases.items():
        x = xs[r].clone().requires_grad_()
        y = fn(x, group)
        y.backward(grads[r])
        out[f"mapping_{name}"] = max((y - fwd).abs().max().item(), (x.grad - bwd).abs().max().item())
    # all_to_all with uneven splits: rank i sends rows[i][j] rows to rank j; upstream gradients are
    # arange-valued so each row's gradient says where it came from.
    rows = [[i + j + 1 for j in range(n)] for i in range(n)]
    data = [torch.randn(sum(rows[i]), 3, generator=g, dtype=torch.float64) for i in range(n)]
    ups = [torch.arange(sum(rows[i][j] for i in range(n)) * 3, dtype=torch.float64).view(-1, 3) + 100 * j
           for j in range(n)]  # rank j's upstream gradient of its received rows
    x = data[r].clone().requires_grad_()
    y = M.all_to_all(x, [rows[i][r] for i in range(n)], rows[r], group)
    y.backward(ups[r])
    fwd = torch.cat([data[i].split(rows[i])[r] for i in range(n)])
    bwd = torch.cat([ups[j].split([rows[i][j] for i in range(n)])[r] for j in range(n)])
    out["mapping_all_to_all"] = max((y - fwd).abs().max().item(), (x.grad - bwd).abs().max().item())
    return out


def _tp_matrix():
    _, mesh, _ = setup(2, tp=2)
    tp = mesh.group("tp")
    results = {f"vocab_{k}": v for k, v in _vocab_losses(tp).items()}
    results.update(_mapping_pairs(tp))
    ids, _ = batch(model_args("debug"))
    for preset in ("debug", "debug-moe"):
        args = model_args(preset)
        for sp in (True, False):
            for lora in (None, LORA):
                ref = reference_model(args, lora=lora)
                par = parallelize(clone(ref), ParallelConfig(tp=2, sequence_parallel=sp), mesh)
                if preset == "debug":  # the plan converted what it should, names unchanged
                    assert isinstance(par.embed, VocabParallelEmbedding) and par.lm_head.weight is par.embed.weight
                    q = par.layers[0].attn.q_proj
                    assert q.weight.to_local().shape[0] == args.num_heads * args.head_dim // 2
                    if lora:
                        assert isinstance(par.layers[0].mlp.down_proj, RowParallelLoRALinear)
                    else:
                        assert isinstance(q, ColumnParallelLinear)
                    assert [n for n, _ in par.named_parameters()] == [n for n, _ in ref.named_parameters()]

                def par_loss(m):
                    logits = m(ids)
                    assert logits.shape[-1] == args.vocab_size // 2  # the vocab is never gathered
                    loss = VP.vocab_parallel_cross_entropy(logits, ids, tp)
                    aux = m.aux_loss()
                    return (loss + aux, loss.detach() + _sum(aux, tp)) if aux is not None else (loss, loss.detach())

                key = f"{preset}/{'sp' if sp else 'nosp'}/{'lora' if lora else 'full'}"
                results.update({f"{key}/{k}": v for k, v in
                                compare_training(ref, par, lambda m: loss_of(m, ids), par_loss).items()})
    return results


def _sum(x, group):
    x = x.detach().clone()
    dist.all_reduce(x, group=group)
    return x


@pytest.mark.slow
def test_tensor_parallel_matches_single_process():
    res = run_ranks(_tp_matrix, 2)
    for rank_res in res:
        bad = {k: v for k, v in rank_res.items() if not v <= TOL}
        assert not bad, f"differences above {TOL}: {bad}"
    print("\n".join(f"{k}: {v:.2e}" for k, v in sorted(res[0].items())))
