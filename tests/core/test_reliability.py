"""Faults injected into one process: NaN and spiking steps (skip, rollback, data moves on),
preemption by SIGTERM, corrupt checkpoints, full disks through posttrain.core.loop.fit;
and the pieces of posttrain.core.reliability on their own (spike detector, flight recorder, signal handler,
hang watchdog). Multi-process faults (a killed rank, a hung rank, a real SIGTERM) and
a dead MLflow server are in tests/core/test_faults.py."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import posttrain.core.checkpoint.writer as ckpt_writer
from posttrain.core.checkpoint import CheckpointError, CheckpointManager
from posttrain.core.config import ConfigError, load_config
from posttrain.core.reliability.config import ReliabilityConfig
from posttrain.stages.config import SFTConfig
from posttrain.core.loop import fit
from posttrain.core.reliability import (
    EXIT_PREEMPTED, FlightRecorder, Preempted, Preemption, Reliability, SpikeDetector,
    TrainingDiverged, Watchdog,
)
from tests.support.fault_stage import Faults, make_loader, make_objective, make_trainer, weights

STEPS = 8
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as fault_stage: runs compared bit for bit reduce in the same order
    yield
    torch.set_num_threads(threads)


class Job:
    """fault_stage's job in this process: the debug model on endless synthetic batches, with the
    faults of `faults` and every on_metrics call recorded."""

    def __init__(self, tmp: Path, steps: int = STEPS, save_every: int = 2, **rel):
        self.trainer = make_trainer(steps)
        self.loader = make_loader(0, 1)
        self.faults = Faults(tmp, 0)
        self.manager = CheckpointManager(tmp / "checkpoints", keep_last=3, interval_steps=save_every) \
            if save_every is not None else None
        self.events: list[tuple[int, dict]] = []
        self.seen: list[tuple[int, int]] = []  # (step attempted, batch_no)
        self.rel = Reliability(**{"spike_window": 8, "max_bad_steps": 3, **rel})
        self.steps = steps
        objective = make_objective(self.faults)

        def watched(model, batch):
            self.seen.append((self.faults.step, batch["batch_no"]))
            return objective(model, batch)

        self.objective = watched

    def on_metrics(self, metrics: dict, step: int) -> None:
        self.events.append((step, dict(metrics)))

    def fit(self, **kw):
        kw = {"max_steps": self.steps, "manager": self.manager, "on_metrics": self.on_metrics, "log_every": 1,
              "before_step": self.faults.before_step, "reliability": self.rel, **kw}
        return fit(self.trainer, self.loader, self.objective, **kw)

    def keyed(self, key: str) -> list[tuple[int, float]]:
        return [(s, m[key]) for s, m in self.events if key in m]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    """Final weights of an uninterrupted, fault-free run."""
    job = Job(tmp_path_factory.mktemp("reference"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    job.fit()
    torch.set_num_threads(threads)
    return weights(job.trainer.model)


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: max diff {(a[k] - b[k]).abs().max()}"


# ------------------------------------------------------------------------------ pieces

def test_spike_detector():
    det = SpikeDetector(zscore=4.0, window=6)
    assert det.min_history == 3
    for x in (2.0, 2.1, 1.9):
        assert det.is_spike(100.0) is None or len(det.losses) >= 3  # inactive until 3 losses are in
        det.accept(x)
    assert det.is_spike(2.05) is None and det.is_spike(1.0) is None  # lower losses are never spikes
    z = det.is_spike(10.0)
    assert z is not None and z > 4
    det.accept(float("nan"))  # never enters the window
    assert list(det.losses) == [2.0, 2.1, 1.9]
    flat = SpikeDetector(zscore=6.0, window=4)
    for _ in range(4):
        flat.accept(3.0)
    assert flat.is_spike(3.001) is None and flat.is_spike(3.1) is not None  # std floor: 1e-3 x mean
    restored = SpikeDetector(zscore=4.0, window=6)
    restored.load_state_dict(json.loads(json.dumps(det.state_dict())))
    assert restored.zscore(10.0) == det.zscore(10.0)


def test_flight_recorder_keeps_the_last_collectives():
    rec = FlightRecorder(size=3)
    for i in range(4):
        rec.step = i
        with rec.record("all_reduce", f"c{i}", torch.zeros(2, 3)):
            pass
    with pytest.raises(RuntimeError):
        with rec.record("all_reduce", "boom"):
            raise RuntimeError("peer reset")
    snap = rec.snapshot()
    assert [r["name"] for r in snap] == ["c2", "c3", "boom"] and snap[0]["shape"] == [2, 3]
    assert snap[-1]["error"] == "RuntimeError: peer reset" and all(r["end"] for r in snap)
    entered, release = threading.Event(), threading.Event()

    def stuck():
        with rec.record("all_reduce", "trainer/grads"):
            entered.set()
            release.wait(5)

    t = threading.Thread(target=stuck)
    t.start()
    entered.wait(5)
    state = rec.state()
    release.set()
    t.join()
    assert state["seq"] == 6 and state["in_flight"]["name"] == "trainer/grads"
    assert rec.state()["in_flight"] is None


def test_preemption_handler_sets_a_flag_and_enforces_the_grace_period():
    expired = threading.Event()
    pre = Preemption(grace_s=0.3, on_expire=expired.set)
    before = signal.getsignal(signal.SIGTERM)
    assert pre.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # would end pytest without the handler
        deadline = time.monotonic() + 5
        while pre.requested is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pre.requested == signal.SIGTERM and pre.agreed()
        assert expired.wait(5)  # nobody exited within the grace period: the hard exit is called
    finally:
        pre.close()
    assert signal.getsignal(signal.SIGTERM) is before


def _stuck_in_test_code(until: threading.Event) -> None:
    until.wait(20)


def test_watchdog_fires_dumps_stacks_and_names_the_rank(tmp_path):
    fired: list[str] = []
    done = threading.Event()
    wd = Watchdog(tmp_path, timeout_s=0.8, interval_s=0.1, on_fire=lambda r: (fired.append(r), done.set()))
    wd.start()
    try:
        for _ in range(15):  # progressing for 1.5 s, longer than the timeout: no alarm
            time.sleep(0.1)
            wd.beat(step=1, phase="forward_backward")
        t0 = time.monotonic()
        assert not fired
        _stuck_in_test_code(done)  # then no progress
        waited = time.monotonic() - t0
    finally:
        wd.stop()
    assert fired and re.fullmatch(rf"watchdog: rank 0 made no progress for \d+ s; stacks in {re.escape(str(wd.dir))}",
                                  fired[0])
    assert 0.8 <= waited < 15
    stacks = (wd.dir / "stacks-rank00000.txt").read_text()
    assert "_stuck_in_test_code" in stacks and "phase forward_backward" in stacks
    assert (wd.dir / "reason.txt").read_text().startswith(fired[0])
    assert json.loads((wd.dir / "collectives-rank00000.json").read_text())["rank"] == 0


def test_watchdog_blames_the_rank_outside_the_collective(tmp_path, monkeypatch):
    """Rank 0 (this process) waits in an all-reduce; rank 1 (a heartbeat file, on another host so
    it is not signalled) stopped before it. The reason names rank 1, the details both."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    rec = FlightRecorder()
    fired = threading.Event()
    wd = Watchdog(tmp_path, timeout_s=0.6, interval_s=0.1, dump_wait_s=0.3, recorder=rec,
                  on_fire=lambda r: fired.set())
    wd.start()
    beat = {"rank": 1, "pid": 1, "host": "elsewhere", "progress": 7, "step": 3, "phase": "forward_backward",
            "collectives": {"seq": 4, "in_flight": None, "last": {"name": "trainer/grads"}}, "time": 0}
    (wd.dir / "heartbeat-rank00001.json").write_text(json.dumps(beat))
    try:
        rec.step = 3
        with rec.record("all_reduce", "trainer/tokens_loss", torch.zeros(2)):
            assert fired.wait(15)
    finally:
        wd.stop()
    reason = (wd.dir / "reason.txt").read_text()
    assert reason.startswith("watchdog: rank 1 made no progress for ")
    assert "rank 0 (pid" in reason and "waiting in collective #1 all_reduce 'trainer/tokens_loss'" in reason
    assert "rank 1 (pid 1 on elsewhere): step 3, forward_backward, not in a collective" in reason
    assert "no dump from ranks [1]" in reason


