"""Row formats as TRL defines them, detected from the columns, and the validation of every row.

    messages            {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}
    prompt_completion   {"prompt": str | messages, "completion": str | messages}
    preference          {"prompt": str | messages, "chosen": ..., "rejected": ...}
    implicit_preference {"chosen": full conversation or text, "rejected": ...}, sharing a prompt prefix
    unpaired_preference {"prompt": str | messages, "completion": ..., "label": bool}  (KTO; true = desirable)

The first two are SFT data, the next two preference data, the last unpaired preference data
(TRL's KTOTrainer format: one completion per row, labelled desirable or not). Validation returns a clean example
(None-valued keys dropped: Parquet and Arrow fill absent struct fields with nulls) or raises
RowError naming the field by its path, e.g. `messages[2].role`. Implicit-prompt rows are split into
prompt and completions here, so everything downstream sees explicit prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from posttrain.core.data.errors import RowError, describe, show

Message = dict[str, Any]
Text = Union[str, list[Message]]  # a plain string, or a list of chat messages

ROLES = ("system", "user", "assistant", "tool")
SFT_FORMATS = ("messages", "prompt_completion")
PREFERENCE_FORMATS = ("preference", "implicit_preference")
UNPAIRED_FORMATS = ("unpaired_preference",)
FORMATS = SFT_FORMATS + PREFERENCE_FORMATS + UNPAIRED_FORMATS

# Which roles may come right before each role (None = start of the conversation). Chat templates
# (Llama 2, Mistral, Gemma) raise on anything else, and a model learns nothing sensible from two
# assistant turns in a row. Tool results follow the assistant turn that called the tool.
_MAY_FOLLOW: dict[str, set[str | None]] = {
    "system": {None},
    "user": {None, "system", "assistant"},
    "assistant": {"user", "tool"},
    "tool": {"assistant", "tool"},
}


@dataclass(frozen=True)
class Conversation:
    messages: list[Message]


@dataclass(frozen=True)
class PromptCompletion:
    prompt: Text
    completion: Text


@dataclass(frozen=True)
class Preference:
    prompt: Text
    chosen: Text
    rejected: Text


@dataclass(frozen=True)
class Unpaired:
    """One completion of a prompt labelled desirable (True) or undesirable (False): KTO's data."""

    prompt: Text
    completion: Text
    label: bool


Example = Union[Conversation, PromptCompletion, Preference, Unpaired]


def is_unpaired(cols: list[str] | set[str]) -> bool:
    """Columns of TRL's unpaired preference format: prompt, completion and label, no chosen/rejected."""
    cols = set(cols)
    return {"prompt", "completion", "label"} <= cols and not {"chosen", "rejected"} & cols


def detect_format(columns: list[str] | set[str], want: str = "auto") -> str | None:
    """The format a row or table with these columns has, or None. `want` is "auto", a task ("sft",
    "preference") or a format name; a forced choice is returned even if columns lack its fields, so
    that validation reports the missing field by name. "preference" takes pairs, or unpaired rows
    when the columns are prompt, completion and label."""
    cols = set(columns)
    if want in ("auto", "preference") and is_unpaired(cols):
        return "unpaired_preference"  # preference data in TRL's unpaired form (KTO)
    if want in FORMATS:
        return want
    pref = "preference" if "prompt" in cols else "implicit_preference"
    sft = "messages" if "messages" in cols or "completion" not in cols else "prompt_completion"
    if want == "preference":
        return pref
    if want == "sft":
        return sft
    if want != "auto":
        raise ValueError(f"unknown data format {want!r}; expected auto, sft, preference or one of {FORMATS}")
    if {"chosen", "rejected"} <= cols:
        return pref
    if "messages" in cols:
        return "messages"
    if {"prompt", "completion"} <= cols:
        return "prompt_completion"
    return None


