"""The Slurm launcher against a real one-node Slurm (infra/slurm/local-cluster.sh).

The cluster script installs slurm-wlm and munge with apt-get when they are missing, starts munged,
slurmctld and slurmd, and waits for the node to be idle; the test is skipped only where that is
impossible (exit 77: not root, or no apt-get), and the cluster is stopped even when a test fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from posttrain.stages.launch.config import LauncherConfig, SlurmOptions
from tests.support.probe_stage import MODULE as PROBE, ProbeConfig
from posttrain.stages.launch import Launch, launch_stage, slurm_job_state

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "infra" / "slurm" / "local-cluster.sh"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def slurm():
    try:
        start = subprocess.run([str(CLUSTER), "start"], capture_output=True, text=True, timeout=400)
        if start.returncode == 77:
            pytest.skip(f"no Slurm here and none can be installed: {start.stderr.strip()}")
        assert start.returncode == 0, f"local-cluster.sh start failed:\n{start.stderr}"
        yield
    finally:
        subprocess.run([str(CLUSTER), "stop"], capture_output=True, timeout=120)


def _alive(pid: int) -> bool:
    try:  # a zombie ("Z") is dead, only not reaped yet
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _launcher(nproc: int) -> LauncherConfig:
    # Never ask for more CPUs than the single node has, or the job pends forever.
    cpus = min(2, len(os.sched_getaffinity(0)))
    return LauncherConfig(kind="slurm", nproc_per_node=nproc,
                          slurm=SlurmOptions(cpus_per_task=cpus, time="00:10:00"))


def test_probe_runs_through_sbatch_and_srun(slurm, tmp_path):
    lines: list[str] = []
    res = launch_stage(PROBE, ProbeConfig(output_dir=str(tmp_path / "out")), _launcher(2),
                       workdir=tmp_path / "w", env={"POSTTRAIN_PROBE_MARK": "via-slurm"},
                       on_output=lines.append)
    assert res.returncode == 0, res.log_file.read_text()[-3000:]
    assert res.job_id and res.job_id.isdigit()
    m = res.manifest
    assert (m["world_size"], m["sum"]) == (2, 1)
    assert m["env"]["SLURM_JOB_ID"] == res.job_id  # the ranks really ran inside the allocation
    assert m["env"]["SLURM_NNODES"] == "1" and m["env"]["POSTTRAIN_PROBE_MARK"] == "via-slurm"
    assert "probe: world_size=2 sum=1" in lines  # the job's output file, tailed while it ran
    assert slurm_job_state(res.job_id) == ("COMPLETED", 0)


def test_failing_job_reports_the_rank_exit_code(slurm, tmp_path):
    res = launch_stage(PROBE, ProbeConfig(output_dir=str(tmp_path / "out"), fail=True), _launcher(1),
                       workdir=tmp_path / "w")
    assert res.returncode == 3 and res.manifest is None
    assert slurm_job_state(res.job_id) == ("FAILED", 3)
    assert "failing on purpose" in res.log_file.read_text()


def test_cancel_scancels_the_job(slurm, tmp_path):
    out = tmp_path / "out"
    job = Launch(PROBE, ProbeConfig(output_dir=str(out), sleep_s=600), _launcher(1),
                 workdir=tmp_path / "w", grace_s=30.0).start()
    try:
        pid_file = out / "pids" / "rank0.pid"
        deadline = time.monotonic() + 240
        while not pid_file.exists():
            assert time.monotonic() < deadline, "the job's rank never started"
            time.sleep(0.5)
        worker = json.loads(pid_file.read_text())["pid"]
    finally:
        job.cancel()
    assert slurm_job_state(job.job_id)[0] == "CANCELLED"
    deadline = time.monotonic() + 30  # slurmd SIGKILLs what SIGTERM left after KillWait
    while _alive(worker):
        assert time.monotonic() < deadline, "the rank outlived scancel"
        time.sleep(0.2)
