"""Verifiers the evaluation tests name by entry point ('tests.support.eval_verifiers:reward'), importable by
the stage in-process and under torchrun."""

from __future__ import annotations


def reward(prompt: str, completion: str, row: dict) -> float:
    """0, 0.5 or 1 by the completion's length in characters (mod 3); a row with bonus=1 always 1."""
    assert isinstance(prompt, str) and isinstance(completion, str) and isinstance(row, dict)
    return 1.0 if row.get("bonus") else (len(completion) % 3) / 2


def broken(prompt: str, completion: str, row: dict) -> float:
    return "not a number"  # type: ignore[return-value]
