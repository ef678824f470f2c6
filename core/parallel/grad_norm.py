"""Gradient-norm clipping over any layout.

torch.nn.utils.clip_grad_norm_ stacks every gradient's norm into one tensor, which fails once
gradients live on different meshes: TP weights are DTensors on (dp_shard_cp, tp), norms and
routers on dp_shard_cp alone, experts on the expert mesh, and plain tensors where no wrapper
shards. Here each mesh's gradients are reduced by DTensor (which sums shards and counts
replicas once), plain gradients locally (every such gradient is complete and identical across
the ranks that hold it: the in-graph reductions of tensor.py / expert.py saw to it), and pipeline
stages' sums meet in one all-reduce over pp (torchtitan's `clip_grad_norm_` does the same).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor


def grad_norm(params: Iterable[Tensor], pp_group: dist.ProcessGroup | None = None) -> Tensor:
    """The global L2 norm of the gradients of `params` (a plain scalar tensor, same on all ranks)."""
    by_mesh: dict[object, list[Tensor]] = defaultdict(list)
    plain: list[Tensor] = []
    for p in params:
        if p.grad is None:
            continue
        (by_mesh[p.grad.device_mesh].append(p.grad) if isinstance(p.grad, DTensor) else plain.append(p.grad))
    device = next(iter([g.device for g in plain] + [gs[0].device for gs in by_mesh.values()]), torch.device("cpu"))
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for grads in by_mesh.values():
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
        sq = sq + torch.linalg.vector_norm(norms).full_tensor() ** 2
    if plain:
        sq = sq + torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32)
                                                        for g in plain])) ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(sq, group=pp_group)
    return sq.sqrt()


@torch.no_grad()
def clip_grad_norm_(params: Iterable[Tensor], max_norm: float, pp_group: dist.ProcessGroup | None = None,
                    counted_elsewhere: Iterable[Tensor] = ()) -> Tensor:
    """Scale gradients so their global norm is at most `max_norm`; returns the norm before.
    counted_elsewhere: parameters whose gradient another pipeline rank holds too (a tied head's
    copy of the embedding), scaled but left out of the norm."""
    params = [p for p in params if p.grad is not None]
    skip = {id(p) for p in counted_elsewhere}
    total = grad_norm([p for p in params if id(p) not in skip], pp_group)
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(scale.to(p.grad.device) if not isinstance(p.grad, DTensor) else scale.item())
    return total
