"""Rewards of a completion: the built-in verifiers and a user's own, by entry point.

A verifier is `fn(prompt: str, completion: str, row: dict) -> float`; `row` is the data row the
prompt came from, so a verifier can read any column (a reference answer, unit tests, a rubric).

    exact_match        1.0 when the completion equals row[reference_column], whitespace-normalized
    normalized_match   the same after lower-casing and dropping punctuation and articles (SQuAD-style)
    module:function    any importable function with the signature above

    reward = load_verifier("my_pkg.rewards:has_citation", reference_column="answer")
    reward("2+2?", "4", {"answer": "4"})  # -> float
"""

from __future__ import annotations

import importlib
import math
import re
import string
from typing import Any, Callable

Verifier = Callable[[str, str, dict], float]

BUILTIN = ("exact_match", "normalized_match")

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def whitespace_normalized(text: str) -> str:
    return " ".join(str(text).strip().split())


def normalized(text: str) -> str:
    """Lower-cased, punctuation and English articles dropped, whitespace collapsed."""
    return whitespace_normalized(_ARTICLES.sub(" ", str(text).lower().translate(_PUNCT)))


def exact_match(reference: Any, completion: str) -> float:
    return float(whitespace_normalized(completion) == whitespace_normalized(reference))


def normalized_match(reference: Any, completion: str) -> float:
    return float(normalized(completion) == normalized(reference))


class VerifierError(ValueError):
    """A verifier that cannot be loaded, or that returned something that is not a number."""


def load_verifier(spec: str, reference_column: str = "answer") -> Verifier:
    """The verifier named by `spec`: a built-in name or 'module:function'. Built-ins read the
    reference from `row[reference_column]` (a row without it is a VerifierError naming the column)."""
    if spec in BUILTIN:
        compare = exact_match if spec == "exact_match" else normalized_match

        def builtin(prompt: str, completion: str, row: dict) -> float:
            if row.get(reference_column) is None:
                raise VerifierError(f"{spec}: the row has no {reference_column!r} field (reference_column)")
            return compare(row[reference_column], completion)

        builtin.__name__ = spec
        return builtin
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise VerifierError(f"verifier {spec!r}: give one of {', '.join(BUILTIN)} or 'module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise VerifierError(f"verifier {spec!r}: cannot import {module!r}: {e}") from None
    except AttributeError:
        raise VerifierError(f"verifier {spec!r}: module {module!r} has no {name!r}") from None
    if not callable(fn):
        raise VerifierError(f"verifier {spec!r} is not callable")

    def checked(prompt: str, completion: str, row: dict) -> float:
        v = fn(prompt, completion, row)
        try:
            v = float(v)
        except (TypeError, ValueError):
            raise VerifierError(f"verifier {spec!r} returned {v!r}, not a number") from None
        if math.isnan(v):
            raise VerifierError(f"verifier {spec!r} returned NaN")
        return v

    checked.__name__ = name
    return checked


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, have {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