def task_of(fmt: str) -> str:
    """"sft", "preference" (pairs) or "unpaired" (KTO's labelled single completions)."""
    return "sft" if fmt in SFT_FORMATS else "unpaired" if fmt in UNPAIRED_FORMATS else "preference"


def validate_row(row: Any, fmt: str) -> Example:
    """The clean example for `row` in format `fmt`, or RowError."""
    if not isinstance(row, dict):
        raise RowError("not_an_object", None, f"expected a JSON object with the fields of format {fmt!r}, "
                                              f"got {describe(row)}")
    if fmt == "messages":
        messages = _messages(_field(row, "messages"), "messages")
        _ends_with_assistant(messages, "messages")
        return Conversation(messages)
    if fmt == "prompt_completion":
        prompt = _prompt(_field(row, "prompt"))
        return PromptCompletion(prompt, _completion(_field(row, "completion"), "completion", prompt))
    if fmt == "preference":
        prompt = _prompt(_field(row, "prompt"))
        chosen = _completion(_field(row, "chosen"), "chosen", prompt)
        rejected = _completion(_field(row, "rejected"), "rejected", prompt)
        if chosen == rejected:
            raise RowError("identical_pair", "rejected", "identical to chosen: the pair teaches nothing")
        return Preference(prompt, chosen, rejected)
    if fmt == "implicit_preference":
        return _split_implicit(_field(row, "chosen"), _field(row, "rejected"))
    if fmt == "unpaired_preference":
        prompt = _prompt(_field(row, "prompt"))
        completion = _completion(_field(row, "completion"), "completion", prompt)
        label = _field(row, "label")
        if not isinstance(label, bool):  # TRL selects desirable rows by a boolean mask: 1/"true" are not labels
            raise RowError("wrong_type", "label", f"expected a JSON boolean (true = desirable, false = undesirable), "
                                                  f"got {describe(label)}")
        return Unpaired(prompt, completion, label)
    raise ValueError(f"unknown data format {fmt!r}")


# ------------------------------------------------------------------------------------------ fields


