"""Deployments on a real `prefect server` on a free loopback port: both are registered, a run is
triggered through the API as the UI does (`run_deployment`) with parameters from the request, it
completes, and the cron schedule is visible through the client."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    from posttrain.flows.ui import _wait_http

    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    server = subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "server", "start", "--host",
                               "127.0.0.1", "--port", str(port)], env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/api"
    try:
        assert _wait_http(f"{url}/health", server, 180), "prefect server did not start"
        yield url, env
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)


def test_deployment_triggered_from_the_api(prefect_api, tmp_path):
    url, env = prefect_api
    cfg = {"name": "deployed", "workspace": str(tmp_path / "runs"), "schedule": "0 4 * * 2",
           "schedule_timezone": "Europe/Paris",
           "nodes": {"prep": {"kind": "data_prep", "synthetic_size": 40}},
           "tracking": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
           "launcher": {"nproc_per_node": 1}}
    cfg_file = tmp_path / "pipeline.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    env = {**env, "PREFECT_API_URL": url}
    serve = subprocess.Popen([sys.executable, "-m", "posttrain.flows.cli", "serve", str(cfg_file)], env=env,
                             cwd=tmp_path, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        from prefect.client.orchestration import get_client
        from prefect.deployments import run_deployment
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: url}):
            deadline = time.time() + 180
            deployments = {}
            while time.time() < deadline and len(deployments) < 2:
                with get_client(sync_client=True) as client:
                    deployments = {d.name: d for d in client.read_deployments()}
                time.sleep(2)
            assert {"on-demand", "scheduled-retraining"} <= deployments.keys()
            scheduled = deployments["scheduled-retraining"]
            assert [(s.schedule.cron, s.schedule.timezone) for s in scheduled.schedules] == [("0 4 * * 2",
                                                                                            "Europe/Paris")]
            assert "(0 4 * * 2, Europe/Paris)" in scheduled.description  # shown on the deployment

            # The UI's "Run" with an edited form: the deployment's parameters (the whole config, without
            # the serve-time schedule) with the edits, from the request.
            params = deployments["on-demand"].parameters
            assert "schedule" not in params["config"] and "schedule_timezone" not in params["config"]
            params["config"]["name"] = "from-ui"
            params["config"]["nodes"]["prep"]["synthetic_size"] = 24
            run = run_deployment("post_training/on-demand", parameters=params, timeout=600)
            assert run.state.is_completed(), run.state
            assert run.parameters["config"]["name"] == "from-ui"
        manifest = json.loads((tmp_path / "runs" / "from-ui" / "prep" / "manifest.json").read_text())
        rows = sum(v for k, v in manifest["metrics"].items() if k.startswith("rows/sft_"))
        assert 0 < rows <= 24
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        serve.wait(30)


def test_schedule_timezone_is_a_setting_defaulting_to_the_machines(monkeypatch):
    from posttrain.core.config import ConfigError
    from posttrain.flows.deploy import build_deployments, machine_timezone
    from posttrain.core.config import load_config
    from posttrain.flows.config import PipelineConfig
    from tests.support.pipelines import DEMO_CONFIG

    def demo_config(sets=()):
        return load_config(PipelineConfig, DEMO_CONFIG, list(sets))

    monkeypatch.setenv("TZ", "Asia/Tokyo")
    assert machine_timezone() == "Asia/Tokyo"
    monkeypatch.setenv("TZ", "Nowhere/Atlantis")  # not a zone: what /etc/localtime links to, else UTC
    assert machine_timezone() in ("UTC", "Etc/UTC") or "/" in machine_timezone()
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    (_, scheduled) = build_deployments(demo_config())
    assert [s.schedule.timezone for s in scheduled.schedules] == ["Asia/Tokyo"]
    assert "Asia/Tokyo" in scheduled.description
    (_, scheduled) = build_deployments(demo_config(["schedule_timezone=America/New_York"]))
    assert [s.schedule.timezone for s in scheduled.schedules] == ["America/New_York"]
    with pytest.raises(ConfigError, match=r"schedule_timezone: .*'Mars/Olympus' is not an IANA timezone"):
        demo_config(["schedule_timezone=Mars/Olympus"])
