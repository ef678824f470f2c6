"""The whole model on one rank, from any layout: the full state dict an HF export writes.

Every split weight is a DTensor (TP/EP shards from tensor.py / expert.py, FSDP shards from
fully_shard) whose names are the model's own in every layout, pipeline stages included, so the
gathered dict loads into the plain model unchanged. Resumable sharded checkpoints, which reshard
to another layout or world size on load, are core/checkpoint's (DCP through get/set_*_state_dict);
they do not go through this module.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from posttrain.core.distenv import rank_world


def _modules(model: nn.Module | Iterable[nn.Module]) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


def full_state_dict(model: nn.Module | Iterable[nn.Module],
                    pp_group: dist.ProcessGroup | None = None) -> dict[str, Tensor] | None:
    """The whole, unsharded state dict on global rank 0 (CPU tensors), None on other ranks.
    Collective: every rank calls it. Tensors are gathered one at a time, so no rank ever holds
    more than its shards plus one full tensor; the pipeline stages' parts then meet on rank 0.
    LoRA layers come as they are (merge them into the base weights on the gathered copy)."""
    rank = rank_world()[0]
    part: dict[str, Tensor] = {}
    for m in _modules(model):
        for name, t in m.state_dict().items():
            full = t.full_tensor() if isinstance(t, DTensor) else t
            part[name] = full.detach().cpu()
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        return part if rank == 0 else None
    # One rank per stage (the lowest of its stage group shares rank 0's position) sends its part.
    parts: list | None = [None] * dist.get_world_size(pp_group) if rank == 0 else None
    if 0 in dist.get_process_group_ranks(pp_group):  # rank 0's pp group: the other columns hold copies
        dist.gather_object(part, parts, dst=0, group=pp_group)
    if rank != 0:
        return None
    return {k: v for p in parts for k, v in p.items()}
