"""GGUF in: a llama.cpp model file as the Hugging Face directory the rest of posttrain reads.

    import_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2/")   # config, weights, tokenizer, template
    gguf_model_dir("model.gguf")                                  # the same, imported once into a cache

A GGUF file holds the weights (each tensor in its own ggml type), the model's hyperparameters under
`<arch>.*` keys, and the tokenizer as metadata (`tokenizer.ggml.*`: tokens, merges, token types,
special ids, the pre-tokenizer's name, the chat template). The import writes:

  * config.json: the family's HF config (llama, qwen2), the head tied when the file has no
    `output.weight`;
  * model.safetensors: every tensor under its HF name, dequantized by `gguf.quants` (every type
    it implements: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K..Q6_K, the
    IQ and TQ types, MXFP4), kept exact: F16/BF16 as they are, a quantized tensor as float32
    (a block's scale times its integers needs float32 to be represented exactly);
    llama's q/k rows back in HF's order (llama.cpp interleaves them for its rope);
  * tokenizer.json, tokenizer_config.json (special tokens, add_bos_token, chat template) and
    generation_config.json, built with `tokenizers` from the metadata: byte-level BPE (`gpt2`,
    split as the model's own tokenizer.json splits, for the pre-tokenizer names in SPLITS) and
    sentencepiece BPE (`llama`).

transformers' own loading of the file (`from_pretrained(..., gguf_file=)`) is the reference the
tests hold this to: logits, tokens and the rendered chat template (tests/registry/test_gguf.py).
One difference is deliberate: for `smollm` (and its kin) transformers keeps GPT-2's plain rules
and drops the digit split the model's tokenizer.json declares and llama.cpp applies, so it cuts
"\n\n  1" or " ½" differently from the tokenizer the model was trained with; this import splits
as the model does.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.core.atomic import replace_dir, write_json_atomic
from posttrain.registry.hf import CheckpointError

GGUF_INSTALL = "pip install 'gguf>=0.10'  (or: pip install 'posttrain[models]')"
# Bumped when what import_gguf writes changes: a cached import of an older version is redone.
IMPORT_VERSION = 1

# The families imported, by GGUF architecture; llama.cpp stores llama's q/k rows interleaved.
FAMILIES = {"llama": "llama", "qwen2": "qwen2"}
PERMUTED_QK = {"llama"}

# llama.cpp's tokenizer.ggml.pre -> how text is split before byte-level BPE, as the model's own
# tokenizer.json does it: GPT-2's rules (ByteLevel's regex); digits one by one first, then GPT-2's
# rules (SmolLM, StarCoder: tokenizers' Digits, which isolates every numeric character, `½`
# too, as llama.cpp's \p{N} split does); or one family regex. A name not here is refused rather
# than tokenized differently from the model's training.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS: dict[str, str] = {
    "default": "gpt2", "gpt2": "gpt2",
    **{name: "digits+gpt2" for name in ("smollm", "starcoder", "refact", "codeshell")},
    **{name: _LLAMA3 for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx")},
    **{name: _QWEN2 for name in ("qwen2", "deepseek-r1-qwen")},
}


def _pre_tokenizer(rule: str):
    from tokenizers import Regex, pre_tokenizers

    if rule == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if rule == "digits+gpt2":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(rule), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# llama.cpp's token types (tokenizer.ggml.token_type)
CONTROL, USER_DEFINED = 3, 4


class GGUFError(CheckpointError):
    """A GGUF file that cannot be imported; the message names the file and what is wrong."""


def _gguf():
    try:
        import gguf
    except ImportError:
        raise GGUFError(f"reading GGUF files needs the `gguf` package: {GGUF_INSTALL}") from None
    return gguf


# ---------------------------------------------------------------------------------------------
# Reading


@dataclass
class GGUFFile:
    """The metadata of a GGUF file (arrays of strings as lists) and its tensors, read lazily."""

    path: Path
    meta: dict[str, Any]
    tensors: list[Any] = field(repr=False)  # gguf.ReaderTensor

    @classmethod
    def open(cls, path: str | Path) -> GGUFFile:
        path = Path(path)
        if not path.is_file():
            raise GGUFError(f"{path}: no such GGUF file")
        gguf = _gguf()
        try:
            reader = gguf.GGUFReader(str(path))
        except (ValueError, OSError, IndexError) as e:
            raise GGUFError(f"{path}: not a readable GGUF file ({e})") from None
        meta = {}
        for key, f in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            value = f.contents()
            meta[key] = value
        return cls(path, meta, list(reader.tensors))

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(key, default)

    def need(self, key: str) -> Any:
        if key not in self.meta:
            raise GGUFError(f"{self.path}: metadata key {key!r} missing")
        return self.meta[key]

    @property
    def architecture(self) -> str:
        return str(self.need("general.architecture"))


def dequantize(tensor) -> torch.Tensor:
    """A GGUF tensor as torch, in (out, in) order like an HF weight: F32/F16/BF16 as stored, every
    quantized type dequantized to float32 by gguf.quants."""
    gguf = _gguf()
    qtype = gguf.GGMLQuantizationType(int(tensor.tensor_type))
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    if qtype == gguf.GGMLQuantizationType.F32:
        return torch.from_numpy(tensor.data.copy()).view(shape)
    if qtype == gguf.GGMLQuantizationType.F16:
        return torch.from_numpy(tensor.data.copy()).view(shape)
    if qtype == gguf.GGMLQuantizationType.BF16:  # stored as raw uint16 bit patterns
        raw = torch.from_numpy(tensor.data.copy().view("int16").reshape(-1))
        return raw.view(torch.bfloat16).view(shape)
    try:
        values = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError:
        raise GGUFError(f"tensor {tensor.name}: ggml type {qtype.name} cannot be dequantized by the installed "
                        f"gguf package") from None
    return torch.from_numpy(values.astype("float32", copy=False)).view(shape)


def unpermute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k rows (each head's two rotary halves interleaved) back in HF's order."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's q/k rows in llama.cpp's order (the inverse of unpermute_qk), for export."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------------------------
# config.json


def hf_config(g: GGUFFile) -> dict[str, Any]:
    """The HF config.json of a GGUF file's model."""
    arch = g.architecture
    if arch not in FAMILIES:
        raise GGUFError(f"{g.path}: architecture {arch!r} is not supported; supported: {', '.join(FAMILIES)}")
    names = {t.name for t in g.tensors}
    heads = int(g.need(f"{arch}.attention.head_count"))
    hidden = int(g.need(f"{arch}.embedding_length"))
    vocab = g.get(f"{arch}.vocab_size") or len(g.get("tokenizer.ggml.tokens") or []) or None
    if vocab is None:
        embd = next((t for t in g.tensors if t.name == "token_embd.weight"), None)
        if embd is None:
            raise GGUFError(f"{g.path}: no vocabulary size ({arch}.vocab_size, tokens or token_embd.weight)")
        vocab = int(embd.shape[1])
    head_dim = int(g.get(f"{arch}.attention.key_length") or hidden // heads)
    rot = g.get(f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise GGUFError(f"{g.path}: {arch}.rope.dimension_count {rot} != head dim {head_dim}: partial rotary "
                        f"embeddings are not supported")
    if "rope_freqs.weight" in names:
        raise GGUFError(f"{g.path}: rope_freqs.weight (Llama 3.1-style rope scaling stored as frequency "
                        f"factors) is not supported yet")
    cfg: dict[str, Any] = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[FAMILIES[arch]]],
        "model_type": FAMILIES[arch],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(g.need(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(g.need(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g.get(f"{arch}.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(g.get(f"{arch}.context_length") or 2048),
        "rms_norm_eps": float(g.get(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-6),
        "rope_theta": float(g.get(f"{arch}.rope.freq_base") or 10000.0),
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "float32",
    }
    scaling = g.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling not in ("linear", "yarn"):
            raise GGUFError(f"{g.path}: {arch}.rope.scaling.type {scaling!r} is not supported (linear, yarn)")
        rope = {"rope_type": scaling, "factor": float(g.need(f"{arch}.rope.scaling.factor"))}
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = int(g.need(f"{arch}.rope.scaling.original_context_length"))
        cfg["rope_scaling"] = rope
    if arch == "llama":
        bias = "blk.0.attn_q.bias" in names
        cfg.update(attention_bias=bias, mlp_bias="blk.0.ffn_up.bias" in names)
    if arch == "qwen2":
        cfg.update(use_sliding_window=False)
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        if (v := g.get(f"tokenizer.ggml.{key}")) is not None:
            cfg[name] = int(v)
    return cfg


# ---------------------------------------------------------------------------------------------
# Tensors


_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_down.bias": "mlp.down_proj.bias",
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}


def hf_name(name: str) -> str | None:
    """The HF name of a GGUF tensor name of the llama/qwen2 layout, None if it has none."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}"
    return None


def gguf_name(hf: str) -> str | None:
    """The GGUF name of an HF tensor name (the inverse of hf_name), for export."""
    inverse_global = {v: k for k, v in _GLOBAL.items()}
    if hf in inverse_global:
        return inverse_global[hf]
    inverse_layer = {v: k for k, v in _LAYER.items()}
    parts = hf.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in inverse_layer:
        return f"blk.{parts[2]}.{inverse_layer[parts[3]]}"
    return None


def hf_tensors(g: GGUFFile, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of the file under its HF name, dequantized, q/k unpermuted where llama.cpp
    permuted them. An unknown tensor name is an error, not a silent drop."""
    out: dict[str, torch.Tensor] = {}
    permuted = g.architecture in PERMUTED_QK
    for t in g.tensors:
        name = hf_name(t.name)
        if name is None:
            raise GGUFError(f"{g.path}: tensor {t.name!r} has no place in a {cfg['model_type']} model")
        w = dequantize(t)
        if permuted and ".attn_q." in t.name:
            w = unpermute_qk(w, cfg["num_attention_heads"])
        elif permuted and ".attn_k." in t.name:
            w = unpermute_qk(w, cfg["num_key_value_heads"])
        out[name] = w.contiguous()
    if "model.embed_tokens.weight" not in out:
        raise GGUFError(f"{g.path}: no token_embd.weight")
    return out


# ---------------------------------------------------------------------------------------------
# Tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, the alphabet of a byte-level vocabulary."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    spelled, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return spelled


def _merges(g: GGUFFile, tokens: list[str], scores: list[float] | None) -> list[tuple[str, str]]:
    """The file's merges, or (sentencepiece files carry none) the merges its vocabulary implies:
    each split of a token into two tokens, ordered by the merged token's score, best first (ties:
    the longer left piece, then the longer right piece, then vocabulary order), as transformers
    derives them."""
    merges = g.get("tokenizer.ggml.merges")
    if merges:
        out = []
        for i, m in enumerate(merges):
            a, sep, b = m.partition(" ")
            if not sep:
                raise GGUFError(f"{g.path}: tokenizer.ggml.merges[{i}] {m!r} is not two tokens")
            out.append((a, b))
        return out
    if scores is None:
        raise GGUFError(f"{g.path}: neither tokenizer.ggml.merges nor tokenizer.ggml.scores")
    ids = {t: i for i, t in enumerate(tokens)}
    found = []
    for t, i in ids.items():
        pairs = sorted(((t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in ids and t[k:] in ids),
                       key=lambda ab: (ids[ab[0]], ids[ab[1]]))
        found.extend((float(scores[i]), a, b) for a, b in pairs)
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)  # stable: ties keep vocabulary order
    return [(a, b) for _, a, b in found]


def build_tokenizer(g: GGUFFile):
    """(tokenizers.Tokenizer, tokenizer_config dict, generation_config dict) from the metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = g.get("tokenizer.ggml.model")
    tokens = g.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise GGUFError(f"{g.path}: no tokenizer in the metadata (tokenizer.ggml.model / tokens)")
    tokens = [str(t) for t in tokens]
    types = list(g.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    scores = g.get("tokenizer.ggml.scores")
    add_bos = g.get("tokenizer.ggml.add_bos_token")
    if kind == "gpt2":
        pre = g.get("tokenizer.ggml.pre") or "default"
        if pre not in SPLITS:
            raise GGUFError(f"{g.path}: tokenizer.ggml.pre {pre!r}: its split rules are not known here; known: "
                            f"{', '.join(sorted(SPLITS))}")
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        # a token outside the byte alphabet (a mislabelled control token, say) is spelled in it
        vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i
                 for i, t in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(g, tokens, scores), fuse_unk=False))
        tok.pre_tokenizer = _pre_tokenizer(SPLITS[pre])
        tok.decoder = decoders.ByteLevel()
        add_bos = bool(add_bos)
    elif kind == "llama":
        vocab = {t: i for i, t in enumerate(tokens)}
        unk = g.get("tokenizer.ggml.unknown_token_id")
        tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(g, tokens, scores), fuse_unk=True, byte_fallback=True,
                                   unk_token=tokens[int(unk)] if unk is not None else None))
        prefix = g.get("tokenizer.ggml.add_space_prefix", True)
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                     split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + ([decoders.Strip(" ", 1, 0)] if prefix else []))
        add_bos = True if add_bos is None else bool(add_bos)  # llama.cpp's default for sentencepiece files
    else:
        raise GGUFError(f"{g.path}: tokenizer.ggml.model {kind!r} is not supported (gpt2, llama)")
    # control tokens stay whole as special tokens (in a byte-level vocabulary only those spelled in
    # its alphabet: the others are mislabelled, as transformers and llama.cpp treat them)
    whole = (lambda t: set(t) <= alphabet) if kind == "gpt2" else (lambda t: True)
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
               if ty == CONTROL and whole(t)]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)

    def token(key: str) -> str | None:
        i = g.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_eos = bool(g.get("tokenizer.ggml.add_eos_token", False))
    pieces = [t for t, on in ((bos, add_bos), (None, True), (eos, add_eos)) if on]
    if (add_bos and bos) or (add_eos and eos):
        single = " ".join("$A:0" if t is None else f"{t}:0" for t in pieces)
        pair = single + " " + " ".join("$B:1" if t is None else f"{t}:1" for t in pieces[1 if add_bos else 0:])
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=[(t, tokens.index(t)) for t in dict.fromkeys([bos, eos]) if t])
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos, "eos_token": eos, "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": add_bos, "add_eos_token": add_eos,
        "model_max_length": int(g.get(f"{g.architecture}.context_length") or 2048),
        "clean_up_tokenization_spaces": False,
    }
    if (template := g.get("tokenizer.chat_template")) is not None:
        config["chat_template"] = str(template)
    generation = {k: int(v) for k, v in (("bos_token_id", g.get("tokenizer.ggml.bos_token_id")),
                                         ("eos_token_id", g.get("tokenizer.ggml.eos_token_id")),
                                         ("pad_token_id", g.get("tokenizer.ggml.padding_token_id")))
                  if v is not None}
    return tok, config, generation


# ---------------------------------------------------------------------------------------------
# The import


def import_gguf(path: str | Path, out: str | Path) -> Path:
    """Write the HF directory of GGUF file `path` at `out` (config, weights, tokenizer), whole or
    not at all: built in a sibling temporary directory and renamed into place."""
    from safetensors.torch import save_file

    g = GGUFFile.open(path)
    cfg = hf_config(g)
    tensors = hf_tensors(g, cfg)
    tok, tok_config, generation = build_tokenizer(g)
    if tok.get_vocab_size(with_added_tokens=True) > cfg["vocab_size"]:
        raise GGUFError(f"{g.path}: the tokenizer has {tok.get_vocab_size(with_added_tokens=True)} tokens, more "
                        f"than the model's {cfg['vocab_size']} embedding rows")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would keep the model from the user's other accounts
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": g.path.name})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        (tmp / "gguf_source.json").write_text(json.dumps(
            {"file": str(g.path.resolve()), "import_version": IMPORT_VERSION, "name": g.get("general.name"),
             "file_type": g.get("general.file_type"), "license": g.get("general.license")}, indent=2) + "\n")
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def is_gguf(name_or_path: str | Path) -> bool:
    return str(name_or_path).lower().endswith(".gguf")


def cache_root() -> Path:
    """Where imported GGUF files are kept: $POSTTRAIN_CACHE/gguf, else ~/.cache/posttrain/gguf."""
    base = os.environ.get("POSTTRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "posttrain")
    return Path(base) / "gguf"


def gguf_model_dir(path: str | Path) -> Path:
    """The HF directory of GGUF file `path`, imported on first use into cache_root() under the
    file's identity (real path, size, modification time) and the importer's version. Processes
    that ask at once (the ranks of one launch) wait on a lock for the one that imports."""
    p = Path(path)
    if not p.is_file():
        raise GGUFError(f"{p}: no such GGUF file")
    st = p.stat()
    ident = json.dumps([str(p.resolve()), st.st_size, st.st_mtime_ns, IMPORT_VERSION])
    root = cache_root()
    out = root / f"{p.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"
    if (out / "config.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").is_file():
            import_gguf(p, out)
            write_json_atomic(out / "gguf_source.json", {**json.loads((out / "gguf_source.json").read_text()),
                                                         "identity": json.loads(ident)})
    return out


# ---------------------------------------------------------------------------------------------
# GGUF out


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
