"""Tensor-parallel layers (Megatron-LM, Shoeybi et al. 2019, arXiv 1909.08053) and sequence
parallelism (Korthikanti et al. 2022, arXiv 2205.05198), converted in place from the model's
nn.Linear / nn.Embedding / LoRALinear so parameter names never change.

    ColumnParallelLinear  W (out, in) split by rows (output features); output stays split
    RowParallelLinear     W (out, in) split by columns (input features); output partial-summed
    VocabParallelEmbedding  E (V, H) split by vocab rows; each rank looks up its own range

A split weight is stored as a DTensor (Shard(dim) on the tp mesh) so FSDP2 composes with it and
DCP can reshard checkpoints between layouts; forward computes on the local shard with the
explicit collectives of mappings.py, never with DTensor dispatch.

LoRA follows the base layer's split (torchtitan's rule): on a column layer A (r, in) is
replicated and B (out, r) split by rows; on a row layer A is split by columns and B replicated.
A replicated adapter weight then sees only this rank's share of the gradient, which is
all-reduced in the graph (copy_to_tp on the weight). The row layer adds its LoRA term before the
output reduction, so the rank-r partial products need no communication of their own. Adapters
routed per token (posttrain.core.lora.route_adapters) split the same way, each token through its own.

`replicate_over_tp` covers modules whose weights are replicated but whose inputs are split by
sequence (RMSNorm under sequence parallelism, MoE on token shards): each rank's weight gradient
is partial, so forward uses copy_to_tp(weight) and backward all-reduces it.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from posttrain.core.lora import LoRALinear
from posttrain.core.lora.layer import routed_lora, token_ids
from posttrain.core.parallel.mappings import copy_to_tp, enter_region, leave_region

InputMode = Literal["region", "replicated", "sequence"]
"""What a column layer receives: already inside a region (its module entered it), a replicated
activation to copy in, or a sequence-split activation to gather."""
OutputMode = Literal["replicated", "sequence"]
"""What a row / vocab layer returns: all-reduced, or reduce-scattered by sequence."""


def local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _shard_param(p: nn.Parameter | None, dim: int, mesh: DeviceMesh) -> nn.Parameter | None:
    """This rank's contiguous slice of `p` along `dim`, as a Shard(dim) DTensor parameter."""
    if p is None:
        return None
    n, r = mesh.size(), mesh.get_local_rank()
    if p.shape[dim] % n:
        raise ValueError(f"cannot split a {tuple(p.shape)} weight over tp={n} along dim {dim}")
    shard = p.detach().chunk(n, dim=dim)[r].clone()
    return nn.Parameter(DTensor.from_local(shard, mesh, [Shard(dim)], run_check=False),
                        requires_grad=p.requires_grad)


def _check_lora(mod: LoRALinear, name: str) -> None:
    if mod.lora_magnitude or mod.merged:
        raise NotImplementedError(f"{name}: tensor parallelism supports LoRA adapters on dense or NF4 bases; not "
                                  "DoRA or merged adapters (merge after gathering, or use tp=1)")


def _split_nf4(mod: LoRALinear, dim: int, mesh: DeviceMesh, name: str) -> None:
    """QLoRA: this rank's slice of the NF4 base (posttrain.core.quant.nf4_shard), what its forward computes
    on, kept out of the state dict; the whole NF4 weight stays in `weight` (replicated over tp;
    under FSDP both are sharded over its mesh, posttrain.core.quant.shard_nf4_storage), so the gathered
    export reads it unchanged."""
    from posttrain.core.quant import NF4Weight, nf4_shard

    try:
        shard = nf4_shard(mod.weight.tensor, dim, mesh.size(), mesh.get_local_rank())
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    mod.tp_weight = NF4Weight(shard, persistent=False)


def _base(mod: nn.Module, x: Tensor, bias: Tensor | None = None) -> Tensor:
    """x W_r^T (+ bias) for this rank's block of the base weight (dense DTensor shard, or NF4 slice)."""
    if isinstance(mod, LoRALinear) and mod.quantized:
        from posttrain.core.quant import nf4_linear

        y = nf4_linear(x, mod.tp_weight)
        return y if bias is None else y + bias
    return F.linear(x, local(mod.weight), bias)


def _active_lora(mod: nn.Module) -> str | None:
    """The adapter to apply in this forward, or None."""
    if not isinstance(mod, LoRALinear) or mod.disabled or mod.active_adapter is None:
        return None
    return mod.active_adapter


def _routed(mod: nn.Module) -> bool:
    """Adapters routed per token (posttrain.core.lora.route_adapters) rather than one active adapter."""
    return isinstance(mod, LoRALinear) and not mod.disabled and mod.routing is not None and bool(mod.adapters)


