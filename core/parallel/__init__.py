"""Parallelism applied from outside to the parallelism-free model (torchtitan's way).

    mesh, device = init_distributed(parallel_config, model_args)   # validated before any group
    model = parallelize(model, parallel_config, mesh)              # TP/SP -> CP -> EP -> AC -> compile -> FSDP
    pipeline = parallelize_pipeline(model, parallel_config, mesh, loss_fn, device)   # when pp > 1

Files: mesh (device mesh), mappings (collectives as autograd pairs), tensor (TP layers), plans
(the TP plan as data), losses (vocab-parallel CE / log-probs / KL), expert (EP dispatch, token-
sharded MoE), context (ring attention), pipeline (stages and schedules), data_parallel
(DDP / FSDP2 / HSDP, activation checkpointing, compile), grad_norm (clipping across meshes),
checkpoint (the full state dict, gathered for export).
"""

from core.parallel.checkpoint import full_state_dict
from core.parallel.context import context_parallel_shard, context_parallel_unshard
from core.parallel.expert import reduce_moe_stats
from core.parallel.grad_norm import clip_grad_norm_, grad_norm
from core.parallel.losses import (
    vocab_parallel_cross_entropy,
    vocab_parallel_distill_loss,
    vocab_parallel_sequence_logps,
    vocab_parallel_token_logps,
)
from core.parallel.mesh import ParallelDims, ParallelMesh, init_distributed
from core.parallel.parallelize import parallelize, parallelize_pipeline
from core.parallel.plans import transformer_tp_plan

__all__ = [
    "ParallelDims", "ParallelMesh", "clip_grad_norm_", "context_parallel_shard", "context_parallel_unshard",
    "full_state_dict", "grad_norm", "init_distributed", "parallelize", "parallelize_pipeline",
    "reduce_moe_stats", "transformer_tp_plan", "vocab_parallel_cross_entropy",
    "vocab_parallel_distill_loss", "vocab_parallel_sequence_logps", "vocab_parallel_token_logps",
]
