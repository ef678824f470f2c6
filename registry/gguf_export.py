"""GGUF out: a Hugging Face directory as a llama.cpp GGUF file (docs/models.md, "GGUF out").

    export_gguf("runs/real/sft/model", "sft.Q8_0.gguf", "Q8_0")

The inverse of registry/gguf.py's import, laid out as llama.cpp's converter writes files: the 2-D
weights in the chosen type, norms and biases F32, llama's q/k rows interleaved for llama.cpp's
rope, and the tokenizer (byte-level BPE) and chat template as metadata.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from posttrain.registry.gguf import _GLOBAL, _LAYER, CONTROL, PERMUTED_QK, SPLITS, USER_DEFINED, GGUFError, _gguf


def permute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's q/k rows in llama.cpp's order (the inverse of unpermute_qk), for export."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_TO_GLOBAL = {v: k for k, v in _GLOBAL.items()}
_TO_LAYER = {v: k for k, v in _LAYER.items()}


def gguf_name(hf: str) -> str | None:
    """The GGUF name of an HF tensor name (the inverse of registry/gguf.hf_name), for export."""
    if hf in _TO_GLOBAL:
        return _TO_GLOBAL[hf]
    parts = hf.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _TO_LAYER:
        return f"blk.{parts[2]}.{_TO_LAYER[parts[3]]}"
    return None


# what `export_gguf` writes the 2-D weights in, and the file type it declares (llama.cpp's
# LlamaFileType); norms and biases are always F32, as llama.cpp's converter writes them
EXPORT_TYPES = {"F32": 0, "F16": 1, "BF16": 32, "Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9}
_ARCH_OF_FAMILY = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}


def _pre_of(pre: dict | None) -> str:
    """The tokenizer.ggml.pre name of a tokenizer.json pre-tokenizer (the inverse of SPLITS)."""
    def is_bytelevel(p, regex):
        return p.get("type") == "ByteLevel" and bool(p.get("use_regex", True)) == regex

    if pre and is_bytelevel(pre, True):
        return "gpt2"
    steps = (pre or {}).get("pretokenizers") or []
    if len(steps) == 2 and steps[0].get("type") == "Digits" and steps[0].get("individual_digits") \
            and is_bytelevel(steps[1], True):
        return "smollm"
    if len(steps) == 2 and steps[0].get("type") == "Split" and is_bytelevel(steps[1], False):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        for name in ("llama-bpe", "qwen2"):
            if regex == SPLITS[name]:
                return name
    raise GGUFError(f"the tokenizer's pre-tokenizer {json.dumps(pre)[:200]} has no llama.cpp name; exportable: "
                    "GPT-2's byte-level rules, SmolLM's digits + byte-level, Llama 3's and Qwen2's splits")


def gguf_tokenizer_metadata(path: str | Path, vocab_size: int) -> dict[str, Any]:
    """llama.cpp's tokenizer.* metadata of the tokenizer in HF directory `path` (byte-level BPE):
    the tokens in id order (ids without a token, as padded embedding rows have, become `[PADn]`,
    unused), their types, the merges, the pre-tokenizer's name, the special ids and the template."""
    from posttrain.registry.tokenizer import Tokenizer

    path = Path(path)
    data = json.loads((path / "tokenizer.json").read_text())
    model = data.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise GGUFError(f"{path / 'tokenizer.json'}: only byte-level BPE tokenizers are exported to GGUF so far "
                        f"(this one: {model.get('type')}{', byte fallback' if model.get('byte_fallback') else ''})")
    pre = _pre_of(data.get("pre_tokenizer"))
    tok = Tokenizer.from_pretrained(path)
    added = {a["id"]: a for a in data.get("added_tokens") or []}
    by_id = {i: t for t, i in model["vocab"].items()}
    by_id.update({i: a["content"] for i, a in added.items()})
    if max(by_id) >= vocab_size:
        raise GGUFError(f"{path}: the tokenizer has id {max(by_id)}, beyond the model's {vocab_size} embedding rows")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]"), types.append(5)  # UNUSED
        else:
            tokens.append(by_id[i])
            types.append(CONTROL if i in added and added[i].get("special") else USER_DEFINED if i in added else 1)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    meta: dict[str, Any] = {"model": "gpt2", "pre": pre, "tokens": tokens, "types": types, "merges": merges,
                            "add_bos": bool(tok.config.get("add_bos_token", False)),
                            "add_eos": bool(tok.config.get("add_eos_token", False)),
                            "chat_template": tok.chat_template}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unk"), ("pad_token", "pad")):
        i = tok.token_to_id(tok.special_tokens.get(name))
        if i is not None:
            meta[key] = i
    return meta


