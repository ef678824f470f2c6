"""Data prep's output, written and read back: one Parquet file per (task, split), named in the manifest.

A data-prep stage directory holds `manifest.json`, whose outputs map `{task}_{split}` (task "sft" or
"preference", split "train", "validation" or "test") to `data/{task}_{split}.parquet`; a split with
no rows has no file. Each row keeps the example's fields (TRL's explicit form: messages, or
prompt/completion, or prompt/chosen/rejected; the synthetic suite adds task and answer) beside
what the Encoder made of it:

    sft          input_ids, labels
    preference   prompt_ids, chosen_ids, chosen_labels, rejected_ids, rejected_labels
    unpaired     prompt_ids, completion_ids, completion_labels, label (KTO: true = desirable)

Labels are -100 where no loss applies (prompt, template tokens such as the newline after the
end-of-turn token); they are stored, not rebuilt from ids, so the stages train on exactly the
labels data prep computed.

    read_rows(sources, task, split)           the rows as dicts
    read_documents(sources, split, cfg)       SFT Documents (the stage's mask_prompt and truncation)
    read_pairs(sources, split, cfg)           (PreferencePair, row) with the row's other fields
    read_unpaired(sources, split, cfg)        (UnpairedExample, row), likewise
    load_documents / load_pairs               the same for stage sources that may also be raw
                                              files (validated, tokenized and split by load_data)
    load_splits(sources, task, splits, ...)   several splits at once, each raw source read once
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from posttrain.core.data.encode import (Document, PreferencePair, Tokenizer, UnpairedExample, fit_unpaired, last_run_start,
                              truncate)
from posttrain.core.data.errors import DataError, DropStats, RowError
from posttrain.core.losses import IGNORE_INDEX
from posttrain.core.data.split import canonical_split
from posttrain.core.manifest import is_stage_dir, read_manifest

if TYPE_CHECKING:
    from posttrain.core.data.config import DataConfig
    from posttrain.core.data.routing import AdapterRouting

TASKS = ("sft", "preference", "unpaired")
COLUMNS = {
    "sft": ("input_ids", "labels"),
    "preference": ("prompt_ids", "chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels"),
    "unpaired": ("prompt_ids", "completion_ids", "completion_labels", "label"),
}
Sources = Union[str, Path, Sequence[Union[str, Path]]]


def output_key(task: str, split: str) -> str:
    """The manifest output naming a task's split: "sft_train", "preference_validation", ..."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    return f"{task}_{canonical_split(split)}"


def record(fields: dict[str, Any], item: Document | PreferencePair | UnpairedExample) -> dict[str, Any]:
    """One Parquet row: the example's fields and its tokens and labels (see COLUMNS)."""
    if isinstance(item, UnpairedExample):
        tokens = {"prompt_ids": item.prompt_ids, "completion_ids": item.completion_ids,
                  "completion_labels": item.completion_labels, "label": bool(item.label)}
    elif isinstance(item, PreferencePair):
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


def read_documents(sources: Sources, split: str, cfg: DataConfig | None = None,
                   bos_id: int | None = None, routing: AdapterRouting | None = None) -> list[Document]:
    """SFT Documents of a split of prepared sources, with the stored labels. With the stage's `cfg`:
    `mask_prompt=False` puts the loss on every token, and a document over `max_seq_len` goes
    through `truncation` as a raw row would (posttrain.core.data.encode.truncate); one no policy can fit is
    a DataError naming its file and row (or skipped, with on_bad_row='skip'). With `routing`, each
    document is tagged with its row's adapter (posttrain.core.data.routing), a bad one an error the same way."""
    docs = []
    for src in _as_list(sources):
        tag = routing.tagger(src) if routing is not None else None
        for i, r in enumerate(read_rows(src, "sft", split)):
            ids, labels = r["input_ids"], r["labels"]
            if cfg is not None and not cfg.mask_prompt:
                labels = list(ids)
            try:
                if cfg is not None and len(ids) > cfg.max_seq_len:
                    ids, labels = truncate(ids, labels, cfg.max_seq_len, cfg.truncation, bos_id,
                                           last_run_start([x != IGNORE_INDEX for x in r["labels"]]))
                docs.append(Document(ids, labels, tag(r) if tag is not None else None))
            except RowError as e:
                if e.always_skip or (cfg is not None and cfg.on_bad_row == "skip"):
                    continue
                raise DataError.from_row(e, str(prepared_files(src, "sft", split)[0]), i, "row") from None
    return docs


def pair_of(row: dict[str, Any]) -> PreferencePair:
    """The PreferencePair of a prepared preference row (stored labels)."""
    return PreferencePair(row["prompt_ids"], row["chosen_ids"], row["chosen_labels"], row["rejected_ids"],
                          row["rejected_labels"])


