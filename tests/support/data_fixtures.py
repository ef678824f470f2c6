"""Helpers for the posttrain.core.data tests: a small byte-level BPE with a ChatML template, trained here (no
downloads, no transformers), and writers for JSONL / Parquet / save_to_disk sources.

The vocabulary stays under the `debug` model preset's 512 so packed rows can go through the model.
"""

from __future__ import annotations

import json
import random
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from posttrain.core.data.config import DataConfig
from posttrain.registry.tokenizer import Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
VOCAB = 400


@lru_cache(maxsize=1)
def _backend_json() -> str:
    rng = random.Random(0)
    words = "the a model learns to answer user assistant system question what is two plus four blue red".split()
    words += ["café", "日本", "🤖", "42", "3.14", "\n"]
    corpus = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(300)]
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok.to_str()


def make_tokenizer() -> Tokenizer:
    """A fresh Tokenizer (ChatML, EOS <|im_end|>, pad <|endoftext|>, no BOS) on the cached BPE."""
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    return Tokenizer(Backend.from_str(_backend_json()), config, chat_templates={"default": CHATML})


def conv(*turns: str, system: str | None = None) -> dict:
    """A `messages` row alternating user/assistant over `turns`."""
    msgs = [{"role": "system", "content": system}] if system else []
    msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return {"messages": msgs}


def sft_rows(n: int, seed: int = 0) -> list[dict]:
    """n varied conversations (1-3 exchanges, different lengths)."""
    rng = random.Random(seed)
    words = "what is two plus four the model answer blue red question".split()
    rows = []
    for i in range(n):
        turns = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) for _ in range(2 * rng.randint(1, 3))]
        rows.append(conv(*turns, system="be brief" if i % 3 == 0 else None))
    return rows


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    """One JSON value per line; a str row is written verbatim (for malformed lines)."""
    lines = [r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in rows]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def data_config(sources: list, **kw: Any) -> DataConfig:
    """Test defaults: no held-out split (every row lands in train) unless asked."""
    kw.setdefault("val_fraction", 0.0)
    kw.setdefault("max_seq_len", 128)
    return DataConfig(sources=[str(s) for s in sources], **kw)
