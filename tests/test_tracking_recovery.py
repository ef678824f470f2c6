"""core.tracking.recovery: runs left RUNNING by a process killed outright are ended as KILLED by
the next run of their pipeline; live runs, other pipelines' runs and runs elsewhere are not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from core.tracking import Tracker, TrackingConfig
from core.tracking.recovery import HOST_TAG, PID_TAG, end_stale_runs, process_alive, process_tags

ROOT = Path(__file__).resolve().parents[1]


def test_process_tags_tell_a_live_process_from_a_dead_or_reused_pid():
    mine = process_tags()
    assert mine[PID_TAG] == str(os.getpid()) and process_alive(mine) is True
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_alive(process_tags(child.pid) | {PID_TAG: str(child.pid)}) is False
    assert process_alive({**mine, "posttrain.pid_start": "1"}) is False  # the pid now is another process
    assert process_alive({**mine, HOST_TAG: "elsewhere"}) is None
    assert process_alive({}) is None


def _runs(uri: str) -> dict[str, object]:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("posttrain")
    return {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}


@pytest.mark.timeout(300)
def test_runs_of_a_killed_flow_end_as_killed_on_the_next_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # A "flow" that opens its pipeline run and a stage child run, then is SIGKILLed.
    script = textwrap.dedent(f"""
        import time
        from core.tracking import Tracker, TrackingConfig
        cfg = TrackingConfig(tracking_uri={uri!r})
        parent = Tracker(cfg, "pipe", tags={{"posttrain.pipeline": "pipe"}})
        parent.flush(60)
        child = Tracker(cfg, "stage", parent_run_id=parent.run_id)
        child.flush(60)
        other = Tracker(cfg, "other-pipeline", tags={{"posttrain.pipeline": "other"}})
        other.flush(60)
        print("ready", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    cfg = TrackingConfig(tracking_uri=uri)
    # A run of the same pipeline that is still going on (this process) is left alone.
    with Tracker(cfg, "alive", tags={"posttrain.pipeline": "pipe"}) as alive:
        alive.flush(60)
        assert {r.info.run_name: r.info.status for r in _runs(uri).values()} == {
            "pipe": "RUNNING", "stage": "RUNNING", "other-pipeline": "RUNNING", "alive": "RUNNING"}
        ended = end_stale_runs(cfg, "pipe")
        runs = _runs(uri)
        assert sorted(ended) == sorted([runs["pipe"].info.run_id, runs["stage"].info.run_id])
        assert {n: r.info.status for n, r in runs.items()} == {
            "pipe": "KILLED", "stage": "KILLED", "other-pipeline": "RUNNING", "alive": "RUNNING"}
        assert "marked KILLED" in runs["pipe"].data.tags["posttrain.error"]
        assert runs["stage"].info.end_time >= runs["stage"].info.start_time
        assert end_stale_runs(cfg, "pipe") == []  # nothing left to end
    assert _runs(uri)["alive"].info.status == "FINISHED"


def test_an_unreachable_tracking_server_only_skips_the_clean_up(caplog, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    cfg = TrackingConfig(tracking_uri="http://127.0.0.1:9")  # nothing listens on the discard port
    t0 = time.monotonic()
    assert end_stale_runs(cfg, "pipe") == []
    assert time.monotonic() - t0 < 60
    assert "could not look for stale MLflow runs" in caplog.text
    assert end_stale_runs(TrackingConfig(enabled=False), "pipe") == []
