"""Data prep's output, written and read back: one Parquet file per (task, split), named in the manifest.

A data-prep stage directory holds `manifest.json`, whose outputs map `{task}_{split}` (task "sft" or
"preference", split "train", "validation" or "test") to `data/{task}_{split}.parquet`; a split with
no rows has no file. Each row keeps the example's fields (TRL's explicit form: messages, or
prompt/completion, or prompt/chosen/rejected; the synthetic suite adds task and answer) beside
what the Encoder made of it:

    sft          input_ids, labels
    preference   prompt_ids, chosen_ids, chosen_labels, rejected_ids, rejected_labels

Labels are -100 where no loss applies (prompt, template tokens such as the newline after the
end-of-turn token); they are stored, not rebuilt from ids, so the stages train on exactly the
labels data prep computed.

    read_rows(sources, task, split)           the rows as dicts
    read_documents(sources, split, max_seq_len)   SFT Documents
    read_pairs(sources, split)                (PreferencePair, row) with the row's other fields
    load_documents / load_pairs               the same for stage sources that may also be raw
                                              files (validated, tokenized and split by load_data)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from core.data.encode import Document, PreferencePair, Tokenizer
from core.data.errors import DataError
from core.data.split import canonical_split
from core.manifest import is_stage_dir, read_manifest

if TYPE_CHECKING:
    from core.config import DataConfig

TASKS = ("sft", "preference")
COLUMNS = {
    "sft": ("input_ids", "labels"),
    "preference": ("prompt_ids", "chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels"),
}
Sources = Union[str, Path, Sequence[Union[str, Path]]]


def output_key(task: str, split: str) -> str:
    """The manifest output naming a task's split: "sft_train", "preference_validation", ..."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    return f"{task}_{canonical_split(split)}"


def record(fields: dict[str, Any], item: Document | PreferencePair) -> dict[str, Any]:
    """One Parquet row: the example's fields and its tokens and labels (see COLUMNS)."""
    if isinstance(item, PreferencePair):
        tokens = {"prompt_ids": item.prompt_ids, "chosen_ids": item.chosen_ids, "chosen_labels": item.chosen_labels,
                  "rejected_ids": item.rejected_ids, "rejected_labels": item.rejected_labels}
    else:
        tokens = {"input_ids": item.input_ids, "labels": item.labels}
    return {**fields, **tokens}


def is_prepared(source: str | Path) -> bool:
    """A data-prep stage directory (it has a manifest)."""
    return is_stage_dir(source)


def prepared_files(source: str | Path, task: str, split: str) -> list[Path]:
    """The Parquet files of a task's split: from a stage directory's manifest ([] when the split has
    no rows), or a Parquet file written by data prep, taken as it is whatever the split."""
    p = Path(source)
    key = output_key(task, split)
    if is_stage_dir(p):
        outputs = read_manifest(p)["outputs"]
        if key in outputs:
            return [p / outputs[key]]
        if any(k.startswith(f"{task}_") for k in outputs):
            return []  # this task was prepared; the split is empty
        raise DataError(f"data prep produced no {task} data (outputs: {', '.join(sorted(outputs))})", source=str(p))
    if p.suffix == ".parquet" and p.is_file():
        return [p]
    if not p.exists():
        raise DataError("does not exist", source=str(p))
    raise DataError("neither a data-prep stage directory (manifest.json) nor a Parquet file", source=str(p))


def _as_list(sources: Sources) -> list[str | Path]:
    items = [sources] if isinstance(sources, (str, Path)) else list(sources)
    if not items:
        raise DataError("no data sources given (data.sources is empty)")
    return items


def read_rows(sources: Sources, task: str, split: str) -> list[dict[str, Any]]:
    """Every row of a task's split of prepared sources, as dicts, checked for the token columns."""
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    for src in _as_list(sources):
        for f in prepared_files(src, task, split):
            try:
                table = pq.read_table(f)
            except Exception as e:  # ArrowInvalid, OSError, ... for corrupt files
                raise DataError(f"cannot read Parquet: {e}", source=str(f)) from e
            missing = [c for c in COLUMNS[task] if c not in table.column_names]
            if missing:
                raise DataError(f"no {', '.join(missing)} column (not {task} data written by this version of data "
                                f"prep; run data prep again)", source=str(f))
            rows.extend(table.to_pylist())
    return rows


def read_documents(sources: Sources, split: str, max_seq_len: int | None = None) -> list[Document]:
    """SFT Documents of a split of prepared sources, with the stored labels, cut to max_seq_len."""
    end = max_seq_len
    return [Document(r["input_ids"][:end], r["labels"][:end]) for r in read_rows(sources, "sft", split)]


def pair_of(row: dict[str, Any]) -> PreferencePair:
    """The PreferencePair of a prepared preference row (stored labels)."""
    return PreferencePair(row["prompt_ids"], row["chosen_ids"], row["chosen_labels"], row["rejected_ids"],
                          row["rejected_labels"])


def read_pairs(sources: Sources, split: str) -> list[tuple[PreferencePair, dict[str, Any]]]:
    """(PreferencePair, row) for every preference row of a split of prepared sources; the row keeps
    its other fields (e.g. the synthetic suite's `answer` and `task`, which on-policy DPO verifies)."""
    return [(pair_of(r), r) for r in read_rows(sources, "preference", split)]


def _load_raw(src: str | Path, task: str, split: str, tokenizer: Tokenizer | None, cfg: DataConfig | None) -> list:
    from core.data.dataset import load_data

    if tokenizer is None or cfg is None:
        raise DataError("raw data (not a data-prep stage directory) needs a tokenizer and a DataConfig",
                        source=str(src))
    data = load_data(cfg.model_copy(update={"sources": [str(src)]}), tokenizer)
    if data.task != task:
        raise DataError(f"holds {data.task} rows; this stage needs {task} rows", source=str(src))
    return data[canonical_split(split)]


def load_documents(sources: Sources, split: str, tokenizer: Tokenizer | None = None,
                   cfg: DataConfig | None = None) -> list[Document]:
    """SFT Documents of `split` from every source: data prep's Parquet for a stage directory (cut to
    cfg.max_seq_len); raw sources (JSONL, Parquet, saved datasets) validated, tokenized and split by
    load_data with cfg, one source at a time."""
    docs: list[Document] = []
    for src in _as_list(sources):
        if is_prepared(src):
            docs.extend(read_documents(src, split, cfg.max_seq_len if cfg is not None else None))
        else:
            docs.extend(_load_raw(src, "sft", split, tokenizer, cfg))
    return docs


def load_pairs(sources: Sources, split: str, tokenizer: Tokenizer | None = None,
               cfg: DataConfig | None = None) -> list[tuple[PreferencePair, dict[str, Any]]]:
    """(PreferencePair, row) of `split` from every source, as load_documents does for documents; a
    raw source's rows hold the pair's token columns only."""
    out: list[tuple[PreferencePair, dict[str, Any]]] = []
    for src in _as_list(sources):
        if is_prepared(src):
            out.extend(read_pairs(src, split))
        else:
            out.extend((p, record({}, p)) for p in _load_raw(src, "preference", split, tokenizer, cfg))
    return out
