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
The way back, an HF directory as a GGUF file, is registry/gguf_export.py.
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
    """llama.cpp's q/k rows (each head's two rotary halves interleaved) back in HF's order; the inverse is
    registry/gguf_export.permute_qk."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


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
