"""Values for a model built on the meta device and parallelized there, this rank's part only.

The order (torchtitan's): build on `meta` -> LoRA -> `parallelize` -> `materialize` (allocate this
rank's shards, uninitialized) -> fill them: from a checkpoint (registry/hf_sharded.py reads just
the slices a rank owns), or by `init_weights`; then `init_adapters`. No rank ever holds the
whole model, and every layout ends with the values the unsharded model gets.

`local_part(t)` says which block of the whole tensor a parameter holds here. A DTensor's
placements decide it: Shard(dim) over a mesh dimension (TP in tensor.py, EP in expert.py), FSDP2's
Shard(0) with torch.chunk's uneven sizes, both at once (_StridedShard on the dp dimension), with
Replicate dimensions holding everything. torch's compute_local_shape_and_global_offset (what DCP
uses) turns them into a local shape and a global offset; every layout here keeps a rank's part
one contiguous block of the whole. A plain tensor (one process, DDP, an unsplit norm under TP)
is whole.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from posttrain.core.lora.layer import init_lora_a
from posttrain.core.lora.model import lora_modules, lora_parameters

Block = tuple[slice, ...]


def local_part(t: Tensor) -> tuple[Tensor, Block]:
    """(this rank's tensor behind `t`, where it lies in the whole tensor: one slice per dim)."""
    if not isinstance(t, DTensor):
        return t, tuple(slice(0, n) for n in t.shape)
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t.to_local()
    if tuple(local.shape) != tuple(shape):
        raise ValueError(f"a DTensor's local tensor {tuple(local.shape)} is not the {tuple(shape)} its placements "
                         f"{t.placements} imply (an uneven split on a dim torch pads?)")
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape))


def materialize(model: nn.Module, device: torch.device | str) -> None:
    """Allocate this rank's shards of a posttrain.core.model.Transformer on `device` (values undefined),
    share the embedding with the head again (to_empty unties plain tensors; DTensors stay one
    parameter) and compute the non-persistent buffers (RoPE frequencies, MoE state)."""
    model.to_empty(device=device)
    staged = getattr(model, "pipeline", None) is not None  # tied ends on two ranks: copies (build_pipeline)
    if model.args.tie_embeddings and not staged and model.lm_head.weight is not model.embed.weight:
        model.tie_weights()
    model.init_buffers()
    if getattr(model, "pipeline", None) is not None:  # its stage modules' RoPE buffers, copied on meta
        model.pipeline.init_buffers(next(model.parameters()).device)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int | None) -> None:
    """Transformer.init_weights(seed) on a materialized, possibly sharded model: every base
    parameter's whole initial value, drawn in the same order from the same generator, this rank's
    part kept; the same values as build_model(args, seed=seed) in any layout. LoRA adapters are
    init_adapters'."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    adapters = {id(p) for p in lora_parameters(model)}
    own = {name: p for name, p in model.named_parameters() if id(p) not in adapters}
    # A pipeline stage's part (posttrain.core.parallel.pipeline.keep_own_stages) draws the whole model's values
    # in order, keeping its own.
    for name, shape in getattr(model, "whole_parameters", None) or [(n, p.shape) for n, p in own.items()]:
        value = model.initial_value(name, shape, gen)
        # tied embeddings split by a pipeline: the last stage's head is a copy of the embedding
        for key in [name] + (["lm_head.weight"] if name == "embed.weight" and model.args.tie_embeddings else []):
            if key in own:
                local, block = local_part(own[key])
                local.copy_(value[block])


@torch.no_grad()
def init_adapters(model: nn.Module) -> None:
    """The LoRA adapters' initial values as apply_lora draws them on a materialized model: A from
    the global RNG on the model's device, layer by layer and adapter by adapter in the order
    apply_lora made them (one call, several adapter names), B zeros; this rank's part kept.
    Right after apply_lora on `meta` (which draws nothing) the RNG is where apply_lora on the
    loaded model would find it, so the values are the same. DoRA magnitudes and PiSSA read the
    base weights: those adapters are made on the loaded model instead (posttrain.stages.common.load_on_meta)."""
    mods = dict(lora_modules(model))
    for mod in mods.values():
        for name in mod.adapters:
            if name in mod.lora_magnitude or mod.configs[name]["init_lora_weights"] == "pissa":
                raise ValueError(f"adapter {name!r}: DoRA / PiSSA initial values depend on the base weights; "
                                 "apply them to the loaded model, not on the meta device")
    order = getattr(model, "whole_adapters", None)  # a pipeline stage's part: the whole model's draws
    if order is None:
        order = [(m, name, mod.lora_A[name].shape, mod.configs[name]["init_lora_weights"])
                 for m, mod in mods.items() for name in mod.adapters]
    some = next((local_part(mod.lora_A[n])[0] for mod in mods.values() for n in mod.adapters), None)
    for m, name, shape, init in order:
        mod = mods.get(m)
        a = mod.lora_A[name] if mod is not None else None
        local, block = local_part(a) if a is not None else (some, None)
        whole = init_lora_a(torch.empty(shape, dtype=local.dtype, device=local.device), init)
        if a is not None:
            local.copy_(whole[block])
            local_part(mod.lora_B[name])[0].zero_()
    init_expert_adapters(model)


@torch.no_grad()
def init_expert_adapters(model: nn.Module) -> None:
    """LoRA on MoE experts (posttrain.core.lora.experts), after the linear layers' adapters as apply_lora
    draws them: each whole A drawn, this rank's experts (and FSDP shard) kept; B zeros."""
    from posttrain.core.lora.experts import expert_loras

    for _, mod in expert_loras(model):
        parts = {k: local_part(getattr(mod, k)) for k in ("gate_up_A", "down_A")}
        whole = {k: torch.empty(getattr(mod, k).shape, dtype=t.dtype, device=t.device) for k, (t, _) in parts.items()}
        mod.reset_a(whole)
        for k, (t, block) in parts.items():
            t.copy_(whole[k][block])
        for k in ("gate_up_B", "down_B"):
            local_part(getattr(mod, k))[0].zero_()