def test_watchdog_ignores_a_rank_that_finished(tmp_path, monkeypatch):
    """A rank that stopped its watchdog cleanly (heartbeat removed) is done, not hung."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    fired: list[str] = []
    wd = Watchdog(tmp_path, timeout_s=0.5, interval_s=0.05, on_fire=fired.append)
    wd.start()
    beat = {"rank": 1, "pid": 1, "host": "elsewhere", "progress": 3, "step": 9, "phase": "checkpoint",
            "collectives": {"seq": 4, "in_flight": None, "last": None}, "time": 0}
    (wd.dir / "heartbeat-rank00001.json").write_text(json.dumps(beat))
    try:
        time.sleep(0.3)  # rank 0 has seen it
        (wd.dir / "heartbeat-rank00001.json").unlink()
        for _ in range(20):  # rank 0 goes on for 1 s, twice the timeout
            wd.beat(step=9)
            time.sleep(0.05)
    finally:
        wd.stop()
    assert not fired and wd._finished == {1}


def test_watchdog_clean_stop_leaves_nothing(tmp_path):
    with Watchdog(tmp_path / "wd", timeout_s=5, interval_s=0.05) as wd:
        wd.beat(1)
        time.sleep(0.2)
        assert (wd.dir / "heartbeat-rank00000.json").exists()
    assert not (tmp_path / "wd").exists()


def test_reliability_config():
    cfg = ReliabilityConfig()
    rel = Reliability.from_config(cfg, watchdog_dir=None)
    assert rel.watchdog is None and rel.preemption.grace_s == cfg.preempt_grace_s
    assert Reliability.from_config(cfg, "/tmp/wd").watchdog.timeout_s == cfg.hang_timeout_s
    with pytest.raises(ConfigError, match="reliability: hang_timeout_s=2000.0 must be below collective_timeout_s"):
        load_config(SFTConfig, overrides=["reliability.hang_timeout_s=2000"])
    with pytest.raises(ConfigError, match=r"reliability.spike_zscore: .*finite"):
        load_config(SFTConfig, overrides=["reliability.spike_zscore=.nan"])


# ------------------------------------------------------------------------------ through fit

def snapshot_weights(job, after_step: int, event: str):
    """An on_metrics callback for job.fit, and the two weight snapshots it fills: after the
    optimizer step `after_step`, and when a metric named `event` is logged."""
    after: dict[str, torch.Tensor] = {}
    at_event: dict[str, torch.Tensor] = {}

    def on_metrics(metrics, step):
        job.on_metrics(metrics, step)
        if step == after_step and "loss" in metrics:
            after.update(weights(job.trainer.model))
        if event in metrics:
            at_event.update(weights(job.trainer.model))

    return on_metrics, after, at_event


def test_nan_steps_are_skipped_then_rolled_back_past_the_bad_batches(tmp_path):
    job = Job(tmp_path, steps=8, save_every=4, max_bad_steps=3)
    job.faults.nan = {6, 7, 8}  # steps 1-5 fine (checkpoint at 4), then three NaN batches in a row
    on_metrics, saved_at_4, at_rollback = snapshot_weights(job, 4, "events/rollback")
    job.fit(on_metrics=on_metrics)
    assert job.keyed("events/skipped_nonfinite") == [(6, 1.0), (6, 2.0), (6, 3.0)]
    assert job.keyed("events/rollback") == [(6, 1.0)] and job.keyed("events/rollback_to_step") == [(6, 4.0)]
    assert job.keyed("events/rollback_from_step") == [(6, 5.0)]
    assert_bitwise_equal(at_rollback, saved_at_4)  # step 5's update was undone too
    assert job.manager.last_report.step == 4
    # Step 6 was tried on batches 6, 7, 8; after the rollback steps 5-8 run on batches 9-12: the
    # data position moved on past the bad batches (and the good batch 5, whose update was undone).
    assert job.seen == [(s, s) for s in range(1, 6)] + [(6, 6), (6, 7), (6, 8)] + [(s, s + 4) for s in range(5, 9)]
    assert job.trainer.step == 8 and job.loader.state_dict()["index"] == 12
    assert all(torch.isfinite(w).all() for w in weights(job.trainer.model).values())
    assert job.manager.latest_step() == 8


def test_loss_spike_is_skipped_and_training_goes_on(tmp_path):
    job = Job(tmp_path, steps=10, save_every=None, spike_zscore=5.0, spike_window=8)
    job.faults.spike = {8}
    on_metrics, after_7, at_skip = snapshot_weights(job, 7, "events/skipped_spike")
    job.fit(on_metrics=on_metrics)
    assert_bitwise_equal(at_skip, after_7)  # the spiking step changed nothing
    (step, z), = job.keyed("events/spike_zscore")
    assert step == 8 and z > 5 and job.keyed("events/skipped_spike") == [(8, 1.0)]
    (_, loss), = job.keyed("events/skipped_loss")
    assert loss > 1000  # the spiking loss is reported, and not applied
    assert not job.keyed("events/rollback") and job.rel.bad_steps == 0
    assert max(job.rel.spike.losses) < 100  # the spike never entered the window
    assert job.trainer.step == 10 and job.seen[-1] == (10, 11)
    losses = dict(job.keyed("loss"))
    assert 8 in losses and losses[8] < 100  # step 8 was redone on the next batch


def test_persistent_nans_end_as_diverged(tmp_path):
    job = Job(tmp_path, steps=20, save_every=2, max_bad_steps=2, max_rollbacks=2)
    job.faults.nan = set(range(3, 100))
    with pytest.raises(TrainingDiverged, match=r"2 bad steps in a row at step 3 .* after 2 rollback\(s\)"):
        job.fit()
    assert [v for _, v in job.keyed("events/rollback")] == [1.0, 2.0]
    nomgr = Job(tmp_path / "b", steps=10, save_every=None, max_bad_steps=2)
    nomgr.faults.nan = {2, 3}
    with pytest.raises(TrainingDiverged, match="no checkpoint manager to roll back with"):
        nomgr.fit()


def test_corrupt_latest_checkpoint_resumes_from_the_previous_one(tmp_path, reference, caplog):
    first = Job(tmp_path)
    first.fit(max_steps=6)  # a run that stopped at step 6 (same schedule length as the reference)
    assert first.manager.list_complete() == [2, 4, 6]
    shard = next((tmp_path / "checkpoints" / "step-000006").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    resumed = Job(tmp_path)  # a restart with the full step budget
    with caplog.at_level(logging.WARNING):
        resumed.fit()
    assert resumed.keyed("events/checkpoint_skipped") == [(4, 1.0)]
    assert resumed.keyed("events/checkpoint_skipped_step") == [(4, 6.0)]
    assert resumed.keyed("events/resumed_from_step") == [(4, 4.0)]
    assert "step-000006 is unusable" in caplog.text and "sha256 mismatch" in caplog.text
    assert resumed.seen[0] == (5, 5)  # the batches after step 4 again, exactly
    assert_bitwise_equal(weights(resumed.trainer.model), reference)


class _FullDisk(ckpt_writer.FileSystemWriter):
    """Writes the shards, then fails before DCP's metadata lands: a save dying midway."""

    def finish(self, metadata, results):
        raise OSError(28, "No space left on device")


