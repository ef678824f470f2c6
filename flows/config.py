"""PipelineConfig: a DAG of nodes the user writes, plus the launcher, tracking, registry and
resources they share. posttrain.flows.dag expands and wires it; posttrain.flows.pipeline runs it.

    nodes:
      prep:    {kind: data_prep, synthetic_size: 3000}
      teacher: {kind: sft, model: {name_or_path: debug, overrides: {...}}, data: prep}
      student: {kind: sft, model: debug, data: prep, sweep: {lora.rank: [8, 16]}}
      kd:      {kind: distill, model: student, teacher: teacher, data: prep}
      dpo:     {kind: dpo, model: kd, data: prep, pairs: on_policy, rounds: 2}
      eval:    {kind: evaluate, models: [student, kd, dpo], data: prep, select: {metric: exact_match}}

A node is a stage of one `kind` with that kind's settings (stages/config.py) and names other nodes
wherever it takes a model or data. `sweep` expands a node over the grid of the listed values
(`name@rank=8`, ...), `rounds` (DPO) chains K copies, each starting from the one before
(`name@r1` ... `name@rK`); posttrain.flows.dag documents how references to expanded nodes resolve.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from posttrain.core.config import ConfigModel, ensure_within
from posttrain.core.tracking import TrackingConfig
from posttrain.flows.nodes import NODE_CLASSES, NODE_NAME, Node, node_error, with_defaults
from posttrain.registry.mlflow_registry import RegistryConfig
from posttrain.stages.config import KINDS
from posttrain.stages.launch.config import LauncherConfig

_LEGACY = ("stages", "data_prep", "sft_teacher", "sft_student", "distill", "dpo", "evaluate")


class ResourcesConfig(ConfigModel):
    gpus: int | None = Field(None, ge=0, description="GPUs nodes are assigned from (CUDA_VISIBLE_DEVICES, "
                                                     "disjoint per node); None = those visible to the flow.")
    cpu_slots: int | None = Field(None, ge=1, description="Ranks CPU nodes may run at once; None = the CPU count.")
    share_gpus: bool = Field(False, description="Let concurrent nodes share GPUs (otherwise they queue).")


class PipelineConfig(ConfigModel):
    name: str = Field("demo", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Run dir name.")
    workspace: str = Field("runs", description="Root of all node outputs: <workspace>/<name>/<node>.")
    nodes: dict[str, Node] = Field(description="The DAG: node name -> a stage of a kind, with its settings.")
    tracking: TrackingConfig = Field(TrackingConfig(), description="MLflow, unless a node sets its own.")
    launcher: LauncherConfig = Field(LauncherConfig(), description="Launcher, unless a node sets its own.")
    registry: RegistryConfig = Field(RegistryConfig(), description="Model registry and promotion.")
    resources: ResourcesConfig = Field(ResourcesConfig(), description="Devices concurrent nodes share.")
    lock_wait_s: float = Field(
        0.0, ge=0, description="How long a node waits for another run holding its output dir; 0 = fail at once.")
    # Serve-time settings (`posttrain serve` builds the scheduled deployment from them): a run never
    # reads them, so they are left out of the flow's parameter schema (the run form) and of the
    # deployments' parameters (flows/form.py: SERVE_ONLY).
    schedule: SkipJsonSchema[str | None] = Field("0 3 * * 1", description="Deployment cron (Mon 03:00); "
                                                                          "None = manual.")
    schedule_timezone: SkipJsonSchema[str | None] = Field(
        None, description="IANA timezone the cron runs in (e.g. Europe/Paris); None = this machine's.")
    stage_retries: int = Field(2, ge=0, description="Retries of a failed node (it resumes from its checkpoint).")
    retry_delay_s: float = Field(10.0, ge=0, description="First retry delay; each next one is 3x longer.")

    @model_validator(mode="before")
    @classmethod
    def _nodes_first(cls, data: Any) -> Any:
        """Old `stages:`-style configs get a message saying how to convert; each node is validated on
        its own first, so every message names the node and the key path (nodes.kd.lora.rank)."""
        if not isinstance(data, dict):
            return data
        legacy = [k for k in _LEGACY if k in data]
        if legacy:
            raise ValueError(f"{', '.join(legacy)}: this is the old fixed-chain format; pipelines are now a DAG "
                             "under `nodes:` (see configs/demo.yaml). Convert it with "
                             "`posttrain config --convert OLD.yaml > NEW.yaml`")
        nodes = data.get("nodes")
        if not isinstance(nodes, dict):
            return data
        if not nodes:
            raise ValueError("nodes: the pipeline has no nodes")
        errors, merged = [], {}
        for name, node in nodes.items():
            if not isinstance(name, str) or not re.match(NODE_NAME, name):
                shown = name if isinstance(name, str) and name.isprintable() else repr(name)  # one line
                errors.append(f"nodes.{shown}: node names are letters, digits, '_' and '-', starting with a letter")
                continue
            if not isinstance(node, dict):
                errors.append(f"nodes.{name}: expected a mapping with a `kind`, got {type(node).__name__}")
                continue
            kind = node.get("kind")
            if not isinstance(kind, str) or kind not in NODE_CLASSES:
                errors.append(f"nodes.{name}.kind: {'missing' if kind is None else repr(kind)}; "
                              f"one of {', '.join(KINDS)}")
                continue
            merged[name] = node = with_defaults(NODE_CLASSES[kind], node)
            try:
                NODE_CLASSES[kind].model_validate(node)
            except ValidationError as e:
                errors.append(node_error(name, NODE_CLASSES[kind], e))
        if errors:
            raise ValueError("\n".join(errors))
        return {**data, "nodes": merged}

    @field_validator("workspace")
    @classmethod
    def _workspace(cls, v: str) -> str:
        # A relative workspace is read on whichever worker runs the flow; `..` makes that ambiguous.
        if ".." in Path(v).parts:
            raise ValueError(f"workspace {v!r} contains '..'; use an absolute path")
        return v

    @field_validator("schedule")
    @classmethod
    def _cron(cls, v: str | None) -> str | None:
        if v is not None and len(v.split()) != 5:
            raise ValueError(f"schedule {v!r} is not a 5-field cron expression")
        return v

    @field_validator("schedule_timezone")
    @classmethod
    def _timezone(cls, v: str | None) -> str | None:
        from zoneinfo import ZoneInfo

        if v is not None:
            try:
                ZoneInfo(v)
            except (ValueError, KeyError, OSError):
                raise ValueError(f"schedule_timezone {v!r} is not an IANA timezone (e.g. Europe/Paris, UTC)") from None
        return v

    @model_validator(mode="after")
    def _check(self) -> PipelineConfig:
        from posttrain.flows.dag import PipelineDAG

        dag = PipelineDAG(self)  # expansion, references, types, cycles, layouts, files: ValueError naming the node
        base = self.registry.baseline
        if base not in (None, "auto") and base not in dag.nodes and base not in dag.members:
            raise ValueError(f"registry.baseline: {base!r} is not a node ({', '.join(dag.nodes)}); name the "
                             "evaluated model the candidate must beat, or 'auto', or null")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.workspace) / self.name

    def node_dir(self, name: str, custom: str | None = None) -> Path:
        """The output dir of node `name`; ValueError if a custom one escapes the workspace."""
        if custom is None:
            return self.run_dir / name
        try:
            return ensure_within(self.workspace, Path(self.name) / custom)
        except ValueError as e:
            raise ValueError(f"nodes.{name.split('@')[0]}.output_dir: {e} (the workspace)") from None
