"""`posttrain serve-model` started in a test as a user starts it (tests/stages/test_serving.py,
tests/registry/test_gguf.py)."""

from __future__ import annotations

import socket
import time

import httpx


def start_serve_model(argv: list[str], cwd, env: dict | None = None, timeout: float = 120):
    """`posttrain serve-model ARGV --port P` started as a user starts it, on a free loopback
    port: (the process, P) once /health answers; the process's output if it died first."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.flows.cli", "serve-model", *argv, "--port", str(port)], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    return proc, port
