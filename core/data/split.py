"""Train/validation/test assignment by a hash of the row's normalized content.

A row's split depends on nothing but its own content, so adding rows never moves existing ones
between splits (a shuffled index split would), and a row that appears twice, in two files or with
different whitespace, lands in the same split twice instead of leaking from train into validation.
The content hashed is the row's prompt side (`split_key`), for the same reason one level up.

Split names are "train", "validation" and "test" everywhere: data prep's Parquet files and
manifest outputs (`sft_validation`), saved DatasetDicts, the readers and the stages.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import unicodedata
from typing import Any

SPLITS = ("train", "validation", "test")
def canonical_split(split: str) -> str:
    """`split` if it is one of SPLITS, else a ValueError naming them."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    return split


def _normalize(value: Any) -> Any:
    """Content that means the same hashes the same: dict keys sorted (by json.dumps) and null
    fields dropped (Parquet fills absent struct fields with nulls), strings NFC and stripped."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _normalize(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_normalize(v) for v in value]
    if isinstance(value, str):
        return unicodedata.normalize("NFC", value).strip()
    if isinstance(value, int) and not isinstance(value, bool):
        return {"$int": hex(value)}  # hex has no digit limit; json.dumps of a 5000-digit int raises
    return value


def split_key(example: Any) -> Any:
    """What decides an example's split: its prompt side, so that several completions or preference
    pairs of one prompt never straddle train and validation (the validation score would then
    measure recall of training prompts). For a conversation, that is every non-assistant turn."""
    messages = getattr(example, "messages", None)
    key = [m for m in messages if m.get("role") != "assistant"] if messages is not None \
        else getattr(example, "prompt", example)
    # rows without a prompt (an empty string) would all land in one split: use the whole row
    return key if _normalize(key) not in ("", []) else example


def content_hash(value: Any) -> str:
    """SHA-256 hex digest of the normalized content of a row or example."""
    # ensure_ascii escapes lone surrogates, which could not be encoded to UTF-8 otherwise
    text = json.dumps(_normalize(value), sort_keys=True, ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def assign_split(value: Any, val_fraction: float, test_fraction: float = 0.0, *, digest: str | None = None) -> str:
    """"train", "validation" or "test" for a row, with the given expected fractions."""
    if not (0 <= val_fraction and 0 <= test_fraction and val_fraction + test_fraction <= 1):
        raise ValueError(f"split fractions must be >= 0 and sum to <= 1, got val={val_fraction}, test={test_fraction}")
    u = int((digest or content_hash(value))[:16], 16) / 2**64  # uniform in [0, 1)
    if u < test_fraction:
        return "test"
    if u < test_fraction + val_fraction:
        return "validation"
    return "train"