def _routed_lora(mod: LoRALinear, x: Tensor, factor: Callable[[str], tuple[Tensor, Tensor]]) -> Tensor:
    """Each token's adapter term with this rank's (A, B) of each adapter, `factor(name)`."""
    ids = token_ids(mod.routing, x)
    return routed_lora(mod.routed_input(x, ids), ids, [(*factor(n), mod.scaling[n]) for n in mod.adapters])


def _lora_input(mod: LoRALinear, name: str, x: Tensor) -> Tensor:
    p = mod.configs[name]["dropout"]
    return F.dropout(x, p) if (mod.training and p > 0) else x


# --------------------------------------------------------------------------- column


def _column_forward(mod: nn.Module, x: Tensor) -> Tensor:
    if mod.input_mode != "region":
        x = enter_region(x, mod.tp_group, mod.input_mode == "sequence")
    y = _base(mod, x, local(mod.bias) if mod.bias is not None else None)
    if _routed(mod):
        return y + _routed_lora(mod, x, lambda n: (copy_to_tp(local(mod.lora_A[n]), mod.tp_group),
                                                   local(mod.lora_B[n])))
    name = _active_lora(mod)
    if name is not None:
        a = copy_to_tp(local(mod.lora_A[name]), mod.tp_group)  # replicated: grads are partial
        h = F.linear(_lora_input(mod, name, x), a)
        y = y + F.linear(h, local(mod.lora_B[name])) * mod.scaling[name]
    return y  # (..., out / tp)


class ColumnParallelLinear(nn.Linear):
    """y_r = x W_r^T + b_r with W_r the r-th block of output rows: (..., in) -> (..., out/tp)."""

    tp_group: object
    input_mode: InputMode

    def forward(self, x: Tensor) -> Tensor:
        return _column_forward(self, x)


class ColumnParallelLoRALinear(LoRALinear):
    """A LoRALinear split like ColumnParallelLinear: A replicated, B split by rows."""

    def forward(self, x: Tensor, adapter_ids: Tensor | None = None) -> Tensor:
        if adapter_ids is not None:
            raise NotImplementedError("adapter_ids as an argument: under tensor parallelism route with posttrain.core.lora.route_adapters")
        return _column_forward(self, x)


def column_parallel(mod: nn.Module, mesh: DeviceMesh, input_mode: InputMode = "region", name: str = "") -> nn.Module:
    """Convert an nn.Linear or LoRALinear in place into its column-parallel form."""
    if isinstance(mod, LoRALinear):
        _check_lora(mod, name)
        for adapter in mod.adapters:
            mod.lora_B[adapter] = _shard_param(mod.lora_B[adapter], 0, mesh)
        mod.__class__ = ColumnParallelLoRALinear
    elif type(mod) is nn.Linear:
        mod.__class__ = ColumnParallelLinear
    else:
        raise TypeError(f"{name}: column parallelism applies to nn.Linear or LoRALinear, not {type(mod).__name__}")
    if isinstance(mod, LoRALinear) and mod.quantized:
        _split_nf4(mod, 0, mesh, name)
    else:
        mod.weight = _shard_param(mod.weight, 0, mesh)
    if mod.bias is not None:
        mod.bias = _shard_param(mod.bias, 0, mesh)
    mod.out_features //= mesh.size()
    mod.tp_group, mod.input_mode = mesh.get_group(), input_mode
    return mod


# --------------------------------------------------------------------------- row


def _row_forward(mod: nn.Module, x: Tensor) -> Tensor:
    y = _base(mod, x)  # (..., out), this rank's partial sum
    name = _active_lora(mod)
    if _routed(mod):  # a partial of each token's LoRA term, like the base's
        y = y + _routed_lora(mod, x, lambda n: (local(mod.lora_A[n]), copy_to_tp(local(mod.lora_B[n]), mod.tp_group)))
    elif name is not None:
        # x_r A_r^T is rank r's partial of x A^T; times B it stays a partial of the LoRA term,
        # so it rides the base layer's reduction. B is replicated: its gradient is partial.
        h = F.linear(_lora_input(mod, name, x), local(mod.lora_A[name]))
        y = y + F.linear(h, copy_to_tp(local(mod.lora_B[name]), mod.tp_group)) * mod.scaling[name]
    sp = mod.output_mode == "sequence"
    y = leave_region(y, mod.tp_group, sp)
    if mod.bias is not None:  # after the reduction; on sequence shards its gradient is partial
        y = y + (copy_to_tp(mod.bias, mod.tp_group) if sp else mod.bias)
    return y


class RowParallelLinear(nn.Linear):
    """y = sum_r x_r W_r^T + b with W_r the r-th block of input columns: (..., in/tp) -> (..., out)."""

    tp_group: object
    output_mode: OutputMode

    def forward(self, x: Tensor) -> Tensor:
        return _row_forward(self, x)


