"""Checkpoints across layouts: sharded saves that load into any other layout, and one full state
dict for Hugging Face export.

Every split weight is a DTensor (TP/EP shards from tensor.py / expert.py, FSDP shards from
fully_shard), so each rank's state dict carries the global shape and its own offsets;
torch.distributed.checkpoint (DCP) writes those pieces once each and, on load, reads whatever
pieces the *new* layout asks for. A checkpoint saved under tp=2 therefore loads under FSDP, EP or
pipeline stages, and back. Names are the model's own in every layout (the parallel layers keep
them), pipeline stages included, so nothing is remapped.

core/checkpoint.py (atomic directories, manifests, optimizer and RNG state) builds on these.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from core.lora import LoRALinear


def _modules(model: nn.Module | Iterable[nn.Module]) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


def sharded_state_dict(model: nn.Module | Iterable[nn.Module]) -> dict[str, Tensor]:
    """This rank's pieces of the model (or of its pipeline stages), keyed by the model's names."""
    out: dict[str, Tensor] = {}
    for m in _modules(model):
        out.update(get_model_state_dict(m))
    return out


def save_sharded(model: nn.Module | Iterable[nn.Module], path: str | Path) -> None:
    """Every rank writes its pieces (collective)."""
    dcp.save(sharded_state_dict(model), checkpoint_id=str(path))


def load_sharded(model: nn.Module | Iterable[nn.Module], path: str | Path) -> None:
    """Fill the model in place from a checkpoint saved under any layout (collective)."""
    state = sharded_state_dict(model)
    dcp.load(state, checkpoint_id=str(path))
    for m in _modules(model):
        own = get_model_state_dict(m).keys()
        set_model_state_dict(m, {k: state[k] for k in own})


def _merge_lora(state: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """Fold each LoRA layer's active adapter into its base weight: W + s B A (plain LoRA only)."""
    for name, mod in model.named_modules():
        if not isinstance(mod, LoRALinear):
            continue
        keys = [k for k in state if k.startswith(f"{name}.lora_")]
        a = mod.active_adapter
        if a is not None and not mod.disabled and a not in mod.merged:
            if a in mod.lora_magnitude:
                raise NotImplementedError(f"{name}: merging DoRA adapters on export is not supported here")
            w = state[f"{name}.weight"]
            delta = mod.scaling[a] * (state[f"{name}.lora_B.{a}"].float() @ state[f"{name}.lora_A.{a}"].float())
            state[f"{name}.weight"] = (w.float() + delta).to(w.dtype)
        for k in keys:
            del state[k]
    return state


def full_state_dict(model: nn.Module | Iterable[nn.Module], pp_group: dist.ProcessGroup | None = None,
                    merge_lora: bool = False) -> dict[str, Tensor] | None:
    """The whole, unsharded state dict on global rank 0 (CPU tensors), None on other ranks.
    Collective: every rank calls it. Tensors are gathered one at a time, so no rank ever holds
    more than its shards plus one full tensor; the pipeline stages' parts then meet on rank 0.
    merge_lora: fold active LoRA adapters into the base weights (for an HF export)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    part: dict[str, Tensor] = {}
    for m in _modules(model):
        for name, t in m.state_dict().items():
            full = t.full_tensor() if isinstance(t, DTensor) else t
            part[name] = full.detach().cpu()
        if merge_lora:
            part = _merge_lora(part, m)
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        return part if rank == 0 else None
    # One rank per stage (the lowest of its stage group shares rank 0's position) sends its part.
    parts: list | None = [None] * dist.get_world_size(pp_group) if rank == 0 else None
    if rank in dist.get_process_group_ranks(pp_group):
        dist.gather_object(part, parts, dst=0, group=pp_group)
    if rank != 0:
        return None
    return {k: v for p in parts for k, v in p.items()}


def save_hf(model: nn.Module | Iterable[nn.Module], path: str | Path, pp_group: dist.ProcessGroup | None = None,
            dtype: torch.dtype | None = None) -> Path | None:
    """Gather (LoRA merged in) and write an HF checkpoint directory from rank 0 via
    registry.hf.save_pretrained; returns the path on rank 0, None elsewhere."""
    from registry.hf import save_pretrained

    state = full_state_dict(model, pp_group, merge_lora=True)
    if state is None:
        return None
    return save_pretrained(_modules(model)[0], path, dtype=dtype, state=state)
