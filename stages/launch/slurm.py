"""The Slurm runner: an sbatch script (infra/slurm/stage.sbatch.j2) whose one srun task per node
runs torchrun, the torchruns meeting at a c10d rendezvous on the allocation's first node. The job
is polled with scontrol/sacct, its output file tailed into the log, and cancelled with scancel."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from posttrain.stages.launch.config import LauncherConfig
from posttrain.stages.launch.base import LaunchError
from posttrain.stages.launch.commands import rank_env, stage_label, stage_module, templates
from posttrain.stages.launch.logstream import FileTail, LogSink

_DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE"}


def render_sbatch(module: str, spec_file: Path, launcher: LauncherConfig, *, workdir: Path,
                  env: dict | None = None, python: str = sys.executable, cwd: Path | None = None) -> str:
    """The batch script (infra/slurm/stage.sbatch.j2): one srun task per node runs torchrun, and
    the torchruns meet at a c10d rendezvous on the allocation's first node."""
    return templates().get_template("stage.sbatch.j2").render(
        module=module, stage_module=stage_module(module), job_name=f"posttrain-{stage_label(module)}",
        nnodes=launcher.nnodes, nproc=launcher.nproc_per_node, max_restarts=launcher.max_restarts,
        slurm=launcher.slurm, output=Path(workdir).resolve() / "slurm-%j.out", cwd=Path(cwd or Path.cwd()).resolve(),
        spec_file=Path(spec_file).resolve(), python=python,
        env={k: v for k, v in rank_env(launcher, env).items() if k != "PYTHONUNBUFFERED"})


def slurm_job_state(job_id: str) -> tuple[str, int | None]:
    """(state, exit status) of a job: scontrol while the controller remembers it, then sacct."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    if out.returncode == 0 and "JobState=" in out.stdout:
        fields = dict(tok.split("=", 1) for tok in out.stdout.split() if "=" in tok)
        state, exit_code = fields["JobState"], fields.get("ExitCode", "0:0")
    else:
        out = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode"],
                             capture_output=True, text=True)
        if out.returncode != 0 or "|" not in out.stdout:
            return "UNKNOWN", None
        state, exit_code = out.stdout.splitlines()[0].split("|")[:2]
        state = state.split()[0]  # "CANCELLED by 0"
    if state not in _DONE:
        return state, None
    code, sig = (int(x) for x in exit_code.split(":"))
    return state, 0 if state == "COMPLETED" else code or (128 + sig if sig else 1)


class SlurmJob:
    """A submitted batch job: polled with scontrol/sacct, its output file tailed into the sink."""

    def __init__(self, script: Path, workdir: Path, sink: LogSink, poll_s: float = 1.0):
        out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
        if out.returncode != 0:
            raise LaunchError(f"sbatch {script} failed ({out.returncode}): {out.stderr.strip()}")
        self.job_id = out.stdout.strip().split(";")[0]  # "id" or "id;cluster"
        self._tail = FileTail(Path(workdir).resolve() / f"slurm-{self.job_id}.out", sink)
        self._sink, self._poll_s = sink, poll_s
        self._next, self._unknown = 0.0, 0
        sink.put(f"posttrain: submitted Slurm job {self.job_id}, output {self._tail.path}")

    def poll(self) -> int | None:
        self._tail.read()
        if time.monotonic() < self._next:
            return None
        self._next = time.monotonic() + self._poll_s
        state, rc = slurm_job_state(self.job_id)
        if state == "UNKNOWN":
            # A controller restart is transient; a job that neither scontrol nor sacct knows for a
            # minute is gone (purged, accounting off) and its fate cannot be learned.
            self._unknown += 1
            if self._unknown * self._poll_s < 60:
                return None
            self._sink.put(f"posttrain: Slurm job {self.job_id} vanished; reporting failure")
            return 1
        self._unknown = 0
        if rc is not None:
            self._tail.read(final=True)
            self._sink.put(f"posttrain: Slurm job {self.job_id} {state}, exit status {rc}")
        return rc

    def terminate(self, grace_s: float) -> None:
        subprocess.run(["scancel", self.job_id], capture_output=True)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and slurm_job_state(self.job_id)[1] is None:
            time.sleep(0.5)
        self._tail.read(final=True)