@pytest.mark.parametrize("mode", ["continue", "fail"])
def test_disk_full_during_a_save(tmp_path, monkeypatch, reference, mode):
    job = Job(tmp_path, steps=STEPS)
    job.manager.on_save_error = mode
    real = ckpt_writer.FileSystemWriter

    def writer_for_step(path, *a, **k):  # the save of step 4 hits a full disk
        return (_FullDisk if "-000004-" in str(path) else real)(path, *a, **k)

    monkeypatch.setattr(ckpt_writer, "FileSystemWriter", writer_for_step)
    if mode == "continue":
        job.fit()
        assert job.trainer.step == STEPS and job.manager.save_failures == 1
        assert job.manager.list_complete() == [2, 6, 8]
        assert_bitwise_equal(weights(job.trainer.model), reference)  # training itself was untouched
        return
    with pytest.raises(CheckpointError, match=r"step 4 .*No space left on device.*previous checkpoint is intact"):
        job.fit()
    ckdir = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckdir.iterdir()) == ["latest", "step-000002"]
    assert (ckdir / "latest").read_text().strip() == "step-000002"
    monkeypatch.undo()
    resumed = Job(tmp_path, steps=STEPS)  # and a restart resumes from it, to the same result
    resumed.fit()
    assert resumed.keyed("events/resumed_from_step") == [(2, 2.0)]
    assert_bitwise_equal(weights(resumed.trainer.model), reference)


