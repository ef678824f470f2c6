"""ReliabilityConfig: the thresholds and timeouts posttrain.core.reliability enforces."""

from __future__ import annotations

from pydantic import Field, model_validator

from posttrain.core.config import ConfigModel


class ReliabilityConfig(ConfigModel):
    """How a training stage survives bad steps, hangs and preemption (posttrain.core.reliability)."""

    spike_zscore: float = Field(
        6.0, ge=0, description="Skip a step whose loss is this many std devs above the recent mean; 0 = off.")
    spike_window: int = Field(
        100, ge=2, description="Recent accepted step losses the z-score uses; active once half full.")
    max_bad_steps: int = Field(
        5, ge=0, description="After this many skipped steps in a row (non-finite or spike), roll back to "
                             "the last checkpoint, keeping the data position; 0 = never roll back.")
    max_rollbacks: int = Field(3, ge=0, description="Rollbacks allowed in one run before it fails as diverged.")
    collective_timeout_s: float = Field(
        1800.0, gt=0, description="Timeout of every collective (init_process_group); past it the rank fails.")
    hang_timeout_s: float = Field(
        900.0, ge=0, description="Watchdog: a rank without progress this long dumps every rank's stack and "
                                 "ends the job (must exceed the longest step, eval or save); 0 = off.")
    preempt_grace_s: float = Field(
        60.0, gt=0, description="After SIGTERM: time to write a final checkpoint and exit (code 75) before a "
                                "hard exit; keep it below the scheduler's kill delay (torchrun: 30 s).")

    @model_validator(mode="after")
    def _check(self) -> ReliabilityConfig:
        if self.hang_timeout_s and self.hang_timeout_s >= self.collective_timeout_s:
            raise ValueError(f"hang_timeout_s={self.hang_timeout_s} must be below collective_timeout_s="
                             f"{self.collective_timeout_s}: the watchdog dumps the stacks before a collective "
                             "times out and ends the job without them")
        return self

