"""Hugging Face checkpoint import/export for the supported families, without `transformers`.

A checkpoint directory holds `config.json` and `model.safetensors` (or shards listed in
`model.safetensors.index.json`). Each family has one state-dict adapter: the table from HF
tensor names to ours, plus the stacking of per-expert tensors into our (E, ...) layout.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from posttrain.core.atomic import replace_dir
from posttrain.core.model.args import ModelArgs, MoEArgs
from posttrain.core.model.model import Transformer
from posttrain.core.model.rope import SUPPORTED_ROPE_TYPES

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked; the message names the file and tensor."""


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelArgs


def args_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
    family = cfg.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise CheckpointError(
            f"{source}: unsupported model_type {family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    try:
        n_layers = cfg["num_hidden_layers"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        if "type" in rope:  # the pre-2024 spelling
            rope.setdefault("rope_type", rope.pop("type"))
        if rope.get("rope_type", "default") not in SUPPORTED_ROPE_TYPES:
            raise CheckpointError(
                f"{source}: rope_type {rope['rope_type']!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if rope.get("rope_type") in ("llama3", "yarn"):
            rope.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
        args = dict(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=n_layers,
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim"),
            intermediate_size=cfg.get("intermediate_size", 0),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_embeddings=cfg.get("tie_word_embeddings", False),
            initializer_range=cfg.get("initializer_range", 0.02),
        )
        if family == "llama":
            args.update(qkv_bias=cfg.get("attention_bias", False), o_bias=cfg.get("attention_bias", False),
                        mlp_bias=cfg.get("mlp_bias", False))
        if family in ("qwen2", "qwen2_moe"):
            args.update(qkv_bias=cfg.get("qkv_bias", True))
            window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
            types = cfg.get("layer_types") or [
                "sliding_attention" if window and i >= cfg.get("max_window_layers", n_layers) else "full_attention"
                for i in range(n_layers)
            ]
            args.update(sliding_window=window or None, layer_types=types if window else None)
        if family in ("mistral", "mixtral"):
            args.update(sliding_window=cfg.get("sliding_window") or None)
        if family == "mixtral":
            args["moe"] = MoEArgs(
                num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                intermediate_size=cfg["intermediate_size"], norm_topk_prob=True,
                aux_loss_coef=cfg.get("router_aux_loss_coef", 0.0),
            )
        if family == "qwen2_moe":
            args["moe"] = MoEArgs(
                num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
                intermediate_size=cfg["moe_intermediate_size"],
                shared_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
                shared_expert_gate=bool(cfg.get("shared_expert_intermediate_size", 0)),
                norm_topk_prob=cfg.get("norm_topk_prob", False),
                aux_loss_coef=cfg.get("router_aux_loss_coef", 0.0),
                sparse_step=cfg.get("decoder_sparse_step", 1),
                dense_layers=list(cfg.get("mlp_only_layers") or []),
            )
        return ModelArgs(**args)
    except KeyError as e:
        raise CheckpointError(f"{source}: missing required field {e.args[0]!r} for model_type {family!r}") from None


def hf_config_from_args(args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    family = args.family
    if family not in SUPPORTED_FAMILIES:
        raise CheckpointError(f"cannot export family {family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}")
    if family in ("llama",) and args.qkv_bias != args.o_bias:
        raise CheckpointError("llama's attention_bias covers q/k/v/o together; export qkv-only bias as qwen2")
    if family in ("qwen2", "qwen2_moe") and args.o_bias:
        raise CheckpointError(f"{family} has no o_proj bias")
    if (args.moe is None) != (family not in ("mixtral", "qwen2_moe")):
        raise CheckpointError(f"family {family!r} does not match the model's MoE setting")
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": dict(args.rope_scaling) if args.rope_scaling else None,
        "max_position_embeddings": args.max_position_embeddings,
        "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": args.initializer_range,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
    if family == "llama":
        cfg.update(attention_bias=args.qkv_bias, mlp_bias=args.mlp_bias)
    if family in ("mistral", "mixtral"):
        cfg["sliding_window"] = args.sliding_window
    if family in ("qwen2", "qwen2_moe"):
        sliding = args.sliding_window is not None
        types = args.layer_types or ["sliding_attention" if sliding else "full_attention"] * args.num_layers
        first = next((i for i, t in enumerate(types) if t == "sliding_attention"), args.num_layers)
        cfg.update(use_sliding_window=sliding, sliding_window=args.sliding_window,
                   max_window_layers=first, layer_types=types, qkv_bias=args.qkv_bias)
    m = args.moe
    if family == "mixtral":
        cfg.update(num_local_experts=m.num_experts, num_experts_per_tok=m.top_k,
                   intermediate_size=m.intermediate_size, router_aux_loss_coef=m.aux_loss_coef)
    if family == "qwen2_moe":
        cfg.update(num_experts=m.num_experts, num_experts_per_tok=m.top_k,
                   moe_intermediate_size=m.intermediate_size,
                   shared_expert_intermediate_size=m.shared_intermediate_size,
                   norm_topk_prob=m.norm_topk_prob, router_aux_loss_coef=m.aux_loss_coef,
                   decoder_sparse_step=m.sparse_step, mlp_only_layers=list(m.dense_layers))
    return cfg


# ---------------------------------------------------------------------------------------------
# State-dict adapters: HF key templates <-> ours. {i} is the layer, {e} the expert.

_DENSE = [
    ("model.embed_tokens.weight", "embed.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.attn_norm.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.mlp_norm.weight"),
] + [
    (f"model.layers.{{i}}.self_attn.{p}.{t}", f"layers.{{i}}.attn.{p}.{t}")
    for p in ("q_proj", "k_proj", "v_proj", "o_proj") for t in ("weight", "bias")
] + [
    (f"model.layers.{{i}}.mlp.{p}.{t}", f"layers.{{i}}.mlp.{p}.{t}")
    for p in ("gate_proj", "up_proj", "down_proj") for t in ("weight", "bias")
]

_MIXTRAL = [
    ("model.layers.{i}.block_sparse_moe.gate.weight", "layers.{i}.mlp.router.gate.weight"),
    ("model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight", "layers.{i}.mlp.experts.gate_proj"),
    ("model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight", "layers.{i}.mlp.experts.up_proj"),
    ("model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight", "layers.{i}.mlp.experts.down_proj"),
]

_QWEN2_MOE = [
    ("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.gate.weight"),
    ("model.layers.{i}.mlp.shared_expert_gate.weight", "layers.{i}.mlp.shared_expert_gate.weight"),
] + [
    (f"model.layers.{{i}}.mlp.shared_expert.{p}.weight", f"layers.{{i}}.mlp.shared_expert.{p}.weight")
    for p in ("gate_proj", "up_proj", "down_proj")
] + [
    (f"model.layers.{{i}}.mlp.experts.{{e}}.{p}.weight", f"layers.{{i}}.mlp.experts.{p}")
    for p in ("gate_proj", "up_proj", "down_proj")
]


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)") + "$")


@dataclass
class StateDictAdapter:
    """Maps one family's HF tensor names to ours and back; expert tensors are stacked on load
    and split on save."""

    family: str
    table: list[tuple[str, str]]

    def __post_init__(self) -> None:
        self._hf = [(_pattern(h), h, o) for h, o in self.table]
        self._ours = [(_pattern(o), h, o) for h, o in self.table if "{e}" not in h]
        self._experts = [(_pattern(o), h, o) for h, o in self.table if "{e}" in h]

    def to_ours(self, hf_key: str) -> tuple[str, int | None] | None:
        """Our key for an HF key, and the expert index when it is one slice of a stacked tensor."""
        for pat, _, ours in self._hf:
            m = pat.match(hf_key)
            if m:
                g = m.groupdict()
                key = ours.replace("{i}", g.get("i") or "")
                return key, int(g["e"]) if g.get("e") is not None else None
        return None

    def to_hf(self, key: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        for pat, hf, _ in self._experts:
            m = pat.match(key)
            if m:
                for e in range(tensor.shape[0]):
                    yield hf.replace("{i}", m["i"]).replace("{e}", str(e)), tensor[e]
                return
        for pat, hf, _ in self._ours:
            m = pat.match(key)
            if m:
                yield hf.replace("{i}", m.groupdict().get("i") or ""), tensor
                return
        raise CheckpointError(f"no HF name for tensor {key!r} in family {self.family!r}")


ADAPTERS = {
    "llama": StateDictAdapter("llama", _DENSE),
    "mistral": StateDictAdapter("mistral", _DENSE),
    "qwen2": StateDictAdapter("qwen2", _DENSE),
    "mixtral": StateDictAdapter("mixtral", _DENSE + _MIXTRAL),
    "qwen2_moe": StateDictAdapter("qwen2_moe", _DENSE + _QWEN2_MOE),
}


# ---------------------------------------------------------------------------------------------
# Reading and writing


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index}: shard file(s) missing: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        raise CheckpointError(
            f"{path}: only pickle weights (*.bin/*.pt) found; posttrain reads safetensors only "
            "(pickle can execute code). Convert them with a trusted tool first."
        )
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def iter_hf_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of an HF checkpoint directory, shard by shard."""
    for file in _safetensors_files(Path(path)):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"{file}: unreadable or truncated safetensors file ({e})") from None


def read_hf_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{cfg_file}: missing (an HF checkpoint directory needs config.json)")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: invalid JSON ({e})") from None


def load_pretrained(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Transformer:
    """Read a local HF checkpoint directory into the project's model (weights cast to `dtype`).
    Every tensor whole: a parallelized model loads its shards with hf_sharded.load_sharded."""
    path = Path(path)
    model = model_on_meta(path)
    state = load_hf_state_dict(path, model, dtype, device)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.init_buffers()
    return model


def model_on_meta(path: str | Path) -> Transformer:
    """The model of the checkpoint directory `path` (its config.json), on the meta device."""
    path = Path(path)
    args = args_from_hf_config(read_hf_config(path), str(path / "config.json"))
    with torch.device("meta"):
        return Transformer(args)


def load_hf_state_dict(path: Path, model: Transformer, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """Our state dict from the HF tensors of `path`, with every name and shape checked."""
    adapter = ADAPTERS[model.args.family]
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not model.args.tie_embeddings}
    expected = {k: v for k, v in expected.items() if not k.endswith("router.expert_bias")}
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    for name, tensor in iter_hf_tensors(path):
        mapped = adapter.to_ours(name)
        if mapped is None or mapped[0] not in expected:
            if name == "lm_head.weight" and model.args.tie_embeddings:
                continue  # some tied checkpoints store the head anyway
            raise CheckpointError(f"{path}: unexpected tensor {name!r} for model_type {model.args.family!r}")
        key, e = mapped
        tensor = tensor.to(device=device, dtype=dtype)
        if e is None:
            state[key] = tensor
        else:
            experts[key][e] = tensor
    for key, parts in experts.items():
        n = expected[key].shape[0]
        missing = sorted(set(range(n)) - parts.keys())
        if missing:
            raise CheckpointError(f"{path}: tensor {key!r} is missing experts {missing}")
        state[key] = torch.stack([parts[e] for e in range(n)])
    for key, ref in expected.items():
        if key not in state:
            raise CheckpointError(f"{path}: missing tensor for {key!r} ({_hf_names(adapter, key, ref)})")
        if state[key].shape != ref.shape:
            raise CheckpointError(
                f"{path}: tensor {key!r} ({_hf_names(adapter, key, ref)}) has shape "
                f"{tuple(state[key].shape)}, config.json implies {tuple(ref.shape)}"
            )
    return state


def _hf_names(adapter: StateDictAdapter, key: str, ref: torch.Tensor) -> str:
    names = [n for n, _ in adapter.to_hf(key, ref)]
    return names[0] if len(names) == 1 else f"{names[0]} ... {names[-1]}"


def hf_state_dict(model: Transformer, dtype: torch.dtype | None = None,
                  state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The model's weights (or `state`, e.g. LoRA-merged) under HF names (experts split per
    expert), contiguous, in `dtype`."""
    adapter = ADAPTERS[model.args.family]
    out = {}
    for key, tensor in (model.state_dict() if state is None else state).items():
        if key.endswith("router.expert_bias") or (key == "lm_head.weight" and model.args.tie_embeddings):
            continue
        for name, t in adapter.to_hf(key, tensor):
            out[name] = t.detach().to(dtype or t.dtype).contiguous().cpu()
    return out


def save_pretrained(
    model: Transformer, path: str | Path, dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write `model` as an HF checkpoint directory that `transformers` loads unchanged.

    Written into a sibling temporary directory and renamed into place, so a crash never leaves
    a half-written checkpoint at `path`."""
    path = Path(path)
    state = hf_state_dict(model, dtype, state)
    dtype = dtype or next(iter(state.values())).dtype
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        shards = _shard(state, max_shard_bytes)
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for n, shard in enumerate(shards, 1):
                fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({k: fname for k in shard})
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(hf_config_from_args(model.args, dtype), indent=2))
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _shard(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> None:
    """Copy the tokenizer and generation files of an HF directory next to exported weights."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja", "chat_template.json", "generation_config.json"):
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, Path(dst) / name)