def test_sigterm_checkpoints_and_stops_then_resume_finishes_identically(tmp_path, reference):
    expired = threading.Event()
    job = Job(tmp_path, steps=STEPS, save_every=100, preemption=Preemption(grace_s=30, on_expire=expired.set))
    before = signal.getsignal(signal.SIGTERM)

    def on_metrics(metrics, step):
        job.on_metrics(metrics, step)
        if step == 3 and "loss" in metrics:
            os.kill(os.getpid(), signal.SIGTERM)  # mid-run, between two steps' work

    try:
        with pytest.raises(Preempted) as e:
            job.fit(on_metrics=on_metrics)
    finally:
        job.rel.preemption.close()
    assert e.value.code == EXIT_PREEMPTED and e.value.step == 3
    assert str(e.value).startswith("preempted at step 3 (checkpoint ") and e.value.checkpoint.endswith("step-000003")
    assert signal.getsignal(signal.SIGTERM) is before and not expired.is_set()
    assert job.manager.latest_step() == 3 and job.trainer.step == 3

    resumed = Job(tmp_path, steps=STEPS, save_every=100)
    resumed.fit()
    assert resumed.keyed("events/resumed_from_step") == [(3, 3.0)]
    assert_bitwise_equal(weights(resumed.trainer.model), reference)


def test_stages_never_talk_to_prefect():
    """Why a Prefect API outage cannot stop a running stage: nothing a stage runs imports Prefect
    (only flows/ does), so there is no call to fail."""
    import ast

    root = Path(__file__).resolve().parents[2]
    files = [f for d in ("core", "stages", "registry", "kernels") for f in (root / d).rglob("*.py")]
    assert len(files) > 20
    importers = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "prefect" or n.startswith(("prefect.", "flows")) for n in names):
                importers.append(str(f.relative_to(root)))
    assert not importers, importers
