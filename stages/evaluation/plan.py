"""What an evaluation reads and computes, decided before any model loads.

Rows come from posttrain.core.data.rows.prompt_rows: `split` of data prep's output (its SFT rows and its
preference rows), or every row of a user's JSONL / Parquet / datasets files. They fall into:

    prompts      rows generated from: every row that is not a preference pair (the pairs' prompts
                 when the data holds pairs only)
    completions  those of them that carry a completion (perplexity, nll)
    pairs        preference pairs (preference_accuracy)

`max_examples` caps each list. `plan_metrics` picks the metrics (`metrics: None` = every one the data
and settings allow) and raises a StageError naming the file, row and field when a metric asked for
cannot be computed from the data; a reference column present on some prompt rows but not others is
such an error too (a half-labelled file is a data bug, not something to average around).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.core.data.errors import DataError, DropStats
from posttrain.core.data.prepared import is_prepared
from posttrain.core.data.rows import PromptRow, prompt_rows
from posttrain.core.manifest import read_manifest
from posttrain.stages.common import StageError
from posttrain.stages.config import EVAL_METRICS, EvalConfig

GENERATION = ("exact_match", "normalized_match", "reward", "pass@k", "win_rate")
"""Metric families that need the models' generations."""


@dataclass
class EvalData:
    prompts: list[PromptRow]
    completions: list[PromptRow]
    pairs: list[PromptRow]
    sources: str  # the sources, for messages
    dropped: DropStats


@dataclass
class Plan:
    metrics: list[str]  # EVAL_METRICS families, in that order
    scorer: str | None  # what scores a sample for pass@k / win rates: "verifier", "exact_match" or None
    group_by: str | None

    @property
    def generates(self) -> bool:
        return any(m in GENERATION for m in self.metrics)

    def has(self, family: str) -> bool:
        return family in self.metrics


def fail(message: str) -> StageError:
    return StageError(f"evaluate: {message}")


def load_eval_data(cfg: EvalConfig) -> EvalData:
    sources = cfg.data.sources
    if not sources:
        raise fail("data.sources is empty: give data prep's output directory or your JSONL/Parquet/datasets files")
    stats = DropStats()
    plain: list[PromptRow] = []
    pairs: list[PromptRow] = []
    for src in sources:
        try:
            rows = _source_rows(src, cfg, stats)
        except DataError as e:
            raise fail(str(e)) from None
        for r in rows:
            (pairs if r.is_pair else plain).append(r)
    names = ", ".join(map(str, sources))
    if not plain and not pairs:
        raise fail(f"no rows in {names}" + (f" (split {cfg.split!r} of data prep's output)"
                                            if any(is_prepared(s) for s in sources) else ""))
    n = cfg.max_examples
    prompts = plain or pairs
    completions = [r for r in plain if r.completion is not None]
    return EvalData(prompts[:n], completions[:n], pairs[:n], names, stats)


def _source_rows(src: str, cfg: EvalConfig, stats: DropStats) -> list[PromptRow]:
    if not is_prepared(src):
        return prompt_rows([src], cfg.split, cfg.data.on_bad_row, stats)
    outputs = read_manifest(src)["outputs"]
    kinds = [k for k in ("sft", "preference") if any(o.startswith(f"{k}_") for o in outputs)]
    if not kinds:
        raise fail(f"{src}: a stage directory without evaluation data (outputs: {', '.join(sorted(outputs))}); "
                   "give data prep's output or your own files")
    rows: list[PromptRow] = []
    for kind in kinds:
        rows.extend(prompt_rows([src], cfg.split, task=kind))
    return rows


def _fields(row: PromptRow) -> str:
    return ", ".join(sorted(map(str, row.fields))[:8]) or "none besides the prompt"


