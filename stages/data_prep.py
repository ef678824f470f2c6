"""Data preparation: import and validate sources (or make the synthetic suite), train or load a
tokenizer, deduplicate, filter by token length, split deterministically, tokenize once, and write
Parquet files plus a manifest.

    python -m stages.data_prep --config spec.json     (rank 0 works; other ranks wait)
"""

from __future__ import annotations

import hashlib
import logging
import re
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Any

from core.config import DataPrepConfig
from core.manifest import write_manifest
from core.tasks import TASKS, make_suite
from stages.common import StageError, parse_spec, stage_run, start_distributed

log = logging.getLogger("posttrain.data_prep")

# ChatML: the end-of-turn token is the EOS, so a model trained on it learns to stop.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    """A byte-level BPE with single-digit pre-splitting (arithmetic stays learnable) and ChatML."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from registry.tokenizer import Tokenizer

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer)
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 4096}
    tok = Tokenizer(backend, config, chat_templates={"default": CHATML})
    tok.save_pretrained(out_dir)
    return Tokenizer.from_pretrained(out_dir)


def normalize_text(s: str) -> str:
    s = unicodedata.normalize("NFKC", s).casefold()
    return re.sub(r"\s+", " ", s).strip()


def row_key(row: dict[str, Any]) -> str:
    """The text a row is deduplicated and split by: its prompt side, normalized."""
    if "messages" in row:
        parts = [str(m.get("content") or "") for m in row["messages"] if m.get("role") != "assistant"]
    else:
        p = row["prompt"]
        parts = [p] if isinstance(p, str) else [str(m.get("content") or "") for m in p]
    return normalize_text(" \n".join(parts))


def split_of(key: str, val: float, test: float) -> str:
    """Deterministic split from a hash of the row's key: adding rows never moves existing ones."""
    u = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
    return "test" if u < test else "val" if u < test + val else "train"


def tokenize_sft(tok, row: dict[str, Any]) -> tuple[list[int], list[int]]:
    if "messages" in row:
        ids, mask = tok.encode_chat_with_mask(row["messages"])
    else:
        ids, mask = tok.encode_prompt_completion(row["prompt"], row["completion"])
    return ids, [i if m else -100 for i, m in zip(ids, mask)]


def tokenize_preference(tok, row: dict[str, Any]) -> dict[str, list[int]]:
    prompt = row["prompt"] if not isinstance(row["prompt"], str) else [{"role": "user", "content": row["prompt"]}]
    out = {"prompt_ids": tok.apply_chat_template(prompt, add_generation_prompt=True)}
    for side in ("chosen", "rejected"):
        ids, mask = tok.encode_prompt_completion(prompt, row[side])
        n = len(out["prompt_ids"])
        if ids[:n] != out["prompt_ids"]:
            raise StageError(f"chat template renders the prompt differently with a {side} reply")
        # only the tokens the model must generate: content + end of turn, not template whitespace
        out[f"{side}_ids"] = [i for i, m in zip(ids[n:], mask[n:]) if m]
    return out


def _sources(cfg: DataPrepConfig, drops: Counter) -> dict[str, list[dict[str, Any]]]:
    """Rows by format ('sft', 'preference'), from user sources or the synthetic suite."""
    rows: dict[str, list[dict[str, Any]]] = {"sft": [], "preference": []}
    if cfg.sources:
        from core.data import load_rows

        for src in cfg.sources:
            fmt, loaded, src_drops = load_rows(src, cfg.format, on_bad_row=cfg.on_bad_row)
            rows[fmt].extend(loaded)
            drops.update({f"invalid:{k}": v for k, v in src_drops.items()})
    if cfg.synthetic_size:
        suite = make_suite(cfg.synthetic_size, cfg.synthetic_seed, tuple(cfg.synthetic_tasks or TASKS))
        rows["sft"].extend(e.sft_row() for e in suite)
        rows["preference"].extend(e.preference_row() for e in suite)
    return rows


def prepare(cfg: DataPrepConfig) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(cfg.output_dir or "data_prep")
    (out / "data").mkdir(parents=True, exist_ok=True)
    drops: Counter = Counter()
    rows = _sources(cfg, drops)

    if cfg.tokenizer:
        from registry.tokenizer import Tokenizer

        tok = Tokenizer.from_pretrained(cfg.tokenizer)
        tok.save_pretrained(out / "tokenizer")
    else:
        texts = [m["content"] for r in rows["sft"] for m in r.get("messages", [])]
        texts += [str(r.get("prompt", "")) + str(r.get("completion", "")) for r in rows["sft"]]
        texts += ["system\nuser\nassistant\n"] * 100  # role names of the chat template
        tok = train_tokenizer(texts, cfg.vocab_size, out / "tokenizer")

    outputs: dict[str, str] = {"tokenizer": "tokenizer"}
    metrics: dict[str, float] = {}
    for fmt, fmt_rows in rows.items():
        seen: set[str] = set()
        splits: dict[str, list[dict[str, Any]]] = {"train": [], "val": [], "test": []}
        lengths = []
        for row in fmt_rows:
            key = row_key(row)
            if cfg.dedup:
                if key in seen:
                    drops[f"{fmt}:duplicate"] += 1
                    continue
                seen.add(key)
            if fmt == "sft":
                ids, labels = tokenize_sft(tok, row)
                n = len(ids)
                record = {**row, "input_ids": ids, "labels": labels}
            else:
                record = {**row, **tokenize_preference(tok, row)}
                n = len(record["prompt_ids"]) + max(len(record["chosen_ids"]), len(record["rejected_ids"]))
            if n < cfg.min_tokens or n > cfg.max_tokens:
                drops[f"{fmt}:{'too_short' if n < cfg.min_tokens else 'too_long'}"] += 1
                continue
            lengths.append(n)
            splits[split_of(key, cfg.val_fraction, cfg.test_fraction)].append(record)
        if not fmt_rows:
            continue
        for split, recs in splits.items():
            if not recs:
                continue
            rel = f"data/{fmt}_{split}.parquet"
            pq.write_table(pa.Table.from_pylist(recs), out / rel)
            outputs[f"{fmt}_{split}"] = rel
            metrics[f"rows/{fmt}_{split}"] = len(recs)
        if lengths:
            lengths.sort()
            metrics[f"tokens/{fmt}_mean"] = sum(lengths) / len(lengths)
            metrics[f"tokens/{fmt}_max"] = lengths[-1]
            metrics[f"tokens/{fmt}_p95"] = lengths[int(0.95 * (len(lengths) - 1))]
    metrics.update({f"dropped/{k}": v for k, v in sorted(drops.items())})
    metrics["vocab_size"] = tok.vocab_size
    return write_manifest(out, "data_prep", outputs, metrics=metrics, config=cfg.model_dump(mode="json"),
                          extra={"drops": dict(drops)})


def main(argv: list[str] | None = None) -> None:
    cfg = parse_spec(DataPrepConfig, argv)
    d = start_distributed()
    manifest = None
    if d.is_main:  # data prep is cheap and must be written once; other ranks just wait
        with stage_run(cfg, "data_prep") as run:
            manifest = prepare(cfg)
            run.log_metrics(manifest["metrics"], step=0)
            run.log_artifact(str(Path(cfg.output_dir) / "manifest.json"))
    d.barrier()
    if manifest:
        log.info("data prep: %s", {k: v for k, v in manifest["metrics"].items() if k.startswith("rows/")})


if __name__ == "__main__":
    main()
