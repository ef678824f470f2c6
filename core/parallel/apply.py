"""`parallelize(model, parallel_config, mesh)`: every kind of parallelism, applied from outside to
the parallelism-free model, in torchtitan's order:

    TP / SP  ->  CP  ->  EP  ->  activation checkpointing  ->  compile  ->  FSDP / HSDP / DDP

TP first because it rewrites modules (FSDP must see the split weights); CP and EP install their
attention / dispatch before checkpointing wraps the blocks, so the recompute replays them;
compile sees the final per-block code; FSDP last so it shards exactly what will be trained.
Pipeline parallelism splits the model into stages before all of this (`parallelize_pipeline`),
and each stage is then parallelized like a model.

Build the model on the meta device or CPU, apply LoRA (if any) before parallelizing, and create
the optimizer after: parameters are replaced here. A model parallelized on `meta` then gets
this rank's shards from posttrain.core.parallel.materialize (and posttrain.registry.hf_sharded for a checkpoint).

Training-loop contract under these layouts (what core/trainer.py must do):
- tp > 1: logits are split by vocab; use posttrain.core.parallel.losses (vocab-parallel CE / log-probs /
  KL) with mesh.group("tp"). The loss is then complete (and equal) on every tp rank.
- cp > 1: shard input_ids, position_ids (always given) and *already shifted* labels with
  context_parallel_shard; compute the loss with shift=False (posttrain.core.parallel.context.shard_batch
  does all of it for a packed batch; posttrain.core.objectives calls it through `model.cp_group`).
- Gradients are averaged over dp_replicate x dp_shard x cp ("dp_cp"): sum token counts over
  mesh.group("dp_cp") and undo that average, not over "dp" alone.
- MoE: add model.aux_loss() to the loss as usual (under tp / cp each rank holds its share of
  the global value, pre-scaled for the cp average); all-reduce tokens_per_expert over
  mesh.group("dp_cp_tp") (reduce_moe_stats) before logging it and before update_bias().
- Clip with posttrain.core.parallel.clip_grad_norm_ (pp_group=mesh.group("pp") under pp):
  torch.nn.utils.clip_grad_norm_ cannot mix the meshes these layouts put gradients on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from posttrain.core.parallel.config import ParallelConfig
from posttrain.core.model.moe import MoE
from posttrain.core.parallel.context import apply_context_parallel
from posttrain.core.parallel.data_parallel import apply_activation_checkpointing, apply_compile, apply_ddp, apply_fsdp
from posttrain.core.parallel.expert import apply_expert_parallel, global_aux_loss
from posttrain.core.parallel.mesh import ParallelMesh
from posttrain.core.parallel.pipeline import Pipeline, PipelineStageModule, build_pipeline
from posttrain.core.parallel.plans import apply_plan, transformer_tp_plan


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def parallelize(model: nn.Module, cfg: ParallelConfig, mesh: ParallelMesh, *, activation_checkpointing: bool | int = False,
                compile: bool = False, capacity_factor: float | None = None,
                data_parallel: bool = True, offload: bool = False) -> nn.Module:
    """Apply mesh's layout to a posttrain.core.model.Transformer (or one PipelineStageModule of it), in
    place; returns the same module. `data_parallel=False` skips the last step (FSDP / DDP) for
    callers that wrap it themselves. offload: FSDP's CPU offload (a ValueError without FSDP).
    activation_checkpointing: True (or 1) every block, k > 1 every k-th block (ModelConfig.checkpoint_every)."""
    dims = mesh.dims
    stage = isinstance(model, PipelineStageModule)
    blocks = _blocks(model)
    tied = getattr(model, "embed", None) is not None and getattr(model, "lm_head", None) is not None \
        and model.embed.weight is model.lm_head.weight

    if dims.tp > 1:
        apply_plan(model, transformer_tp_plan(model.args, cfg.sequence_parallel), mesh["tp"], strict=not stage)
        if tied:  # both split the same rows over tp: one shard, one parameter again
            model.lm_head.weight = model.embed.weight
        if stage and cfg.sequence_parallel:
            model.sequence_split = dims.tp

    if dims.cp > 1:
        state = apply_context_parallel(model, mesh.group("cp"))
        model.cp_group = mesh.group("cp")  # the objectives shard batches over it (context.shard_batch)
        if stage:
            model.cp_state = state

    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in moes:
        # ep=1 installs the same dispatcher without traffic: every expert then gets a gradient
        # (zeros if idle), which data parallelism needs to agree across ranks.
        ep_mesh = mesh["ep"] if dims.ep > 1 else None
        tp_group = mesh.group("tp") if dims.tp > 1 and dims.ep > 1 else None  # see replicate_over_tp
        apply_expert_parallel(moe, ep_mesh, capacity_factor, tp_group)
        if dims.tp > 1 or dims.cp > 1:
            global_aux_loss(moe, mesh.group("cp_tp"), grad_scale=float(dims.cp))

    if activation_checkpointing:
        apply_activation_checkpointing(blocks, int(activation_checkpointing))
    if compile:
        apply_compile(blocks)

    if offload and not (data_parallel and dims.fsdp):
        raise ValueError("optim.offload: CPU offload of the optimizer state is FSDP's (CPUOffloadPolicy); this "
                         "layout does not shard with FSDP (parallel.dp_shard > 1 does)")
    if data_parallel and dims.fsdp:
        apply_fsdp(model, blocks, mesh, cfg.mixed_precision_param, cfg.mixed_precision_reduce,
                   cfg.fsdp_reshard_after_forward, offload)
    elif data_parallel and dims.ddp:
        apply_ddp(model, mesh)
    return model


def parallelize_pipeline(model: nn.Module, cfg: ParallelConfig, mesh: ParallelMesh, loss_fn: Callable,
                         device: torch.device, microbatch_size: int, seq_len: int, packed: bool = False,
                         scale_grads: bool = True, **kwargs) -> Pipeline:
    """Split into this rank's pipeline stages, `parallelize` each (kwargs as `parallelize`), and
    build the schedule for microbatches of (microbatch_size, seq_len) tokens (scale_grads: as
    build_pipeline)."""
    return build_pipeline(model, cfg, mesh, loss_fn, device, microbatch_size, seq_len, packed,
                          lambda m: parallelize(m, cfg, mesh, **kwargs), scale_grads=scale_grads)
