"""LoRA adapters in PEFT's on-disk format: `adapter_config.json` + `adapter_model.safetensors`.

Our module names map to HF's through the family's state-dict adapter (registry/hf.py), so an
adapter trained here loads with `peft` onto the `transformers` model, and PEFT adapters load here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from posttrain.core.atomic import replace_dir
from posttrain.core.lora import adapter_config, adapter_state_dict, apply_lora, load_adapter_state_dict
from posttrain.registry.hf import ADAPTERS, CheckpointError

_PREFIX = "base_model.model."
# our suffix -> PEFT's suffix (the adapter name is not stored in PEFT's files)
_SUFFIXES = {"lora_A": "lora_A.weight", "lora_B": "lora_B.weight", "lora_magnitude": "lora_magnitude_vector"}
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def _check_name(name: str) -> None:
    if not _SAFE_NAME.match(name) or name in (".", ".."):
        raise ValueError(f"adapter name {name!r} must be letters, digits, '_', '-' or '.' (no path parts)")


def _hf_module(family: str, module: str) -> str:
    (hf_key, _), = ADAPTERS[family].to_hf(f"{module}.weight", torch.empty(0))
    return hf_key.removesuffix(".weight")


# LoRA on MoE experts (posttrain.core.lora.experts) as peft's `target_parameters` on transformers' stacked
# experts (`model.layers.<i>.mlp.experts.gate_up_proj` (E, 2I, H) and `.down_proj` (E, H, I)):
# peft wraps the experts module once per parameter, the first listed innermost (`base_layer`);
# its lora_A is (E * r, in), expert-major, and its lora_B (out, r * E), expert-minor.
_EXPERT_TARGETS = ["experts.gate_up_proj", "experts.down_proj"]
_EXPERT_KEYS = {"gate_up": "base_layer.", "down": ""}  # ours -> where peft puts it under the experts module


def _expert_tensors(module: str, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our (E, r, in) A and (E, out, r) B of one experts module -> peft's keys and layouts."""
    hf = "model." + module  # layers.<i>.mlp.experts, the same path in transformers (Mixtral, Qwen2-MoE)
    out = {}
    for ours, where in _EXPERT_KEYS.items():
        a, b = params[f"{ours}_A"], params[f"{ours}_B"]
        out[f"{_PREFIX}{hf}.{where}lora_A.weight"] = a.reshape(-1, a.shape[-1])
        out[f"{_PREFIX}{hf}.{where}lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], -1)
    return out


def _expert_params(tensors: dict[str, torch.Tensor], E: int) -> dict[str, torch.Tensor]:
    """Inverse of _expert_tensors for one module's four peft tensors (keys `<where>lora_A|B`)."""
    out = {}
    for ours, where in _EXPERT_KEYS.items():
        a, b = tensors[f"{where}lora_A"], tensors[f"{where}lora_B"]
        out[f"{ours}_A"] = a.reshape(E, -1, a.shape[-1])
        out[f"{ours}_B"] = b.reshape(b.shape[0], -1, E).permute(2, 0, 1)
    return out


def save_adapter(model, path: str | Path, name: str = "default", base_model: str | None = None) -> Path:
    """Write adapter `name` of `model` as a PEFT LoRA adapter directory (atomically)."""
    _check_name(name)
    family = model.args.family
    cfg = adapter_config(model, name)
    tensors, experts = {}, {}
    for key, t in adapter_state_dict(model, name).items():
        module, kind = key.rsplit(".", 1)
        if module.endswith(".experts.lora"):
            experts.setdefault(module.removesuffix(".lora"), {})[kind] = t
            continue
        tensors[f"{_PREFIX}{_hf_module(family, module)}.{_SUFFIXES[kind]}"] = t.contiguous().cpu()
    for module, params in experts.items():
        tensors.update({k: v.contiguous().cpu() for k, v in _expert_tensors(module, params).items()})
    peft_cfg = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": cfg["rank"], "lora_alpha": cfg["alpha"], "lora_dropout": cfg["dropout"],
        "use_rslora": cfg["use_rslora"], "use_dora": cfg["use_dora"], "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": True, "modules_to_save": None,
        "target_modules": sorted(_hf_module(family, m) for m in cfg["targets"]),
        "target_parameters": _EXPERT_TARGETS if experts else None,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.mkdir(exist_ok=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    (tmp / "adapter_config.json").write_text(json.dumps(peft_cfg, indent=2))
    replace_dir(tmp, path)
    return path


def load_adapter(model, path: str | Path, name: str = "default") -> list[str]:
    """Add the PEFT LoRA adapter at `path` to `model` as adapter `name`; returns wrapped modules."""
    _check_name(name)
    cfg, state, targets, experts = read_adapter(model, path)
    apply_lora(model, adapter_name=name, rank=cfg["r"], alpha=cfg["lora_alpha"],
               dropout=cfg.get("lora_dropout", 0.0), use_rslora=cfg.get("use_rslora", False),
               use_dora=cfg.get("use_dora", False), experts=bool(experts),
               targets=[f"re:^{re.escape(t)}$" for t in targets] or ["re:^$"])
    load_adapter_state_dict(model, state, name)
    return targets + sorted(experts)


def read_adapter(model, path: str | Path) -> tuple[dict, dict[str, torch.Tensor], list[str], dict]:
    """The PEFT LoRA adapter at `path`, read for `model` without changing it: (adapter_config.json,
    the tensors under this project's module names, the targeted linear modules, the expert
    modules). load_adapter_state_dict puts the tensors into an adapter the model already has (e.g.
    a QLoRA policy from posttrain.stages.common.load_quantized)."""
    path = Path(path)
    cfg_file, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    for f in (cfg_file, weights):
        if not f.exists():
            raise CheckpointError(f"{f}: missing (a PEFT adapter directory needs it)")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("peft_type") != "LORA":
        raise CheckpointError(f"{cfg_file}: peft_type {cfg.get('peft_type')!r} is not supported (LORA only)")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise CheckpointError(f"{cfg_file}: per-module rank/alpha patterns are not supported")
    adapter = ADAPTERS[model.args.family]
    state, experts = {}, {}
    try:
        with safe_open(str(weights), framework="pt") as f:
            for key in f.keys():
                hf_module, ours = _split_peft_key(key, weights)
                expert = re.fullmatch(r"model\.(layers\.\d+\.mlp\.experts)\.?(base_layer)?", hf_module)
                if expert and cfg.get("target_parameters"):
                    where = "base_layer." if expert.group(2) else ""
                    experts.setdefault(expert.group(1), {})[f"{where}{ours}"] = f.get_tensor(key)
                    continue
                mapped = adapter.to_ours(f"{hf_module}.weight")
                if mapped is None or mapped[1] is not None:
                    raise CheckpointError(f"{weights}: tensor {key!r} targets no linear layer of this model")
                state[f"{mapped[0].removesuffix('.weight')}.{ours}"] = f.get_tensor(key)
    except SafetensorError as e:
        raise CheckpointError(f"{weights}: unreadable or truncated safetensors file ({e})") from None
    targets = sorted({k.rsplit(".", 1)[0] for k in state})
    if experts:
        if sorted(cfg["target_parameters"]) != sorted(_EXPERT_TARGETS):
            raise CheckpointError(f"{cfg_file}: target_parameters {cfg['target_parameters']} are not the experts' "
                                  f"{_EXPERT_TARGETS}")
        E = model.args.moe.num_experts
        for module, tensors in experts.items():
            state.update({f"{module}.lora.{k}": v for k, v in _expert_params(tensors, E).items()})
    return cfg, state, targets, experts


def _split_peft_key(key: str, where: Path) -> tuple[str, str]:
    if key.startswith(_PREFIX):
        key = key[len(_PREFIX):]
    for ours, theirs in _SUFFIXES.items():
        if key.endswith("." + theirs):
            return key[: -len(theirs) - 1], ours
    raise CheckpointError(f"{where}: tensor {key!r} is not a LoRA A/B/magnitude tensor")
