"""What a killed run leaves behind, cleared by the next: MLflow runs left RUNNING by a process
killed outright end as KILLED (posttrain.core.tracking.recovery; live runs, other pipelines' runs and runs
elsewhere do not), an ephemeral Prefect server whose flow process was killed is stopped
(posttrain.flows.recovery), and a stage directory a killed attempt left keeps only its checkpoints
(posttrain.core.manifest.clear_partial)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from posttrain.core.tracking import Tracker, TrackingConfig
from posttrain.core.tracking.recovery import HOST_TAG, PID_TAG, end_stale_runs, process_alive, process_tags



@pytest.mark.slow
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
@pytest.mark.slow
def test_runs_of_a_killed_flow_end_as_killed_on_the_next_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # A "flow" that opens its pipeline run and a stage child run, then is SIGKILLed.
    script = textwrap.dedent(f"""
        import time
        from posttrain.core.tracking import Tracker, TrackingConfig
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
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, env=os.environ,
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


def test_clear_partial_keeps_only_the_checkpoints(tmp_path):
    from posttrain.core.manifest import CHECKPOINTS, ManifestError, clear_partial, write_manifest

    out = tmp_path / "stage"
    (out / CHECKPOINTS / "step-000003").mkdir(parents=True)
    (out / CHECKPOINTS / "latest").write_text("step-000003")
    (out / "tokenizer").mkdir()
    (out / "tokenizer" / ".tokenizer.json.123-abcd.tmp").write_text("half")  # a write cut short by a kill
    (out / ".key").write_text("k")
    (out / "results.json").write_text("{")
    assert clear_partial(out, keep=(".key", CHECKPOINTS)) == ["results.json", "tokenizer"]
    assert sorted(p.name for p in out.iterdir()) == [".key", CHECKPOINTS]
    assert (out / CHECKPOINTS / "latest").read_text() == "step-000003"
    (out / "results.json").write_text("{}")
    write_manifest(out, "evaluate", {"results": "results.json"})
    with pytest.raises(ManifestError, match="complete"):  # a finished stage is never cleared
        clear_partial(out)


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_an_ephemeral_server_left_by_a_killed_flow_is_stopped(tmp_path):
    from posttrain.flows.recovery import SERVER_APP, reap_orphaned_servers

    records = tmp_path / "servers"
    # A "flow" with a child that looks like Prefect's ephemeral server; it notes it, then is SIGKILLed.
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        from pathlib import Path
        from posttrain.flows.recovery import reap_orphaned_servers
        server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", {SERVER_APP!r}])
        print(server.pid, reap_orphaned_servers(Path({str(records)!r})), flush=True)
        time.sleep(600)
    """)
    flow = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, env=os.environ,
                            stdout=subprocess.PIPE, text=True)
    try:
        pid, stopped = flow.stdout.readline().split(maxsplit=1)
        server = int(pid)
        assert stopped.strip() == "[]" and (records / f"{server}.json").exists()
        assert reap_orphaned_servers(records) == []  # its flow lives: left alone
    finally:
        flow.kill()
        flow.wait()
    assert reap_orphaned_servers(records) == [server]
    deadline = time.monotonic() + 30
    while (alive := process_alive(process_tags(server))) and time.monotonic() < deadline:
        time.sleep(0.1)  # gone, or a zombie its new parent has not reaped yet
    assert not alive
    # its record is gone (this test process's own ephemeral server, if an earlier test started one, is
    # noted there too, and left alone: its owner lives)
    assert not (records / f"{server}.json").exists()
