"""Per-row records -> metrics (torch-free; the records are gathered from every rank first, so the
numbers do not depend on how many ranks computed them).

    generation     exact_match, normalized_match, reward: mean over prompts x samples
                   pass@<k>: mean over prompts of the unbiased estimator 1 - C(n-c, k) / C(n, k),
                   c = samples whose score (the verifier's, else exact match) is >= 1
    completions    nll: summed negative log-likelihood of the completion tokens / their number
                   (token-weighted over all rows); perplexity = exp(nll)
    pairs          preference_accuracy: share of pairs whose chosen completion has the higher
                   summed log-probability given the prompt (a tie counts as wrong)
    win rates      per prompt, models[0]'s mean score over its samples against the other's (the
                   judge's mean per-token log-likelihood, else the verifier / exact match):
                   1 if higher, 0.5 if equal, 0 if lower; win_rate/<other> is the mean
    breakdowns     each of these again on the rows of one group: `<key>/<group_by>=<value>`
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from posttrain.core.rewards import pass_at_k

PASSES = 1.0 - 1e-9
"""A sample passes when its score reaches 1 (a verifier's 'all tests pass'); float slack."""


@dataclass
class GenRecord:
    """One prompt's samples from one model."""

    completions: list[str]
    scores: dict[str, list[float]] = field(default_factory=dict)  # exact_match / normalized_match / reward
    primary: list[float] | None = None  # the score pass@k and verifier win rates use
    judge: list[float] | None = None  # the judge's mean log-likelihood per sample


def mean(xs: Sequence[float]) -> float:
    return math.fsum(xs) / len(xs)


def generation_metrics(records: Sequence[GenRecord], families: Sequence[str], pass_k: Sequence[int]) -> dict:
    if not records:
        return {}
    out: dict[str, float] = {}
    for name in ("exact_match", "normalized_match", "reward"):
        if name in families:
            out[name] = mean([s for r in records for s in r.scores[name]])
    if "pass@k" in families:
        for k in pass_k:
            out[f"pass@{k}"] = mean([pass_at_k(len(r.primary), sum(s >= PASSES for s in r.primary), k)
                                     for r in records if r.primary is not None])
    return out


def nll_metrics(items: Sequence[tuple[float, int]]) -> dict:
    """items: (summed NLL of a completion's tokens, their number)."""
    tokens = sum(n for _, n in items)
    if not tokens:
        return {}
    nll = math.fsum(s for s, _ in items) / tokens
    return {"perplexity": math.exp(min(nll, 700.0)), "nll": nll}


def preference_metrics(items: Sequence[tuple[float, float]]) -> dict:
    """items: (summed log-prob of chosen, of rejected)."""
    return {"preference_accuracy": mean([float(c > r) for c, r in items])} if items else {}


def outcome(mine: float, theirs: float) -> float:
    return 1.0 if mine > theirs else 0.5 if mine == theirs else 0.0


def per_prompt_value(r: GenRecord, by_judge: bool) -> float:
    """The value a model's prompt is compared by: its samples' mean judge score, else mean score."""
    values = r.judge if by_judge else r.primary
    assert values is not None
    return sum(values) / len(values)  # plain sum: -inf judge scores stay -inf


def win_rate(first: Sequence[GenRecord], other: Sequence[GenRecord], by_judge: bool) -> float:
    return mean([outcome(per_prompt_value(a, by_judge), per_prompt_value(b, by_judge))
                 for a, b in zip(first, other)])


def with_groups(fn: Callable[[list], dict], items: Sequence[Any], groups: Sequence[str | None],
                group_by: str | None) -> dict:
    """fn over all items, then over each group's items with keys `<key>/<group_by>=<value>`."""
    items = list(items)
    out = dict(fn(items))
    for g in sorted({g for g in groups if g is not None}):
        sub = fn([it for it, gg in zip(items, groups) if gg == g])
        out.update({f"{k}/{group_by}={g}": v for k, v in sub.items()})
    return out


def with_win_rates(results: dict[str, dict], gen: dict[str, list[GenRecord]], groups: list[str | None],
                   group_by: str | None, by_judge: bool) -> None:
    """Add win_rate/<other> to models[0]'s metrics (the first of `gen`) and win_rate/<models[0]>
    = 1 - that to each other model's."""
    names = list(gen)
    first = names[0]
    for other in names[1:]:
        key = f"win_rate/{other}"

        def rate(pairs: list[tuple[GenRecord, GenRecord]], key: str = key) -> dict:
            return {key: win_rate([a for a, _ in pairs], [b for _, b in pairs], by_judge)} if pairs else {}

        rates = with_groups(rate, list(zip(gen[first], gen[other])), groups, group_by)
        for k, v in rates.items():
            results[first][k] = v
            results[other][f"win_rate/{first}" + k[len(key):]] = 1.0 - v


def select_model(results: dict[str, dict], names: list[str], paths: list[str], metric: str, mode: str) -> dict:
    """The best model by `metric` (first on ties); models without the metric are not candidates."""
    candidates = [(results[n][metric], i) for i, n in enumerate(names) if metric in results[n]
                  and not math.isnan(results[n][metric])]
    if not candidates:
        raise ValueError(f"select.metric={metric!r}: no evaluated model has this metric")
    best = max(candidates, key=lambda c: (c[0] if mode == "max" else -c[0], -c[1]))
    i = best[1]
    return {"model": paths[i], "name": names[i], "metric": metric, "mode": mode, "value": best[0]}


def flat_metrics(results: dict[str, dict], names: list[str]) -> dict[str, float]:
    """The manifest's `metrics`: models[0]'s metrics unprefixed (what a pipeline gates and caches
    on), then `models/<name>/<key>` for every other model."""
    out = dict(results[names[0]])
    for n in names[1:]:
        out.update({f"models/{n}/{k}": v for k, v in results[n].items()})
    return out
