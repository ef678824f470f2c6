"""What every runner shares: the interface the launch drives, its result, and its error."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class LaunchError(RuntimeError):
    """The launch itself failed (sbatch refused the job, kubectl is missing), not the stage."""


class Runner(Protocol):
    """One started piece of a launch (a local torchrun, a Slurm job, a Kubernetes job)."""

    job_id: str | None
    """Slurm job id or Kubernetes job name; None for torchrun started here."""

    def poll(self) -> int | None:
        """None while running, then the exit code (0, the failing rank's, or 128 + signal)."""

    def terminate(self, grace_s: float) -> None:
        """Stop it, forcibly once `grace_s` is over, and return when it has stopped (or been told to)."""


@dataclass
class LaunchResult:
    returncode: int
    """0, the first failing rank's exit code, or 128 + signal."""
    manifest: dict | None
    """`<output_dir>/manifest.json` after a successful run; None after a failure."""
    log_file: Path
    wall_time_s: float
    job_id: str | None = None
    """Slurm job id or Kubernetes job name; None for torchrun launched here."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0
