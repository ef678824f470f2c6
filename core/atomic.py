"""Files and directories that appear whole or not at all: write beside the target, then rename.

A reader (another rank, the flow, a resumed run) sees the previous version or the new one, never a
half-written file. Torch-free, so the flow side and the launcher use it as the ranks do.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable


def fsync_dir(path: str | Path) -> None:
    """Make the renames inside directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str | Path, text: str, *, mode: int | None = None, fsync: bool = True) -> Path:
    """Write `text` to a temporary file in `path`'s directory, fsync it (unless `fsync=False`, for
    files that must be whole but need not survive a power cut), and os.replace it onto `path`.

    `mode` gives the file exactly those permission bits (0o600 for files holding secrets), set
    before any byte is written; by default the file gets what open() gives (0o666 less the umask).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)  # exactly `mode`, whatever the umask
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_json_atomic(path: str | Path, obj: Any, *, mode: int | None = None, indent: int | None = 2,
                      sort_keys: bool = True, default: Callable[[Any], Any] | None = None,
                      fsync: bool = True) -> Path:
    """`obj` as JSON (plus a final newline) into `path`, atomically (see write_text_atomic).
    `indent=None` writes one compact line; `default` converts what JSON cannot hold (e.g. `str`).
    The text is built before the file is opened, so a value JSON refuses leaves nothing behind."""
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys, default=default) + "\n"
    return write_text_atomic(path, text, mode=mode, fsync=fsync)


def replace_dir(tmp: str | Path, path: str | Path) -> None:
    """Move the finished directory `tmp` to `path` (same filesystem). An existing `path` is renamed
    aside first and removed only once the new one is in place, so `path` is never half-written."""
    tmp, path = Path(tmp), Path(path)
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
