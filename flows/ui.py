"""`posttrain ui`: a real `prefect server` and `mlflow server` on 127.0.0.1 (SQLite by default,
Postgres when a backend store URI says so), their URLs printed, both stopped cleanly on Ctrl-C,
SIGTERM (a service manager, `kill`) or SIGHUP (the terminal closed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def _wait_http(url: str, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status < 500:
                    return True
        except OSError:
            time.sleep(0.5)
    return False


def port_in_use(host: str, port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) == 0


def start_servers(host: str = "127.0.0.1", prefect_port: int = 4200, mlflow_port: int = 5000,
                  backend_store: str | None = None, artifacts: str = "mlartifacts",
                  timeout: float = 120.0, procs: list | None = None) -> list[tuple[str, subprocess.Popen, str]]:
    """Start both servers (each in its own process group) and wait until they answer. A port
    already taken is an error before anything starts (else the health check would be answered by
    whatever holds it, and runs would go to someone else's server). Each server goes into `procs`
    the moment it is spawned, so a caller holding that list can stop whatever was started even if
    a signal lands between here and its own `try`."""
    for what, port, flag in (("Prefect", prefect_port, "--prefect-port"), ("MLflow", mlflow_port, "--mlflow-port")):
        if port_in_use(host, port):
            raise RuntimeError(f"{host}:{port} (for the {what} server) is already in use, perhaps by another "
                               f"`posttrain ui` or server; choose another with {flag}")
    bindir = Path(sys.executable).parent
    backend_store = backend_store or f"sqlite:///{Path('mlflow.db').resolve()}"
    env = {**os.environ, "PREFECT_SERVER_API_HOST": host, "PREFECT_SERVER_API_PORT": str(prefect_port)}
    procs = [] if procs is None else procs
    try:
        procs.append(("prefect", subprocess.Popen([str(bindir / "prefect"), "server", "start", "--host", host,
                                                   "--port", str(prefect_port)], env=env, start_new_session=True),
                      f"http://{host}:{prefect_port}/api/health"))
        procs.append(("mlflow", subprocess.Popen([str(bindir / "mlflow"), "server", "--host", host, "--port",
                                                  str(mlflow_port), "--backend-store-uri", backend_store,
                                                  "--artifacts-destination", str(Path(artifacts).resolve()),
                                                  "--workers", "1"], start_new_session=True),
                      f"http://{host}:{mlflow_port}/health"))
        for name, proc, health in procs:
            if not _wait_http(health, proc, timeout):
                raise RuntimeError(f"{name} server did not come up at {health}")
    except BaseException:  # not up, or stopped (a signal) while coming up: leave nothing behind
        stop_servers(procs)
        raise
    return procs


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_servers(procs, grace: float = 10.0) -> None:
    """SIGTERM each server's process group; after `grace` seconds SIGKILL what is left of it. A
    leader that exits can leave members behind (mlflow's gunicorn workers, Prefect's services),
    so the wait is for the whole group, not the leader alone."""
    for _, proc, _ in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.time() + grace
    for _, proc, _ in procs:
        try:
            proc.wait(max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            pass
        while _group_alive(proc.pid) and time.time() < deadline:
            time.sleep(0.1)
        if _group_alive(proc.pid):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def run_ui(host: str = "127.0.0.1", prefect_port: int = 4200, mlflow_port: int = 5000,
           backend_store: str | None = None) -> int:
    def stop(signum, frame):
        raise KeyboardInterrupt  # the same way out as Ctrl-C: through `finally`, which stops both

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return _serve(host, prefect_port, mlflow_port, backend_store)
    except KeyboardInterrupt:
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve(host: str, prefect_port: int, mlflow_port: int, backend_store: str | None) -> int:
    procs: list = []
    try:  # from before the first spawn: a signal during the prints below must still stop both
        start_servers(host, prefect_port, mlflow_port, backend_store, procs=procs)
        print(f"Prefect UI:  http://{host}:{prefect_port}")
        print(f"MLflow UI:   http://{host}:{mlflow_port}")
        print(f"Point runs at them:  export PREFECT_API_URL=http://{host}:{prefect_port}/api "
              f"MLFLOW_TRACKING_URI=http://{host}:{mlflow_port}")
        print("Ctrl-C (or SIGTERM, SIGHUP) stops both.", flush=True)
        while all(p.poll() is None for _, p, _ in procs):
            time.sleep(1)
        return 1  # one died on its own
    finally:
        stop_servers(procs)
