"""From sources to tokenized splits: normalize -> validate -> dedup -> encode -> split.

`load_data` reads every source once, validates and tokenizes every row before training starts (so
a bad row stops the job at load time, never mid-run), routes rows to train/validation/test by a
hash of their content (or by the split a saved DatasetDict names), and returns the tokenized
splits with the DropStats of what was skipped. Data prep runs the same `ExamplePipeline` and writes
its result to Parquet (posttrain.core.data.prepared reads it back); posttrain.core.data.loader batches either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.core.data.encode import Document, Encoder, PreferencePair, Tokenizer, num_tokens
from posttrain.core.data.errors import DataError, DropStats, RowError, describe
from posttrain.core.data.formats import FORMATS, Example, detect_format, task_of, validate_row
from posttrain.core.data.sources import RawRow, Source, open_sources
from posttrain.core.data.split import SPLITS, assign_split, content_hash, split_key

if TYPE_CHECKING:
    from posttrain.core.data.config import DataConfig

_EXPECTED = "messages, prompt+completion, prompt+chosen+rejected, chosen+rejected, or prompt+completion+label"


@dataclass
class PreparedData:
    """Tokenized splits: Documents for SFT, PreferencePairs for preference data."""

    task: str  # "sft" | "preference"
    splits: dict[str, list[Document | PreferencePair]] = field(default_factory=lambda: {s: [] for s in SPLITS})
    stats: DropStats = field(default_factory=DropStats)
    pad_id: int = 0

    def __getitem__(self, split: str) -> list[Document | PreferencePair]:
        return self.splits[split]


class ExamplePipeline:
    """What happens to every validated example, in `load_data` and in data prep alike: dedup by
    content hash (dedup=True), tokenize with the Encoder (chat template, label masks, truncation),
    drop examples under `min_tokens`, and route to a split: the one the source names (a saved
    DatasetDict's), else by a hash of the prompt side (posttrain.core.data.split). Raises RowError."""

    def __init__(self, encoder: Encoder, val_fraction: float, test_fraction: float = 0.0, *, dedup: bool = False,
                 min_tokens: int = 1):
        assign_split("", val_fraction, test_fraction)  # bad fractions fail here, not at the first row
        self.encoder, self.val_fraction, self.test_fraction = encoder, val_fraction, test_fraction
        self.dedup, self.min_tokens = dedup, min_tokens
        self.seen: set[str] = set()

    def __call__(self, example: Example, split: str | None = None) -> tuple[str, Document | PreferencePair]:
        try:
            digest = content_hash(example)
            split = split or assign_split(split_key(example), self.val_fraction, self.test_fraction)
        except RecursionError:  # a field nested deeper than json.loads minded (extra message keys)
            raise RowError("wrong_type", None, "a field is nested too deeply") from None
        if self.dedup:
            if digest in self.seen:
                raise RowError("duplicate", None, "duplicate of an earlier row (dedup=true)", always_skip=True)
            self.seen.add(digest)
        item = self.encoder(example)
        n = num_tokens(item)
        if n < self.min_tokens:
            raise RowError("too_short", None, f"{n} tokens < min_tokens={self.min_tokens}", always_skip=True)
        return split, item


def make_encoder(cfg: DataConfig, tokenizer: Tokenizer) -> Encoder:
    """The Encoder for a DataConfig: its max_seq_len, truncation, mask_prompt and chat_template."""
    return Encoder(tokenizer, cfg.max_seq_len, cfg.truncation, cfg.mask_prompt, read_template(cfg.chat_template))


def read_template(template: str | None) -> str | None:
    """A chat template setting: a name (e.g. "tool_use"), a Jinja file (read here), or the template
    text itself (it has "{" and may be too long a string to stat)."""
    if template is not None and "{" not in template and Path(template).is_file():
        return Path(template).read_text(encoding="utf-8")
    return template


def load_data(cfg: DataConfig, tokenizer: Tokenizer, tag: Callable[[Any], int] | None = None) -> PreparedData:
    """Read, validate and tokenize cfg.sources. Raises DataError for the first bad row (or any
    source problem) when cfg.on_bad_row == "error"; otherwise counts bad rows in `stats`. `tag`
    (raw row -> adapter index, or RowError; posttrain.core.data.routing) sets every item's adapter."""
    pipeline = ExamplePipeline(make_encoder(cfg, tokenizer), cfg.val_fraction, cfg.test_fraction, dedup=cfg.dedup)
    splits: dict[str, list] = {s: [] for s in SPLITS}

    def add(source: Source, example: Example, row: Any = None) -> None:
        adapter = tag(row) if tag is not None else None  # a bad adapter fails before tokenizing
        split, item = pipeline(example, source.split)
        item.adapter = adapter
        splits[split].append(item)

    stats = DropStats()
    task = for_each_example(list(cfg.sources), cfg.format, cfg.on_bad_row, stats, add, with_row=tag is not None)
    return PreparedData(task, splits, stats, pad_id_of(tokenizer))


def for_each_example(paths: list[str], want: str, on_bad_row: str, stats: DropStats,
                     handle: Callable[..., None], *, require_rows: bool = True, with_row: bool = False) -> str | None:
    """Validate every row of every source and pass the clean example (with_row: and the raw row) to `handle` (which may raise
    RowError too, e.g. while tokenizing). A RowError becomes a DataError naming file, row and
    field, raised or (on_bad_row="skip", or a row the config drops) counted in `stats`. Returns the
    task; raises DataError when sources mix tasks or (require_rows) no row survives; without
    require_rows the task is None when no row revealed one."""
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
                ex = _validate(raw, fmt)
                handle(source, ex, raw.value) if with_row else handle(source, ex)
            except RowError as e:
                err = DataError.from_row(e, source.name, raw.index, source.unit)
                if not (e.always_skip or on_bad_row == "skip"):
                    raise err from None
                stats.drop(err)
                continue
            stats.kept += 1
    if require_rows and (task is None or stats.kept == 0):
        raise DataError(f"no usable rows in {', '.join(map(str, paths))} ({stats})")
    return task


def pad_id_of(tokenizer: Tokenizer) -> int:
    pad = tokenizer.pad_id
    return 0 if pad is None else pad  # padding is masked out everywhere; any id serves


def _rows_with_format(source: Source, want: str) -> Iterator[tuple[RawRow, str | None]]:
    """Rows paired with the source's format. Tables know their columns; JSONL rows are buffered
    until the first object whose fields reveal the format (usually line 1; with data.format "sft"
    or "preference" that row still tells messages from prompt/completion), so that a malformed row
    is then reported as a missing or mistyped field of that format."""
    # a preference JSONL may be paired or unpaired (KTO): its first row tells, as with "auto"
    if source.columns is not None or (want in FORMATS and want != "preference"):
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
