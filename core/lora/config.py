"""LoRAConfig: what posttrain.core.lora.apply_lora builds (its only source of defaults)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from posttrain.core.config import ConfigModel


class LoRAConfig(ConfigModel):
    enabled: bool = Field(False, description="Train low-rank adapters on a frozen base, not all weights.")
    rank: int = Field(16, gt=0, description="Adapter rank r.")
    alpha: float = Field(32.0, gt=0, description="Updates are scaled by alpha/r (alpha/sqrt(r) with rsLoRA).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input.")
    targets: list[str] = Field(
        ["all-linear"], description="Layer names or globs (q_proj, mlp.*), or 'all-linear' (not lm_head).")
    modules_to_save: list[str] = Field([], description="Modules trained in full, e.g. embed_tokens.")
    experts: bool = Field(False, description="Also adapt every MoE expert: one low-rank update per expert of its "
                          "gate+up and down weights (peft's target_parameters on HF's stacked experts).")
    use_rslora: bool = Field(False, description="Rank-stabilized scaling alpha/sqrt(r).")
    use_dora: bool = Field(False, description="DoRA: learn a per-channel magnitude beside the direction.")
    init_lora_weights: Literal["kaiming", "gaussian", "pissa"] = Field(
        "kaiming", description="How A starts (B starts at 0); 'pissa' takes the base's top singular part.")
    quantize_base: Literal["nf4"] | None = Field(None, description="QLoRA: hold the frozen base in NF4.")
    double_quant: bool = Field(False, description="Also quantize the NF4 block scales.")
    adapter_names: list[str] = Field(
        ["default"], description="Named adapters on one base, trained in one job; the first is active. With "
                                 "several, each example trains the one its row names (adapter_column) or its "
                                 "source maps to (adapter_sources); each is exported on its own.")
    adapter_column: str = Field(
        "adapter", description="With several adapters: the data field naming each row's adapter.")
    adapter_sources: dict[str, list[str]] = Field(
        {}, description="With several adapters: adapter -> data sources (paths as in data.sources) whose every "
                        "row trains it, instead of naming it in adapter_column.")
    adapter_lr: dict[str, float] = Field(
        {}, description="Peak learning rate per adapter (its own parameter group); the others use optim.lr.")

    @field_validator("adapter_sources", mode="before")
    @classmethod
    def _one_source(cls, v):
        """`{a: data/a.jsonl}` means `{a: [data/a.jsonl]}`."""
        return {k: [s] if isinstance(s, str) else s for k, s in v.items()} if isinstance(v, dict) else v

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
        for key in ("adapter_sources", "adapter_lr"):
            unknown = sorted(set(getattr(self, key)) - set(names))
            if unknown:
                raise ValueError(f"{key} names {unknown}, which are not in adapter_names {names}")
        if any(lr <= 0 for lr in self.adapter_lr.values()):
            raise ValueError(f"adapter_lr: learning rates must be > 0, got {self.adapter_lr}")
        twice = [s for s in {s for v in self.adapter_sources.values() for s in v}
                 if sum(s in v for v in self.adapter_sources.values()) > 1]
        if twice:
            raise ValueError(f"adapter_sources: {twice[0]!r} is mapped to more than one adapter")
        if self.multi and self.init_lora_weights == "pissa":
            raise ValueError("init_lora_weights='pissa' moves part of the base into each adapter; several adapters "
                             "share one base, so use kaiming or gaussian")
        if self.multi and self.modules_to_save:
            raise ValueError("modules_to_save trains shared weights, which every adapter's examples would move; "
                             "with several adapter_names train adapters only")
        if self.experts and (self.multi or self.use_dora or self.quantize_base or self.init_lora_weights == "pissa"):
            raise ValueError("experts: LoRA on MoE experts takes one plain adapter (no several adapter_names, DoRA, "
                             "QLoRA or PiSSA)")
        if self.experts and self.dropout:
            raise ValueError("dropout: LoRA on MoE experts (experts: true) folds each expert's update into its "
                             "weights, so there is no adapter input to drop; set dropout to 0")
        if not self.multi and self.adapter_sources:
            raise ValueError("adapter_sources routes data to one of several adapter_names; there is one")
        return self

    @property
    def multi(self) -> bool:
        """Several adapters trained at once, each example routed to its own."""
        return len(self.adapter_names) > 1

