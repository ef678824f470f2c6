"""Tokenize validated examples with the chat template, build loss labels, apply the truncation policy.

Labels are the input ids with IGNORE_INDEX (-100) everywhere except assistant / completion tokens
(the tokenizer's masks: each assistant reply and its end-of-turn token). They are *unshifted*: the
loss shifts them (posttrain.core.losses, shift=True), so the label at position t is the target of the logits
at t - 1.

Truncation, when prompt + completion exceed max_seq_len:
  right  cut the end; the row must keep at least one trained token.
  left   cut the start of the prompt (after BOS), keeping the final completion whole; a completion
         longer than max_seq_len on its own cannot be kept.
  drop   drop the row (counted as too_long, never an error).
A row no policy can fix is a bad row (`too_long`): DataError, or counted when on_bad_row="skip".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from posttrain.core.data.errors import DataError, RowError
from posttrain.core.data.formats import Conversation, Example, Preference, Unpaired, common_prefix
from posttrain.core.losses import IGNORE_INDEX


TRUNCATIONS = ("right", "left", "drop")


class Tokenizer(Protocol):
    """What the data path needs of a tokenizer (posttrain.registry.tokenizer.Tokenizer is one): core does
    not import the registry."""

    bos_id: int | None
    pad_id: int | None
    chat_template: str | None
    origin: str

    def encode_chat_with_mask(self, messages: list[dict], **kwargs: Any) -> tuple[list[int], list[bool]]: ...

    def encode_prompt_completion(self, prompt: Any, completion: Any, **kwargs: Any
                                 ) -> tuple[list[int], list[bool]]: ...


@dataclass
class Document:
    """One tokenized sequence: ids and labels of equal length."""

    input_ids: list[int]
    labels: list[int]
    adapter: int | None = None  # several adapters trained at once: the one it trains (posttrain.core.data.routing)

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class PreferencePair:
    """A tokenized preference row: the shared prompt, then each completion with its labels (-100 on
    template tokens the model does not generate, such as the newline after the end-of-turn token)."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    chosen_labels: list[int]
    rejected_ids: list[int]
    rejected_labels: list[int]
    adapter: int | None = None  # several adapters trained at once: the one it trains (posttrain.core.data.routing)

    def _doc(self, ids: list[int], labels: list[int]) -> Document:
        return Document(self.prompt_ids + ids, [IGNORE_INDEX] * len(self.prompt_ids) + labels, self.adapter)

    @property
    def chosen(self) -> Document:
        return self._doc(self.chosen_ids, self.chosen_labels)

    @property
    def rejected(self) -> Document:
        return self._doc(self.rejected_ids, self.rejected_labels)

    def __len__(self) -> int:
        """Tokens of both sequences: what the pair costs in a batch."""
        return 2 * len(self.prompt_ids) + len(self.chosen_ids) + len(self.rejected_ids)

    @property
    def longest(self) -> int:
        """Tokens of the longer sequence (prompt + the longer completion): what max_seq_len bounds."""
        return len(self.prompt_ids) + max(len(self.chosen_ids), len(self.rejected_ids))


@dataclass
class UnpairedExample:
    """A tokenized unpaired preference row (KTO): the prompt, one completion with its labels, and
    whether the completion is desirable."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_labels: list[int]
    label: bool
    adapter: int | None = None

    @property
    def document(self) -> Document:
        return Document(self.prompt_ids + self.completion_ids,
                        [IGNORE_INDEX] * len(self.prompt_ids) + self.completion_labels, self.adapter)

    def with_completion_of(self, other: UnpairedExample) -> Document:
        """This prompt with `other`'s completion: a mismatched pair (x, y') of KTO's reference point."""
        return Document(self.prompt_ids + other.completion_ids,
                        [IGNORE_INDEX] * len(self.prompt_ids) + other.completion_labels, self.adapter)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def num_tokens(item: Document | PreferencePair | UnpairedExample) -> int:
    """An example's length as max_seq_len, min_tokens and token statistics count it: a document's
    tokens, or a pair's longer sequence."""
    return item.longest if isinstance(item, PreferencePair) else len(item)


def _has_target(labels: list[int]) -> bool:
    # labels[0] is never a target: no logits come before the first token.
    return any(x != IGNORE_INDEX for x in labels[1:])


