"""Where rows come from: local JSONL, Parquet and `datasets.save_to_disk` directories.

JSONL is streamed line by line, so a bad line is reported as `train.jsonl line 17` (1-based, blank
lines counted) rather than as a pyarrow parse error with a byte offset; the rest of the file still
loads in skip mode. Parquet is read with pyarrow in record batches (what `datasets` does underneath,
without copying the file into the HF cache); saved datasets are memory-mapped with
`datasets.load_from_disk`. Rows of tables are numbered by their 0-based index (`ds[17]`).

`datasets` and pyarrow are imported on first use: importing them costs seconds, and a stage that
only reads JSONL need not pay for it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.core.data.errors import DataError, RowError, show
from posttrain.core.data.split import SPLITS

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
_BATCH = 1024


@dataclass
class RawRow:
    """One row as read: its position (`index` is a line or a row index, per `unit`) and either its
    value or the RowError that made it unreadable (invalid JSON or bytes)."""

    index: int
    value: Any = None
    error: RowError | None = None


@dataclass
class Source:
    """One file or table. `columns` is known up front for tables (None for JSONL: rows may differ);
    `split` is set when the data says which split it is (a DatasetDict's train/validation/test)."""

    name: str
    kind: str  # "jsonl" | "parquet" | "datasets"
    unit: str  # how rows are numbered in messages: "line" | "row"
    columns: list[str] | None = None
    split: str | None = None
    _table: Any = None  # the datasets.Dataset, for kind == "datasets"

    def rows(self) -> Iterator[RawRow]:
        if self.kind == "jsonl":
            return _jsonl_rows(self.name)
        if self.kind == "parquet":
            return _parquet_rows(self.name)
        return _dataset_rows(self._table)


def open_sources(paths: list[str]) -> list[Source]:
    """Resolve each path to its sources. A directory is a saved dataset (it has dataset_info.json or
    dataset_dict.json) or else a folder of .jsonl/.parquet files, read in sorted order."""
    if not paths:
        raise DataError("no data sources given (data.sources is empty)")
    out: list[Source] = []
    for path in paths:
        p = Path(path)
        if not p.exists():
            raise DataError("does not exist", source=str(path))
        if p.is_dir():
            if (p / "dataset_dict.json").is_file() or (p / "dataset_info.json").is_file():
                out.extend(_open_saved(str(path)))
                continue
            files = sorted(f for f in p.iterdir() if f.suffix in JSONL_SUFFIXES + PARQUET_SUFFIXES)
            if not files:
                raise DataError("directory holds no save_to_disk dataset and no .jsonl/.parquet files",
                                source=str(path))
            out.extend(_open_file(str(f)) for f in files)
        else:
            out.append(_open_file(str(path)))
    return out


def _open_file(name: str) -> Source:
    suffix = Path(name).suffix
    if suffix in JSONL_SUFFIXES:
        return Source(name, "jsonl", "line")
    if suffix in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        try:
            columns = pq.ParquetFile(name).schema_arrow.names
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for corrupt files
            raise DataError(f"cannot read Parquet: {e}", source=name) from e
        return Source(name, "parquet", "row", columns=list(columns))
    raise DataError(f"unsupported file type {suffix!r}; expected .jsonl, .parquet or a save_to_disk directory",
                    source=name)


def _open_saved(name: str) -> list[Source]:
    import datasets

    try:
        loaded = datasets.load_from_disk(name)
    except Exception as e:
        raise DataError(f"cannot load with datasets.load_from_disk: {e}", source=name) from e
    if isinstance(loaded, datasets.DatasetDict):
        known = [s for s in SPLITS if s in loaded]
        if not known:
            raise DataError(f"saved DatasetDict has splits {sorted(loaded)}; expected some of {', '.join(SPLITS)}",
                            source=name)
        # Each split is its own source, named so that messages say which: "dir[validation] row 3".
        return [Source(f"{name}[{s}]", "datasets", "row", list(loaded[s].column_names), s, loaded[s]) for s in known]
    return [Source(name, "datasets", "row", list(loaded.column_names), None, loaded)]


# ------------------------------------------------------------------------------------------ readers


def _jsonl_rows(name: str) -> Iterator[RawRow]:
    with open(name, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 BOM some editors write
                raw = raw[3:]
            raw = raw.rstrip(b"\r\n")  # else a truncated row is reported at "line 2 column 1"
            if not raw.strip():
                continue  # blank lines (a trailing newline, spacing) are not rows
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                bad = show(raw[e.start : e.start + 4])
                yield RawRow(lineno, error=RowError("invalid_unicode", None, f"not UTF-8 at byte {e.start}: {bad}"))
                continue
            try:
                yield RawRow(lineno, value=json.loads(text))
            except RecursionError:  # nesting deeper than the interpreter's stack
                yield RawRow(lineno, error=RowError("invalid_json", None, "invalid JSON (nested too deeply)"))
            except ValueError as e:  # JSONDecodeError, and ints past the digit limit
                yield RawRow(lineno, error=RowError("invalid_json", None, f"invalid JSON ({_json_reason(e)})"))


def _json_reason(e: ValueError) -> str:
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at column {e.colno}"
    return str(e)


def _parquet_rows(name: str) -> Iterator[RawRow]:
    import pyarrow.parquet as pq

    index = 0
    try:
        for batch in pq.ParquetFile(name).iter_batches(batch_size=_BATCH):
            for value in batch.to_pylist():
                yield RawRow(index, value=value)
                index += 1
    except (OSError, ValueError) as e:  # a truncated or corrupt page part-way through (ArrowInvalid)
        raise DataError(f"cannot read Parquet after row {index}: {e}", source=name) from e


def _dataset_rows(table: Any) -> Iterator[RawRow]:
    index = 0
    for batch in table.with_format("arrow").iter(batch_size=_BATCH):
        for value in batch.to_pylist():
            yield RawRow(index, value=value)
            index += 1
