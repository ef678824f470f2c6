"""The model-level LoRA API: which layers get adapters (`apply_lora` from a LoRAConfig), named
adapters (add, set, delete, route per example, disable = the base model), merging, and adapter
state dicts. The layer itself is core/lora/layer.py."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from fnmatch import fnmatchcase
from typing import Any

import torch
from pydantic import ValidationError
from torch import nn

from posttrain.core.lora.config import LoRAConfig
from posttrain.core.lora.experts import PARAMS as EXPERT_PARAMS, apply_expert_lora, expert_loras
from posttrain.core.lora.layer import OUTPUT_HEADS, LoRALinear



def _resolve(cfg: LoRAConfig | None, kwargs: dict[str, Any]) -> LoRAConfig:
    """`cfg` (default LoRAConfig()) with `kwargs` set over it, validated by the schema. A string
    `targets` / `modules_to_save` is "all-linear" or a regex (peft's rule)."""
    for key in ("targets", "modules_to_save"):
        if isinstance(kwargs.get(key), str):
            kwargs[key] = [kwargs[key]] if kwargs[key] == "all-linear" else [f"re:{kwargs[key]}"]
    unknown = set(kwargs) - set(LoRAConfig.model_fields)
    if unknown:
        raise TypeError(f"unknown LoRA option(s) {sorted(unknown)}; known: {sorted(LoRAConfig.model_fields)}")
    try:
        return LoRAConfig(**{**(cfg.model_dump() if cfg is not None else {}), **kwargs})
    except ValidationError as e:
        raise ValueError(f"invalid LoRA options: {e}") from None


def _is_all_linear(targets: str | Sequence[str]) -> bool:
    return targets in ("all-linear", ["all-linear"], ("all-linear",))


def _matches(name: str, spec: str | Sequence[str]) -> bool:
    """A string is a regex on the full module name (peft's rule). A list holds exact names,
    suffixes ("q_proj" matches "layers.0.attn.q_proj"), globs ("mlp.*") or "re:<regex>"."""
    if isinstance(spec, str):
        return re.fullmatch(spec, name) is not None
    for t in spec:
        if t.startswith("re:"):
            hit = re.fullmatch(t[3:], name) is not None
        else:  # "*." + t: t may match the tail of the name, on a "." boundary
            hit = fnmatchcase(name, t) or fnmatchcase(name, "*." + t)
        if hit:
            return True
    return False


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    for name, mod in model.named_modules():
        if isinstance(mod, LoRALinear):
            yield name, mod


def adapter_names(model: nn.Module) -> list[str]:
    """Adapters in order of first appearance (creation order when they share targets)."""
    names: dict[str, None] = {}
    for _, mod in lora_modules(model):
        names.update(dict.fromkeys(mod.adapters))
    for _, mod in expert_loras(model):
        names.update(dict.fromkeys([mod.name]))
    return list(names)


def apply_lora(
    model: nn.Module, cfg: LoRAConfig | None = None, adapter_name: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None, base_weight: Callable[[str, nn.Linear], None] | None = None,
    **kwargs: Any,
) -> list[str]:
    """Wrap the targeted nn.Linear layers (or reuse existing wrappers) and add the adapter(s)
    `adapter_name` (default: the config's adapter_names; the first added becomes active).
    The first call freezes everything but the adapters (and `modules_to_save`, trained in full).
    Returns the targeted module names. base_weight(name, linear): called for a targeted layer
    whose weight is still on the meta device, to give it its values just before it is wrapped
    (and quantized, under quantize_base: a model built on meta is quantized one weight at a time).

    kwargs: LoRAConfig fields set over `cfg`. targets: "all-linear" or ["all-linear"] (every
    nn.Linear but the output head), a regex, or a list of exact names / suffixes / globs /
    "re:<regex>". exclude: the same forms, default OUTPUT_HEADS for all-linear.
    """
    c = _resolve(cfg, kwargs)
    if isinstance(adapter_name, str):
        adapter_name = [adapter_name]
    names = list(adapter_name or c.adapter_names)
    for n in names:
        if not n or "." in n:
            raise ValueError(f"adapter names must be non-empty and contain no '.', got {n!r}")
    targets, quantize = c.targets, c.quantize_base is not None
    all_linear = _is_all_linear(targets)
    if exclude is None:
        exclude = OUTPUT_HEADS if all_linear else ()
    first_call = next(lora_modules(model), None) is None
    chosen = []
    for name, mod in model.named_modules():
        # Exact type: a subclass (a parallel layer, a quantized layer) has its own forward.
        if not name or not (type(mod) is nn.Linear or isinstance(mod, LoRALinear)):
            continue
        if (all_linear or _matches(name, targets)) and not _matches(name, exclude):
            chosen.append(name)
    if not chosen and not c.experts:
        raise ValueError(f"no nn.Linear in {type(model).__name__} matches targets={targets!r} "
                         f"(exclude={exclude!r})")
    for name in chosen:
        mod = model.get_submodule(name)
        if not isinstance(mod, LoRALinear):
            if base_weight is not None and mod.weight.is_meta:
                base_weight(name, mod)
            mod = LoRALinear(mod, quantize=quantize, double_quant=c.double_quant)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, mod)
        elif quantize != mod.quantized:
            raise ValueError(f"{name}: quantize_base={c.quantize_base!r} but the layer was "
                             f"wrapped with quantize_base={mod.quantized}")
        for n in names:
            mod.add_adapter(n, c.rank, c.alpha, c.dropout, c.use_rslora, c.use_dora, c.init_lora_weights)
    if c.experts:  # after the linear layers: init_adapters draws in this order too
        chosen += apply_expert_lora(model, names[0], c.rank, c.alpha, c.dropout, c.use_rslora, c.init_lora_weights)
    if first_call:
        model.requires_grad_(False)
    for p in lora_parameters(model):
        p.requires_grad_(True)
    if c.modules_to_save:
        saved = [n for n, _ in model.named_modules() if n and _matches(n, c.modules_to_save)]
        if not saved:
            raise ValueError(f"modules_to_save={c.modules_to_save!r} matches no module")
        for n in saved:
            model.get_submodule(n).requires_grad_(True)
    return chosen


