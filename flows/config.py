"""PipelineConfig: the whole pipeline the flow runs (which stages, each stage's config, and
the launcher and tracking they share); flows.dag turns it into edges and stage specs."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from core.config import ConfigModel, ensure_within
from core.tracking import TrackingConfig
from registry.mlflow_registry import RegistryConfig
from stages.config import STAGES, DataPrepConfig, DistillConfig, DPOConfig, EvalConfig, SFTConfig, check_layout
from stages.launch.config import LauncherConfig


class StagesEnabled(ConfigModel):
    data_prep: bool = Field(True, description="Tokenizer, synthetic suite, splits.")
    sft_teacher: bool = Field(True, description="Fine-tune the teacher.")
    sft_student: bool = Field(True, description="Fine-tune the student.")
    distill: bool = Field(True, description="Distill the teacher into the student.")
    dpo: bool = Field(True, description="Preference-optimize the student.")
    evaluate: bool = Field(True, description="Evaluate and compare; gates promotion.")


class PipelineConfig(ConfigModel):
    name: str = Field("demo", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Run dir name.")
    workspace: str = Field("runs", description="Root of all stage outputs.")
    stages: StagesEnabled = Field(StagesEnabled(), description="Which stages run.")
    data_prep: DataPrepConfig = Field(DataPrepConfig(), description="Data preparation.")
    sft_teacher: SFTConfig = Field(SFTConfig(), description="SFT of the teacher.")
    sft_student: SFTConfig = Field(SFTConfig(), description="SFT of the student.")
    distill: DistillConfig = Field(DistillConfig(), description="Teacher -> student distillation.")
    dpo: DPOConfig = Field(DPOConfig(), description="Preference optimization.")
    evaluate: EvalConfig = Field(EvalConfig(), description="Evaluation.")
    tracking: TrackingConfig = Field(TrackingConfig(), description="MLflow, unless a stage sets its own.")
    launcher: LauncherConfig = Field(LauncherConfig(), description="Launcher, unless a stage sets its own.")
    registry: RegistryConfig = Field(RegistryConfig(), description="Model registry and promotion.")
    schedule: str | None = Field("0 3 * * 1", description="Deployment cron (Mon 03:00); None = manual.")
    stage_retries: int = Field(2, ge=0, description="Retries of a failed stage (it resumes from its checkpoint).")
    retry_delay_s: float = Field(10.0, ge=0, description="First retry delay; each next one is 3x longer.")

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

    @model_validator(mode="after")
    def _check(self) -> PipelineConfig:
        if not self.enabled_stages():
            raise ValueError("stages: every stage is disabled")
        dirs: dict[Path, str] = {}
        for i, s in enumerate(STAGES):
            cfg = getattr(self, s)
            for ref in ("init_from", "teacher_from"):
                if (up := getattr(cfg, ref, None)) is not None and STAGES.index(up) >= i:
                    raise ValueError(f"{s}.{ref}: {up!r} does not run before {s!r}")
            if (d := self.stage_dir(s)) in dirs:  # stage_dir raises if output_dir escapes
                raise ValueError(f"{s}.output_dir: same directory as {dirs[d]}.output_dir")
            dirs[d] = s
            data = getattr(cfg, "data", None)
            enabled = getattr(self.stages, s)
            if enabled and hasattr(cfg, "parallel") and cfg.launcher is None:
                try:
                    check_layout(cfg.parallel, self.launcher)
                except ValueError as e:
                    raise ValueError(f"{s}.{e}") from None
            if data is not None and not data.sources and enabled and not self.stages.data_prep:
                raise ValueError(f"{s}.data.sources is empty and stages.data_prep is disabled")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.workspace) / self.name

    def stage_dir(self, name: str) -> Path:
        """The output dir of stage `name`; ValueError if a custom one escapes the workspace."""
        custom = getattr(self, name).output_dir
        if custom is None:
            return self.run_dir / name
        try:
            return ensure_within(self.workspace, Path(self.name) / custom)
        except ValueError as e:
            raise ValueError(f"{name}.output_dir: {e} (the workspace)") from None

    def enabled_stages(self) -> list[str]:
        return [s for s in STAGES if getattr(self.stages, s)]

