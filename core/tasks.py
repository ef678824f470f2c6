"""The embedded default data: a suite of small tasks with exact, checkable answers.

Each task turns a random instance into a prompt and its one correct answer, and offers a
plausible wrong answer for preference pairs. Rows carry the answer in their `answer` column,
which the built-in rewards (core.rewards: exact_match, DPO's default on-policy reward) compare
completions against, so every stage of the demo pipeline has a number that can rise.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from core.rewards import exact_match

LETTERS = "abcdefghij"


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


def _perturb_digits(s: str, rng: random.Random) -> str:
    i = rng.randrange(len(s))
    d = str((int(s[i]) + rng.choice([1, 9])) % 10)
    return s[:i] + d + s[i + 1:]


def _add(rng: random.Random) -> Example:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    ans = str(a + b)
    return Example("add", f"add {a} {b}", ans, _perturb_digits(ans, rng))


def _sort(rng: random.Random) -> Example:
    xs = [rng.randint(0, 9) for _ in range(rng.randint(3, 5))]
    ans = " ".join(map(str, sorted(xs)))
    wrong = " ".join(map(str, xs)) if xs != sorted(xs) else " ".join(map(str, sorted(xs, reverse=True)))
    if wrong == ans:  # all equal: change one element
        wrong = " ".join(map(str, [(xs[0] + 1) % 10] + sorted(xs)[1:]))
    return Example("sort", "sort " + " ".join(map(str, xs)), ans, wrong)


def _reverse(rng: random.Random) -> Example:
    w = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6)))
    ans = w[::-1]
    wrong = w if w != ans else w[1:] + w[0]
    if wrong == ans:
        wrong = ans[:-1]
    return Example("reverse", f"reverse {w}", ans, wrong)


def _max(rng: random.Random) -> Example:
    xs = rng.sample(range(10, 100), rng.randint(3, 5))
    ans = str(max(xs))
    wrong = str(sorted(xs)[-2])
    return Example("max", "max " + " ".join(map(str, xs)), ans, wrong)


TASKS: dict[str, Callable[[random.Random], Example]] = {
    "add": _add, "sort": _sort, "reverse": _reverse, "max": _max,
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
