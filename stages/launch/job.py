"""A launch: the spec written, one runner per backend started, waited for, and cancelled."""

from __future__ import annotations

import json
import shlex
import socket
import time
from collections.abc import Callable
from pathlib import Path

from posttrain.core.atomic import write_text_atomic
from posttrain.core.config import ConfigModel, spec_text
from posttrain.stages.launch.config import LauncherConfig
from posttrain.stages.launch.base import LaunchResult, Runner
from posttrain.stages.launch.commands import check_stage_module, local_env, rdzv_id, stage_module, torchrun_command
from posttrain.stages.launch.kubernetes import KubeJob, render_kubernetes
from posttrain.stages.launch.local import RECORD, LocalNode, await_earlier
from posttrain.stages.launch.logstream import LogSink
from posttrain.stages.launch.signals import sigterm_raises
from posttrain.stages.launch.slurm import SlurmJob, render_sbatch


# How long a launch waits for an earlier one's leftovers beyond its own grace: a training rank told
# to stop checkpoints first (posttrain.core.reliability's preemption grace, 60 s by default).
EARLIER_GRACE_S = 60.0


class Launch:
    """A stage being run: `with Launch(...) as job: result = job.wait()`.

    Leaving the block by an exception, or calling `cancel()` from another thread, stops the job and
    every process it started. Start and wait in the same thread: torchrun is told to die with the
    thread that started it (PR_SET_PDEATHSIG is per thread).
    `nodes > 1` (kind 'multinode') runs that many node launchers on this host, which is how the
    tests, and a single box posing as a cluster, exercise the c10d rendezvous.
    """

    def __init__(self, module: str, spec: ConfigModel, launcher: LauncherConfig, *, workdir: Path,
                 env: dict | None = None, log_file: Path | None = None,
                 on_output: Callable[[str], None] | None = None, grace_s: float = 15.0, nodes: int = 1):
        check_stage_module(module)
        if nodes > 1 and (launcher.kind != "multinode" or nodes != launcher.nnodes):
            raise ValueError(f"nodes={nodes} needs kind='multinode' with nnodes={nodes}")
        self.module, self.spec, self.launcher, self.env = module, spec, launcher, env
        self.workdir = Path(workdir).resolve()
        self.log_file = Path(log_file or self.workdir / "launch.log").resolve()
        self.on_output, self.grace_s, self.nodes = on_output, grace_s, nodes
        self._runners: list[Runner] = []
        self._sink: LogSink | None = None
        self._cancelled = False

    def start(self) -> Launch:
        try:
            return self._start()
        except BaseException:  # e.g. sbatch refused the job, or Ctrl-C while torchrun starts
            self.cancel()
            raise

    def _start(self) -> Launch:
        self._cwd = Path.cwd()  # relative paths in the spec are read from here, by ranks and manifest
        # The spec is serialized once: the file the ranks parse, the rendezvous id, the ConfigMap.
        spec_json = spec_text(self.spec)
        self.workdir.mkdir(parents=True, exist_ok=True)
        spec_file = write_text_atomic(self.workdir / "spec.json", spec_json, mode=0o600).resolve()
        kind = self.launcher.kind
        self._sink = LogSink(self.log_file, self.on_output,
                             f"==> posttrain launch {stage_module(self.module)} ({kind}) {time.strftime('%F %T')}")
        self._t0 = time.monotonic()
        if kind in ("local", "multinode"):
            env = local_env(self.launcher, self.env)
            rid = rdzv_id(self.module, spec_json)
            # Node launchers on one host must agree on the address the workers meet at.
            addr = "127.0.0.1" if self.nodes > 1 else None
            cmd = torchrun_command(self.module, spec_file, self.launcher, rdzv=rid, local_addr=addr)
            await_earlier(self.workdir, self._sink, timeout_s=self.grace_s + EARLIER_GRACE_S)
            host = socket.gethostname()  # a shared workdir holds every host's records; each checks its own
            self._sink.put("posttrain: " + shlex.join(cmd))
            for i in range(self.nodes):  # one by one, so that a cancel mid-way finds each started
                self._runners.append(LocalNode(cmd, env, self._cwd, self._sink, f"[node{i}] " if self.nodes > 1 else "",
                                               self.grace_s, record=self.workdir / RECORD.format(host=host, node=i)))
        elif kind == "slurm":
            script = self.workdir / "stage.sbatch"
            script.write_text(render_sbatch(self.module, spec_file, self.launcher, workdir=self.workdir,
                                            env=self.env, cwd=self._cwd))
            self._runners = [SlurmJob(script, self.workdir, self._sink)]
        else:
            manifests = render_kubernetes(self.module, spec_json, self.launcher, env=self.env)
            (self.workdir / "manifests.json").write_text(json.dumps(manifests, indent=2))
            self._runners = [KubeJob(manifests, self._sink)]
        return self

    def wait(self) -> LaunchResult:
        assert self._sink is not None, "start() first"
        codes: list[int | None] = [None] * len(self._runners)
        rc = 0  # the first failure's code; the nodes stopped after it report only their SIGTERM
        try:
            with sigterm_raises():
                while any(c is None for c in codes):
                    codes = [c if c is not None else r.poll() for c, r in zip(codes, self._runners)]
                    if not rc and (rc := next((c for c in codes if c), 0)):
                        # One node failed: the others would hang in collectives until timeout.
                        for c, r in zip(codes, self._runners):
                            if c is None:
                                r.terminate(self.grace_s)
                    self._sink.drain()
                    # Short sleeps: Prefect cancels a task thread with an exception that only
                    # lands between bytecodes, never inside a long blocking wait.
                    time.sleep(0.1)
        except BaseException:
            self.cancel()
            raise
        finally:
            self._sink.drain()
        self._sink.close()
        return LaunchResult(returncode=rc, manifest=self._manifest() if rc == 0 else None,
                            log_file=self.log_file, wall_time_s=time.monotonic() - self._t0,
                            job_id=self.job_id)

    @property
    def job_id(self) -> str | None:
        """Slurm job id or Kubernetes job name, once started."""
        return self._runners[0].job_id if self._runners else None

    @property
    def pids(self) -> list[int]:
        """The torchrun processes started here (one per node launcher)."""
        return [r.proc.pid for r in self._runners if isinstance(r, LocalNode)]

    def _manifest(self) -> dict | None:
        if self.spec.output_dir is None:
            return None
        path = self._cwd / self.spec.output_dir / "manifest.json"
        return json.loads(path.read_text()) if path.exists() else None

    def cancel(self) -> None:
        """SIGTERM the whole job, SIGKILL what is left after `grace_s`; safe to call twice."""
        if self._cancelled or self._sink is None:
            return
        self._cancelled = True
        self._sink.put(f"posttrain: cancelling (grace {self.grace_s}s)")
        for r in self._runners:
            r.terminate(self.grace_s)
        self._sink.close()

    def __enter__(self) -> Launch:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.cancel()


def launch_stage(module: str, spec: ConfigModel, launcher: LauncherConfig, *, workdir: Path,
                 env: dict | None = None, log_file: Path | None = None,
                 on_output: Callable[[str], None] | None = None, grace_s: float = 15.0) -> LaunchResult:
    """Run stage `module` with `spec` on `launcher` and wait for it (see the package docstring).

    kind 'multinode' runs this host's node launcher; start it the same way on every node, or use
    launch_nodes to run all of them here.
    """
    with Launch(module, spec, launcher, workdir=workdir, env=env, log_file=log_file,
                on_output=on_output, grace_s=grace_s) as job:
        return job.wait()


def launch_nodes(module: str, spec: ConfigModel, launcher: LauncherConfig, *, workdir: Path,
                 env: dict | None = None, log_file: Path | None = None,
                 on_output: Callable[[str], None] | None = None, grace_s: float = 15.0) -> LaunchResult:
    """All `launcher.nnodes` node launchers of a 'multinode' launch, on this host."""
    with Launch(module, spec, launcher, workdir=workdir, env=env, log_file=log_file,
                on_output=on_output, grace_s=grace_s, nodes=launcher.nnodes) as job:
        return job.wait()
