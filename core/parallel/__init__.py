"""Parallelism applied from outside to the parallelism-free model (torchtitan's way).

    mesh, device = init_distributed(parallel_config, model_args)   # validated before any group
    model = parallelize(model, parallel_config, mesh)              # TP/SP -> CP -> EP -> AC -> compile -> FSDP
    pipeline = parallelize_pipeline(model, parallel_config, mesh, loss_fn, device)   # when pp > 1

Files: apply (parallelize, parallelize_pipeline: the layout applied in order), mesh (the process
group and device mesh), mappings (collectives as autograd pairs), tensor (TP layers), plans
(the TP plan as data), losses (vocab-parallel CE / log-probs / KL), expert (EP dispatch, token-
sharded MoE), context (ring attention), pipeline (stages and schedules), data_parallel
(DDP / FSDP2 / HSDP, activation checkpointing, compile), grad_norm (clipping across meshes),
checkpoint (the full state dict, gathered for export), materialize (a model parallelized on the
meta device given this rank's shards: the block each holds, random init, LoRA init).

Names load on first use (posttrain.core.lazy): `posttrain.core.parallel.config` (ParallelConfig) imports without torch.
"""

from posttrain.core.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "ParallelDims": "posttrain.core.parallel.mesh",
    "ParallelMesh": "posttrain.core.parallel.mesh",
    "clip_grad_norm_": "posttrain.core.parallel.grad_norm",
    "context_parallel_shard": "posttrain.core.parallel.context",
    "context_parallel_unshard": "posttrain.core.parallel.context",
    "full_state_dict": "posttrain.core.parallel.checkpoint",
    "init_distributed": "posttrain.core.parallel.mesh",
    "parallelize": "posttrain.core.parallel.apply",
    "parallelize_pipeline": "posttrain.core.parallel.apply",
    "reduce_moe_stats": "posttrain.core.parallel.expert",
    "transformer_tp_plan": "posttrain.core.parallel.plans",
    "vocab_parallel_cross_entropy": "posttrain.core.parallel.losses",
    "vocab_parallel_distill_loss": "posttrain.core.parallel.losses",
    "vocab_parallel_sequence_logps": "posttrain.core.parallel.losses",
    "vocab_parallel_token_logps": "posttrain.core.parallel.losses",
})
