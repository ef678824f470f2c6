"""Which adapter each example trains, when several LoRA adapters train in one job.

A row names its adapter in a column (`adapter` by default), or its whole source is mapped to one
(a data source as data.sources lists it: a file, a directory, a data-prep stage dir). The adapter
is stored on the tokenized item (`Document.adapter`, `PreferencePair.adapter`: an index into the
adapter names), and collation turns it into per-token ids (posttrain.core.data.packing: `adapter_ids`), so a
packed row routes each document's tokens to its own adapter. A row naming no adapter, or one that
is not trained, is a bad row: DataError naming file, row and field (or skipped with
on_bad_row='skip').
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.core.data.errors import RowError, describe


def same_source(a: str | Path, b: str | Path) -> bool:
    return os.path.normpath(os.path.abspath(a)) == os.path.normpath(os.path.abspath(b))


@dataclass(frozen=True)
class AdapterRouting:
    names: tuple[str, ...]
    column: str = "adapter"
    sources: Mapping[str, Sequence[str]] = field(default_factory=dict)  # adapter -> sources

    def source_adapter(self, source: str | Path) -> str | None:
        """The adapter a source is mapped to, or None (its rows name theirs)."""
        return next((name for name, srcs in self.sources.items() for s in srcs if same_source(s, source)), None)

    def tagger(self, source: str | Path) -> Callable[[Any], int]:
        """row -> the index of its adapter, for the rows of `source`; RowError for a bad one."""
        fixed = self.source_adapter(source)
        col, names = self.column, list(self.names)

        def tag(row: Any) -> int:
            value = row.get(col) if isinstance(row, dict) else None
            if fixed is not None:
                if value is not None and value != fixed:
                    raise RowError("unknown_adapter", col, f"{describe(value)}, but lora.adapter_sources maps this "
                                                           f"source to adapter {fixed!r}")
                return names.index(fixed)
            if value is None:
                raise RowError("missing_field", col, f"missing: with several adapters ({', '.join(names)}) each row "
                                                     "names the one it trains, or lora.adapter_sources maps its "
                                                     "source to one")
            if value not in names:
                raise RowError("unknown_adapter", col, f"{describe(value)} is not an adapter being trained "
                                                       f"(lora.adapter_names: {', '.join(names)})")
            return names.index(value)

        return tag
