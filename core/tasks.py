"""The embedded default data: a suite of small tasks with exact, checkable answers.

Each task turns a random instance into a prompt and its one correct answer, and offers a
plausible wrong answer for preference pairs. Rows carry the answer in their `answer` column,
which the built-in rewards (posttrain.core.rewards: exact_match, DPO's default on-policy reward) compare
completions against, so every stage of the demo pipeline has a number that can rise.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from posttrain.core.rewards import exact_match

LETTERS = "abcdefghij"
DIGITS = "0123456789"


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str
    answer: str
    wrong: str
    """A near-miss answer: the rejected side of a preference pair."""

    def sft_row(self) -> dict:
        return {"task": self.task, "answer": self.answer, "messages": [
            {"role": "user", "content": self.prompt}, {"role": "assistant", "content": self.answer}]}

    def preference_row(self) -> dict:
        return {"task": self.task, "answer": self.answer,
                "prompt": [{"role": "user", "content": self.prompt}],
                "chosen": [{"role": "assistant", "content": self.answer}],
                "rejected": [{"role": "assistant", "content": self.wrong}]}


def _spaced(items) -> str:
    """One symbol per word: the tokenizer gives each its own token (digits are split singly, and a
    space-led letter is one pre-token), so a tiny model can learn the task symbol by symbol."""
    return " ".join(map(str, items))


def _letters(rng: random.Random) -> list[str]:
    return [rng.choice(LETTERS) for _ in range(rng.randint(3, 6))]


def _change_one(xs: list, alphabet: str, rng: random.Random) -> list:
    """`xs` with one symbol replaced by its neighbour in `alphabet`: a near miss."""
    i = rng.randrange(len(xs))
    out = list(xs)
    out[i] = alphabet[(alphabet.index(str(xs[i])) + rng.choice([1, -1])) % len(alphabet)]
    return out


def _copy(rng: random.Random) -> Example:
    w = _letters(rng)
    return Example("copy", "copy " + _spaced(w), _spaced(w), _spaced(_change_one(w, LETTERS, rng)))


def _reverse(rng: random.Random) -> Example:
    w = _letters(rng)
    ans = w[::-1]
    wrong = w if w != ans else _change_one(ans, LETTERS, rng)  # a palindrome: a near miss instead
    return Example("reverse", "reverse " + _spaced(w), _spaced(ans), _spaced(wrong))


def _sort(rng: random.Random) -> Example:
    xs = [rng.randint(0, 9) for _ in range(rng.randint(3, 5))]
    ans = sorted(xs)
    wrong = xs if xs != ans else ans[::-1]
    if wrong == ans:  # all equal: change one element
        wrong = _change_one(ans, DIGITS, rng)
    return Example("sort", "sort " + _spaced(xs), _spaced(ans), _spaced(wrong))


def _max(rng: random.Random) -> Example:
    # The maximum is drawn first, uniformly, so that no one answer ("9") is right most of the time.
    top = rng.randint(1, 9)
    others = [rng.randint(0, top - 1) for _ in range(rng.randint(2, 5))]
    xs = others[:]
    xs.insert(rng.randrange(len(xs) + 1), top)
    return Example("max", "max " + _spaced(xs), str(top), str(max(others)))  # the runner-up: the usual slip


TASKS: dict[str, Callable[[random.Random], Example]] = {
    "copy": _copy, "reverse": _reverse, "sort": _sort, "max": _max,
}


def make_suite(n: int, seed: int = 0, tasks: tuple[str, ...] = tuple(TASKS)) -> list[Example]:
    """`n` examples cycling through `tasks`, reproducible from `seed`."""
    unknown = set(tasks) - TASKS.keys()
    if unknown:
        raise ValueError(f"unknown task(s) {sorted(unknown)}; available: {', '.join(TASKS)}")
    rng = random.Random(seed)
    return [TASKS[tasks[i % len(tasks)]](rng) for i in range(n)]


def verify(answer: str, completion: str) -> float:
    """1.0 when the completion is exactly the answer (whitespace-normalized), else 0.0."""
    return exact_match(answer, completion)
