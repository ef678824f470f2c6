"""posttrain.stages.launch: torchrun launches of the probe stage, cancellation, and the cluster renderings.

The multi-process tests start real torchrun jobs of the probe stage, tests/support/probe_stage.py (gloo on
CPU); each costs a few torch imports, so they use as few ranks as what they check needs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml

from posttrain.core.config import spec_text
from posttrain.stages.launch.config import KubernetesOptions, LauncherConfig, SlurmOptions
from tests.support.probe_stage import MODULE as PROBE, ProbeConfig
from posttrain.stages.launch import Launch, LaunchError, launch_nodes, launch_stage, render_kubernetes, render_sbatch



def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead, only not yet reaped (here PID 1 may never reap the orphans it inherits).
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _worker_pids(out: Path, n: int, timeout: float = 180.0) -> list[int]:
    """The pids the probe's ranks wrote once all n had joined the process group."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted((out / "pids").glob("rank*.pid"))
        if len(files) == n:
            try:
                return [json.loads(f.read_text())["pid"] for f in files]
            except (json.JSONDecodeError, KeyError):
                pass  # written atomically, but be safe
        time.sleep(0.2)
    raise AssertionError(f"probe ranks did not start within {timeout}s")


def _all_dead(pids: list[int], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


# ---------------------------------------------------------------------------------- local torchrun

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_two_ranks_write_the_manifest(tmp_path):
    lines: list[str] = []
    spec = ProbeConfig(output_dir=str(tmp_path / "out"))
    res = launch_stage(PROBE, spec, LauncherConfig(nproc_per_node=2), workdir=tmp_path / "w",
                       env={"MLFLOW_PARENT_RUN_ID": "parent-123"}, on_output=lines.append)
    assert res.returncode == 0 and res.ok
    assert res.manifest is not None
    assert (res.manifest["world_size"], res.manifest["sum"]) == (2, 0 + 1)
    assert res.manifest["env"]["MLFLOW_PARENT_RUN_ID"] == "parent-123"  # env reaches every rank
    assert res.manifest["env"]["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert json.loads((tmp_path / "w" / "spec.json").read_text())["output_dir"] == spec.output_dir
    # Output streamed line by line to the callback and to the log.
    assert "probe: world_size=2 sum=1" in lines
    assert "probe: world_size=2 sum=1" in res.log_file.read_text().splitlines()
    assert res.wall_time_s > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_failing_stage_returns_its_exit_code(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text('{"stale": true}')  # an earlier run's, not this one's
    res = launch_stage(PROBE, ProbeConfig(output_dir=str(out), fail=True),
                       LauncherConfig(nproc_per_node=2), workdir=tmp_path / "w")
    assert res.returncode == 3  # the rank's code, not torchrun's generic 1
    assert res.manifest is None
    assert "failing on purpose" in res.log_file.read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_max_restarts_recovers_from_a_first_failure(tmp_path):
    out = tmp_path / "out"
    res = launch_stage(PROBE, ProbeConfig(output_dir=str(out), fail_once=True),
                       LauncherConfig(nproc_per_node=2, max_restarts=1), workdir=tmp_path / "w")
    assert res.returncode == 0, res.log_file.read_text()[-3000:]
    assert res.manifest["restart_count"] == 1 and res.manifest["sum"] == 1
    assert (out / ".probe_failed_once").exists()
    assert "failing on the first attempt" in res.log_file.read_text()


# ---------------------------------------------------------------------------------- cancellation

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cancel_kills_the_process_tree(tmp_path):
    """Ranks that ignore SIGTERM (stuck) still die: SIGKILL after the grace period reaches every
    process of the tree, though torchrun put each worker in a session of its own."""
    out = tmp_path / "out"
    spec = ProbeConfig(output_dir=str(out), sleep_s=600, ignore_sigterm=True)
    job = Launch(PROBE, spec, LauncherConfig(nproc_per_node=2), workdir=tmp_path / "w", grace_s=2.0).start()
    try:
        workers = _worker_pids(out, 2)
        launchers = job.pids
        assert all(_alive(p) for p in workers + launchers)
        assert all(os.getsid(p) != os.getsid(launchers[0]) for p in workers)
    finally:
        job.cancel()
    assert _all_dead(workers + launchers, timeout=5.0)  # cancel() returns once all are gone (5 s: reaping lags under load)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig, exc", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, SystemExit)])
def test_interrupt_while_waiting_leaves_no_workers(tmp_path, sig, exc):
    """Ctrl-C, or SIGTERM to the flow process (Prefect's cancellation), during launch_stage."""
    # Python's own dispositions, whatever handlers libraries imported by earlier tests left behind
    # (restored after the test by _restore_signal_handlers).
    for s, handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        _RESTORE.append((s, signal.signal(s, handler)))
    out, done = tmp_path / "out", threading.Event()
    workers: list[int] = []

    def interrupt():
        workers.extend(_worker_pids(out, 1))
        if not done.is_set():
            os.kill(os.getpid(), sig)

    t = threading.Thread(target=interrupt, daemon=True)
    t.start()
    with pytest.raises(exc):
        try:
            launch_stage(PROBE, ProbeConfig(output_dir=str(out), sleep_s=600),
                         LauncherConfig(nproc_per_node=1), workdir=tmp_path / "w", grace_s=10.0)
        finally:
            done.set()
    t.join()
    assert workers and _all_dead(workers, timeout=5.0)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # our handler is gone again


_RESTORE: list = []


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    yield
    while _RESTORE:
        s, previous = _RESTORE.pop()
        signal.signal(s, previous)


class _Cancelled(BaseException):
    pass


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_exception_raised_into_the_waiting_thread_cancels(tmp_path):
    """Prefect cancels a task running in a worker thread by raising into that thread
    (PyThreadState_SetAsyncExc); there is no signal handler off the main thread."""
    import ctypes

    out, caught = tmp_path / "out", []

    def task():
        try:
            launch_stage(PROBE, ProbeConfig(output_dir=str(out), sleep_s=600),
                         LauncherConfig(nproc_per_node=1), workdir=tmp_path / "w", grace_s=10.0)
        except _Cancelled as e:
            caught.append(e)

    t = threading.Thread(target=task)
    t.start()
    workers = _worker_pids(out, 1)
    assert ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(_Cancelled)) == 1
    t.join(timeout=60)
    assert not t.is_alive() and caught
    assert _all_dead(workers, timeout=5.0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killed_launcher_takes_its_workers_along(tmp_path):
    """The launching process killed outright (no Python cleanup): torchrun dies with it."""
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        from pathlib import Path
        from posttrain.stages.launch.config import LauncherConfig
        from posttrain.stages.launch import launch_stage
        from tests.support.probe_stage import MODULE, ProbeConfig
        launch_stage(MODULE, ProbeConfig(output_dir={str(out)!r}, sleep_s=600),
                     LauncherConfig(nproc_per_node=1), workdir=Path({str(tmp_path / 'w')!r}))
    """)
    flow = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path)
    try:
        workers = _worker_pids(out, 1)
    finally:
        flow.kill()
        flow.wait()
    assert _all_dead(workers, timeout=60.0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killed_torchrun_takes_its_ranks_along(tmp_path):
    """torchrun SIGKILLed with no launch watching it (its flow process gone too): the ranks get
    SIGTERM from the kernel (signals.die_with_agent) instead of running on as orphans."""
    out = tmp_path / "out"
    spec = tmp_path / "spec.json"
    spec.write_text(spec_text(ProbeConfig(output_dir=str(out), sleep_s=600)))
    cmd = [sys.executable, "-m", "posttrain.stages.launch", "torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=2",
           "-m", PROBE, "--config", str(spec)]
    torchrun = subprocess.Popen(cmd, cwd=tmp_path, env=os.environ, start_new_session=True)
    try:
        workers = _worker_pids(out, 2)
    finally:
        torchrun.kill()
        torchrun.wait()
    assert _all_dead(workers, timeout=60.0)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_relaunch_waits_for_the_leftovers_of_a_killed_launch(tmp_path, monkeypatch):
    """A launch from the workdir of a live launch refuses to start; once that launch's process is
    killed outright, its job (ranks that ignore SIGTERM, like a slow final checkpoint) lingers, and
    the next launch waits for it to be gone before starting its own ranks: past its wait (its
    grace plus EARLIER_GRACE_S, here 1 + 3 s instead of 1 + 60, so that torchrun's own 30 s
    escalation does not end the leftover first) it kills them."""
    monkeypatch.setattr("posttrain.stages.launch.job.EARLIER_GRACE_S", 3.0)
    out, work = tmp_path / "out", tmp_path / "w"
    script = textwrap.dedent(f"""
        from pathlib import Path
        from posttrain.stages.launch.config import LauncherConfig
        from posttrain.stages.launch import launch_stage
        from tests.support.probe_stage import MODULE, ProbeConfig
        launch_stage(MODULE, ProbeConfig(output_dir={str(out)!r}, sleep_s=600, ignore_sigterm=True),
                     LauncherConfig(nproc_per_node=1), workdir=Path({str(work)!r}))
    """)
    flow = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path)
    try:
        workers = _worker_pids(out, 1)
        with pytest.raises(LaunchError, match="another launch from .* is running"):
            launch_stage(PROBE, ProbeConfig(output_dir=str(tmp_path / "out2")), LauncherConfig(nproc_per_node=1),
                         workdir=work)
    finally:
        flow.kill()
        flow.wait()
    assert not _all_dead(workers, timeout=2.0)  # torchrun got SIGTERM; the rank ignores it, for now
    result = launch_stage(PROBE, ProbeConfig(output_dir=str(tmp_path / "out3")), LauncherConfig(nproc_per_node=1),
                          workdir=work, grace_s=1.0)
    assert result.ok and not any(_alive(p) for p in workers)
    log = result.log_file.read_text()
    (line,) = [ln for ln in log.splitlines() if "of an earlier launch, whose launcher is gone" in ln]
    assert str(workers[0]) in line  # the rank was named among the earlier launch's and waited for,
    assert f"killing process {workers[0]} of the earlier launch" in log  # then killed,
    assert log.index(line) < log.rindex("posttrain.stages.launch torchrun")  # before this launch's torchrun started


# ---------------------------------------------------------------------------------- multinode

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_node_launchers_meet_at_a_c10d_rendezvous(tmp_path):
    launcher = LauncherConfig(kind="multinode", nnodes=2, nproc_per_node=1,
                              rdzv_endpoint=f"127.0.0.1:{_free_port()}")
    res = launch_nodes(PROBE, ProbeConfig(output_dir=str(tmp_path / "out")), launcher,
                       workdir=tmp_path / "w")
    assert res.returncode == 0, res.log_file.read_text()[-3000:]
    assert (res.manifest["world_size"], res.manifest["sum"]) == (2, 1)
    assert sorted(res.manifest["group_ranks"]) == [0, 1]  # one rank under each node's torchrun
    # Each node's output is told apart in the shared log (only the node hosting rank 0 prints).
    assert any(l.startswith(("[node0] probe: world_size=2", "[node1] probe: world_size=2"))
               for l in res.log_file.read_text().splitlines())


# ---------------------------------------------------------------------------------- Slurm script

def _sbatch_directives(script: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line[len("#SBATCH "):].partition("=")
            out.setdefault(key, []).append(value)
    return out


@pytest.mark.slow
def test_sbatch_script_structure(tmp_path):
    launcher = LauncherConfig(
        kind="slurm", nnodes=4, nproc_per_node=8, max_restarts=2, env={"NCCL_DEBUG": "WARN"},
        slurm=SlurmOptions(partition="gpu", account="llm", time="02:00:00", gpus_per_node=8,
                           cpus_per_task=64, extra_args=["--qos=high", "--exclusive"]))
    tricky = "it's a \"value\" with $HOME and spaces"
    script = render_sbatch("sft", tmp_path / "spec.json", launcher, workdir=tmp_path,
                           env={"MLFLOW_PARENT_RUN_ID": "run-1", "POSTTRAIN_TRICKY": tricky})
    d = _sbatch_directives(script)
    assert d["--nodes"] == ["4"] and d["--ntasks-per-node"] == ["1"]
    assert d["--gpus-per-node"] == ["8"] and d["--cpus-per-task"] == ["64"]
    assert (d["--partition"], d["--account"], d["--time"]) == (["gpu"], ["llm"], ["02:00:00"])
    assert d["--output"] == [str(tmp_path.resolve() / "slurm-%j.out")]
    assert d["--qos"] == ["high"] and "--exclusive" in d
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in script
    srun = script[script.index("\nsrun "):]
    for arg in ("--nnodes=4", "--nproc-per-node=8", "--max-restarts=2", "--rdzv-backend=c10d",
                '--rdzv-endpoint="$head_node:$rdzv_port"', '--rdzv-id="$SLURM_JOB_ID"', "-m posttrain.stages.sft"):
        assert arg in srun
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    # The exported env survives shell quoting exactly.
    exports = "\n".join(l for l in script.splitlines() if l.startswith("export POSTTRAIN_TRICKY="))
    got = subprocess.run(["bash", "-c", exports + '\nprintf %s "$POSTTRAIN_TRICKY"'],
                         capture_output=True, text=True).stdout
    assert got == tricky
    assert "export NCCL_DEBUG=WARN" in script and "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in script


def test_sbatch_cpu_job_has_no_gpu_or_partition_lines(tmp_path):
    script = render_sbatch(PROBE, tmp_path / "spec.json", LauncherConfig(kind="slurm"), workdir=tmp_path)
    d = _sbatch_directives(script)
    assert "--gpus-per-node" not in d and "--partition" not in d and "--account" not in d
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in script  # only with restarts


# ---------------------------------------------------------------------------------- Kubernetes

def _k8s_launcher(api: str, **kw) -> LauncherConfig:
    return LauncherConfig(kind="kubernetes", nnodes=3, nproc_per_node=2, max_restarts=1, env={"A": "1"},
                          kubernetes=KubernetesOptions(
                              api=api, image="registry/posttrain:1", namespace="ml",
                              resources={"nvidia.com/gpu": 2, "cpu": 16, "memory": "64Gi"},
                              volumes=[{"name": "ws", "mountPath": "/ws",
                                        "persistentVolumeClaim": {"claimName": "posttrain-ws"}}],
                              service_account="trainer"), **kw)


def _spec_roundtrip(configmap: dict, spec: ProbeConfig) -> None:
    assert configmap["kind"] == "ConfigMap" and configmap["apiVersion"] == "v1"
    assert ProbeConfig.model_validate(json.loads(configmap["data"]["spec.json"])) == spec


def test_trainjob_manifest_structure():
    spec = ProbeConfig(output_dir="runs/demo/probe", sleep_s=1.5)
    cm, job = render_kubernetes(PROBE, spec_text(spec), _k8s_launcher("trainjob"), env={"MLFLOW_RUN": "x'y"})
    _spec_roundtrip(cm, spec)
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert job["metadata"]["namespace"] == "ml" and cm["metadata"]["namespace"] == "ml"
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    tr = job["spec"]["trainer"]
    assert (tr["image"], tr["numNodes"], tr["numProcPerNode"]) == ("registry/posttrain:1", 3, 2)
    assert tr["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": 2, "cpu": 16, "memory": "64Gi"}}
    assert tr["command"][:4] == ["python", "-m", "posttrain.stages.launch", "torchrun"]
    assert "--chdir=/ws" in tr["command"] and "--max-restarts=1" in tr["command"]
    assert tr["command"][-4:] == ["-m", "tests.support.probe_stage", "--config", "/etc/posttrain/spec.json"]
    env = {e["name"]: e["value"] for e in tr["env"]}
    assert env["MLFLOW_RUN"] == "x'y" and env["A"] == "1" and env["OMP_NUM_THREADS"] == "8"
    override = job["spec"]["podTemplateOverrides"][0]
    assert override["targetJobs"] == [{"name": "node"}]
    vols = {v["name"]: v for v in override["spec"]["volumes"]}
    assert vols["ws"] == {"name": "ws", "persistentVolumeClaim": {"claimName": "posttrain-ws"}}
    assert vols["posttrain-spec"]["configMap"]["name"] == cm["metadata"]["name"]
    mounts = {m["name"]: m["mountPath"] for m in override["spec"]["containers"][0]["volumeMounts"]}
    assert mounts == {"ws": "/ws", "posttrain-spec": "/etc/posttrain"}
    assert override["spec"]["serviceAccountName"] == "trainer"
    # Valid YAML to hand to kubectl, and stable under a dump/load round trip.
    assert list(yaml.safe_load_all(yaml.safe_dump_all([cm, job]))) == [cm, job]


@pytest.mark.parametrize("elastic", [False, True])
def test_pytorchjob_manifest_structure(elastic):
    spec = ProbeConfig(output_dir="runs/demo/probe")
    cm, job = render_kubernetes(PROBE, spec_text(spec), _k8s_launcher("pytorchjob"), elastic=elastic)
    _spec_roundtrip(cm, spec)
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert job["spec"]["nprocPerNode"] == "2"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    if elastic:
        assert set(replicas) == {"Worker"} and replicas["Worker"]["replicas"] == 3
        assert job["spec"]["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 3,
                                                "maxReplicas": 3, "maxRestarts": 1}
    else:
        assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 2)
        assert "elasticPolicy" not in job["spec"]
    for rep in replicas.values():
        pod = rep["template"]["spec"]
        (c,) = pod["containers"]
        assert c["name"] == "pytorch" and c["image"] == "registry/posttrain:1"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
        assert {v["name"] for v in pod["volumes"]} == {"ws", "posttrain-spec"}
        assert {m["mountPath"] for m in c["volumeMounts"]} == {"/ws", "/etc/posttrain"}


def test_kubernetes_single_node_and_bad_volume():
    launcher = _k8s_launcher("pytorchjob").model_copy(update={"nnodes": 1})
    _, job = render_kubernetes(PROBE, spec_text(ProbeConfig()), launcher)
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Master"}
    bad = _k8s_launcher("trainjob")
    bad.kubernetes.volumes = [{"name": "ws", "persistentVolumeClaim": {"claimName": "c"}}]
    with pytest.raises(ValueError, match="mountPath"):
        render_kubernetes(PROBE, spec_text(ProbeConfig()), bad)


def test_same_spec_on_every_launcher(tmp_path):
    """One spec file, byte for byte, whatever the launcher kind."""
    spec = ProbeConfig(output_dir="runs/x/probe", launcher=_k8s_launcher("trainjob"))
    cm, _ = render_kubernetes(PROBE, spec_text(spec), spec.launcher)
    local = tmp_path / "spec.json"
    from posttrain.core.config import to_json_file
    to_json_file(spec, local)
    assert cm["data"]["spec.json"].strip() == local.read_text().strip()


@pytest.mark.parametrize("condition, code", [("Complete", 0), ("Failed", 1)])
@pytest.mark.slow
def test_kubernetes_launch_applies_and_follows_the_job(tmp_path, monkeypatch, condition, code):
    """Plumbing only, against a stand-in kubectl: what is applied, and how the outcome is read."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(textwrap.dedent(f"""\
        #!/bin/bash
        echo "$*" >> {tmp_path}/calls
        case $1 in
          apply) cat > {tmp_path}/applied.json; echo "trainjob.trainer.kubeflow.org/x created" ;;
          get) echo '{{"status": {{"conditions": [{{"type": "{condition}", "status": "True"}}]}}}}' ;;
        esac
    """))
    (bin_dir / "kubectl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    res = launch_stage(PROBE, ProbeConfig(output_dir=str(tmp_path / "out")), _k8s_launcher("trainjob"),
                       workdir=tmp_path / "w")
    assert res.returncode == code
    applied = json.loads((tmp_path / "applied.json").read_text())
    assert [m["kind"] for m in applied["items"]] == ["ConfigMap", "TrainJob"]
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0] == "apply -f -"
    assert calls[1] == f"get -n ml trainjob.trainer.kubeflow.org/{res.job_id} -o json"
    assert "created" in res.log_file.read_text()
