"""CheckpointConfig: how often posttrain.core.checkpoint saves, how many it keeps, and resume."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from posttrain.core.config import ConfigModel


class CheckpointConfig(ConfigModel):
    interval_steps: int = Field(100, ge=0, description="Save every N steps; 0 = only at the end.")
    keep_last: int = Field(2, ge=1, description="Complete checkpoints kept.")
    async_save: bool = Field(False, description="Save in the background while training goes on.")
    resume: bool = Field(True, description="Resume from the latest complete checkpoint if there is one.")
    on_save_error: Literal["fail", "continue"] = Field(
        "fail", description="A failed periodic save stops the job, or is logged and retried next time.")