def plan_metrics(cfg: EvalConfig, data: EvalData) -> Plan:
    """The metrics to compute; a StageError for one asked for that the data cannot give."""
    col = cfg.reference_column
    labelled = [r for r in data.prompts if r.fields.get(col) is not None]
    unlabelled = [r for r in data.prompts if r.fields.get(col) is None]
    if labelled and unlabelled:
        first = unlabelled[0]
        raise fail(f"{first.where}: no {col!r} field (reference_column), while {len(labelled)} other row(s) have "
                   f"one; every row needs it to check generations against (this row has: {_fields(first)})")
    no_ref = None if labelled else (
        f"the rows of {data.sources} have no {col!r} field (reference_column) to check generations against "
        f"({data.prompts[0].where} has: {_fields(data.prompts[0])})")
    scorer = "verifier" if cfg.verifier else ("exact_match" if labelled else None)
    why_not: dict[str, str | None] = {
        "exact_match": no_ref,
        "normalized_match": no_ref,
        "reward": None if cfg.verifier else "it is the mean score of `verifier`, which is not set",
        "pass@k": None if scorer else f"a sample passes by the verifier's score or exact match: {no_ref}",
        "perplexity": None if data.completions else (
            f"no row of {data.sources} carries a completion to score (prompt/completion rows, or messages "
            "ending with an assistant turn)"),
        "preference_accuracy": None if data.pairs else (
            f"no preference pairs in {data.sources} (rows with chosen and rejected, or data prep's preference "
            f"split {cfg.split!r})"),
        "win_rate": ("it compares models[0] with the others; only one model is evaluated" if len(cfg.models) < 2
                     else None if cfg.judge or scorer else f"without a judge or verifier it needs a reference: {no_ref}"),
    }
    if cfg.metrics is None:
        chosen = [m for m in EVAL_METRICS if why_not[m] is None]
        if cfg.num_samples == 1 and cfg.pass_k == [1]:
            chosen = [m for m in chosen if m != "pass@k"]  # pass@1 of one sample = the mean score
        if not chosen:
            raise fail(f"nothing to evaluate in {data.sources}: " + "; ".join(f"{m}: {w}" for m, w in why_not.items()))
    else:
        chosen = [m for m in EVAL_METRICS if m in cfg.metrics]
        for m in chosen:
            if why_not[m] is not None:
                raise fail(f"metric {m}: {why_not[m]}")
    plan = Plan(chosen, scorer, cfg.group_by)
    if cfg.select is not None:
        keys = expected_keys(plan, data, cfg)
        if cfg.select.metric not in keys:
            shown = ", ".join(sorted(keys)[:20])
            raise fail(f"select.metric={cfg.select.metric!r}: this evaluation computes no such metric "
                       f"(it computes: {shown}{', ...' if len(keys) > 20 else ''})")
    return plan


def group_of(row: PromptRow, group_by: str | None) -> str | None:
    if group_by is None:
        return None
    v = row.fields.get(group_by)
    return None if v is None else str(v)


def expected_keys(plan: Plan, data: EvalData, cfg: EvalConfig) -> set[str]:
    """The metric keys every model's results will have (win rates aside)."""
    families: list[tuple[list[str], list[PromptRow]]] = [
        ([m for m in ("exact_match", "normalized_match", "reward") if plan.has(m)]
         + ([f"pass@{k}" for k in cfg.pass_k] if plan.has("pass@k") else []), data.prompts),
        (["perplexity", "nll"] if plan.has("perplexity") else [], data.completions),
        (["preference_accuracy"] if plan.has("preference_accuracy") else [], data.pairs),
    ]
    keys: set[str] = set()
    for names, rows in families:
        groups = {g for r in rows if (g := group_of(r, plan.group_by)) is not None}
        for name in names:
            keys.add(name)
            keys.update(f"{name}/{plan.group_by}={g}" for g in groups)
    return keys


def model_names(paths: list[str]) -> list[str]:
    """Each model's name: the last part of its path (`Path(path).name`), made unique with -2, -3..."""
    names: list[str] = []
    for p in paths:
        base = Path(p).name or str(p).strip("/").replace("/", "_") or "model"
        name, k = base, 2
        while name in names:
            name, k = f"{base}-{k}", k + 1
        names.append(name)
    return names


def reference_of(row: PromptRow, column: str) -> Any:
    return row.fields.get(column)
