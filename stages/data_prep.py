"""Data preparation: import and validate sources (or make the synthetic suite), train or load a
tokenizer, then posttrain.core.data's one path (dedup, encode with labels, filter by token length, split by
content hash) and Parquet files plus a manifest (layout: posttrain.core.data.prepared).

Drops are counted as `dropped/{task}:{reason}` (posttrain.core.data.errors.REASONS: invalid rows in skip
mode, duplicate, too_long over max_tokens, too_short under min_tokens).

    python -m posttrain.stages.data_prep --config spec.json     (rank 0 works; other ranks wait)
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from pathlib import Path
from typing import Any

from posttrain.stages.config import DataPrepConfig
from posttrain.core.data import (SPLITS, DataError, DropStats, Encoder, ExamplePipeline, detect_format, for_each_example,
                       num_tokens, output_key, record, validate_row)
from posttrain.core.data.dataset import read_template
from posttrain.core.data.errors import RowError
from posttrain.core.data.formats import Example, Preference, Unpaired
from posttrain.core.data.prepared import TASKS as PREPARED_TASKS
from posttrain.core.manifest import write_manifest
from posttrain.core.tasks import TASKS, make_suite
from posttrain.stages.common import parse_spec, stage_run, start_distributed

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

    from posttrain.registry.tokenizer import Tokenizer

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


def _texts(example: Example) -> list[str]:
    """The text of an example, for training the tokenizer: message contents or plain strings."""
    out: list[str] = []
    for value in dataclasses.asdict(example).values():
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, list):  # messages (an unpaired row's label is neither)
            out.extend(str(m.get("content") or "") for m in value)
    return out


_STRUCTURAL = {"messages", "prompt", "completion", "chosen", "rejected", "input_ids", "labels", "prompt_ids",
               "chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels", "label", "completion_ids",
               "completion_labels"}


def extra_columns(row: Any) -> dict[str, Any]:
    """A user row's other scalar columns (a reference `answer`, a `task`, an id), kept beside the
    tokens so evaluation and on-policy rewards can read them from data prep's output."""
    if not isinstance(row, dict):
        return {}
    return {k: v for k, v in row.items() if k not in _STRUCTURAL and isinstance(v, (str, int, float, bool))}


def _task(example: Example) -> str:
    return "preference" if isinstance(example, Preference) else "unpaired" if isinstance(example, Unpaired) else "sft"


def _tokenizer(cfg: DataPrepConfig, out: Path, suite: list) -> Any:
    """The tokenizer given (a tokenizer or model directory, a stage output, a .gguf file or a
    packaged model; copied beside the data), or a BPE trained on every example's text."""
    from posttrain.stages.common import load_tokenizer

    if cfg.tokenizer:
        tok = load_tokenizer(cfg.tokenizer)
        tok.save_pretrained(out / "tokenizer")
        return tok
    texts: list[str] = []
    for src in cfg.sources:  # validated (bad rows raise or are skipped as in the main pass), not counted
        for_each_example([src], cfg.format, cfg.on_bad_row, DropStats(), lambda _, ex: texts.extend(_texts(ex)),
                         require_rows=False)
    texts += [m["content"] for e in suite for m in e.sft_row()["messages"]]
    texts += ["system\nuser\nassistant\n"] * 100  # role names of the chat template
    return train_tokenizer(texts, cfg.vocab_size, out / "tokenizer")


