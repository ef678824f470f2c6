"""Stage manifests: what a stage produced, with content hashes, written last and atomically.

A stage's output directory is complete exactly when its `manifest.json` exists; the next stage
reads only the manifest. Hashes make outputs content-addressed, so the pipeline's cache can key a
stage on the hashes of its inputs. No torch import here: the flow side uses this module too.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from posttrain.core.atomic import write_json_atomic

MANIFEST = "manifest.json"
CHECKPOINTS = "checkpoints"  # a training stage's resume checkpoints, inside its output directory


class ManifestError(ValueError):
    """A missing or unusable stage manifest; the message names the file."""


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_files(root: str | Path, rel_paths: list[str]) -> dict[str, str]:
    """{relative path: sha256} for files, and for every file under listed directories."""
    root = Path(root)
    out = {}
    for rel in rel_paths:
        p = root / rel
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        for f in files:
            out[str(f.relative_to(root))] = file_sha256(f)
    return dict(sorted(out.items()))


def digest(obj: Any) -> str:
    """A stable sha256 of a JSON-able object (configs, hash tables)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def write_manifest(
    out_dir: str | Path,
    stage: str,
    outputs: dict[str, str],
    *,
    metrics: dict[str, float] | None = None,
    inputs: dict[str, str] | None = None,
    config: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Hash `outputs` (name -> path relative to out_dir) and write manifest.json last.

    `inputs` maps names to the content digests of what the stage read (upstream manifests'
    digests), so a manifest records its lineage."""
    out_dir = Path(out_dir)
    missing = [rel for rel in outputs.values() if not (out_dir / rel).exists()]
    if missing:
        raise ManifestError(f"{out_dir}: outputs listed but not written: {missing}")
    files = hash_files(out_dir, list(outputs.values()))
    manifest = {
        "stage": stage,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "outputs": outputs,
        "files": files,
        "digest": digest(files),
        "inputs": inputs or {},
        "config_digest": digest(config) if config is not None else None,
        "metrics": metrics or {},
        **(extra or {}),
    }
    write_json_atomic(out_dir / MANIFEST, manifest, default=str)
    return manifest


def read_manifest(stage_dir: str | Path) -> dict[str, Any]:
    path = Path(stage_dir) / MANIFEST
    if not path.exists():
        raise ManifestError(f"{path}: missing — the stage at {stage_dir} has not completed")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: invalid JSON ({e})") from None


def output_path(stage_dir: str | Path, name: str) -> Path | None:
    """Absolute path of output `name` of the stage at `stage_dir` (None if it has none)."""
    rel = read_manifest(stage_dir)["outputs"].get(name)
    return Path(stage_dir) / rel if rel is not None else None


def is_stage_dir(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).exists()


def verify_manifest(stage_dir: str | Path) -> list[str]:
    """Files whose content no longer matches the manifest (empty list: intact)."""
    m = read_manifest(stage_dir)
    bad = []
    for rel, h in m["files"].items():
        p = Path(stage_dir) / rel
        if not p.exists() or file_sha256(p) != h:
            bad.append(rel)
    return bad


def clear_partial(stage_dir: str | Path, keep: Iterable[str] = (CHECKPOINTS,)) -> list[str]:
    """Before a stage reruns in the directory a failed or killed attempt left (no manifest): remove
    all but `keep` (its checkpoints, which the rerun resumes from), so that the outputs the rerun
    hashes hold only what it writes, never a half-written file or a temporary one of the attempt
    before. Returns the names removed."""
    stage_dir, keep = Path(stage_dir), set(keep)
    if (stage_dir / MANIFEST).exists():
        raise ManifestError(f"{stage_dir}: complete (has {MANIFEST}); not clearing it")
    removed = []
    for p in sorted(stage_dir.iterdir()) if stage_dir.is_dir() else []:
        if p.name in keep:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
        removed.append(p.name)
    return removed
