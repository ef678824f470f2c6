"""Helpers of tests/flows/test_ui_browser.py: Chromium (found, installed or skipped), `posttrain ui` and
`posttrain serve` as subprocesses, Prefect's REST API (create a run, wait for it, its logs), and
screenshots that say where they were saved."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
# Where the screenshots go: a CI job uploads this folder as an artifact (git-ignored).
ARTIFACTS = Path(os.environ.get("POSTTRAIN_UI_ARTIFACTS", ROOT / "test-artifacts" / "ui"))


def chromium() -> str | None:
    """Debian's Chromium: the path, after installing it with apt-get where it is missing and this
    is root with apt-get (as `make setup` does); None where it cannot be installed here. An
    install that should work but fails raises: that is a broken machine, not a skip."""
    found = shutil.which("chromium") or (CHROMIUM if os.access(CHROMIUM, os.X_OK) else None)
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium"], check=True, env=env)
    return shutil.which("chromium") or CHROMIUM


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A subprocess whose output is drained into a log file (a full pipe would block it) and kept
    in memory for waiting on a line."""

    def __init__(self, name: str, args: list[str], cwd: Path, env: dict[str, str], log: Path):
        self.name, self.log_path, self.lines = name, log, []
        self._log = open(log, "w")
        self.proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self._log.write(line)
            self._log.flush()

    def tail(self, n: int = 40) -> str:
        return "".join(self.lines[-n:])

    def wait_for_line(self, text: str, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(text in line for line in self.lines):
                return
            if self.proc.poll() is not None:
                time.sleep(0.5)  # the reader's last lines
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before printing {text!r}:\n"
                                   f"{self.tail()}")
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} did not print {text!r} in {timeout:.0f} s:\n{self.tail()}")

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM (for `posttrain ui`: the way out that stops both servers), then SIGKILL."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        self._log.close()
        return self.proc.returncode


def posttrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "posttrain.flows.cli", *args]


def child_env(prefect_port: int, mlflow_port: int, prefect_home: Path) -> dict[str, str]:
    """The environment `posttrain ui` prints to export: runs (and `serve`) point at its servers."""
    env = {**os.environ, "PREFECT_HOME": str(prefect_home),
           "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api",
           "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{mlflow_port}"}
    env.pop("PREFECT_PROFILE", None)
    return env


class PrefectAPI:
    """The few REST calls the test needs (no Prefect client: nothing of prefect's settings here)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def call(self, method: str, path: str, body: Any = None, timeout: float = 30) -> Any:
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(6):  # a busy server answers 503 (its SQLite locked) now and then: retry
            req = urllib.request.Request(f"{self.url}{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    text = r.read()
                return json.loads(text) if text else None
            except urllib.error.HTTPError as e:
                if e.code < 500 or attempt == 5:
                    raise
            except (urllib.error.URLError, TimeoutError):
                if attempt == 5:
                    raise
            time.sleep(2 ** attempt)

    def deployment(self, flow: str, name: str, timeout: float = 240, proc: Proc | None = None) -> dict:
        """The deployment, once `posttrain serve` has registered it."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                return self.call("GET", f"/deployments/name/{flow}/{name}")
            except urllib.error.HTTPError as e:
                if e.code != 404:
                    raise
            if proc is not None and proc.proc.poll() is not None:
                raise RuntimeError(f"{proc.name} exited ({proc.proc.returncode}):\n{proc.tail()}")
            time.sleep(1)
        raise TimeoutError(f"deployment {flow}/{name} not registered in {timeout:.0f} s"
                           + (f":\n{proc.tail()}" if proc else ""))

    def create_run(self, deployment_id: str, parameters: dict | None = None, name: str | None = None) -> dict:
        body: dict[str, Any] = {"parameters": parameters or {}}
        if name:
            body["name"] = name
        return self.call("POST", f"/deployments/{deployment_id}/create_flow_run", body)

    def flow_run(self, run_id: str) -> dict:
        return self.call("GET", f"/flow_runs/{run_id}")

    def flow_runs(self, deployment_id: str) -> list[dict]:
        return self.call("POST", "/flow_runs/filter", {"deployments": {"id": {"any_": [deployment_id]}},
                                                        "sort": "EXPECTED_START_TIME_DESC", "limit": 50})

    def task_runs(self, flow_run_id: str) -> list[dict]:
        return self.call("POST", "/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}, "limit": 200})

    def artifacts(self, flow_run_id: str) -> list[dict]:
        return self.call("POST", "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})

    def logs_tail(self, flow_run_id: str, n: int = 60) -> str:
        try:
            logs = self.call("POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}},
                                                      "sort": "TIMESTAMP_DESC", "limit": n})
        except OSError as e:
            return f"(logs not read: {e})"
        return "\n".join(f"{rec['timestamp'][11:19]} {rec['message']}" for rec in reversed(logs))

    def wait(self, run_id: str, timeout: float, serve: Proc | None = None) -> dict:
        """The flow run once it is in a final state; a timeout or a run that is not Completed fails
        with the tail of its logs (and of the serve process's output)."""
        deadline = time.time() + timeout
        run = self.flow_run(run_id)
        while time.time() < deadline:
            run = self.flow_run(run_id)
            if run["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                break
            time.sleep(3)
        else:
            raise AssertionError(f"flow run {run['name']} still {run['state_name']} after {timeout:.0f} s; "
                                 f"its logs:\n{self.logs_tail(run_id)}"
                                 + (f"\n--- serve:\n{serve.tail()}" if serve else ""))
        if run["state_type"] != "COMPLETED":
            raise AssertionError(f"flow run {run['name']} ended {run['state_name']}: "
                                 f"{(run.get('state') or {}).get('message')}; its logs:\n{self.logs_tail(run_id)}")
        return run


def shot(page, name: str) -> Path:
    """A full-page screenshot into the artifact folder."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    try:  # a page fading in would be captured half-transparent
        page.wait_for_function("() => document.getAnimations().every(a => a.playState !== 'running' "
                               "|| a.effect?.getComputedTiming().iterations === Infinity)", timeout=5000)
    except Exception:  # noqa: BLE001 - an endless spinner: take it as it is
        pass
    page.screenshot(path=str(path), full_page=True)
    return path