class Encoder:
    """Example -> Document (SFT) or PreferencePair, or RowError."""

    def __init__(self, tokenizer: Tokenizer, max_seq_len: int, truncation: str = "right", mask_prompt: bool = True,
                 chat_template: str | None = None):
        if truncation not in TRUNCATIONS:
            raise ValueError(f"unknown truncation {truncation!r}; expected one of {TRUNCATIONS}")
        self.tok, self.max_len, self.truncation, self.mask_prompt = tokenizer, max_seq_len, truncation, mask_prompt
        self.template_kwargs: dict[str, Any] = {} if chat_template is None else {"chat_template": chat_template}
        self.bos_id = tokenizer.bos_id

    def __call__(self, example: Example) -> Document | PreferencePair | UnpairedExample:
        if isinstance(example, Preference):
            return self._preference(example)
        if isinstance(example, Unpaired):
            return self._unpaired(example)
        if isinstance(example, Conversation):
            field = "messages"
            ids, mask = self._encode(field, example.messages)
        else:  # PromptCompletion
            field = "completion"
            ids, mask = self._encode(field, example.prompt, example.completion)
        if not any(mask):
            raise RowError("no_target_tokens", field, "the chat template renders no assistant tokens")
        labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask)] if self.mask_prompt else list(ids)
        if len(ids) > self.max_len:
            ids, labels = self._truncate(field, ids, labels, last_run_start(mask))
        if not _has_target(labels):  # e.g. a one-token reply at position 0: nothing predicts it
            raise RowError("no_target_tokens", field, "no token is trained on (none follows another token)")
        return Document(ids, labels)

    # ---------------------------------------------------------------------------------------- encode

    def _encode(self, field: str, prompt: Any, completion: Any = None) -> tuple[list[int], list[bool]]:
        needs_template = not isinstance(prompt, str)
        if needs_template and self.tok.chat_template is None and not self.template_kwargs:
            # A setup problem, not a row problem: stop at once instead of skipping every row.
            raise DataError(f"the tokenizer ({self.tok.origin}) has no chat template and data.chat_template is not "
                            "set, but the data holds chat messages")
        try:
            if completion is None:
                return self.tok.encode_chat_with_mask(prompt, **self.template_kwargs)
            return self.tok.encode_prompt_completion(prompt, completion, **self.template_kwargs)
        except Exception as e:  # templates are user code (raise_exception, type errors): this row's problem
            raise RowError("template_error", field, f"tokenizing failed: {type(e).__name__}: {e}") from e

    def _preference(self, ex: Preference) -> PreferencePair:
        ids_c, mask_c = self._encode("chosen", ex.prompt, ex.chosen)
        ids_r, mask_r = self._encode("rejected", ex.prompt, ex.rejected)
        for name, mask in (("chosen", mask_c), ("rejected", mask_r)):
            if not any(mask):
                raise RowError("no_target_tokens", name, "the chat template renders no completion tokens")
        # The prompt is what both sequences share before either completion starts; taking it from
        # the ids (not by encoding the prompt alone) is exact even when BPE merges across the boundary.
        p = min(common_prefix(ids_c, ids_r), mask_c.index(True), mask_r.index(True))
        prompt = ids_c[:p]
        comp = {
            "chosen": (ids_c[p:], [t if m else IGNORE_INDEX for t, m in zip(ids_c[p:], mask_c[p:])]),
            "rejected": (ids_r[p:], [t if m else IGNORE_INDEX for t, m in zip(ids_r[p:], mask_r[p:])]),
        }
        longest = max(len(ids) for ids, _ in comp.values())
        if p + longest > self.max_len:
            over = f"prompt + longest completion = {p + longest} tokens > max_seq_len={self.max_len}"
            if self.truncation == "drop":
                raise RowError("too_long", "chosen", f"{over} (truncation='drop')", always_skip=True)
            if self.truncation == "left":
                head = 1 if self.bos_id is not None and prompt[:1] == [self.bos_id] else 0
                cut = p + longest - self.max_len
                if cut > p - head:
                    raise RowError("too_long", "chosen", f"{over}, and truncation='left' keeps completions whole: "
                                                         f"the longest has {longest} tokens")
                prompt = prompt[:head] + prompt[head + cut :]
            else:
                room = self.max_len - p
                comp = {k: (ids[:room], labels[:room]) for k, (ids, labels) in comp.items()}
                for name, (_, labels) in comp.items():
                    if not _has_target([IGNORE_INDEX] * p + labels):
                        raise RowError("too_long", name, f"{over}, and truncation='right' leaves no {name} tokens")
        pair = PreferencePair(prompt, *comp["chosen"], *comp["rejected"])
        for name, doc in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            if not _has_target(doc.labels):
                raise RowError("no_target_tokens", name, "no completion token is trained on")
        return pair

    def _unpaired(self, ex: Unpaired) -> UnpairedExample:
        ids, mask = self._encode("completion", ex.prompt, ex.completion)
        if not any(mask):
            raise RowError("no_target_tokens", "completion", "the chat template renders no completion tokens")
        p = mask.index(True)  # the prompt: everything before the completion's first trained token
        labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
        item = fit_unpaired(UnpairedExample(ids[:p], ids[p:], labels[p:], ex.label), self.max_len, self.truncation,
                            self.bos_id)
        if not _has_target(item.document.labels):
            raise RowError("no_target_tokens", "completion", "no completion token is trained on")
        return item

    def _truncate(self, field: str, ids: list[int], labels: list[int], completion_start: int):
        return truncate(ids, labels, self.max_len, self.truncation, self.bos_id, completion_start, field)


