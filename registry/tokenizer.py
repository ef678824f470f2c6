"""Hugging Face tokenizers at runtime without transformers: tokenizer.json + its config files.

Reads what `transformers.PreTrainedTokenizerFast.save_pretrained` writes (tokenizer.json,
tokenizer_config.json, chat_template.jinja — the file transformers 5 writes a single template to —
chat_templates/*.jinja, plus the legacy chat_template.json / special_tokens_map.json and the model's
generation_config.json) and reproduces transformers' token ids: plain encoding goes through the
`tokenizers` library, chat templates are rendered in the same sandboxed jinja2 environment.

SFT loss masks come from rendering prefixes of the conversation, so they work for any template,
with or without transformers' `{% generation %}` markers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend
from tokenizers import processors

from posttrain.core.atomic import write_text_atomic

Message = dict[str, Any]

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the names templates see as variables (`bos_token`, ...).
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers stores "no limit" as int(1e30); anything that large means the config sets none.
_NO_MAX_LENGTH = int(1e29)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A chat template is missing, does not compile, or raised while rendering."""


# ---------------------------------------------------------------- jinja environment (transformers')


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text in some templates (TRL, SmolLM3).
    transformers tracks it for masks; we only render its body, since masks come from prefixes."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson sorts keys and HTML-escapes `<>&'`, changing the prompt; transformers' doesn't.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    # Templates come from model repos, i.e. untrusted code: the immutable sandbox forbids mutation
    # of inputs and access to Python internals.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def _normalize_message(message: Message) -> Message:
    """As transformers does: drop None fields (templates print them as "None") and alias reasoning."""
    if not isinstance(message, dict):
        raise TypeError(f"chat messages must be dicts with 'role' and 'content', got {message!r}")
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


# ---------------------------------------------------------------- files


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e