def export_gguf(path: str | Path, out: str | Path, qtype: str = "F16", name: str | None = None,
                tokenizer: str | Path | None = None) -> Path:
    """Write HF directory `path` (config.json, safetensors; a byte-level BPE tokenizer there or in
    directory `tokenizer`) as GGUF file `out`, as llama.cpp's converter lays it out: 2-D weights in `qtype` (EXPORT_TYPES; a
    weight whose rows do not fill whole blocks falls back to F16, as llama.cpp's converter does),
    norms and biases F32, llama's q/k rows interleaved for llama.cpp's rope, the tokenizer and
    chat template as metadata. Written beside `out` and renamed into place."""
    gguf = _gguf()
    from posttrain.registry.hf import iter_hf_tensors, read_hf_config

    qtype = qtype.upper()
    if qtype not in EXPORT_TYPES:
        raise GGUFError(f"export type {qtype!r}: choose one of {', '.join(EXPORT_TYPES)}")
    path, out = Path(path), Path(out)
    cfg = read_hf_config(path)
    family = cfg.get("model_type")
    if family not in _ARCH_OF_FAMILY:
        raise GGUFError(f"{path / 'config.json'}: model_type {family!r} cannot be exported to GGUF here "
                        f"(supported: {', '.join(_ARCH_OF_FAMILY)})")
    arch = _ARCH_OF_FAMILY[family]
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    vocab = int(cfg["vocab_size"])
    tokenizer = gguf_tokenizer_metadata(tokenizer or path, vocab)
    tied = bool(cfg.get("tie_word_embeddings", False))
    q = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[q][0]

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    try:
        w.add_name(name or cfg.get("_name_or_path") or path.name)
        w.add_file_type(EXPORT_TYPES[qtype])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_block_count(int(cfg["num_hidden_layers"]))
        w.add_context_length(int(cfg.get("max_position_embeddings", 2048)))
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(int(cfg["intermediate_size"]))
        w.add_head_count(heads)
        w.add_head_count_kv(kv_heads)
        w.add_rope_freq_base(float((cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta", 1e4)))
        w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
        w.add_rope_dimension_count(head_dim)
        if head_dim != hidden // heads:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        w.add_vocab_size(vocab)
        rope = dict(cfg.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind in ("linear", "yarn"):
            w.add_rope_scaling_type(gguf.RopeScalingType(kind))
            w.add_rope_scaling_factor(float(rope["factor"]))
            if kind == "yarn":
                w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        elif kind != "default":
            raise GGUFError(f"{path / 'config.json'}: rope_type {kind!r} cannot be exported to GGUF here")
        w.add_tokenizer_model(tokenizer["model"])
        w.add_tokenizer_pre(tokenizer["pre"])
        w.add_token_list(tokenizer["tokens"])
        w.add_token_types(tokenizer["types"])
        w.add_token_merges(tokenizer["merges"])
        for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unk", w.add_unk_token_id),
                         ("pad", w.add_pad_token_id)):
            if key in tokenizer:
                add(tokenizer[key])
        w.add_add_bos_token(tokenizer["add_bos"])
        w.add_add_eos_token(tokenizer["add_eos"])
        if tokenizer["chat_template"]:
            w.add_chat_template(tokenizer["chat_template"])

        for hf, t in iter_hf_tensors(path):
            target = gguf_name(hf)
            if target is None:
                raise GGUFError(f"{path}: tensor {hf!r} has no place in a GGUF {arch} model")
            if target == "output.weight" and tied:
                continue
            v = t.float().numpy()
            if arch in PERMUTED_QK and ".attn_q." in target:
                v = permute_qk(torch.from_numpy(v), heads).numpy()
            elif arch in PERMUTED_QK and ".attn_k." in target:
                v = permute_qk(torch.from_numpy(v), kv_heads).numpy()
            if v.ndim == 1 or q == gguf.GGMLQuantizationType.F32:
                w.add_tensor(target, v.astype("float32"))
            elif q == gguf.GGMLQuantizationType.F16 or v.shape[-1] % block:
                w.add_tensor(target, v.astype("float16"))
            else:
                w.add_tensor(target, gguf.quants.quantize(v, q).view("uint8"), raw_dtype=q)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    except BaseException:
        try:
            w.close()
        finally:
            tmp.unlink(missing_ok=True)
        raise
    return out
