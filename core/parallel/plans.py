"""Tensor-parallel plans as data: a dict from submodule pattern to a parallel style.

A pattern is an fnmatch glob over module names (`layers.*.attn.q_proj`). A style says what to do
to the matched module; applying the plan converts modules in place (tensor.py) and registers
the region-entry hooks, so the model code runs unchanged on its local heads / columns / vocab.

The transformer's plan (Megatron's split of a Llama block):

    embed                 vocab-parallel; output all-reduced (or reduce-scattered by sequence)
    layers.*.attn         enter the region once for q, k and v (copy, or all-gather by sequence)
    attn.{q,k,v}_proj     column-parallel: each rank computes n_heads/tp and n_kv_heads/tp heads
    attn.o_proj           row-parallel: partial sums all-reduced (reduce-scattered by sequence)
    dense mlp             enter once; gate/up column-parallel; down row-parallel
    MoE mlp               token-sharded, weights replicated over tp (see expert.py)
    *norm                 sequence parallelism only: norms run on sequence shards, weight grads
                          all-reduced over tp; without it they are replicated and need nothing
    lm_head               column-parallel over the vocab: logits stay split, the loss is
                          vocab-parallel (losses.py), the full vocab is never gathered
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from posttrain.core.model.args import ModelArgs
from posttrain.core.parallel.mappings import enter_region
from posttrain.core.parallel.tensor import (
    InputMode,
    OutputMode,
    column_parallel,
    replicate_over_tp,
    row_parallel,
    vocab_parallel_embedding,
)


class ParallelStyle:
    def apply(self, module: nn.Module, mesh: DeviceMesh, name: str) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class ColwiseParallel(ParallelStyle):
    input_mode: InputMode = "region"

    def apply(self, module, mesh, name):
        column_parallel(module, mesh, self.input_mode, name)


@dataclass(frozen=True)
class RowwiseParallel(ParallelStyle):
    output_mode: OutputMode = "replicated"

    def apply(self, module, mesh, name):
        row_parallel(module, mesh, self.output_mode, name)


@dataclass(frozen=True)
class VocabParallel(ParallelStyle):
    output_mode: OutputMode = "replicated"

    def apply(self, module, mesh, name):
        vocab_parallel_embedding(module, mesh, self.output_mode, name)


@dataclass(frozen=True)
class EnterRegion(ParallelStyle):
    """The module's first input enters a tensor-parallel region (torchtitan's PrepareModuleInput):
    one gather / copy serves every column-parallel layer that reads it."""

    sequence_parallel: bool

    def apply(self, module, mesh, name):
        group = mesh.get_group()
        module.tp_sequence_parallel = self.sequence_parallel  # read per call: decoding switches it off
        module.register_forward_pre_hook(
            lambda mod, args: (enter_region(args[0], group, mod.tp_sequence_parallel),) + args[1:])


@dataclass(frozen=True)
class SequenceParallel(ParallelStyle):
    """Replicated weights applied to sequence shards: gradients all-reduced over tp."""

    def apply(self, module, mesh, name):
        replicate_over_tp(module, mesh.get_group())


@dataclass(frozen=True)
class TokenShardedMoE(ParallelStyle):
    sequence_parallel: bool

    def apply(self, module, mesh, name):
        from posttrain.core.parallel.expert import shard_moe_tokens

        shard_moe_tokens(module, mesh.get_group(), self.sequence_parallel)


def transformer_tp_plan(args: ModelArgs, sequence_parallel: bool = True) -> dict[str, ParallelStyle]:
    """The plan for posttrain.core.model.Transformer (and for pipeline stages built from it)."""
    sp = sequence_parallel
    act: OutputMode = "sequence" if sp else "replicated"
    plan: dict[str, ParallelStyle] = {
        "embed": VocabParallel(act),
        "layers.*.attn": EnterRegion(sp),
        "layers.*.attn.q_proj": ColwiseParallel(),
        "layers.*.attn.k_proj": ColwiseParallel(),
        "layers.*.attn.v_proj": ColwiseParallel(),
        "layers.*.attn.o_proj": RowwiseParallel(act),
        "lm_head": ColwiseParallel(input_mode=act),
    }
    if sp:
        plan.update({"layers.*.attn_norm": SequenceParallel(), "layers.*.mlp_norm": SequenceParallel(),
                     "norm": SequenceParallel()})
    for i in range(args.num_layers):
        if args.is_moe_layer(i):
            plan[f"layers.{i}.mlp"] = TokenShardedMoE(sp)
        else:
            plan.update({f"layers.{i}.mlp": EnterRegion(sp),
                         f"layers.{i}.mlp.gate_proj": ColwiseParallel(),
                         f"layers.{i}.mlp.up_proj": ColwiseParallel(),
                         f"layers.{i}.mlp.down_proj": RowwiseParallel(act)})
    return plan


def apply_plan(model: nn.Module, plan: dict[str, ParallelStyle], tp_mesh: DeviceMesh, strict: bool = True) -> None:
    """Apply each style to every module its pattern matches. strict: a pattern matching nothing is
    an error (a renamed module would otherwise silently stay unsplit); pipeline stages hold only
    some layers and pass strict=False."""
    names = [n for n, _ in model.named_modules() if n]
    for pattern, style in plan.items():
        hits = [n for n in names if fnmatchcase(n, pattern)]
        if not hits and strict:
            raise ValueError(f"tensor-parallel plan pattern {pattern!r} matches no module of {type(model).__name__}")
        for n in hits:
            style.apply(model.get_submodule(n), tp_mesh, n)
