"""Faults injected into real processes (tests/support/fault_stage.py): a rank SIGKILLed mid-step under
torchrun --max-restarts 1, a rank hung before its all-reduce, SIGTERM to a training process; and
a training run whose MLflow server is down. Each checks the outcome, not only the exit code."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tests.support.fault_stage as fault_stage
from posttrain.core.reliability import EXIT_HUNG, EXIT_PREEMPTED

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(fault_stage.__file__).resolve())
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**faults: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAULT_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",  # as posttrain.stages.launch sets it when restarts are on
               **faults)
    return env


def torchrun(out: Path, *args: str, max_restarts: int = 0, timeout: float = 300, **faults: str):
    """The product's torchrun wrapper (exits with the first failing rank's code) on 2 CPU ranks."""
    cmd = [sys.executable, "-m", "posttrain.stages.launch", "torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=2",
           f"--max-restarts={max_restarts}", SCRIPT, "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(**faults), capture_output=True, text=True, timeout=timeout)
    return proc, time.time()


def _forked_rank(rank: int, port: int, out: str, kwargs: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    fault_stage.train(out, **kwargs)
    torch.distributed.destroy_process_group()


def forked_reference(out: Path, **kwargs) -> dict[str, torch.Tensor]:
    """The same job on 2 forked ranks (no torchrun start-up), uninterrupted: the expected weights."""
    ctx, port = mp.get_context("fork"), _free_port()
    procs = [ctx.Process(target=_forked_rank, args=(r, port, str(out), kwargs)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    return load_file(out / "final.safetensors")


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: max diff {(a[k] - b[k]).abs().max()}"


def events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


def test_killed_rank_restarts_and_resumes_to_identical_weights(tmp_path):
    marker = tmp_path / "killed-once"
    proc, _ = torchrun(tmp_path / "run", "--steps", "8", "--save-every", "2", max_restarts=1,
                       FAULT_KILL_AT="5:1", FAULT_MARKER=str(marker))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert marker.exists() and "exitcode: -9" in log  # rank 1 really died of SIGKILL in attempt 0
    resumed = [e for e in events(tmp_path / "run") if "events/resumed_from_step" in e]
    assert [e["events/resumed_from_step"] for e in resumed] == [4.0]  # attempt 1 resumed from step 4
    steps = [e["step"] for e in events(tmp_path / "run") if "loss" in e]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8]  # step 5 died before logging; each step logged once
    got = load_file(tmp_path / "run" / "final.safetensors")
    assert_bitwise_equal(got, forked_reference(tmp_path / "ref", steps=8, save_every=2))


def test_hung_rank_is_detected_dumped_and_ended(tmp_path):
    timeout = 6.0
    out = tmp_path / "run"
    proc, ended = torchrun(out, "--steps", "8", "--save-every", "2", "--hang-timeout", str(timeout),
                           "--collective-timeout", "300", FAULT_HANG_AT="3:1")
    log = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_HUNG, log[-5000:]
    hung_at = float((out / "hang-started").read_text())
    # Not before the configured time, and not long after it (dumps, teardown; a loaded machine).
    assert timeout <= ended - hung_at < timeout + 60, ended - hung_at
    (session,) = (out / "watchdog").iterdir()
    reason = (session / "reason.txt").read_text()
    assert reason.startswith(f"watchdog: rank 1 made no progress for ") and f"; stacks in {session}\n" in reason
    assert reason.splitlines()[0] in log  # the reason is what the job's output says, too
    assert "every rank dumped its stacks" in reason
    stacks0 = (session / "stacks-rank00000.txt").read_text()
    stacks1 = (session / "stacks-rank00001.txt").read_text()
    assert "in _hang" in stacks1 and "fault_stage.py" in stacks1  # where rank 1 is stuck
    assert "in all_reduce" in stacks0 and "in optim_step" in stacks0  # rank 0 waits for it
    c0 = json.loads((session / "collectives-rank00000.json").read_text())
    c1 = json.loads((session / "collectives-rank00001.json").read_text())
    waiting = c0["recorded"][-1]
    assert (waiting["name"], waiting["step"], waiting["end"]) == ("trainer/grads", 3, None)
    assert all(r["end"] is not None for r in c1["recorded"]) and c1["recorded"][-1]["seq"] == waiting["seq"] - 1
    fr = c0["torch_flight_recorder"]  # torch's own trace, on gloo
    assert isinstance(fr, dict) and any(e["profiling_name"] == "gloo:all_reduce" for e in fr["entries"])


def _collective_timeout_rank(rank: int, port: int, out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from posttrain.core.reliability import all_reduce
    from posttrain.stages.common import start_distributed

    start_distributed(timeout_s=3.0)
    if rank == 1:
        time.sleep(60)  # never joins the all-reduce; the parent kills it
        return
    t0 = time.monotonic()
    try:
        all_reduce(torch.ones(1), name="test/never_completes")
        out.put(("completed", time.monotonic() - t0))
    except RuntimeError as e:
        out.put((str(e), time.monotonic() - t0))


def test_collective_timeout_from_config_ends_a_wait_for_a_missing_rank():
    """The backstop under the watchdog: init_process_group(timeout=collective_timeout_s)."""
    ctx, port = mp.get_context("fork"), _free_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=_collective_timeout_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        message, waited = out.get(timeout=120)
    finally:
        for p in procs:
            p.kill()
            p.join()
    assert message != "completed" and "timed out" in message.lower(), message
    assert 3.0 <= waited < 60, waited


def _run_in_process(out: Path, **kwargs) -> dict[str, torch.Tensor]:
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        fault_stage.train(out, **kwargs)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det)
    return load_file(out / "final.safetensors")


def test_sigterm_writes_a_checkpoint_and_exits_75_then_resume_matches(tmp_path, monkeypatch):
    out = tmp_path / "run"
    cmd = [sys.executable, SCRIPT, "--out", str(out), "--steps", "12", "--save-every", "100", "--grace", "60"]
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(FAULT_STEP_SLEEP="0.3"), stdout=subprocess.PIPE,
                                stderr=err, text=True)
        try:
            for line in proc.stdout:  # wait until training is under way
                if line.startswith("step 3 "):
                    break
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert rc == EXIT_PREEMPTED, stderr[-3000:]
    latest = (out / "checkpoints" / "latest").read_text().strip()
    stopped = int(latest.removeprefix("step-"))
    assert 3 <= stopped < 12 and f"preempted at step {stopped} (checkpoint " in stderr
    assert "Traceback" not in stderr  # a clean exit, not a crash

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    resumed = _run_in_process(out, steps=12, save_every=100)  # the retry, here to save a start-up
    assert [e["events/resumed_from_step"] for e in events(out) if "events/resumed_from_step" in e] == [stopped]
    assert_bitwise_equal(resumed, _run_in_process(tmp_path / "ref", steps=12, save_every=100))


def test_fit_with_mlflow_down_finishes_and_delivers_later(tmp_path, monkeypatch):
    """MLflow is unreachable for a whole (short) run: fit finishes on time, the tracker keeps the
    metrics, and delivers them once a store answers. (The flow, not the stage, talks to Prefect:
    a Prefect outage cannot reach a running stage.)"""
    from mlflow import MlflowClient

    from posttrain.core.tracking import TrackingConfig
    from posttrain.core.tracking import Tracker

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "POSTTRAIN_PARENT_RUN_ID", "MLFLOW_PARENT_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    down = TrackingConfig(tracking_uri=f"http://127.0.0.1:{_free_port()}", experiment="dead")  # nothing listens
    tracker = Tracker(down, "sft", connect_timeout_s=30)
    from posttrain.core.checkpoint import CheckpointManager
    from posttrain.core.loop import fit
    from posttrain.core.reliability import Reliability

    threads = torch.get_num_threads()
    try:
        trainer = fault_stage.make_trainer(4)
        fit(trainer, fault_stage.make_loader(0, 1), fault_stage.make_objective(), max_steps=4,
            manager=CheckpointManager(tmp_path / "ck", interval_steps=2), on_metrics=tracker.log_metrics,
            log_every=1, reliability=Reliability(preemption=None))
    finally:
        torch.set_num_threads(threads)
    assert trainer.step == 4 and tracker.run_id is None
    assert tracker.flush(timeout=30) is False and tracker.pending() >= 4

    store = f"sqlite:///{tmp_path}/mlflow.db"
    tracker.tracking_uri = store  # the server is back (here: the store it would write to)
    assert tracker.flush(timeout=120)
    tracker.end()
    history = MlflowClient(store).get_metric_history(tracker.run_id, "loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4] and all(math.isfinite(m.value) for m in history)
