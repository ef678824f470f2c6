"""The model a stage loads (posttrain.core.model, posttrain.registry.hf): which, in what dtype, run how."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from posttrain.core.config import ConfigModel, Dtype


class ModelConfig(ConfigModel):
    name_or_path: str = Field("debug", description="Preset name, HF checkpoint dir, or a stage output dir.")
    dtype: Dtype = Field("float32", description="Weight/compute dtype: bfloat16 on GPUs, float32 on CPU.")
    activation_checkpointing: bool | Literal["none", "full", "every_k"] = Field(
        False, description="Recompute block activations in backward: false/'none' off, true/'full' every block, "
        "'every_k' every activation_checkpointing_every-th block (selective).")
    activation_checkpointing_every: int = Field(
        2, ge=1, description="With activation_checkpointing='every_k': blocks k-1, 2k-1, ... are checkpointed.")
    compile: bool = Field(False, description="torch.compile each transformer block.")
    overrides: dict[str, Any] = Field({}, description="Architecture fields set over the preset.")
    tokenizer: str | None = Field(None, description="Tokenizer dir; None = the checkpoint's or data prep's.")
    kernels: Literal["auto", "torch"] = Field(
        "auto", description="'auto': Triton on CUDA, torch elsewhere; 'torch' forces the references.")

    @property
    def checkpoint_every(self) -> int:
        """Which blocks activation checkpointing wraps: 0 none, 1 all, k every k-th."""
        ac = self.activation_checkpointing
        if ac in (False, "none"):
            return 0
        return self.activation_checkpointing_every if ac == "every_k" else 1