def add_adapter(model: nn.Module, name: str, cfg: LoRAConfig | None = None, **kwargs: Any) -> list[str]:
    """Add another adapter (apply_lora under another name)."""
    return apply_lora(model, cfg, adapter_name=name, **kwargs)


def _with_adapter(model: nn.Module, name: str) -> list[LoRALinear]:
    mods = [m for _, m in lora_modules(model) if name in m.lora_A]
    if not mods:
        raise KeyError(f"no LoRA adapter named {name!r}; adapters: {adapter_names(model)}")
    return mods


def set_adapter(model: nn.Module, name: str) -> None:
    """Make `name` the active adapter; layers without it run their base only."""
    _with_adapter(model, name)
    for _, mod in lora_modules(model):
        mod.active_adapter = name if name in mod.lora_A else None


def delete_adapter(model: nn.Module, name: str) -> None:
    for mod in _with_adapter(model, name):
        mod.delete_adapter(name)


def merged_state_dict(model: nn.Module, name: str | None = "default") -> dict[str, torch.Tensor]:
    """The model's state dict as a plain (adapter-free) model would have it, with adapter `name`
    folded into each wrapped weight; the model itself is not changed. For HF export."""
    wrapped = dict(lora_modules(model))
    experts = {m.removesuffix(".lora"): mod for m, mod in expert_loras(model)}
    out = {}
    state = model.state_dict()
    folded = {}  # the experts' stacks with their update folded in
    for owner, mod in experts.items():
        weights = [state[f"{owner}.{k}"] for k in ("gate_proj", "up_proj", "down_proj")]
        merged = mod.merged(*weights) if name == mod.name else weights
        folded.update({f"{owner}.{k}": w for k, w in zip(("gate_proj", "up_proj", "down_proj"), merged)})
    for key, value in state.items():
        if key in folded:
            out[key] = folded[key]
            continue
        if any(key.startswith(f"{owner}.lora.") for owner in experts):
            continue
        module, _, leaf = key.rpartition(".")
        owner = next((m for m in wrapped if module == m or module.startswith(m + ".")), None)
        if owner is None:
            out[key] = value
        elif key == f"{owner}.weight" or module == f"{owner}.weight":  # dense or NF4 parts
            if f"{owner}.weight" not in out:
                layer = wrapped[owner]
                out[f"{owner}.weight"] = layer.merged_weight(name if name in layer.lora_A else None)
        elif key == f"{owner}.bias":
            out[key] = value
    return out


def merge_lora(model: nn.Module, name: str = "default") -> None:
    """Fold adapter `name` into the base weights (not allowed on an NF4 base)."""
    for mod in _with_adapter(model, name):
        mod.merge(name)


def unmerge_lora(model: nn.Module, name: str = "default") -> None:
    """Exact inverse of merge_lora, up to floating-point rounding."""
    for mod in _with_adapter(model, name):
        mod.unmerge(name)


@contextmanager
def disable_adapter(model: nn.Module) -> Iterator[None]:
    """Inside, the model computes exactly its base outputs (DPO's reference model). Refused
    where that is not the pre-LoRA model: merged adapters, a PiSSA-rewritten base, or weights
    outside the adapters being trained (modules_to_save)."""
    mods = [m for _, m in lora_modules(model)]
    merged = [m.merged for m in mods if m.merged]
    if merged:
        raise RuntimeError(f"adapters {merged[0]} are merged; unmerge before disable_adapter")
    if any(m.base_rewritten for m in mods):
        raise RuntimeError("PiSSA moved part of the base weights into the adapters; "
                           "disable_adapter would not give the original model")
    own = {id(p) for p in lora_parameters(model)}
    full = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in own]
    if full:
        raise RuntimeError(f"{full[:3]} are trained in full (modules_to_save); "
                           "disable_adapter would not give the base model")
    mods += [m for _, m in expert_loras(model)]
    prev = [m.disabled for m in mods]
    for m in mods:
        m.disabled = True
    try:
        yield
    finally:
        for m, d in zip(mods, prev):
            m.disabled = d


