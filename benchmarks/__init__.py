"""Benchmark scripts: each prints one JSON document (see benchmarks/kernels.py)."""

import json
from pathlib import Path


def emit(doc: dict, out: str | None) -> int:
    """Print a benchmark's JSON document, and write it to `out` when given; the exit status."""
    text = json.dumps(doc, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return 0
