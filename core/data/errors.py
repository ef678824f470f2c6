"""Bad rows: the error that names file, row and field, and the tally of rows skipped by reason.

Validators deep inside the data path know the field but not where the row came from, so they raise
`RowError(reason, field, detail)`; the loader, which knows the file and line, turns it into a
`DataError` (on_bad_row="error") or counts it in `DropStats` (on_bad_row="skip").
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# Why a row can be rejected; DropStats counts by these names.
REASONS = (
    "invalid_json",        # the line does not parse as JSON
    "invalid_unicode",     # undecodable bytes, or a lone surrogate in a string
    "not_an_object",       # the row is a JSON array/number/... instead of an object
    "unknown_format",      # no known set of fields (messages, prompt/completion, chosen/rejected)
    "missing_field",
    "wrong_type",
    "unknown_role",
    "role_order",
    "empty_content",       # empty completion or assistant content
    "identical_pair",      # preference row whose chosen and rejected completions are the same
    "template_error",      # the chat template raised on this row
    "no_target_tokens",    # tokenized, but no token is trained on
    "too_long",            # over max_seq_len and the truncation policy cannot fix it (or is "drop")
    "too_short",           # fewer tokens than data prep's min_tokens
    "duplicate",           # exact duplicate of an earlier row (dedup=True)
    "unknown_adapter",     # with several LoRA adapters: the row names one that is not trained
)

_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", list: "array", dict: "object",
               type(None): "null"}


def describe(value: Any, limit: int = 60) -> str:
    """`integer 5`, `string 'bot'`: the JSON type and a short, always-printable repr of a value."""
    kind = _JSON_TYPES.get(type(value), type(value).__name__)
    try:
        text = repr(value)
    except Exception:  # e.g. ints beyond sys.get_int_max_str_digits() cannot be printed at all
        return kind
    return f"{kind} {text if len(text) <= limit else text[: limit - 3] + '...'}"


def show(value: Any, limit: int = 60) -> str:
    """A short repr, truncated: error messages must stay readable when a field holds 1 MB of text."""
    try:
        text = repr(value)
    except Exception:
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RowError(Exception):
    """A rejected row, before its location is known. `always_skip` marks rows the config itself asks
    to drop (truncation="drop", dedup): they are counted, never raised."""

    def __init__(self, reason: str, field: str | None, detail: str, always_skip: bool = False):
        assert reason in REASONS, reason
        super().__init__(detail)
        self.reason, self.field, self.detail, self.always_skip = reason, field, detail, always_skip


class DataError(ValueError):
    """Bad data, named precisely: `train.jsonl line 17, field messages[2].role: expected ...`.

    Attributes: source (path as given), row (1-based line for JSONL, 0-based row index for
    Parquet and datasets directories; None for whole-source problems), unit ("line" or "row"),
    field (a path such as `messages[2].role`, or None), reason (one of REASONS, or "source")."""

    def __init__(self, detail: str, *, source: str | None = None, row: int | None = None, unit: str = "line",
                 field: str | None = None, reason: str = "source"):
        self.detail, self.source, self.row, self.unit = detail, source, row, unit
        self.field, self.reason = field, reason
        where = source or ""
        if row is not None:
            where += f" {unit} {row}"
        if field is not None:
            where += f", field {field}" if where else f"field {field}"
        super().__init__(f"{where}: {detail}" if where else detail)

    @classmethod
    def from_row(cls, err: RowError, source: str, row: int, unit: str) -> DataError:
        return cls(err.detail, source=source, row=row, unit=unit, field=err.field, reason=err.reason)


@dataclass
class DropStats:
    """Rows kept and rows dropped by reason, with the first few messages of each reason for the logs."""

    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    max_examples: int = 3

    def drop(self, err: DataError) -> None:
        self.dropped[err.reason] += 1
        shown = self.examples.setdefault(err.reason, [])
        if len(shown) < self.max_examples:
            shown.append(str(err))

    @property
    def total_dropped(self) -> int:
        return sum(self.dropped.values())

    def to_dict(self) -> dict[str, int]:
        """Flat counts, ready for metrics: {"kept": 10, "dropped": 3, "dropped/too_long": 2, ...}."""
        out = {"kept": self.kept, "dropped": self.total_dropped}
        out.update({f"dropped/{r}": n for r, n in sorted(self.dropped.items())})
        return out

    def __str__(self) -> str:
        reasons = ", ".join(f"{n} {r}" for r, n in self.dropped.most_common())
        return f"kept {self.kept}, dropped {self.total_dropped}" + (f" ({reasons})" if reasons else "")