@contextmanager
def route_adapters(
    model: nn.Module, adapter_ids: torch.Tensor | Sequence[int] | Sequence[str],
    names: Sequence[str] | None = None,
) -> Iterator[None]:
    """Inside, every example of a batch, or every token, uses its own adapter: adapter_ids holds
    indices into `names` (default adapter_names(model)) or adapter names, one per example (B,), or
    one per token (B, T) as a packed row needs (each document's tokens carry its adapter); -1 means
    no adapter (the base alone, e.g. on padding). Layers lacking an adapter add nothing for its
    tokens. Model code needs no extra argument."""
    names = list(names) if names is not None else adapter_names(model)
    if len(adapter_ids) and isinstance(adapter_ids[0], str):
        unknown = set(adapter_ids) - set(names)
        if unknown:
            raise KeyError(f"unknown adapter(s) {sorted(unknown)}; adapters: {names}")
        adapter_ids = [names.index(n) for n in adapter_ids]
    ids = torch.as_tensor(adapter_ids, dtype=torch.long)
    if ids.dim() not in (1, 2) or (ids.numel() and (ids.min() < -1 or ids.max() >= len(names))):
        raise ValueError(f"adapter_ids must be a (B,) or (B, T) tensor of indices into {names} "
                         f"(or -1), got {ids}")
    mods = [m for _, m in lora_modules(model)]
    prev = [m.routing for m in mods]
    for m in mods:
        local = {n: i for i, n in enumerate(m.adapters)}
        lut = torch.tensor([local.get(n, len(local)) for n in names] + [len(local)], device=ids.device)
        m.routing = lut[ids]  # -1 picks the last entry: none
    try:
        yield
    finally:
        for m, r in zip(mods, prev):
            m.routing = r


def lora_parameters(model: nn.Module, name: str | None = None) -> Iterator[nn.Parameter]:
    """A, B (and DoRA magnitudes) of adapter `name`, or of every adapter."""
    for _, mod in lora_modules(model):
        for params in (mod.lora_A, mod.lora_B, mod.lora_magnitude):
            for n, p in params.items():
                if name is None or n == name:
                    yield p
    for _, mod in expert_loras(model):
        if name is None or mod.name == name:
            yield from (getattr(mod, k) for k in EXPERT_PARAMS)


def count_trainable(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; an NF4 weight counts its logical size."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    total += sum(m.weight.numel() for _, m in lora_modules(model) if m.quantized)
    return trainable, total


def _adapter_params(model: nn.Module, name: str) -> dict[str, nn.Parameter]:
    """`<module>.lora_A` / `.lora_B` / `.lora_magnitude` -> adapter `name`'s parameter."""
    out = {f"{mname}.{kind}": getattr(mod, kind)[name]
           for mname, mod in lora_modules(model)
           for kind in ("lora_A", "lora_B", "lora_magnitude") if name in getattr(mod, kind)}
    out.update({f"{mname}.{kind}": getattr(mod, kind) for mname, mod in expert_loras(model) if mod.name == name
                for kind in EXPERT_PARAMS})
    if not out:
        raise KeyError(f"no LoRA adapter named {name!r}; adapters: {adapter_names(model)}")
    return out


def adapter_state_dict(model: nn.Module, name: str = "default") -> dict[str, torch.Tensor]:
    """Adapter `name` only, keyed `<module>.lora_A` / `.lora_B` / `.lora_magnitude` (no adapter
    name in the key, so it loads under any name)."""
    return {k: p.detach() for k, p in _adapter_params(model, name).items()}


def load_adapter_state_dict(
    model: nn.Module, state: dict[str, torch.Tensor], name: str = "default"
) -> None:
    """Copy an adapter_state_dict into existing adapter `name` (create it with apply_lora and
    the same rank/targets first). Every key must match, both ways."""
    own = _adapter_params(model, name)
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    if missing or unexpected:
        raise KeyError(f"adapter {name!r}: missing keys {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for key, p in own.items():
            if state[key].shape != p.shape:
                raise ValueError(f"{key}: shape {tuple(state[key].shape)} != {tuple(p.shape)}")
            p.copy_(state[key])


def adapter_config(model: nn.Module, name: str = "default") -> dict[str, Any]:
    """rank/alpha/dropout/use_rslora/use_dora/init and the target module names (PEFT export)."""
    targets = [n for n, m in lora_modules(model) if name in m.lora_A]
    experts = [n for n, m in expert_loras(model) if m.name == name]
    if targets:
        config = _with_adapter(model, name)[0].configs[name]
    elif experts:
        config = model.get_submodule(experts[0]).config
    else:
        raise KeyError(f"no LoRA adapter named {name!r}; adapters: {adapter_names(model)}")
    return dict(config, targets=targets, experts=experts)
