"""Rewards of a completion: the built-in verifiers and a user's own, by entry point.

A verifier is `fn(prompt: str, completion: str, row: dict) -> float`; `row` is the data row the
prompt came from, so a verifier can read any column (a reference answer, unit tests, a rubric).

    exact_match        1.0 when the completion equals row[reference_column], whitespace-normalized
    normalized_match   the same after lower-casing and dropping punctuation and articles (SQuAD-style)
    unit_tests         1.0 when the prompt + completion (cut at HumanEval's stop sequences), then
                       row['test'] and check(row['entry_point']) (HumanEval's layout), run clean in the sandbox
                       (core/sandbox.py: no network, no files of the host, time/memory/output caps)
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

BUILTIN = ("exact_match", "normalized_match")  # compare with row[reference_column]
EXECUTED = ("unit_tests",)  # run the completion against the row's tests
VERIFIERS = BUILTIN + EXECUTED
UNIT_TEST_FIELDS = ("prompt", "test", "entry_point")
# HumanEval's protocol (Chen et al. 2021): a completion ends at the first of these; what a model
# writes after the function (another def, a test, prints) is not part of the answer
STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")


def truncate_completion(text: str, stops: tuple[str, ...] = STOP_SEQUENCES) -> str:
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]

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


def unit_tests(allow_unsafe_exec: bool = False, timeout_s: float = 10.0) -> Verifier:
    """The `unit_tests` verifier: HumanEval's check program of the row and the completion, run in
    the sandbox; 1.0 when it exits cleanly. Where the sandbox cannot isolate (not root), loading
    it fails unless `allow_unsafe_exec`."""
    from posttrain.core.sandbox import Limits, SandboxUnavailable, isolation_problem, program_of, run_python

    if isolation_problem() is not None and not allow_unsafe_exec:
        raise VerifierError(f"unit_tests: cannot isolate generated code: {isolation_problem()}. Run as root, or "
                            "set allow_unsafe_exec: true to run it with resource limits only")
    limits = Limits(timeout_s=timeout_s, cpu_s=max(1, int(timeout_s)))

    def verify(prompt: str, completion: str, row: dict) -> float:
        missing = [f for f in UNIT_TEST_FIELDS[1:] if row.get(f) is None]
        if missing:
            raise VerifierError(f"unit_tests: the row has no {', '.join(map(repr, missing))} field "
                                f"(HumanEval's layout: {', '.join(UNIT_TEST_FIELDS)})")
        # the code the completion continues: the row's `prompt` column (a stage passes the row's
        # other columns as `row`, its prompt as `prompt`)
        row = {**row, "prompt": row["prompt"] if row.get("prompt") is not None else prompt}
        program = program_of(row, truncate_completion(completion))
        try:
            return float(run_python(program, limits, allow_unsafe_exec=allow_unsafe_exec).passed)
        except SandboxUnavailable as e:
            raise VerifierError(f"unit_tests: {e}") from None

    verify.__name__ = "unit_tests"
    return verify


def load_verifier(spec: str, reference_column: str = "answer", allow_unsafe_exec: bool = False) -> Verifier:
    """The verifier named by `spec`: a built-in name or 'module:function'. Built-ins read the
    reference from `row[reference_column]` (a row without it is a VerifierError naming the column);
    `unit_tests` runs code, in the sandbox unless `allow_unsafe_exec` where it cannot isolate."""
    if spec in EXECUTED:
        return unit_tests(allow_unsafe_exec)
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
        raise VerifierError(f"verifier {spec!r}: give one of {', '.join(VERIFIERS)} or 'module:function'")
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
