"""LoRAConfig: what core.lora.apply_lora builds (its only source of defaults)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from core.config import ConfigModel


class LoRAConfig(ConfigModel):
    enabled: bool = Field(False, description="Train low-rank adapters on a frozen base, not all weights.")
    rank: int = Field(16, gt=0, description="Adapter rank r.")
    alpha: float = Field(32.0, gt=0, description="Updates are scaled by alpha/r (alpha/sqrt(r) with rsLoRA).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input.")
    targets: list[str] = Field(
        ["all-linear"], description="Layer names or globs (q_proj, mlp.*), or 'all-linear' (not lm_head).")
    modules_to_save: list[str] = Field([], description="Modules trained in full, e.g. embed_tokens.")
    use_rslora: bool = Field(False, description="Rank-stabilized scaling alpha/sqrt(r).")
    use_dora: bool = Field(False, description="DoRA: learn a per-channel magnitude beside the direction.")
    init_lora_weights: Literal["kaiming", "gaussian", "pissa"] = Field(
        "kaiming", description="How A starts (B starts at 0); 'pissa' takes the base's top singular part.")
    quantize_base: Literal["nf4"] | None = Field(None, description="QLoRA: hold the frozen base in NF4.")
    double_quant: bool = Field(False, description="Also quantize the NF4 block scales.")
    adapter_names: list[str] = Field(
        ["default"], description="Named adapters on one base, trained in one job; the first is active.")

    @model_validator(mode="after")
    def _check(self) -> LoRAConfig:
        if not self.targets:
            raise ValueError("targets is empty; use e.g. [q_proj, v_proj] or [all-linear]")
        if "all-linear" in self.targets and len(self.targets) > 1:
            raise ValueError("targets: 'all-linear' covers every linear layer; use it alone")
        if self.double_quant and self.quantize_base is None:
            raise ValueError("double_quant needs quantize_base='nf4'")
        if self.init_lora_weights == "pissa" and self.quantize_base:
            raise ValueError("init_lora_weights='pissa' rewrites the base; not with quantize_base")
        names = self.adapter_names
        if not names or len(set(names)) != len(names) or not all(n.isidentifier() for n in names):
            raise ValueError(f"adapter_names must be unique identifiers, got {names}")
        return self