def _token_content(value: Any) -> str | None:
    """Special tokens are saved as strings or as AddedToken dicts ({"content": ..., "lstrip": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _load_chat_templates(path: Path, config: dict) -> tuple[dict[str, str], str]:
    """Named templates and where they came from. Standalone files win over tokenizer_config.json,
    as in transformers 5 (its save_pretrained writes chat_template.jinja and leaves the config without)."""
    jinja_file, json_file = path / "chat_template.jinja", path / "chat_template.json"
    if jinja_file.is_file():
        raw, origin = jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    elif json_file.is_file():  # processors' format: {"chat_template": "..."}
        raw, origin = _read_json(json_file).get("chat_template"), str(json_file)
    else:
        raw, origin = config.get("chat_template"), str(path / "tokenizer_config.json")
    if isinstance(raw, str):
        templates = {"default": raw}
    elif isinstance(raw, list):  # legacy multi-template format: [{"name": ..., "template": ...}]
        templates = {t["name"]: t["template"] for t in raw}
    else:
        templates = {}
    for extra in sorted((path / "chat_templates").glob("*.jinja")):
        templates[extra.stem] = extra.read_text(encoding="utf-8")
    return templates, origin


# ---------------------------------------------------------------- tokenizer


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens and chat templates of a HF model directory."""

    def __init__(
        self,
        backend: _Backend,
        config: dict | None = None,
        *,
        chat_templates: dict[str, str] | None = None,
        extra_eos_ids: Iterable[int] = (),
        origin: str = "<memory>",
    ):
        self.backend = backend
        self.config = dict(config or {})
        self.chat_templates = dict(chat_templates or {})
        self.origin = origin  # named in error messages
        self.special_tokens = {
            name: tok for name in _NAMED_TOKENS if (tok := _token_content(self.config.get(name))) is not None
        }
        # Like transformers, a named special token missing from tokenizer.json is added to it.
        vocab = backend.get_vocab(with_added_tokens=True)
        missing = [t for t in dict.fromkeys(self.special_tokens.values()) if t not in vocab]
        if missing:
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        # tokenizer.json's post-processor decides BOS/EOS (transformers 5 ignores add_bos_token when it
        # exists); older exports have none and relied on add_bos_token/add_eos_token: build it from them.
        if backend.post_processor is None and any(self.config.get(f"add_{t}_token") for t in ("bos", "eos")):
            backend.post_processor = self._bos_eos_processor()
        self._special_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self.eos_ids = {i for i in (self.eos_id, *extra_eos_ids) if i is not None}

    def _bos_eos_processor(self) -> processors.TemplateProcessing:
        """What transformers 4's update_post_processor built from add_bos_token/add_eos_token."""
        bos = self.special_tokens.get("bos_token") if self.config.get("add_bos_token") else None
        eos = self.special_tokens.get("eos_token") if self.config.get("add_eos_token") else None

        def seq(name: str, type_id: int) -> str:  # e.g. "<s>:0 $A:0"
            return " ".join(f"{t}:{type_id}" for t in (bos, f"${name}", eos) if t)

        return processors.TemplateProcessing(
            single=seq("A", 0),
            pair=f"{seq('A', 0)} {seq('B', 1)}",
            special_tokens=[(t, self.backend.token_to_id(t)) for t in (bos, eos) if t],
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            what = "does not exist" if not path.exists() else "has no tokenizer.json"
            raise FileNotFoundError(f"tokenizer directory {path} {what} (expected {path / 'tokenizer.json'})")
        backend = _Backend.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        # Legacy special_tokens_map.json fills in tokens tokenizer_config.json does not name.
        for name, value in _read_json(path / "special_tokens_map.json").items():
            if name in _NAMED_TOKENS and config.get(name) is None:
                config[name] = value
        templates, template_origin = _load_chat_templates(path, config)
        # Chat models often stop on several ids (Llama 3: <|end_of_text|>, <|eom_id|>, <|eot_id|>).
        gen_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        gen_eos = [] if gen_eos is None else [gen_eos] if isinstance(gen_eos, int) else list(gen_eos)
        return cls(backend, config, chat_templates=templates, extra_eos_ids=gen_eos, origin=template_origin)

    # ------------------------------------------------------------ vocabulary

    @property
    def vocab_size(self) -> int:
        """Number of ids including added tokens (`len(hf_tokenizer)`): the embedding rows needed."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self.token_to_id(self.special_tokens.get("bos_token"))

    @property
    def eos_id(self) -> int | None:
        return self.token_to_id(self.special_tokens.get("eos_token"))

    @property
    def pad_id(self) -> int | None:
        """Many chat models define no pad token; padding is masked out anyway, so EOS serves."""
        pad = self.token_to_id(self.special_tokens.get("pad_token"))
        return self.eos_id if pad is None else pad

    @property
    def model_max_length(self) -> int | None:
        n = self.config.get("model_max_length")
        return int(n) if isinstance(n, (int, float)) and n < _NO_MAX_LENGTH else None

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")

    # ------------------------------------------------------------ text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        # No clean_up_tokenization_spaces: transformers 5 skips it for BPE models too (it corrupts text).
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------ chat templates

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        tools: list[dict] | None = None,
        *,
        chat_template: str | None = None,
        documents: list[dict] | None = None,
        **kwargs: Any,
    ) -> list[int] | str:
        """Render like transformers; token ids never get BOS/EOS added again (the template has them)."""
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        text = self._render(messages, add_generation_prompt, tools, documents, chat_template, kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def encode_chat_with_mask(
        self, messages: Sequence[Message], **template_kwargs: Any
    ) -> tuple[list[int], list[bool]]:
        """Ids of the conversation (as apply_chat_template) and a mask, True on assistant turns.

        The mask covers each assistant message's rendered content and its end-of-turn token (what
        the model must generate), not the role header nor the template's whitespace after it."""
        return self._chat_with_mask(list(messages), 0, template_kwargs)

    def encode_prompt_completion(
        self, prompt: str | Sequence[Message], completion: str | Sequence[Message], **template_kwargs: Any
    ) -> tuple[list[int], list[bool]]:
        """Prompt/completion pairs; the mask is True on the completion only.

        A string prompt is plain text: BOS as the tokenizer adds it, then EOS appended (and trained) so
        the model learns to stop. A message-list prompt goes through the chat template, the completion
        being an assistant message (a string) or a list of messages.
        """
        if isinstance(prompt, str):
            if not isinstance(completion, str):
                raise TypeError("a string prompt needs a string completion")
            text = prompt + completion
            ids, mask = self._encode_with_spans(text, [(prompt, text)], add_special_tokens=True)
            if self.eos_id is not None:
                if ids and ids[-1] == self.eos_id:
                    mask[-1] = True
                else:
                    ids, mask = ids + [self.eos_id], mask + [True]
            return ids, mask
        if isinstance(completion, str):
            completion = [{"role": "assistant", "content": completion}]
        return self._chat_with_mask([*prompt, *completion], len(prompt), template_kwargs)

    def _select_template(self, chat_template: str | None, tools: list | None) -> tuple[str, str]:
        """(template, where it came from) — as transformers picks: a name, or the text itself."""
        if chat_template is not None:
            if chat_template in self.chat_templates:
                return self.chat_templates[chat_template], f"{self.origin} [{chat_template}]"
            return chat_template, "the chat_template argument"
        if not self.chat_templates:
            raise ChatTemplateError(
                f"no chat template set: {self.origin} has none (add chat_template.jinja or a "
                "'chat_template' entry in tokenizer_config.json, or pass chat_template=...)"
            )
        name = "tool_use" if tools and "tool_use" in self.chat_templates else "default"
        if name not in self.chat_templates:
            raise ChatTemplateError(
                f"{self.origin} has chat templates {sorted(self.chat_templates)} but no 'default'; "
                "pass chat_template=<name>"
            )
        return self.chat_templates[name], self.origin

    def _render(self, messages, add_generation_prompt, tools, documents, chat_template, kwargs) -> str:
        template, origin = self._select_template(chat_template, tools)
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise TypeError("tools must be JSON-schema dicts (callables are not converted here)")
        try:
            compiled = _compile(template)
        except jinja2.TemplateSyntaxError as e:
            msg = f"chat template from {origin}: syntax error, line {e.lineno}: {e.message}"
            raise ChatTemplateError(msg) from e
        try:
            return compiled.render(
                messages=[_normalize_message(m) for m in messages],
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **kwargs},  # caller's kwargs win, as in transformers
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template from {origin} raised: {e}") from e

    # ------------------------------------------------------------ loss masks

    def _chat_with_mask(self, messages: list[Message], first: int, kwargs: dict):
        """Assistant message i (i >= first) spans from the end of render(messages[:i], generation
        prompt) to the end of render(messages[:i+1]); the template itself says where turns are."""
        tools, documents, template = (kwargs.pop(k, None) for k in ("tools", "documents", "chat_template"))

        def render(msgs: list[Message], gen: bool) -> str:
            return self._render(msgs, gen, tools, documents, template, kwargs)

        text = render(messages, False)
        spans = [
            (render(messages[:i], True), render(messages[: i + 1], False))
            for i in range(first, len(messages))
            if messages[i].get("role") == "assistant"
        ]
        return self._encode_with_spans(text, spans, add_special_tokens=False)

    def _encode_with_spans(
        self, text: str, spans: list[tuple[str, str]], add_special_tokens: bool
    ) -> tuple[list[int], list[bool]]:
        """Encode `text`; mark the tokens of each span given as (text before it, text through its end)."""
        enc = self.backend.encode(text, add_special_tokens=add_special_tokens)
        ids, seq = enc.ids, enc.sequence_ids
        lead = next((k for k, s in enumerate(seq) if s is not None), len(ids))  # BOS etc. added in front
        body = ids[lead:]
        mask = [False] * len(ids)
        for before, through in spans:
            if not text.startswith(through):
                raise ChatTemplateError(
                    "the chat template renders a turn differently once later turns follow (e.g. it drops "
                    "earlier reasoning), so assistant tokens cannot be located by prefixes; split the "
                    "conversation or use a template that renders history unchanged"
                )
            # The span starts where the generation prompt and the finished turn diverge (some templates
            # put text in the generation prompt that the finished turn renders differently).
            start = len(os.path.commonprefix([before, through]))
            head, whole = self.encode(through[:start], False), self.encode(through, False)
            if whole[: len(head)] == head and body[: len(whole)] == whole:
                marked = list(range(lead + len(head), lead + len(whole)))
            else:
                # A token straddles a boundary (e.g. "Assistant: " + "Hi" -> " Hi"): take every token
                # overlapping the span in character offsets, as transformers does for {% generation %}.
                end = len(through)
                marked = [
                    k for k, (s, e) in enumerate(enc.offsets) if seq[k] is not None and s < end and e > start
                ]
            for k in self._drop_after_end_of_turn(ids, marked):
                mask[k] = True
        return ids, mask

    def _drop_after_end_of_turn(self, ids: list[int], marked: list[int]) -> list[int]:
        """Templates often add a newline after the end-of-turn token ("<|im_end|>\\n"); the model never
        generates it (it stops at the end-of-turn token), so it is not trained on."""
        specials = [k for k in marked if ids[k] in self._special_ids]
        if specials:
            tail = [ids[k] for k in marked if k > specials[-1]]
            if tail and not self.decode(tail).strip():
                return [k for k in marked if k <= specials[-1]]
        return marked

    # ------------------------------------------------------------ saving

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json and tokenizer_config.json (chat template inside) for AutoTokenizer."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path / "tokenizer.json", self.backend.to_str(pretty=True))
        config = {k: v for k, v in self.config.items() if k != "chat_template"}
        config.update(self.special_tokens)
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        if set(self.chat_templates) == {"default"}:
            config["chat_template"] = self.chat_templates["default"]
        elif self.chat_templates:
            config["chat_template"] = [{"name": n, "template": t} for n, t in self.chat_templates.items()]
        write_text_atomic(path / "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        # A standalone template file there would shadow the config's; keep it in step instead.
        if (path / "chat_template.jinja").is_file() and self.chat_template is not None:
            write_text_atomic(path / "chat_template.jinja", self.chat_template)
