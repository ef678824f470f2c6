"""A node's output directory belongs to one run at a time: an advisory lock (fcntl.flock on
`<run dir>/.locks/<node>.lock`, released by the kernel when the holder dies, even by SIGKILL)
taken before the directory is checked, cleared or written. A second pipeline reaching the same
node waits up to `lock_wait_s`, then fails naming the holder; it never touches the directory."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path


class WorkspaceBusy(RuntimeError):
    """Another run holds the node's output directory."""


@contextlib.contextmanager
def node_lock(run_dir: Path, node: str, wait_s: float = 0.0, owner: str = "") -> Iterator[None]:
    locks = Path(run_dir) / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    path = locks / f"{node}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    try:
                        holder = json.loads(Path(path).read_text() or "{}")
                    except (OSError, ValueError):
                        holder = {}
                    who = ", ".join(f"{k} {v}" for k, v in holder.items()) or "unknown"
                    raise WorkspaceBusy(
                        f"node {node!r}: its output directory {Path(run_dir) / node} is in use by another "
                        f"pipeline run ({who}); wait for it, or set lock_wait_s to queue behind it") from None
                time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "run": owner,
                                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing drops the lock
