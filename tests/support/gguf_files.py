"""Tiny GGUF files written with the `gguf` package, laid out as llama.cpp's converter writes them
(q/k rows interleaved for llama, the tokenizer in the metadata), for tests/registry/test_gguf.py.

    path, hf_state = write_tiny_gguf(tmp_path / "m.gguf", qtype="Q4_1")
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")

# merges of a small byte-level vocabulary (GPT-2 spelling: Ġ is a space, Ċ a newline); none joins
# a digit, so every split rule of SPLITS tokenizes digits alike
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("a", "n"), ("o", "n"), ("Ġ", "a"),
          ("r", "e"), ("Ġ", "s"), ("Ġ", "w"), ("o", "r"), ("Ġ", "c"), ("i", "s"), ("e", "n"), ("Ġ", "f"),
          ("Ġ", "o"), ("Ġo", "f"), ("a", "t"), ("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("Ċ", "Ċ"), ("(", ")"), ("d", "e"),
          ("de", "f"), ("Ġ", "(")]
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# a sentencepiece vocabulary: pieces and their scores (merges are derived from them)
SPM_PIECES = ["▁", "▁t", "he", "▁the", "in", "er", "an", "▁a", "on", "re", "▁s", "▁w", "or", "is", "en", "▁of",
              "at", "▁c", "▁th", "▁is", "▁in", "ing", "▁an", "▁and"]


def byte_alphabet() -> list[str]:
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    out, extra = [], 0
    for b in range(256):
        out.append(chr(b) if b in keep else chr(256 + extra))
        extra += b not in keep
    return out


def gpt2_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the byte-level vocabulary."""
    tokens = byte_alphabet() + [a + b for a, b in MERGES] + CONTROL
    types = [1] * (len(tokens) - len(CONTROL)) + [3] * len(CONTROL)
    return tokens, types, [f"{a} {b}" for a, b in MERGES]