def _field(row: dict, name: str) -> Any:
    value = row.get(name)
    if value is None:
        have = ", ".join(sorted(map(str, row))[:8]) or "none"
        raise RowError("missing_field", name, f"missing (the row has fields: {have})")
    return value


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise RowError("wrong_type", field, f"expected a string, got {describe(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON may carry "\ud800"; no tokenizer can encode it
        raise RowError("invalid_unicode", field, f"lone surrogate {show(value[e.start])} at character {e.start}")
    return value


def _messages(value: Any, field: str, prev: str | None = None, offset: int = 0) -> list[Message]:
    """Check a list of messages continuing a conversation whose last role was `prev`; fields are
    numbered from `offset` (a completion's messages continue its prompt's)."""
    if not isinstance(value, list):
        raise RowError("wrong_type", field, f"expected a list of messages, got {describe(value)}")
    if not value:
        raise RowError("empty_content", field, "expected at least one message, got an empty list")
    out = []
    for i, msg in enumerate(value, start=offset):
        where = f"{field}[{i}]"
        if not isinstance(msg, dict):
            raise RowError("wrong_type", where, f"expected a message object with role and content, got {describe(msg)}")
        msg = {k: v for k, v in msg.items() if v is not None}
        role = msg.get("role")
        if role is None:
            raise RowError("missing_field", f"{where}.role", "missing")
        if not isinstance(role, str):
            raise RowError("wrong_type", f"{where}.role", f"expected a string, got {describe(role)}")
        if role not in ROLES:
            raise RowError("unknown_role", f"{where}.role", f"expected one of {'/'.join(ROLES)}, got {show(role)}")
        if prev not in _MAY_FOLLOW[role]:
            after = "start a conversation" if prev is None else f"follow {prev!r}"
            allowed = "/".join(r if r else "start" for r in sorted(_MAY_FOLLOW[role], key=str))
            raise RowError("role_order", f"{where}.role", f"{role!r} cannot {after} (may follow: {allowed})")
        calls = role == "assistant" and bool(msg.get("tool_calls"))
        if "content" not in msg and not calls:
            raise RowError("missing_field", f"{where}.content", "missing")
        if "content" in msg:
            content = _text(msg["content"], f"{where}.content")
            if role == "assistant" and not calls and not content.strip():
                raise RowError("empty_content", f"{where}.content", "empty assistant reply")
        out.append(msg)
        prev = role
    return out


def _ends_with_assistant(messages: list[Message], field: str, offset: int = 0) -> None:
    last = messages[-1]["role"]
    if last != "assistant":
        where = f"{field}[{offset + len(messages) - 1}].role"
        raise RowError("role_order", where, f"must end with an assistant turn (the trained reply), got {last!r}")


def _prompt(value: Any) -> Text:
    if isinstance(value, str):
        return _text(value, "prompt")
    messages = _messages(value, "prompt")
    last = messages[-1]["role"]
    if last not in ("user", "tool"):
        where = f"prompt[{len(messages) - 1}].role"
        raise RowError("role_order", where, f"a prompt must end with a user or tool turn, got {last!r}")
    return messages


def _completion(value: Any, field: str, prompt: Text) -> Text:
    """A completion of `prompt`: a string (for a message prompt: the assistant's reply) or, after a
    message prompt, messages continuing it and ending with the assistant."""
    if isinstance(value, str) or isinstance(prompt, str):
        if not isinstance(value, str):
            raise RowError("wrong_type", field, f"expected a string (the prompt is a string), got {describe(value)}")
        if not _text(value, field).strip():
            raise RowError("empty_content", field, "empty completion")
        return value
    messages = _messages(value, field, prev=prompt[-1]["role"])
    _ends_with_assistant(messages, field)
    return messages


def _split_implicit(chosen: Any, rejected: Any) -> Preference:
    """TRL's implicit prompt: chosen and rejected are whole conversations (or texts) that agree up to
    where the replies begin; that shared part is the prompt."""
    if isinstance(chosen, str):
        _text(chosen, "chosen")
        if not isinstance(rejected, str):
            raise RowError("wrong_type", "rejected", f"expected a string like chosen, got {describe(rejected)}")
        _text(rejected, "rejected")
        k = common_prefix(chosen, rejected)
        if k == min(len(chosen), len(rejected)):
            raise RowError("identical_pair", "rejected", "chosen and rejected do not diverge (one is a prefix of "
                                                         "the other), so there is no completion to compare")
        if k > 0 and chosen[k - 1] == " ":  # as TRL: the completions keep their leading space
            k -= 1
        for name, text in (("chosen", chosen), ("rejected", rejected)):
            if not text[k:].strip():
                raise RowError("empty_content", name, "empty completion after the shared prompt")
        return Preference(chosen[:k], chosen[k:], rejected[k:])
    full = {name: _messages(value, name) for name, value in (("chosen", chosen), ("rejected", rejected))}
    for name, msgs in full.items():
        _ends_with_assistant(msgs, name)
    c, r = full["chosen"], full["rejected"]
    k = common_prefix(c, r)
    if k == 0:
        raise RowError("missing_field", "prompt", "no prompt field, and chosen and rejected share no first turn "
                                                  "to take as the prompt")
    if k == min(len(c), len(r)):
        raise RowError("identical_pair", "rejected", "chosen and rejected do not diverge, so there is no "
                                                     "completion to compare")
    if c[k - 1]["role"] not in ("user", "tool"):
        raise RowError("role_order", f"chosen[{k}].role", "chosen and rejected must diverge at the assistant "
                                                          "reply that follows a user or tool turn")
    return Preference(c[:k], c[k:], r[k:])


def common_prefix(a: Any, b: Any) -> int:
    """Length of the longest common prefix of two sequences (strings, message lists, token ids)."""
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k
