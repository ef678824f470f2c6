"""LauncherConfig (with its Slurm and Kubernetes options): where and how posttrain.stages.launch starts a stage."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from posttrain.core.config import ConfigModel


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class SlurmOptions(ConfigModel):
    partition: str | None = Field(None, description="sbatch --partition.")
    account: str | None = Field(None, description="sbatch --account.")
    time: str = Field("01:00:00", description="sbatch --time limit.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node; 0 = CPU job.")
    cpus_per_task: int = Field(8, ge=1, description="CPUs per node (torchrun runs once per node).")
    extra_args: list[str] = Field([], description="More sbatch arguments, e.g. ['--qos=high'].")

    @field_validator("partition", "account", "time", "extra_args")
    @classmethod
    def _one_line(cls, v: Any) -> Any:
        # Each lands on an `#SBATCH` line of the batch script: a newline would start a shell command.
        for item in v if isinstance(v, list) else [v]:
            if item is not None and _CONTROL.search(item):
                raise ValueError("contains a control character (a newline would add a line to the batch script)")
        return v


class KubernetesOptions(ConfigModel):
    api: Literal["trainjob", "pytorchjob"] = Field(
        "trainjob", description="Kubeflow Trainer TrainJob, or the older Training Operator PyTorchJob.")
    image: str | None = Field(None, description="Container image with this project installed.")
    namespace: str = Field("default", description="Namespace of the job.")
    runtime: str = Field("torch-distributed", description="TrainJob runtimeRef.")
    resources: dict[str, str | int] = Field({}, description="Per-node limits, e.g. {nvidia.com/gpu: 8}.")
    volumes: list[dict[str, Any]] = Field([], description="Pod volumes, each with a mountPath.")
    service_account: str | None = Field(None, description="Service account of the pods.")


class LauncherConfig(ConfigModel):
    kind: Literal["local", "multinode", "slurm", "kubernetes"] = Field(
        "local", description="torchrun here, torchrun on several hosts, Slurm, or a Kubeflow job.")
    nproc_per_node: int = Field(2, ge=1, description="Ranks per node (one per GPU on GPU nodes).")
    nnodes: int = Field(1, ge=1, description="Number of nodes.")
    rdzv_endpoint: str | None = Field(None, description="host:port of the c10d rendezvous (multinode).")
    max_restarts: int = Field(0, ge=0, description="Worker-group restarts after a failure (resume).")
    env: dict[str, str] = Field({}, description="Environment of every rank, whatever the kind.")
    slurm: SlurmOptions = Field(SlurmOptions(), description="Used when kind='slurm'.")
    kubernetes: KubernetesOptions = Field(KubernetesOptions(), description="Used when kind='kubernetes'.")

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        # The Slurm script exports each key unquoted: it must be a plain name.
        for k, val in v.items():
            if not _ENV_NAME.fullmatch(k):
                raise ValueError(f"env key {k!r} is not a variable name ([A-Za-z_][A-Za-z0-9_]*)")
        return v

    @model_validator(mode="after")
    def _check(self) -> LauncherConfig:
        if self.kind == "local" and self.nnodes > 1:
            raise ValueError("kind='local' runs on this machine; use kind='multinode' for nnodes > 1")
        if self.kind == "multinode" and not self.rdzv_endpoint:
            raise ValueError("kind='multinode' needs rdzv_endpoint (host:port)")
        if self.kind == "kubernetes" and not self.kubernetes.image:
            raise ValueError("kind='kubernetes' needs kubernetes.image")
        return self

