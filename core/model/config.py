"""The model a stage loads (core.model, registry.hf): which, in what dtype, run how."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from core.config import ConfigModel, Dtype


class ModelConfig(ConfigModel):
    name_or_path: str = Field("debug", description="Preset name, HF checkpoint dir, or a stage output dir.")
    dtype: Dtype = Field("float32", description="Weight/compute dtype: bfloat16 on GPUs, float32 on CPU.")
    activation_checkpointing: bool = Field(False, description="Recompute block activations in backward.")
    compile: bool = Field(False, description="torch.compile each transformer block.")
    overrides: dict[str, Any] = Field({}, description="Architecture fields set over the preset.")
    tokenizer: str | None = Field(None, description="Tokenizer dir; None = the checkpoint's or data prep's.")
    kernels: Literal["auto", "torch"] = Field(
        "auto", description="'auto': Triton on CUDA, torch elsewhere; 'torch' forces the references.")