def read_pairs(sources: Sources, split: str, cfg: DataConfig | None = None, bos_id: int | None = None,
               routing: AdapterRouting | None = None) -> list[tuple[PreferencePair, dict[str, Any]]]:
    """(PreferencePair, row) for every preference row of a split of prepared sources; the row keeps
    its other fields (e.g. the synthetic suite's `answer` and `task`, which on-policy DPO verifies).
    With the stage's `cfg`, a pair whose prompt + longest completion exceeds max_seq_len goes
    through `truncation` as the Encoder does for raw rows: right cuts the completions, left the
    prompt (after BOS), drop skips the pair; one no policy fits is a DataError (or skipped). With
    `routing`, each pair is tagged with its row's adapter."""
    out = []
    for src in _as_list(sources):
        tag = routing.tagger(src) if routing is not None else None
        for i, r in enumerate(read_rows(src, "preference", split)):
            pair = pair_of(r)
            try:
                if cfg is not None and pair.longest > cfg.max_seq_len:
                    pair = fit_pair(pair, cfg.max_seq_len, cfg.truncation, bos_id)
                pair.adapter = tag(r) if tag is not None else None
            except RowError as e:
                if e.always_skip or (cfg is not None and cfg.on_bad_row == "skip"):
                    continue
                raise DataError.from_row(e, str(prepared_files(src, "preference", split)[0]), i, "row") from None
            out.append((pair, r))
    return out


def read_unpaired(sources: Sources, split: str, cfg: DataConfig | None = None, bos_id: int | None = None,
                  routing: AdapterRouting | None = None) -> list[tuple[UnpairedExample, dict[str, Any]]]:
    """(UnpairedExample, row) for every unpaired preference row (KTO) of a split of prepared
    sources, as read_pairs: cut to cfg.max_seq_len by its truncation, tagged by `routing`."""
    out = []
    for src in _as_list(sources):
        tag = routing.tagger(src) if routing is not None else None
        for i, r in enumerate(read_rows(src, "unpaired", split)):
            ex = UnpairedExample(r["prompt_ids"], r["completion_ids"], r["completion_labels"], bool(r["label"]))
            try:
                if cfg is not None:
                    ex = fit_unpaired(ex, cfg.max_seq_len, cfg.truncation, bos_id)
                ex.adapter = tag(r) if tag is not None else None
            except RowError as e:
                if e.always_skip or (cfg is not None and cfg.on_bad_row == "skip"):
                    continue
                raise DataError.from_row(e, str(prepared_files(src, "unpaired", split)[0]), i, "row") from None
            out.append((ex, r))
    return out


def fit_pair(p: PreferencePair, max_len: int, policy: str, bos_id: int | None) -> PreferencePair:
    """A pair whose prompt + longest completion exceeds `max_len`, cut by the truncation policy
    (right: the completions; left: the prompt after BOS; drop: skipped); RowError when it cannot."""
    over = f"prompt + longest completion = {p.longest} tokens > max_seq_len={max_len}"
    if policy == "drop":
        raise RowError("too_long", "chosen", f"{over} (truncation='drop')", always_skip=True)
    if policy == "left":
        head = 1 if bos_id is not None and p.prompt_ids[:1] == [bos_id] else 0
        cut = p.longest - max_len
        if cut > len(p.prompt_ids) - head:
            raise RowError("too_long", "chosen", f"{over}, and truncation='left' keeps completions whole")
        prompt = p.prompt_ids[:head] + p.prompt_ids[head + cut:]
        return PreferencePair(prompt, p.chosen_ids, p.chosen_labels, p.rejected_ids, p.rejected_labels)
    room = max_len - len(p.prompt_ids)
    out = PreferencePair(p.prompt_ids, p.chosen_ids[:room], p.chosen_labels[:room], p.rejected_ids[:room],
                         p.rejected_labels[:room])
    for name, labels in (("chosen", out.chosen_labels), ("rejected", out.rejected_labels)):
        if all(x == IGNORE_INDEX for x in labels):
            raise RowError("too_long", name, f"{over}, and truncation='right' leaves no {name} tokens")
    return out


def _load_raw(src: str | Path, task: str, tokenizer: Tokenizer | None, cfg: DataConfig | None,
              stats: DropStats | None = None, routing: AdapterRouting | None = None):
    """load_data of one raw source (every split), checked to hold `task` rows (tagged with their
    adapters by `routing`); its skipped rows are added to `stats`."""
    from posttrain.core.data.dataset import load_data

    if tokenizer is None or cfg is None:
        raise DataError("raw data (not a data-prep stage directory) needs a tokenizer and a DataConfig",
                        source=str(src))
    data = load_data(cfg.model_copy(update={"sources": [str(src)]}), tokenizer,
                     routing.tagger(src) if routing is not None else None)
    if data.task != task:
        raise DataError(f"holds {data.task} rows; this stage needs {task} rows", source=str(src))
    if stats is not None:
        stats.kept += data.stats.kept
        stats.dropped.update(data.stats.dropped)
        for reason, shown in data.stats.examples.items():
            have = stats.examples.setdefault(reason, [])
            have.extend(shown[: max(stats.max_examples - len(have), 0)])
    return data


