"""Rows as prompts: what generation-based stages (evaluation, on-policy DPO) read.

Every row becomes a `PromptRow`: its prompt (a string, or chat messages without the final
assistant turn), the completion / chosen / rejected it carries if any, and every other column
(`fields`: a reference answer, a task name, unit tests) for metrics and verifiers to read. The
rows come from data prep's output (one split of its SFT or preference Parquet) or straight from
the user's files (JSONL, Parquet, `datasets` directories), in any TRL format or prompts only:

    {"prompt": "2+2?", "answer": "4"}                                   prompts only
    {"messages": [..., {"role": "assistant", "content": "4"}]}         conversation (completion = last turn)
    {"prompt": ..., "completion": ...}                                  prompt/completion
    {"prompt": ..., "chosen": ..., "rejected": ...}                     preference (explicit or implicit)

A user's file is read whole (its rows are the evaluation set); a bad row is a DataError naming file,
line/row and field, or is counted and skipped with on_bad_row="skip".

    rows = prompt_rows(["eval.jsonl"], split="test")
    rows[0].prompt, rows[0].fields["answer"], rows[0].where      # where: "eval.jsonl line 1"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.core.data.errors import DataError, DropStats, RowError, describe
from posttrain.core.data.formats import FORMATS, Conversation, Preference, PromptCompletion, Text, validate_row
from posttrain.core.data.prepared import _as_list, is_prepared, prepared_files, read_rows
from posttrain.core.data.sources import open_sources

_STRUCTURE = ("messages", "prompt", "completion", "chosen", "rejected")
_TOKENS = ("input_ids", "labels", "prompt_ids", "chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels",
           "completion_ids", "completion_labels")


@dataclass
class PromptRow:
    prompt: Text
    completion: Text | None = None
    chosen: Text | None = None
    rejected: Text | None = None
    fields: dict[str, Any] = field(default_factory=dict)  # the row's other columns
    where: str = ""  # "file line 3": for messages about this row
    split: str | None = None  # the split the data names (data prep's, a saved DatasetDict's), if any

    @property
    def is_pair(self) -> bool:
        return self.chosen is not None and self.rejected is not None


def from_example(ex: Any, fields: dict[str, Any], where: str) -> PromptRow:
    if isinstance(ex, Conversation):
        return PromptRow(ex.messages[:-1], [ex.messages[-1]], fields=fields, where=where)
    if isinstance(ex, PromptCompletion):
        return PromptRow(ex.prompt, ex.completion, fields=fields, where=where)
    assert isinstance(ex, Preference)
    return PromptRow(ex.prompt, chosen=ex.chosen, rejected=ex.rejected, fields=fields, where=where)


def parse_row(row: Any) -> PromptRow:
    """The PromptRow of one raw row (any TRL format, or prompt only), or RowError."""
    if not isinstance(row, dict):
        raise RowError("not_an_object", None, f"expected a JSON object, got {describe(row)}")
    row = {k: v for k, v in row.items() if v is not None}
    fields = {k: v for k, v in row.items() if k not in _STRUCTURE and k not in _TOKENS}
    cols = set(row)
    if {"chosen", "rejected"} & cols:
        fmt = "preference" if "prompt" in cols else "implicit_preference"
    elif "messages" in cols:
        fmt = "messages"
    elif "completion" in cols:
        fmt = "prompt_completion"
    elif "prompt" in cols:
        prompt = validate_row({"prompt": row["prompt"], "completion": "x"}, "prompt_completion").prompt
        if isinstance(prompt, list) and prompt[-1]["role"] == "assistant":
            raise RowError("role_order", f"prompt[{len(prompt) - 1}].role",
                           "a prompt must not end with an assistant turn (nothing is left to generate)")
        return PromptRow(prompt, fields=fields)
    else:
        have = ", ".join(sorted(map(str, row))[:8]) or "none"
        raise RowError("unknown_format", None, f"expected a prompt (or messages, or chosen/rejected); the row has "
                                               f"fields: {have}")
    assert fmt in FORMATS
    return from_example(validate_row(row, fmt), fields, "")


def prompt_rows(sources: Any, split: str = "test", on_bad_row: str = "error",
                stats: DropStats | None = None, task: str | None = None) -> list[PromptRow]:
    """PromptRows of every source: `split` of a data-prep stage dir (its SFT rows, or with
    task="preference" its preference rows; task=None: SFT rows, or preference rows when it has no
    SFT rows), and every row of a user's file."""
    stats = stats if stats is not None else DropStats()
    out: list[PromptRow] = []
    for src in _as_list(sources):
        if is_prepared(src):
            kinds = [task] if task else ["sft", "preference"]
            for kind in kinds:
                try:
                    files = prepared_files(src, kind, split)
                except DataError:
                    if task is not None:
                        raise
                    continue  # this kind was not prepared: try the next
                if not files and task is None:
                    continue
                for i, r in enumerate(read_rows(src, kind, split)):
                    where = f"{files[0]} row {i}"
                    try:
                        pr = parse_row(r)
                    except RowError as e:
                        raise DataError.from_row(e, str(files[0]), i, "row") from None
                    pr.where, pr.split = where, split
                    out.append(pr)
                    stats.kept += 1
                if task is None:
                    break
            continue
        for source in open_sources([str(src)]):
            for raw in source.rows():
                try:
                    if raw.error is not None:
                        raise raw.error
                    pr = parse_row(raw.value)
                except RowError as e:
                    err = DataError.from_row(e, source.name, raw.index, source.unit)
                    if on_bad_row != "skip":
                        raise err from None
                    stats.drop(err)
                    continue
                pr.where, pr.split = f"{source.name} {source.unit} {raw.index}", source.split
                out.append(pr)
                stats.kept += 1
    return out


def prompt_text(prompt: Text) -> str:
    """The prompt as one string (the last user turn's content for messages): what verifiers get."""
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content", "") for m in prompt if m["role"] == "user"]
    return users[-1] if users else ""


def completion_text(completion: Text | None) -> str | None:
    if completion is None or isinstance(completion, str):
        return completion
    return "".join(m.get("content", "") or "" for m in completion)