def truncate(ids: list[int], labels: list[int], max_len: int, policy: str, bos_id: int | None,
             completion_start: int, field: str = "completion") -> tuple[list[int], list[int]]:
    """Apply a truncation policy (module docstring) to a sequence longer than `max_len`; RowError
    when the policy drops it or cannot keep a trained token. `completion_start`: where the final
    completion begins (kept whole by 'left')."""
    over = f"{len(ids)} tokens > max_seq_len={max_len}"
    if policy == "drop":
        raise RowError("too_long", field, f"{over} (truncation='drop')", always_skip=True)
    if policy == "right":
        ids, labels = ids[:max_len], labels[:max_len]
        if not _has_target(labels):
            raise RowError("too_long", field, f"{over}, and truncation='right' leaves no trained tokens")
        return ids, labels
    # left: drop tokens after BOS (the model always saw BOS first), never from the final completion
    head = 1 if bos_id is not None and ids[:1] == [bos_id] else 0
    cut = len(ids) - max_len
    if head + cut > completion_start:
        raise RowError("too_long", field, f"{over}, and truncation='left' keeps the final completion whole: "
                                          f"it has {len(ids) - completion_start} tokens")
    return ids[:head] + ids[head + cut :], labels[:head] + labels[head + cut :]


def fit_unpaired(ex: UnpairedExample, max_len: int, policy: str, bos_id: int | None) -> UnpairedExample:
    """An unpaired example within `max_len` tokens by the truncation policy (right: cut the
    completion's end; left: the prompt after BOS, the completion kept whole; drop: skipped), as for
    a pair; RowError when no policy keeps a trained token. Examples that fit are returned as is."""
    if len(ex) <= max_len:
        return ex
    over = f"prompt + completion = {len(ex)} tokens > max_seq_len={max_len}"
    if policy == "drop":
        raise RowError("too_long", "completion", f"{over} (truncation='drop')", always_skip=True)
    if policy == "left":
        head = 1 if bos_id is not None and ex.prompt_ids[:1] == [bos_id] else 0
        cut = len(ex) - max_len
        if cut > len(ex.prompt_ids) - head:
            raise RowError("too_long", "completion", f"{over}, and truncation='left' keeps the completion whole: "
                                                     f"it has {len(ex.completion_ids)} tokens")
        return UnpairedExample(ex.prompt_ids[:head] + ex.prompt_ids[head + cut:], ex.completion_ids,
                               ex.completion_labels, ex.label, ex.adapter)
    room = max_len - len(ex.prompt_ids)
    out = UnpairedExample(ex.prompt_ids, ex.completion_ids[:room], ex.completion_labels[:room], ex.label, ex.adapter)
    if not _has_target(out.document.labels):
        raise RowError("too_long", "completion", f"{over}, and truncation='right' leaves no completion tokens")
    return out


def last_run_start(mask: list[bool]) -> int:
    """Start of the last run of True: the final assistant reply / completion."""
    k = len(mask) - 1
    while k >= 0 and not mask[k]:
        k -= 1
    while k > 0 and mask[k - 1]:
        k -= 1
    return k
