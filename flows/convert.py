"""`posttrain config --convert OLD.yaml`: an old fixed-chain config (`stages:`, `sft_teacher:`, ...,
stages wired by `init_from` / `teacher_from` / `compare_to`) rewritten as a DAG under `nodes:`.

Each enabled stage becomes a node of the same name; a stage whose `data.sources` was empty reads
the data_prep node; a reference to a disabled stage passes on to that stage's own start model, as
the old chain did. The defaults of the old format are applied where the old file left them out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

KIND = {"data_prep": "data_prep", "sft_teacher": "sft", "sft_student": "sft", "distill": "distill", "dpo": "dpo",
        "evaluate": "evaluate"}
OLD_DEFAULT_FROM = {"distill": "sft_student", "dpo": "distill", "evaluate": "dpo"}
OLD_DEFAULT_TEACHER = "sft_teacher"
OLD_DEFAULT_COMPARE = ["sft_student", "distill"]


def _check_old(old: dict[str, Any]) -> None:
    """ValueError naming the key where the old document is not of the old format's shape (what
    the conversion reads: sections, `stages` flags, the references between stages)."""
    for key in ("stages", *KIND):
        if not isinstance(old.get(key) or {}, dict):
            raise ValueError(f"{key}: expected a mapping, got {type(old[key]).__name__}")
    for stage, on in (old.get("stages") or {}).items():
        if stage not in KIND or not isinstance(on, bool):
            raise ValueError(f"stages.{stage}: expected one of {', '.join(KIND)} set to true or false")
    for stage in KIND:
        sec = old.get(stage) or {}
        for ref in ("init_from", "teacher_from"):
            if sec.get(ref) is not None and sec[ref] not in KIND:
                raise ValueError(f"{stage}.{ref}: {sec[ref]!r} is not a stage ({', '.join(KIND)})")
        compare = sec.get("compare_to", []) if stage == "evaluate" else []
        if not isinstance(compare, list) or not all(isinstance(c, str) for c in compare):
            raise ValueError(f"evaluate.compare_to: expected a list of stage names or paths, got {compare!r}")
        for key in ("model", "teacher", "data"):  # sections the conversion adds references to
            if not isinstance(sec.get(key) or {}, dict):
                raise ValueError(f"{stage}.{key}: expected a mapping, got {type(sec[key]).__name__}")


def convert(old: dict[str, Any]) -> dict[str, Any]:
    _check_old(old)
    enabled = {s: bool((old.get("stages") or {}).get(s, True)) for s in KIND}
    sections = {s: dict(old.get(s) or {}) for s in KIND}

    def start_of(stage: str) -> str | None:
        return sections[stage].get("init_from", OLD_DEFAULT_FROM.get(stage))

    def live(ref: str | None) -> str | None:
        seen = []
        while ref is not None and not enabled.get(ref, True):
            if ref in seen:  # disabled stages starting from each other (the old format refused it)
                raise ValueError(f"{ref}.init_from: the disabled stages {' -> '.join(seen + [ref])} start from "
                                 "each other; no stage runs first")
            seen.append(ref)
            ref = start_of(ref)
        return ref

    nodes: dict[str, Any] = {}
    for stage, kind in KIND.items():
        if not enabled[stage]:
            continue
        sec = sections[stage]
        node: dict[str, Any] = {"kind": kind}
        init = live(sec.pop("init_from", OLD_DEFAULT_FROM.get(stage)))
        teacher = live(sec.pop("teacher_from", OLD_DEFAULT_TEACHER)) if kind == "distill" else None
        compare = sec.pop("compare_to", OLD_DEFAULT_COMPARE) if kind == "evaluate" else []
        if kind == "evaluate":
            model = sec.pop("model", {}) or {}
            for k in ("dtype", "tokenizer", "kernels"):
                if k in model:
                    sec[k] = model[k]
            first = init or model.get("name_or_path", "debug")
            sec["models"] = [first] + [live(c) or c for c in compare if live(c) is not None or c not in KIND]
        elif kind != "data_prep":
            if init is not None:
                sec["model"] = {**(sec.get("model") or {}), "name_or_path": init}
            if teacher is not None:
                sec["teacher"] = {**(sec.get("teacher") or {}), "name_or_path": teacher}
        if kind != "data_prep":
            data = dict(sec.get("data") or {})
            if not data.get("sources") and enabled["data_prep"]:
                data["sources"] = ["data_prep"]
            sec["data"] = data
        if kind == "distill" and "kind" in sec:  # the divergence was called `kind`
            sec["divergence"] = sec.pop("kind")
        node.update(sec)
        nodes[stage] = node
    out = {k: v for k, v in old.items() if k not in KIND and k != "stages"}
    out["nodes"] = nodes
    return out


def convert_file(path: str | Path) -> str:
    from posttrain.core.config import ConfigError, _read

    old = _read(Path(path))
    if "nodes" in old:
        raise ConfigError(f"{path}: already in the DAG format (it has `nodes:`)")
    try:
        return yaml.safe_dump(convert(old), sort_keys=False)
    except ValueError as e:
        raise ConfigError(f"{e} in {path}") from None
