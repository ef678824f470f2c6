"""The OpenAI API subset: request bodies checked into engine requests, errors in OpenAI's shape.

Every check raises `APIError` (an HTTP status and OpenAI's `{"error": {message, type, param,
code}}`), never anything else, so no body reaches the engine unchecked. Fields we do not
implement are refused when set to anything but their neutral value; unknown fields are ignored
(as OpenAI-compatible servers commonly do).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from posttrain.core.generation import RequestParams

MAX_N = 16
MAX_STOPS = 8
MAX_TOP_LOGPROBS = 20
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_TOKENS = 256  # chat: the rest of the context, capped here
UNSUPPORTED = {"presence_penalty": 0, "frequency_penalty": 0, "best_of": 1, "echo": False, "suffix": None,
               "logit_bias": None, "tools": None, "functions": None, "response_format": None}


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class Limits:
    vocab_size: int
    context: int
    max_n: int = MAX_N


@dataclass
class Parsed:
    """A checked request: the prompt's token ids, the engine's params, and how to answer."""

    model: str
    prompt: list[int]
    params: RequestParams
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    """completions: top-k alternatives asked for (0: the chosen token's only); chat: top_logprobs.
    None: no log-probs in the answer."""
    stops: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON ({e})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


def _number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(f"{key} must be a number", key)
    if v < lo or (lo_open and v == lo) or v > hi:
        raise bad(f"{key} = {v} is out of range ({'(' if lo_open else '['}{lo}, {hi}])", key)
    return float(v)


def _int(body: dict, key: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"{key} must be an integer", key)
    if v < lo or (hi is not None and v > hi):
        raise bad(f"{key} = {v} is out of range ([{lo}, {hi if hi is not None else 'inf'}])", key)
    return v


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{key} must be a boolean", key)
    return v


def _stops(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise bad(f"stop must be a non-empty string or a list of at most {MAX_STOPS} non-empty strings", "stop")
    return tuple(stops)


def model_name(body: dict) -> str:
    m = body.get("model")
    if not isinstance(m, str) or not m:
        raise bad("model is required (a string: the base model's id or an adapter's name)", "model")
    return m


def _common(body: dict, prompt: list[int], limits: Limits, default_tokens: int) -> tuple[RequestParams, dict]:
    for key, neutral in UNSUPPORTED.items():
        if key in body and body[key] not in (neutral, None) and not (neutral == 0 and body[key] == 0.0):
            raise bad(f"{key} is not supported by this server", key, code="unsupported_parameter")
    if len(prompt) >= limits.context:
        raise bad(f"the prompt has {len(prompt)} tokens; this model's context is {limits.context} tokens",
                  "prompt", code="context_length_exceeded")
    room = limits.context - len(prompt)
    max_tokens = _int(body, "max_tokens", None, 1)
    if "max_completion_tokens" in body and body.get("max_completion_tokens") is not None:
        max_tokens = _int(body, "max_completion_tokens", None, 1)
    if max_tokens is None:
        max_tokens = min(default_tokens, room)
    elif max_tokens > room:
        raise bad(f"max_tokens = {max_tokens} with a {len(prompt)}-token prompt exceeds the model's context "
                  f"({limits.context} tokens)", "max_tokens", code="context_length_exceeded")
    n = _int(body, "n", 1, 1, limits.max_n)
    seed = _int(body, "seed", None, -(2 ** 63), 2 ** 63 - 1)
    if seed is not None and seed < 0:
        seed %= 2 ** 63  # torch generators take non-negative seeds
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not stream):
        raise bad("stream_options must be an object, and only with stream: true", "stream_options")
    params = RequestParams(max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                           top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True), n=n, seed=seed,
                           stop=_stops(body), logprobs=False)
    return params, {"stream": stream, "include_usage": bool(opts and _bool(opts, "include_usage", False))}


def parse_completion(body: dict, limits: Limits, encode) -> Parsed:
    model = model_name(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad_ids = [t for t in prompt if not 0 <= t < limits.vocab_size]
        if bad_ids:
            raise bad(f"token id {bad_ids[0]} is outside the vocabulary (0..{limits.vocab_size - 1})", "prompt",
                      code="invalid_token")
        ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("batched prompts (a list of several prompts) are not supported; send one request each", "prompt")
    else:
        raise bad("prompt must be a string or a non-empty list of token ids", "prompt")
    if not ids:
        raise bad("the prompt encodes to no tokens", "prompt")
    params, flags = _common(body, ids, limits, DEFAULT_COMPLETION_TOKENS)
    lp = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    if lp is not None:
        params.logprobs, params.top_logprobs = True, lp
    return Parsed(model, ids, params, logprobs=lp, stops=params.stop, **flags)


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        return "".join(p["text"] for p in content)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def parse_chat(body: dict, limits: Limits, render) -> Parsed:
    """render(messages) -> token ids (the tokenizer's chat template with the generation prompt)."""
    model = model_name(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"messages[{i}] must be an object with a role of system, user, assistant or tool",
                      f"messages[{i}].role")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": _content(m, i)})
    try:
        ids = render(clean)
    except Exception as e:  # noqa: BLE001 - a template that refuses the conversation (raise_exception, sandbox)
        raise bad(f"the chat template refused the messages: {e}", "messages") from None
    params, flags = _common(body, ids, limits, DEFAULT_CHAT_TOKENS)
    want = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not want:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    if want:
        params.logprobs, params.top_logprobs = True, top or 0
    return Parsed(model, ids, params, logprobs=(top or 0) if want else None, stops=params.stop, **flags)