def spm_vocab() -> tuple[list[str], list[int], list[float]]:
    """(tokens, token types, scores) of the sentencepiece vocabulary: <unk>, <s>, </s>, the 256 byte
    tokens, then pieces best-scored first."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(SPM_PIECES))]
    return tokens, types, scores


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's interleaving of q/k rows, written here from its description (each
    head's rows: first half and second half of the rotary dims alternate)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, *, arch: str = "llama", qtype: str = "F32", tokenizer: str = "gpt2",
                    pre: str = "smollm", hidden: int = 64, intermediate: int = 128, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, tied: bool = True, seed: int = 0) -> tuple[Path, dict[str, torch.Tensor]]:
    """A random tiny model as a GGUF file; also its HF-layout tensors (float32, before quantizing)."""
    import gguf

    rng = np.random.default_rng(seed)
    if tokenizer == "gpt2":
        tokens, types, merges = gpt2_vocab()
    else:
        tokens, types, scores = spm_vocab()
    vocab = len(tokens)
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model(tokenizer)
    if tokenizer == "gpt2":
        w.add_tokenizer_pre(pre)
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index("<|im_start|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_pad_token_id(tokens.index("<|endoftext|>"))
        w.add_add_bos_token(False)
    else:
        w.add_token_scores(scores)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(True)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_chat_template(CHATML)

    hf: dict[str, torch.Tensor] = {}
    q = gguf.GGMLQuantizationType[qtype]

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], scale: float = 0.08, permute: int = 0) -> None:
        value = (rng.standard_normal(shape) * scale).astype(np.float32)
        if len(shape) == 1:
            value = (1.0 + value).astype(np.float32)  # a norm's weight
        hf[hf_name] = torch.from_numpy(value.copy())
        stored = permute_qk(value, permute) if permute and arch == "llama" else value
        if len(shape) == 1 or q == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name, stored)
        elif q == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gguf_name, stored.astype(np.float16))
        elif q in K_QUANTS:  # no quantizer in gguf-py: random blocks with sane scales
            w.add_tensor(gguf_name, random_k_blocks(q, shape, rng), raw_dtype=q)
        else:
            data = gguf.quants.quantize(stored, q)  # BF16 comes back as uint16: the writer wants bytes
            w.add_tensor(gguf_name, data.view(np.uint8), raw_dtype=q)

    add("token_embd.weight", "model.embed_tokens.weight", (vocab, hidden))
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", f"model.layers.{i}.input_layernorm.weight", (hidden,))
        add(f"blk.{i}.attn_q.weight", f"model.layers.{i}.self_attn.q_proj.weight", (heads * head_dim, hidden),
            permute=heads)
        add(f"blk.{i}.attn_k.weight", f"model.layers.{i}.self_attn.k_proj.weight", (kv_heads * head_dim, hidden),
            permute=kv_heads)
        add(f"blk.{i}.attn_v.weight", f"model.layers.{i}.self_attn.v_proj.weight", (kv_heads * head_dim, hidden))
        if arch == "qwen2":
            for n, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
                add(f"blk.{i}.attn_{n}.bias", f"model.layers.{i}.self_attn.{n}_proj.bias", (rows,))
        add(f"blk.{i}.attn_output.weight", f"model.layers.{i}.self_attn.o_proj.weight", (hidden, heads * head_dim))
        add(f"blk.{i}.ffn_norm.weight", f"model.layers.{i}.post_attention_layernorm.weight", (hidden,))
        add(f"blk.{i}.ffn_gate.weight", f"model.layers.{i}.mlp.gate_proj.weight", (intermediate, hidden))
        add(f"blk.{i}.ffn_up.weight", f"model.layers.{i}.mlp.up_proj.weight", (intermediate, hidden))
        add(f"blk.{i}.ffn_down.weight", f"model.layers.{i}.mlp.down_proj.weight", (hidden, intermediate))
    add("output_norm.weight", "model.norm.weight", (hidden,))
    if not tied:
        add("output.weight", "lm_head.weight", (vocab, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, hf


def _k_quants():
    import gguf

    T = gguf.GGMLQuantizationType
    # the byte offsets of each block's fp16 scale fields (ggml-common.h's block_q*_K layouts)
    return {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


try:
    K_QUANTS = _k_quants()
except ImportError:  # the gguf package is missing: the tests that need it skip
    K_QUANTS = {}


def random_k_blocks(q, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks for a (rows, cols) tensor: random integer and scale bytes, each block's
    fp16 super-scales set to small values so the weights stay in a sane range."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[q]
    rows, cols = shape
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in K_QUANTS[q]:
        d = (rng.uniform(0.0005, 0.004, size=(rows, cols // block))).astype(np.float16)
        data[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, cols // block * size)


def varied_strings(n: int, seed: int = 0) -> list[str]:
    """`n` strings mixing what tokenizers get wrong: unicode of many scripts, emoji, numbers and
    fractions, code, runs of spaces, tabs and newlines, leading/trailing blanks, special tokens."""
    pieces = [
        "the", "The", " of", "and", "isn't", "we'll", "THEY'RE", "naïve", "Ünïcödé", "straße", "façade", "日本語",
        "中文字符", "한국어", "Привет", "مرحبا", "שלום", "ελληνικά", "हिन्दी", "🎉", "👍🏽", "🧑‍💻", "½", "①", "²",
        "12345", "3.14159", "1,000,000", "0x1F", "2024-12-07", "-42", "def f(x):", "    return x", "{'a': 1}",
        "if (a && b) {", "}", "x = [i**2 for i in range(10)]", "<div class=\"c\">", "</div>", "\\n", "\t", "\t\t",
        "\n", "\n\n", "\r\n", " ", "  ", "    ", "   \n  ", "!", "?!", "...", "—", "–", "“quoted”", "'single'",
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "user", "assistant", "#", "##", "@", "$", "%", "^",
        "https://example.com/a?b=c", "e-mail@x.org", "CamelCase", "snake_case", "ALLCAPS", "\u00a0", "\u200b",
    ]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(1, 8)
        s = "".join(rng.choice(pieces) + rng.choice(["", " ", "", "  ", "\n"]) for _ in range(k))
        out.append(s)
    return out
