"""DataConfig: what posttrain.core.data reads, and how it tokenizes, packs and batches it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from posttrain.core.config import ConfigModel


class DataConfig(ConfigModel):
    sources: list[str] = Field([], description="JSONL/Parquet/HF dataset dirs; empty = data prep's output.")
    format: Literal["sft", "preference", "auto"] = Field(
        "auto", description="Rows: prompt/response or messages, prompt/chosen/rejected, or detect.")
    max_seq_len: int = Field(512, gt=0, description="Tokens per sequence (or per packed row).")
    packing: bool = Field(True, description="Pack examples padding-free; attention never crosses them.")
    truncation: Literal["left", "right", "drop"] = Field(
        "right", description="Over-long examples: cut the start, cut the end, or skip them.")
    on_bad_row: Literal["error", "skip"] = Field(
        "error", description="Malformed rows raise (naming file, row, field) or are counted and skipped.")
    micro_batch_size: int = Field(8, gt=0, description="Sequences per rank per micro step.")
    batch_tokens: int | None = Field(
        None, gt=0, description="Tokens per rank per micro step when packing; replaces micro_batch_size.")
    chat_template: str | None = Field(
        None, description="Template name or Jinja file for raw sources; None = the tokenizer's. Data prep's "
                          "output is tokenized already (set data_prep.chat_template there).")
    mask_prompt: bool = Field(True, description="Loss on responses only; false = on every token.")
    seed: int = Field(0, ge=0, lt=2**63, description="Shuffle seed (sampling is deterministic and resumable).")
    val_fraction: float = Field(0.05, ge=0, lt=1, description="Held out for validation if raw sources lack the split.")
    test_fraction: float = Field(0.0, ge=0, lt=1, description="Held out for test if raw sources lack the split.")
    dedup: bool = Field(False, description="Drop exact duplicates of raw sources (data prep's output is deduplicated).")

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.val_fraction + self.test_fraction >= 1:
            raise ValueError("val_fraction + test_fraction must leave some training data")
        if self.batch_tokens is not None and (not self.packing or self.batch_tokens < self.max_seq_len):
            raise ValueError("batch_tokens needs packing=true and batch_tokens >= max_seq_len")
        return self

