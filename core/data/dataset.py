"""From DataConfig to tokenized splits and loaders: the one entry point stages call.

`load_data` reads every source once, validates and tokenizes every row before training starts (so
a bad row stops the job at load time, never mid-run), routes rows to train/validation/test by a
hash of their content (or by the split a saved DatasetDict names), and returns the tokenized
splits with the DropStats of what was skipped. `build_loader` packs a split and returns a
resumable, rank-sharded iterator of model-ready batches.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from core.data.encode import Document, Encoder, PreferencePair
from core.data.errors import DataError, DropStats, RowError, describe
from core.data.formats import FORMATS, Example, detect_format, task_of, validate_row
from core.data.packing import collate_padded, collate_padding_free, collate_preference, pack
from core.data.sampler import BatchSampler, StatefulLoader
from core.data.sources import SPLITS, RawRow, Source, open_sources
from core.data.split import assign_split, content_hash, split_key

if TYPE_CHECKING:
    from core.config import DataConfig
    from registry.tokenizer import Tokenizer

_EXPECTED = "messages, prompt+completion, prompt+chosen+rejected, or chosen+rejected"


@dataclass
class PreparedData:
    """Tokenized splits: Documents for SFT, PreferencePairs for preference data."""

    task: str  # "sft" | "preference"
    splits: dict[str, list[Document | PreferencePair]] = field(default_factory=lambda: {s: [] for s in SPLITS})
    stats: DropStats = field(default_factory=DropStats)
    pad_id: int = 0

    def __getitem__(self, split: str) -> list[Document | PreferencePair]:
        return self.splits[split]


def load_data(cfg: DataConfig, tokenizer: Tokenizer) -> PreparedData:
    """Read, validate and tokenize cfg.sources. Raises DataError for the first bad row (or any
    source problem) when cfg.on_bad_row == "error"; otherwise counts bad rows in `stats`."""
    template = cfg.chat_template
    # A name (e.g. "tool_use"), a Jinja file, or the template text itself (it has "{" and may be too
    # long a string to stat).
    if template is not None and "{" not in template and Path(template).is_file():
        template = Path(template).read_text(encoding="utf-8")
    encoder = Encoder(tokenizer, cfg.max_seq_len, cfg.truncation, cfg.mask_prompt, template)
    splits: dict[str, list] = {s: [] for s in SPLITS}
    seen: set[str] = set()

    def add(source: Source, example: Example) -> None:
        try:
            digest = content_hash(example)
            key = split_key(example)
            split = source.split or assign_split(key, cfg.val_fraction, cfg.test_fraction)
        except RecursionError:  # a field nested deeper than json.loads minded (extra message keys)
            raise RowError("wrong_type", None, "a field is nested too deeply") from None
        if cfg.dedup:
            if digest in seen:
                raise RowError("duplicate", None, "duplicate of an earlier row (dedup=true)", always_skip=True)
            seen.add(digest)
        splits[split].append(encoder(example))

    stats = DropStats()
    task = for_each_example(list(cfg.sources), cfg.format, cfg.on_bad_row, stats, add)
    return PreparedData(task, splits, stats, _pad_id(tokenizer))


def load_documents(paths: list[str], tokenizer: Tokenizer, cfg: DataConfig) -> list[Document | PreferencePair]:
    """Every row of `paths` tokenized (Documents, or PreferencePairs), with no held-out split: for
    sources that are one split already."""
    data = load_data(cfg.model_copy(update={"sources": list(paths), "val_fraction": 0.0, "test_fraction": 0.0}),
                     tokenizer)
    return data["train"] + data["validation"] + data["test"]  # a DatasetDict's splits, in order


def load_rows(paths: str | list[str], format: str = "auto", on_bad_row: str = "error"
              ) -> tuple[str, list[dict], Counter]:
    """Validated rows, untokenized, for data prep: (task "sft" | "preference", rows, drops by reason).
    Rows come back in TRL's explicit form: {"messages"}, {"prompt", "completion"} or
    {"prompt", "chosen", "rejected"} (implicit-prompt rows split), null fields dropped."""
    rows: list[dict] = []
    stats = DropStats()
    task = for_each_example([paths] if isinstance(paths, str) else list(paths), format, on_bad_row, stats,
                            lambda source, ex: rows.append(dataclasses.asdict(ex)))
    return task, rows, stats.dropped


def for_each_example(paths: list[str], want: str, on_bad_row: str, stats: DropStats,
                     handle: Callable[[Source, Example], None]) -> str:
    """Validate every row of every source and pass the clean example to `handle` (which may raise
    RowError too, e.g. while tokenizing). A RowError becomes a DataError naming file, row and
    field, raised or (on_bad_row="skip", or a row the config drops) counted in `stats`. Returns the
    task; raises DataError when sources mix tasks or no row survives."""
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    task = first = None
    for source in open_sources(paths):
        for raw, fmt in _rows_with_format(source, want):
            if fmt is not None and task is None:
                task, first = task_of(fmt), source.name
            elif fmt is not None and task_of(fmt) != task:
                raise DataError(f"holds {task_of(fmt)} rows but {first} holds {task} rows; "
                                "load SFT and preference data separately", source=source.name)
            try:
                handle(source, _validate(raw, fmt))
            except RowError as e:
                err = DataError.from_row(e, source.name, raw.index, source.unit)
                if not (e.always_skip or on_bad_row == "skip"):
                    raise err from None
                stats.drop(err)
                continue
            stats.kept += 1
    if task is None or stats.kept == 0:
        raise DataError(f"no usable rows in {', '.join(map(str, paths))} ({stats})")
    return task


def _pad_id(tokenizer: Tokenizer) -> int:
    pad = tokenizer.pad_id
    return 0 if pad is None else pad  # padding is masked out everywhere; any id serves


def _rows_with_format(source: Source, want: str) -> Iterator[tuple[RawRow, str | None]]:
    """Rows paired with the source's format. Tables know their columns; JSONL rows are buffered
    until the first object whose fields reveal the format (usually line 1; with data.format "sft"
    or "preference" that row still tells messages from prompt/completion), so that a malformed row
    is then reported as a missing or mistyped field of that format."""
    if source.columns is not None or want in FORMATS:
        fmt = detect_format(source.columns or [], want)
        if fmt is None:
            raise DataError(f"cannot tell the format from columns {sorted(source.columns or [])}; expected {_EXPECTED} "
                            f"(or set data.format)", source=source.name)
        for raw in source.rows():
            yield raw, fmt
        return
    fmt, buffered = None, []
    for raw in source.rows():
        if fmt is None and isinstance(raw.value, dict):
            fmt = detect_format(raw.value.keys(), want)
            if fmt is not None:
                yield from ((b, fmt) for b in buffered)
                buffered = []
        if fmt is None:
            buffered.append(raw)
        else:
            yield raw, fmt
    yield from ((b, None) for b in buffered)  # no row revealed a format


def _validate(raw: RawRow, fmt: str | None) -> Example:
    if raw.error is not None:
        raise raw.error
    if fmt is None:
        if not isinstance(raw.value, dict):
            raise RowError("not_an_object", None, f"expected a JSON object, got {describe(raw.value)}")
        fields = sorted(map(str, raw.value))[:8]
        raise RowError("unknown_format", None, f"cannot tell the format from fields {fields}; expected {_EXPECTED}")
    return validate_row(raw.value, fmt)


# ------------------------------------------------------------------------------------------- loader


def build_loader(data: PreparedData, cfg: DataConfig, split: str = "train", *, rank: int = 0, world_size: int = 1,
                 padding_free: bool = True, pack_strategy: str = "ffd", shuffle: bool | None = None,
                 drop_last: bool = True, num_epochs: int | None = 1) -> StatefulLoader:
    """A resumable loader over one split. SFT documents are packed into rows of max_seq_len tokens
    (cfg.packing) or kept one per row; preference pairs are never packed together across pairs
    (each batch holds whole pairs). padding_free=True collates a micro-batch into one (1, T) row;
    False gives (B, L) padded rows with attention_mask. shuffle defaults to split == "train"."""
    items = data[split]
    if not items:
        raise DataError(f"split {split!r} has no rows ({data.stats})")
    budget = {"batch_tokens": cfg.batch_tokens} if cfg.batch_tokens else {"micro_batch_size": cfg.micro_batch_size}
    shuffle = split == "train" if shuffle is None else shuffle
    common = dict(rank=rank, world_size=world_size, seed=cfg.seed, shuffle=shuffle,
                  drop_last=drop_last, num_epochs=num_epochs, padded=not padding_free, **budget)
    if data.task == "preference":
        sampler = BatchSampler([len(p) for p in items], **common)
        return StatefulLoader(sampler, lambda units: collate_preference([items[u] for u in units], padding_free,
                                                                        data.pad_id))
    lengths = [len(d) for d in items]
    rows = pack(lengths, cfg.max_seq_len, pack_strategy) if cfg.packing else [[i] for i in range(len(items))]
    sampler = BatchSampler([sum(lengths[i] for i in row) for row in rows], **common)

    def collate(units: list[int]) -> dict:
        if padding_free:
            return collate_padding_free([items[i] for u in units for i in rows[u]])
        return collate_padded([[items[i] for i in rows[u]] for u in units], data.pad_id)

    return StatefulLoader(sampler, collate)