class RowParallelLoRALinear(LoRALinear):
    """A LoRALinear split like RowParallelLinear: A split by columns, B replicated."""

    def forward(self, x: Tensor, adapter_ids: Tensor | None = None) -> Tensor:
        if adapter_ids is not None:
            raise NotImplementedError("adapter_ids as an argument: under tensor parallelism route with posttrain.core.lora.route_adapters")
        return _row_forward(self, x)


def row_parallel(mod: nn.Module, mesh: DeviceMesh, output_mode: OutputMode = "replicated", name: str = "") -> nn.Module:
    """Convert an nn.Linear or LoRALinear in place into its row-parallel form."""
    if isinstance(mod, LoRALinear):
        _check_lora(mod, name)
        for adapter in mod.adapters:
            mod.lora_A[adapter] = _shard_param(mod.lora_A[adapter], 1, mesh)
        mod.__class__ = RowParallelLoRALinear
    elif type(mod) is nn.Linear:
        mod.__class__ = RowParallelLinear
    else:
        raise TypeError(f"{name}: row parallelism applies to nn.Linear or LoRALinear, not {type(mod).__name__}")
    if isinstance(mod, LoRALinear) and mod.quantized:  # the bias stays whole: added once, after the sum
        _split_nf4(mod, 1, mesh, name)
    else:
        mod.weight = _shard_param(mod.weight, 1, mesh)
    mod.in_features //= mesh.size()
    mod.tp_group, mod.output_mode = mesh.get_group(), output_mode
    return mod


# --------------------------------------------------------------------------- embedding


class VocabParallelEmbedding(nn.Embedding):
    """Rows [r V/tp, (r+1) V/tp) of the table on rank r; other ids give zeros, and the leave-region
    reduction sums the one non-zero contribution per token."""

    tp_group: object
    output_mode: OutputMode
    vocab_start: int

    def forward(self, ids: Tensor) -> Tensor:
        w = local(self.weight)
        rel = ids - self.vocab_start
        outside = (rel < 0) | (rel >= w.shape[0])
        out = F.embedding(rel.masked_fill(outside, 0), w)
        out = out.masked_fill(outside[..., None], 0.0)
        return leave_region(out, self.tp_group, self.output_mode == "sequence")


def vocab_parallel_embedding(mod: nn.Embedding, mesh: DeviceMesh, output_mode: OutputMode = "replicated",
                             name: str = "") -> nn.Embedding:
    if type(mod) is not nn.Embedding:
        raise TypeError(f"{name}: vocab parallelism applies to nn.Embedding, not {type(mod).__name__}")
    if mod.padding_idx is not None or mod.max_norm is not None:
        raise NotImplementedError(f"{name}: padding_idx / max_norm are not supported under tensor parallelism")
    mod.__class__ = VocabParallelEmbedding
    mod.weight = _shard_param(mod.weight, 0, mesh)
    mod.num_embeddings //= mesh.size()
    mod.vocab_start = mesh.get_local_rank() * mod.num_embeddings
    mod.tp_group, mod.output_mode = mesh.get_group(), output_mode
    return mod


# --------------------------------------------------------------------------- replicated weights, split tokens


def replicate_over_tp(module: nn.Module, group) -> nn.Module:
    """Every trainable parameter under `module` is replicated over tp but used on this rank's
    tokens only: during its forward, each is replaced by copy_to_tp(param), so backward
    all-reduces its gradient over tp (Megatron reduces such `sequence_parallel` grads after
    backward; in the graph nothing can forget it). Names and state dicts are unchanged."""

    def swap_in(mod, args):
        saved = []
        for sub in mod.modules():
            for name, p in list(sub._parameters.items()):
                if p is not None and p.requires_grad and not isinstance(p, DTensor):
                    saved.append((sub, name, p))
                    sub._parameters[name] = copy_to_tp(p, group)
        mod._tp_saved_params = saved

    def swap_out(mod, args, out):
        for sub, name, p in mod._tp_saved_params:
            sub._parameters[name] = p
        mod._tp_saved_params = []
        return out

    module.register_forward_pre_hook(swap_in)
    module.register_forward_hook(swap_out, always_call=True)
    return module


class decode_without_sequence_parallel:
    """Within it, a model under tensor parallelism runs with replicated activations between its
    tensor-parallel regions (no sequence split): for token-by-token decoding, whose one new token
    a step cannot be split by sequence. Weights, KV heads and vocab stay split; only where the
    activations live changes, so the results are those of the model with sequence parallelism."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self):
        self.changed: list[tuple[nn.Module, str, object]] = []
        for m in self.model.modules():
            for attr, off in (("input_mode", "replicated"), ("output_mode", "replicated"),
                              ("tp_sequence_parallel", False), ("tp_split_tokens", False)):
                value = getattr(m, attr, None)
                if value in ("sequence", True):
                    self.changed.append((m, attr, value))
                    setattr(m, attr, off)
        return self.model

    def __exit__(self, *exc):
        for m, attr, value in self.changed:
            setattr(m, attr, value)