def prepare(cfg: DataPrepConfig, run_id: str | None = None) -> dict[str, Any]:
    """Sources and the synthetic suite through posttrain.core.data's one path: validate (for_each_example),
    then per task dedup by content hash, encode (Encoder: chat template, labels; examples over
    max_tokens dropped), drop under min_tokens, split by posttrain.core.data.split; then Parquet + manifest."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(cfg.output_dir or "data_prep")
    (out / "data").mkdir(parents=True, exist_ok=True)
    suite = make_suite(cfg.synthetic_size, cfg.synthetic_seed, tuple(cfg.synthetic_tasks or TASKS)) \
        if cfg.synthetic_size else []
    tok = _tokenizer(cfg, out, suite)
    if cfg.chat_template is not None:  # the rows are rendered with it, and so is every later prompt
        template = tok.chat_templates.get(cfg.chat_template) or read_template(cfg.chat_template)
        tok.chat_templates["default"] = template
        tok.save_pretrained(out / "tokenizer")

    encoder = Encoder(tok, cfg.max_tokens, truncation="drop")
    pipelines = {task: ExamplePipeline(encoder, cfg.val_fraction, cfg.test_fraction, dedup=cfg.dedup,
                                       min_tokens=cfg.min_tokens) for task in PREPARED_TASKS}
    records: dict[str, dict[str, list[dict[str, Any]]]] = {t: {s: [] for s in SPLITS} for t in PREPARED_TASKS}
    lengths: dict[str, list[int]] = {t: [] for t in PREPARED_TASKS}
    drops: Counter = Counter()

    def add(example: Example, fields: dict[str, Any], split: str | None = None) -> None:
        task = _task(example)
        split, item = pipelines[task](example, split)
        records[task][split].append(record(fields, item))
        lengths[task].append(num_tokens(item))

    for src in cfg.sources:
        stats = DropStats()
        task = for_each_example([src], cfg.format, cfg.on_bad_row, stats,
                                lambda source, ex, row: add(ex, {**extra_columns(row), **dataclasses.asdict(ex)},
                                                            source.split), require_rows=False, with_row=True)
        drops.update({f"{task or 'unknown'}:{reason}": n for reason, n in stats.dropped.items()})
    for i, e in enumerate(suite):
        for row in (e.sft_row(), e.preference_row()):
            example = validate_row(row, detect_format(row.keys()))
            try:
                add(example, row)
            except RowError as err:
                if not (err.always_skip or cfg.on_bad_row == "skip"):
                    raise DataError.from_row(err, "synthetic suite", i, "example") from None
                drops[f"{_task(example)}:{err.reason}"] += 1
    if not any(lengths.values()):
        raise DataError(f"no usable rows (dropped: {dict(drops)})", source=", ".join(cfg.sources) or "synthetic suite")

    outputs: dict[str, str] = {"tokenizer": "tokenizer"}
    metrics: dict[str, float] = {}
    for task, splits in records.items():
        for split, recs in splits.items():
            if not recs:
                continue
            key = output_key(task, split)
            rel = f"data/{key}.parquet"
            try:
                table = pa.Table.from_pylist(recs)
            except (pa.ArrowInvalid, pa.ArrowTypeError) as e:  # e.g. a column holding numbers and strings
                raise DataError(f"the rows' extra columns do not form one table: {e}",
                                source=", ".join(cfg.sources)) from None
            pq.write_table(table, out / rel)
            outputs[key] = rel
            metrics[f"rows/{key}"] = len(recs)
        if lengths[task]:
            n = sorted(lengths[task])
            metrics[f"tokens/{task}_mean"] = sum(n) / len(n)
            metrics[f"tokens/{task}_max"] = n[-1]
            metrics[f"tokens/{task}_p95"] = n[int(0.95 * (len(n) - 1))]
    metrics.update({f"dropped/{k}": v for k, v in sorted(drops.items())})
    metrics["vocab_size"] = tok.vocab_size
    return write_manifest(out, "data_prep", outputs, metrics=metrics, config=cfg.model_dump(mode="json"),
                          extra={"drops": dict(drops), "mlflow_run_id": run_id})  # run_id: the stage's MLflow run


def main(argv: list[str] | None = None) -> None:
    cfg = parse_spec(DataPrepConfig, argv)
    d = start_distributed()
    manifest = None
    if d.is_main:  # data prep is cheap and must be written once; other ranks just wait
        with stage_run(cfg, "data_prep") as run:
            manifest = prepare(cfg, run.run_id)
            run.log_metrics(manifest["metrics"], step=0)
            run.log_artifact(str(Path(cfg.output_dir) / "manifest.json"))
    d.barrier()
    if manifest:
        log.info("data prep: %s", {k: v for k, v in manifest["metrics"].items() if k.startswith("rows/")})


if __name__ == "__main__":
    main()
