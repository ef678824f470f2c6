"""Several LoRA adapters trained in one job on one frozen base (`lora.adapter_names: [a, b, ...]`).

Each example trains one adapter: the one its row names (`lora.adapter_column`) or its source is
mapped to (`lora.adapter_sources`), read with the data (posttrain.core.data.routing) and carried by each
document into the batch as per-token `adapter_ids` (posttrain.core.data.packing), so packed rows route
every document's tokens through its own adapter. The skeleton (stages/recipe.py) adds every
adapter, builds the Trainer with one parameter group per adapter (`lora.adapter_lr`), each
normalized by its own tokens, clipped alone, and skipped in a step none of its examples reached
(posttrain.core.trainer), and exports each adapter on its own:

    adapters/<name>/     PEFT adapter (adapter_config.json, adapter_model.safetensors)   manifest "adapter/<name>"
    model-<name>/        the base with that adapter merged, HF format (save: full, or     manifest "model/<name>"
                         export_merged)

A pipeline names one adapter's merged model as `<node>:<name>` (flows/dag.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from posttrain.core.data.routing import AdapterRouting
from posttrain.core.losses import IGNORE_INDEX
from posttrain.core.lora import route_adapters
from posttrain.core.objectives import cp_view
from posttrain.core.parallel.context import CP_KEY
from posttrain.core.trainer import LossOutput, Objective

ADAPTERS_DIR = "adapters"


def adapter_routing(lora) -> AdapterRouting | None:
    """The data routing of a LoRAConfig with several adapters; None with one (nothing to route)."""
    if not (lora.enabled and lora.multi):
        return None
    return AdapterRouting(tuple(lora.adapter_names), lora.adapter_column, lora.adapter_sources)


def trained_adapters(cfg) -> list[str]:
    """The adapters a stage trains at once (Trainer(adapters=...)); [] for one adapter or full FT."""
    return list(cfg.lora.adapter_names) if cfg.lora.enabled and cfg.lora.multi else []


def routed(objective: Objective, names: list[str]) -> Objective:
    """`objective` with each token through its document's adapter (batch["adapter_ids"]), reporting
    what its num_tokens counts per adapter (LossOutput.adapter_tokens): target tokens, or pairs for
    a preference batch."""

    def wrapped(model: torch.nn.Module, batch: dict[str, Any]) -> LossOutput:
        if "adapter_ids" not in batch:
            raise ValueError(f"training adapters {names}: the batch carries no adapter_ids (its documents were "
                             "read without routing: posttrain.core.data.routing)")
        pipe = getattr(model, "pipeline", None)
        if pipe is not None:  # the pipelined objective lays the ids out as its rows, each stage routes its own
            route = pipe.routing(names)
        else:
            batch = cp_view(model, batch)  # under context parallelism: this rank's share, adapter ids cut alike
            ids = batch["adapter_ids"]
            lm_head = getattr(model, "lm_head", None)
            if getattr(lm_head, "input_mode", None) == "sequence":  # posttrain.core.objectives pads the tokens for tp
                ids = F.pad(ids, (0, -ids.shape[-1] % dist.get_world_size(lm_head.tp_group)), value=-1)
            route = route_adapters(model, ids, names)
        with route:
            out = objective(model, batch)
        if "num_pairs" in batch:
            per = batch["sequence_adapters"][: batch["num_pairs"]]
        else:  # (labels shifted by cp_view under cp: a document's first label is never a target either way)
            per = batch["adapter_ids"][batch["labels"] != IGNORE_INDEX]
        out.adapter_tokens = torch.bincount(per[per >= 0], minlength=len(names))
        if "num_pairs" in batch and CP_KEY in batch:  # every cp rank holds the whole pairs: 1/cp of each
            out.adapter_tokens = out.adapter_tokens / batch[CP_KEY][1]
        return out

    return wrapped


def by_adapter(items: list, names: list[str]) -> dict[str, list]:
    """Items (Documents or PreferencePairs) grouped by adapter, in `names`' order, empty ones left out."""
    groups = {name: [x for x in items if x.adapter == i] for i, name in enumerate(names)}
    return {name: xs for name, xs in groups.items() if xs}


def targets(docs: list) -> int:
    """Target tokens of documents (a label after the first, not ignored): what sft_objective counts."""
    return sum(sum(1 for y in d.labels[1:] if y != IGNORE_INDEX) for d in docs)


def per_adapter_loss(docs: list, names: list[str], loss_of: Callable[[list], float], key: str) -> dict[str, float]:
    """`key/<name>`: loss_of(that adapter's documents), and `key`: their token-weighted mean."""
    out, total, n = {}, 0.0, 0
    for name, subset in by_adapter(docs, names).items():
        out[f"{key}/{name}"] = loss = loss_of(subset)
        k = targets(subset)
        total, n = total + loss * k, n + k
    out[key] = total / max(n, 1)
    return out


def export_adapters(model, tok, cfg, out: Path) -> dict[str, str]:
    """Each adapter as its own PEFT directory, and (save: full, or export_merged) merged into its
    own copy of the base; returns the manifest outputs. Rank 0, on a plain (gathered) model."""
    from posttrain.core.lora import merged_state_dict
    from posttrain.registry.adapters import save_adapter
    from posttrain.registry.hf import save_pretrained

    outputs: dict[str, str] = {}
    for name in cfg.lora.adapter_names:
        rel = f"{ADAPTERS_DIR}/{name}"
        save_adapter(model, out / rel, name=name, base_model=cfg.model.name_or_path)
        outputs[f"adapter/{name}"] = rel
        if cfg.save == "full" or cfg.export_merged:
            rel = merged_dir(name)
            save_pretrained(model, out / rel, state=merged_state_dict(model, name))
            tok.save_pretrained(out / rel)
            outputs[f"model/{name}"] = rel
    return outputs


def merged_dir(name: str) -> str:
    """Where a stage writes adapter `name` merged into the base (relative to its output dir)."""
    return f"model-{name}"


def log_adapters(run, out: Path, outputs: dict[str, str]) -> None:
    """Each adapter's PEFT directory as artifacts of the stage's MLflow run (`adapters/<name>`)."""
    for key, rel in outputs.items():
        if key.startswith("adapter/"):
            run.log_artifact(str(out / rel), rel)
