"""Data parallelism, activation checkpointing and compilation: the last steps of `parallelize`.

- DDP: torch's, in its composable form (`replicate`) so the model keeps its class and parameter
  names (no `module.` prefix); gradients are averaged over dp_replicate.
- FSDP2 (`fully_shard`, Zhao et al. 2023 / torchtitan): each transformer block is one unit, then
  the root (embedding, final norm, lm_head: one unit, so tied embeddings stay one parameter).
  Parameters are sharded over dp_shard x cp (cp ranks hold the same weights), gradients
  reduce-scattered and averaged over the data ranks. HSDP shards within dp_shard_cp and
  replicates across dp_replicate (2-D mesh). Expert weights, already split over ep, form their own
  unit over the remaining dp_shard_mod_ep ranks (x dp_replicate); FSDP averages over those, and
  the expert layer has already scaled its gradient by 1/ep (the all-to-all summed the tokens of
  the ep ranks into it), so the divisor is the full data-parallel degree. (In the graph rather
  than FSDP's set_gradient_divide_factor: that is a PREMUL_SUM, which gloo lacks, and with torch
  2.13 it was not applied at all on a one-rank expert mesh, ep = dp_shard * cp.)
- QLoRA under FSDP (FSDP-QLoRA): the NF4 bases are buffers, which fully_shard leaves whole, so
  their storage is sharded over the same mesh first (posttrain.core.quant.shard_nf4_storage) and gathered
  by each forward and backward that needs the weight.
- Optimizer offload (optim.offload): FSDP2's CPUOffloadPolicy keeps the shards, gradients and the
  optimizer state on CPU; the optimizer steps there.
- Activation checkpointing: each block's (or every k-th block's) forward runs under non-reentrant
  torch.utils.checkpoint.
  MoE routing statistics are side effects of forward, so the recompute restores them; LoRA adapter
  routing is set around the forward only, so the recompute sets the forward's again.
- torch.compile per block (torchtitan's granularity: one graph reused by every layer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from posttrain.core.lora.layer import LoRALinear
from posttrain.core.model.model import run_eagerly_under_compile
from posttrain.core.model.moe import MoE
from posttrain.core.quant import shard_nf4_storage
from posttrain.core.parallel.mesh import ParallelMesh

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, None: None}


def apply_ddp(model: nn.Module, mesh: ParallelMesh) -> nn.Module:
    from torch.distributed._composable.replicate import replicate

    # No buffer broadcast before each forward: it would overwrite each rank's MoE token counts
    # (summed explicitly by reduce_moe_stats); RoPE and expert-bias buffers agree on every rank.
    return replicate(model, device_mesh=mesh["dp_replicate"], broadcast_buffers=False)


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], mesh: ParallelMesh,
               param_dtype: str | None = None, reduce_dtype: str | None = "float32",
               reshard_after_forward: Literal["default", "always", "never"] = "default",
               offload: bool = False) -> nn.Module:
    """Shard `blocks` one unit each, expert weights their own units, and `model` as the root.
    offload: sharded parameters, their gradients and so the optimizer state on CPU
    (CPUOffloadPolicy; each unit's forward and backward copies its shard to the device)."""
    dims = mesh.dims
    policy = MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[reduce_dtype])
    # Pipeline stages run several microbatches forward before any backward: keeping their blocks
    # gathered between them saves one all-gather per microbatch (torchtitan's default too).
    reshard = {"always": True, "never": False, "default": dims.pp == 1}[reshard_after_forward]
    kw = dict(mp_policy=policy, reshard_after_forward=reshard)
    if offload:
        # Pinned host memory (for async copies) needs an accelerator; on a CPU mesh nothing moves.
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.fsdp_mesh().device_type != "cpu")
    shard_nf4_storage(model, mesh.fsdp_mesh())
    for block in blocks:
        if dims.ep > 1:
            for moe in (m for m in block.modules() if isinstance(m, MoE)):
                fully_shard(moe.experts, mesh=mesh.expert_fsdp_mesh(), **kw)
        fully_shard(block, mesh=mesh.fsdp_mesh(), **kw)
    fully_shard(model, mesh=mesh.fsdp_mesh(), **kw)
    return model


class _ForwardState:
    """What a checkpointed block's recompute must see as its forward did. MoE side effects of the
    recompute (token counts, aux loss, router logits) are undone, so they stay those of the real
    forward. LoRA adapter routing (posttrain.core.lora.route_adapters) is set around the forward only and
    gone by backward, so the forward's is captured and set again for the recompute."""

    def __init__(self, moes: list[MoE], loras: list[LoRALinear]):
        self.moes, self.loras = moes, loras

    @contextlib.contextmanager
    def forward(self):
        self.routing = [m.routing for m in self.loras]
        yield

    @contextlib.contextmanager
    def recompute(self):
        moe = [(m.tokens_per_expert.clone(), m.aux_loss, m.last_router_logits) for m in self.moes]
        routing = [m.routing for m in self.loras]
        for m, r in zip(self.loras, self.routing):
            m.routing = r
        try:
            yield
        finally:
            for m, (counts, aux, logits) in zip(self.moes, moe):
                m.tokens_per_expert.copy_(counts)
                m.aux_loss, m.last_router_logits = aux, logits
            for m, r in zip(self.loras, routing):
                m.routing = r


def apply_activation_checkpointing(blocks: list[nn.Module], every: int = 1) -> list[nn.Module]:
    """Recompute the activations of every `every`-th block (blocks every-1, 2*every-1, ...; 1 = all,
    torchtitan's selective per-layer checkpointing) in backward; a block stays the same module
    (names and hooks unchanged), only its forward is wrapped. Returns the wrapped blocks.
    The others keep their activations: between full checkpointing's memory and none's speed."""
    chosen = [b for i, b in enumerate(blocks) if every > 0 and (i + 1) % every == 0]
    for block in chosen:
        moes = [m for m in block.modules() if isinstance(m, MoE)]
        loras = [m for m in block.modules() if isinstance(m, LoRALinear)]

        def contexts(_moes=moes, _loras=loras):
            state = _ForwardState(_moes, _loras)
            return state.forward(), state.recompute()

        block.checkpointed_forward = block.forward  # apply_compile may swap in a compiled version

        def forward(*args, _block=block, _contexts=contexts, **kwargs):
            return checkpoint(_block.checkpointed_forward, *args, use_reentrant=False, context_fn=_contexts, **kwargs)

        block.forward = forward
    return chosen


def apply_compile(blocks: list[nn.Module], backend: str | Callable = "inductor") -> None:
    """Compile each block; a checkpointed block compiles inside the checkpoint (the recompute
    context above is eager Python, which a compiled checkpoint would not accept)."""
    run_eagerly_under_compile()
    for block in blocks:
        if hasattr(block, "checkpointed_forward"):
            block.checkpointed_forward = torch.compile(block.checkpointed_forward, backend=backend)
        else:
            block.compile(backend=backend)
