"""Configs as MLflow params: flattened to dotted keys, stringified within MLflow's limits, and every
secret masked (keys that name one, passwords in URIs, secret query parameters)."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping

MAX_PARAM_LEN, MAX_TAG_LEN, MAX_KEY_LEN = 6000, 8000, 250  # mlflow.utils.validation's limits
MASK = "***"
_SECRET_KEY = re.compile(r"(^|[_\-.])(password|passwd|pwd|secret|token|api_?key|access_?key|private_?key"
                         r"|credentials?|auth|authorization)($|[_\-.])", re.IGNORECASE)
_URI_PASSWORD = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^/\s:@]+:)([^@/\s]+)(@)")
_QUERY_SECRET = re.compile(r"([?&](?:password|token|secret|api_?key|access_?key|sig|signature)=)([^&\s]+)",
                           re.IGNORECASE)
_BAD_KEY_CHARS = re.compile(r"[^\w\-. /:]")


# ------------------------------------------------------------------------------ params

def is_secret_key(key: str) -> bool:
    return any(_SECRET_KEY.search(part) for part in str(key).split("."))


def mask_secrets(text: str) -> str:
    """Passwords inside URIs (scheme://user:pass@host) and secret query parameters -> ***."""
    return _QUERY_SECRET.sub(rf"\1{MASK}", _URI_PASSWORD.sub(rf"\1{MASK}\3", text))


def plain(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):  # pydantic
        return obj.model_dump(mode="json")
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return obj


def _scrub(obj: Any) -> Any:
    """Secret-named entries masked anywhere inside lists and dicts (a list of env dicts...)."""
    obj = plain(obj)
    if isinstance(obj, Mapping):
        return {k: MASK if is_secret_key(k) else _scrub(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_scrub(v) for v in obj]
    return obj


def truncate(text: str, limit: int) -> str:
    marker = "...[truncated]"
    return text if len(text) <= limit else text[: limit - len(marker)] + marker


def check_artifact_path(path: str | None, what: str = "artifact path") -> str | None:
    """A user-given artifact path must stay inside the run's artifact root: relative, without
    `..`, backslashes or NUL (MLflow joins it onto the root, local or S3)."""
    if not path:
        return path
    text = str(path)
    if ("\x00" in text or "\\" in text or text.startswith("/") or re.match(r"^[A-Za-z]:", text)
            or ".." in text.split("/")):
        raise ValueError(f"{what} {text!r} must be a relative path inside the run's artifacts (no '..', "
                         "no absolute path, no backslash)")
    return text


def clean_key(key: str) -> str:
    return _BAD_KEY_CHARS.sub("_", str(key))[:MAX_KEY_LEN]


def flatten_params(obj: Any, prefix: str = "") -> dict[str, str]:
    """A nested config (dicts, pydantic models, dataclasses) as MLflow params: dotted keys,
    values stringified (lists as JSON) and truncated to MLflow's limit, secrets masked."""
    obj = plain(obj)
    if isinstance(obj, Mapping) and (obj or not prefix):
        out: dict[str, str] = {}
        for k, v in obj.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            out.update({key: MASK} if is_secret_key(str(k)) else flatten_params(v, key))
        return out
    if isinstance(obj, (list, tuple, Mapping)):
        text = json.dumps(_scrub(obj), default=str)
    else:
        text = str(obj)
    return {clean_key(prefix): truncate(mask_secrets(text), MAX_PARAM_LEN)}