def data_task(sources: Sources, want: str = "preference") -> str:
    """The preference task the sources hold, "preference" (pairs) or "unpaired" (KTO's labelled
    single completions), without reading them through: a data-prep stage directory by its outputs,
    a raw source by the columns of its table or first JSONL row (as format detection does).
    "preference" when nothing tells; DataError when the sources mix the two."""
    from posttrain.core.data.formats import detect_format, task_of
    from posttrain.core.data.sources import open_sources

    found: dict[str, str] = {}
    for src in _as_list(sources):
        if is_prepared(src):
            outputs = read_manifest(src)["outputs"]
            kinds = [t for t in ("preference", "unpaired") if any(k.startswith(f"{t}_") for k in outputs)]
            if len(kinds) == 1:
                found.setdefault(kinds[0], str(src))
            continue
        for source in open_sources([str(src)]):
            cols = source.columns
            if cols is None:
                cols = next((list(r.value) for r in source.rows() if isinstance(r.value, dict)), None)
            fmt = detect_format(cols, want) if cols is not None else None
            if fmt is not None and task_of(fmt) in ("preference", "unpaired"):
                found.setdefault(task_of(fmt), source.name)
    if len(found) > 1:
        raise DataError(f"mixes paired preference rows ({found['preference']}) with unpaired ones "
                        f"({found['unpaired']}, prompt/completion/label); train them in separate stages",
                        source=", ".join(map(str, _as_list(sources))))
    return next(iter(found), "preference")


def _check_prepared(src: str | Path, cfg: DataConfig | None) -> None:
    if cfg is not None and cfg.chat_template is not None:
        raise DataError(f"data.chat_template={cfg.chat_template!r} cannot apply to data prep's output, which is "
                        "tokenized already; set data_prep.chat_template instead", source=str(src))


def load_splits(sources: Sources, task: str, splits: Sequence[str], tokenizer: Tokenizer | None = None,
                cfg: DataConfig | None = None, stats: DropStats | None = None,
                routing: AdapterRouting | None = None) -> dict[str, list]:
    """{split: items} for several splits of every source, `task` "sft" (Documents), "preference"
    ((PreferencePair, row) tuples; a raw source's rows hold the pair's token columns only) or
    "unpaired" ((UnpairedExample, row), likewise). Data
    prep's output is read back split by split (cut to cfg.max_seq_len); a raw source (JSONL,
    Parquet, saved datasets) is validated, tokenized and split once by load_data with cfg, its
    skipped rows counted in `stats`. Every bad row is raised (or counted) here, before training.
    With `routing` (several adapters), every item is tagged with its adapter (posttrain.core.data.routing)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    out: dict[str, list] = {canonical_split(s): [] for s in splits}
    bos_id = getattr(tokenizer, "bos_id", None)
    for src in _as_list(sources):
        if is_prepared(src):
            _check_prepared(src, cfg)
            for split in out:
                if task == "sft":
                    out[split].extend(read_documents(src, split, cfg, bos_id, routing))
                elif task == "unpaired":
                    out[split].extend(read_unpaired(src, split, cfg, bos_id, routing))
                else:
                    out[split].extend(read_pairs(src, split, cfg, bos_id, routing))
        else:
            data = _load_raw(src, task, tokenizer, cfg, stats, routing)
            for split in out:
                items = data[split]
                out[split].extend(items if task == "sft" else [(p, record({}, p)) for p in items])
    return out


def load_documents(sources: Sources, split: str, tokenizer: Tokenizer | None = None,
                   cfg: DataConfig | None = None, routing: AdapterRouting | None = None) -> list[Document]:
    """SFT Documents of `split` from every source: data prep's Parquet for a stage directory (cut to
    cfg.max_seq_len); raw sources (JSONL, Parquet, saved datasets) validated, tokenized and split by
    load_data with cfg, one source at a time."""
    return load_splits(sources, "sft", [split], tokenizer, cfg, routing=routing)[split]


def load_pairs(sources: Sources, split: str, tokenizer: Tokenizer | None = None,
               cfg: DataConfig | None = None) -> list[tuple[PreferencePair, dict[str, Any]]]:
    """(PreferencePair, row) of `split` from every source, as load_documents does for documents; a
    raw source's rows hold the pair's token columns only."""
    return load_splits(sources, "preference", [split], tokenizer, cfg)[split]
