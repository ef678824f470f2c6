"""A checkpoint directory on disk: its names, the inventory of a checkpoint dir, and DCP's
`.metadata` read through an allowlist so that loading a checkpoint cannot run code."""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

FORMAT = 1
MANIFEST, COMMON, LATEST = "manifest.json", "common.json", "latest"
STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_PREFIX = ".tmp-step-"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, or no usable one could be loaded; the message says why."""


@dataclass
class LoadReport:
    """What load_latest/load did: the step used and every checkpoint skipped, with the reason."""

    step: int | None = None
    path: str | None = None
    skipped: list[tuple[int, str]] = field(default_factory=list)


# DCP raises CheckpointException, a BaseException, carrying one wrapped exception per failing rank.
ERRORS = (Exception, CheckpointException)


def why(e: BaseException) -> str:
    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {r}: {why(exc)}" for r, (exc, _) in e.failures.items())
    return f"{type(e).__name__}: {e}"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def final_steps(dir: Path) -> list[int]:
    """Steps with a directory under its final name (complete or not: see verify)."""
    if not dir.is_dir():
        return []
    return sorted(int(m.group(1)) for p in dir.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())


def read_latest(dir: Path) -> int | None:
    """The step `latest` names, None when it is missing or unreadable."""
    try:
        m = STEP_DIR.match((dir / LATEST).read_text().strip())
    except OSError:
        return None
    return int(m.group(1)) if m else None


_TORCH_CONSTANTS = (torch.dtype, torch.memory_format, torch.layout)


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle; accept only the classes a DCP metadata file is made of."""

    _OTHER = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
              ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
              ("pathlib", "PureWindowsPath"), ("pathlib", "Path"), ("builtins", "set"), ("builtins", "frozenset")}

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint."):
            obj = super().find_class(module, name)
            if isinstance(obj, type):  # a dataclass or an enum, never a function
                return obj
        elif module == "torch" and isinstance(obj := getattr(torch, name, None), _TORCH_CONSTANTS):
            return obj
        elif (module, name) in self._OTHER:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in checkpoint metadata")


def read_metadata(path: Path) -> Metadata:
    with open(path / ".metadata", "rb") as f:
        md = _MetadataUnpickler(f).load()
    if not isinstance(md, Metadata):
        raise pickle.UnpicklingError(f".metadata holds a {type(md).__name__}, not DCP Metadata")
    return md


class SafeReader(FileSystemReader):
    """DCP's file reader, with `.metadata` read by read_metadata."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_metadata(Path(self.path))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md
