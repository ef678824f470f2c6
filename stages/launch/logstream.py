"""A launch's output, line by line, into its log file and the caller's `on_output`.

The sink writes each line to the log at once (complete even if the caller stalls) and queues it
for `drain`, which hands it to on_output in the caller's thread, where Prefect's run logger works.
Lines come from a pipe (a torchrun started here) or from a file another host writes (Slurm).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO


class LogSink:
    def __init__(self, path: Path, on_output: Callable[[str], None] | None, header: str):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8", buffering=1)
        self._file.write(header + "\n")
        self._lock = threading.Lock()
        self._on_output = on_output
        self._queue: queue.SimpleQueue[str] = queue.SimpleQueue()

    def put(self, line: str) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")
        if self._on_output is not None:
            self._queue.put(line)

    def drain(self) -> None:
        while self._on_output is not None:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                return
            self._on_output(line)

    def close(self) -> None:
        with self._lock:
            self._file.close()


def pump(stream: IO[bytes], sink: LogSink, prefix: str = "") -> threading.Thread:
    """A daemon thread putting each line of `stream` into `sink` (prefixed) until EOF, then closing it."""

    def read() -> None:
        for raw in iter(stream.readline, b""):
            sink.put(prefix + raw.decode("utf-8", "replace").rstrip("\r\n"))
        stream.close()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


class FileTail:
    """Follows a file that may not exist yet, putting each complete new line into the sink."""

    def __init__(self, path: Path, sink: LogSink):
        self.path, self._sink = path, sink
        self._offset, self._partial = 0, b""

    def read(self, final: bool = False) -> None:
        """Put the lines added since the last read; `final`: also an unterminated last line."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:  # not created yet (a job still pending)
            return
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        if final and self._partial:
            lines, self._partial = lines + [self._partial], b""
        for line in lines:
            self._sink.put(line.decode("utf-8", "replace").rstrip("\r"))
