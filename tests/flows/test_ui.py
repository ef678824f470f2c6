"""`posttrain ui` stops the servers it started however it is stopped: Ctrl-C, SIGTERM (kill, a
service manager) or SIGHUP (the terminal closed)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_sigterm_stops_both_real_servers(tmp_path):
    prefect, mlflow = _free_port(), _free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.flows.cli", "ui", "--prefect-port", str(prefect),
                             "--mlflow-port", str(mlflow)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        lines.append(line)
        if "stops both" in line:
            break
    assert "stops both" in lines[-1], "".join(lines)[-3000:]
    servers = psutil.Process(proc.pid).children(recursive=True)
    assert servers and _answers(prefect) and _answers(mlflow)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    _, alive = psutil.wait_procs(servers, timeout=30)
    assert alive == [], [p.cmdline()[:3] for p in alive]
    assert not _answers(prefect) and not _answers(mlflow)
    assert (tmp_path / "mlflow.db").exists()  # the default store: here, beside where it was started


def test_sighup_takes_the_same_way_out_as_ctrl_c(monkeypatch):
    import posttrain.flows.ui as ui

    stopped = []

    class Proc:
        pid = os.getpid()

        def poll(self):
            return None  # running until stopped

    monkeypatch.setattr(ui, "start_servers", lambda *a, procs, **k: procs.extend([("prefect", Proc(), ""),
                                                                                  ("mlflow", Proc(), "")]))
    monkeypatch.setattr(ui, "stop_servers", lambda procs: stopped.append([name for name, _, _ in procs]))
    before = signal.getsignal(signal.SIGHUP)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGHUP)).start()
    assert ui.run_ui(prefect_port=1, mlflow_port=2) == 0
    assert stopped == [["prefect", "mlflow"]]
    assert signal.getsignal(signal.SIGHUP) is before  # handlers put back


def test_a_signal_while_the_urls_are_printed_still_stops_both(monkeypatch):
    """The race CI hit: SIGTERM sent the moment the last line is read lands before `print` returns;
    the servers were already running, so they must be stopped, not orphaned."""
    import builtins

    import posttrain.flows.ui as ui

    stopped = []

    class Proc:
        pid = os.getpid()

        def poll(self):
            return None

    def print_then_signal(*args, **kwargs):
        builtins.print(*args, **kwargs)
        if "stops both" in str(args[0]):
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs as this call returns

    monkeypatch.setattr(ui, "start_servers", lambda *a, procs, **k: procs.extend([("prefect", Proc(), ""),
                                                                                  ("mlflow", Proc(), "")]))
    monkeypatch.setattr(ui, "stop_servers", lambda procs: stopped.append([name for name, _, _ in procs]))
    monkeypatch.setattr(ui, "print", print_then_signal, raising=False)
    assert ui.run_ui(prefect_port=1, mlflow_port=2) == 0
    assert stopped == [["prefect", "mlflow"]]


@pytest.mark.slow
def test_a_port_in_use_is_an_error_before_anything_starts(tmp_path):
    """Another server on the Prefect port would answer the health check: `posttrain ui` must refuse
    (naming the port and the flag) instead of sending runs to someone else's server."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "posttrain.flows.cli", "ui", "--prefect-port", str(port),
                              "--mlflow-port", str(_free_port())], cwd=tmp_path, capture_output=True, text=True,
                             timeout=120, env={**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")})
    assert out.returncode == 1, out
    assert f"127.0.0.1:{port} (for the Prefect server) is already in use" in out.stderr, out.stderr
    assert "--prefect-port" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "mlflow.db").exists()  # nothing was started
