"""Training precision (`precision:` in every training stage): which dtype the math runs in, and
which the optimizer steps.

    mode   weights the optimizer steps      compute                       gradient reductions
    full   model.dtype (float32 default)     model.dtype                    model.dtype
    bf16   float32 master copy                bfloat16 (autocast; FSDP:      float32 (reduce_dtype)
                                              MixedPrecisionPolicy too)
    fp16   float32 master copy                float16, dynamic loss scale    float32 (reduce_dtype)
    fp8    float32 master copy                float8 linear layers (torchao  float32 (reduce_dtype)
                                              Float8Linear), bfloat16 rest

`full` with model.dtype=bfloat16 is pure bf16 training: weights, gradients and AdamW moments in
bf16, no master copy (the pre-`precision` behaviour, kept because it is the lightest). In the mixed
modes the *trainable* parameters are held in float32 (a full fine-tune upcasts them, LoRA upcasts
its adapters) while frozen weights (a LoRA or QLoRA base, a teacher, a reference) keep model.dtype;
the forward runs under `torch.autocast` on every layout, and FSDP additionally gathers parameters
in the compute dtype and reduces gradients in `reduce_dtype` (MixedPrecisionPolicy), as
torchtitan and FSDP-QLoRA setups do.

fp16's gradients can overflow: `LossScaler` multiplies the loss by a scale before backward, folds
1/scale into the trainer's token normalization, halves the scale and skips the step when the
(global) gradient norm is not finite, and doubles it after `loss_scale_growth_interval` clean steps
(torch.amp.GradScaler's rule, kept in the trainer so it works on every layout: the norm it reads
is already global over FSDP, TP and PP meshes). Its state is checkpointed with the trainer's.

fp8 needs a GPU with float8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell) and
torchao; elsewhere it is refused before training starts. `fp8_emulate` runs torchao's emulation
(float8 rounding, matmuls in high precision) on any device: for tests, not for speed.

Torch-free at import, like every config module; torch is imported by the functions that need it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from posttrain.core.config import ConfigModel

if TYPE_CHECKING:
    import torch
    from torch import nn

PrecisionMode = Literal["full", "bf16", "fp16", "fp8"]
COMPUTE = {"bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}
"""The autocast / FSDP param dtype of each mixed mode (fp8: the layers torchao does not convert)."""
TORCHAO_HINT = "pip install 'posttrain[optim]' (or: pip install torchao==0.18.0)"


class PrecisionConfig(ConfigModel):
    mode: PrecisionMode = Field(
        "full", description="'full': everything in model.dtype (float32 by default; bfloat16 = pure bf16, no master "
        "weights); 'bf16' / 'fp16': mixed, float32 master weights and optimizer state, compute in bf16 / fp16 "
        "(fp16 with a dynamic loss scale); 'fp8': torchao float8 linear layers, bf16 elsewhere (CUDA sm89+).")
    reduce_dtype: Literal["float32", "compute"] = Field(
        "float32", description="Mixed modes under FSDP: gradient reduce-scatter in float32 or in the compute dtype.")
    loss_scale: float = Field(
        2.0**10, gt=0, description="fp16: the initial loss scale (the losses are token sums, so it starts lower than "
        "GradScaler's 2^16 for means; it grows while no step overflows).")
    loss_scale_growth_interval: int = Field(
        2000, ge=1, description="fp16: clean steps after which the loss scale doubles (it halves on an overflow).")
    fp8_emulate: bool = Field(
        False, description="fp8: torchao's emulation on any device (float8 rounding, high-precision matmuls); for "
        "testing the path, not for speed.")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        """`precision: bf16` means `precision: {mode: bf16}`."""
        return {"mode": v} if isinstance(v, str) else v

    @property
    def mixed(self) -> bool:
        return self.mode != "full"


def check_precision(precision: PrecisionConfig, *, lora: bool, tp: int, pp: int,
                    fsdp_param_dtype: str | None) -> None:
    """ValueError naming the key for a precision the stage's other settings cannot take (checked
    when the config loads: nothing launches)."""
    mode = precision.mode
    if mode == "fp16" and pp > 1:
        raise ValueError("precision.mode: 'fp16' under pipeline parallelism (parallel.pp > 1) is not supported: the "
                         "schedule runs the backward, so the loss scale cannot reach it; use 'bf16'")
    if mode == "fp8" and lora:
        raise ValueError("precision.mode: 'fp8' trains the linear layers' own weights in float8 matmuls; with "
                         "lora.enabled the base is frozen: use 'bf16' (or 'full') for LoRA/QLoRA")
    if mode == "fp8" and tp > 1:
        raise ValueError(f"precision.mode: 'fp8' with tensor parallelism (parallel.tp={tp}) is not supported yet; "
                         "use FSDP/DDP for fp8, or 'bf16' with tp")
    if precision.mixed and fsdp_param_dtype is not None and fsdp_param_dtype != COMPUTE[mode]:
        raise ValueError(f"parallel.mixed_precision_param: {fsdp_param_dtype} conflicts with precision.mode "
                         f"{mode!r} (which gathers FSDP parameters in {COMPUTE[mode]}); leave it unset")


def fsdp_dtypes(precision: PrecisionConfig, param: str | None, reduce: str | None) -> tuple[str | None, str | None]:
    """(param_dtype, reduce_dtype) of FSDP's MixedPrecisionPolicy under `precision`, given
    parallel.mixed_precision_param / _reduce (used as they are in mode 'full')."""
    if not precision.mixed:
        return param, reduce
    compute = COMPUTE[precision.mode]
    return compute, ("float32" if precision.reduce_dtype == "float32" else compute)


def autocast_dtype(precision: PrecisionConfig, model_dtype: str, device: torch.device) -> torch.dtype | None:
    """The dtype the trainer's forward autocasts to: the mixed mode's compute dtype; in mode
    'full', bf16 for bf16 weights on CUDA (fp32-listed ops stay fp32), else none."""
    import torch

    if precision.mixed:
        return getattr(torch, COMPUTE[precision.mode])
    return torch.bfloat16 if model_dtype == "bfloat16" and device.type == "cuda" else None


def upcast_trainable(model: nn.Module) -> int:
    """Hold every trainable parameter in float32 (the master weights of a mixed mode), frozen ones
    as they are; works on the meta device too. Returns how many were cast."""
    import torch

    n = 0
    for p in model.parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()
            n += 1
    return n


def check_fp8_device(precision: PrecisionConfig, device: torch.device) -> None:
    """RuntimeError unless this device can run float8 matmuls (CUDA sm89+), or emulation is asked."""
    import torch

    if precision.mode != "fp8" or precision.fp8_emulate:
        return
    if device.type != "cuda":
        raise RuntimeError(f"precision.mode='fp8' needs a CUDA GPU with float8 tensor cores (compute capability 8.9+: "
                           f"Ada, Hopper, Blackwell); this rank runs on {device.type}. Use 'bf16', or "
                           "precision.fp8_emulate=true to test the path")
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise RuntimeError(f"precision.mode='fp8' needs compute capability 8.9+ (Ada, Hopper, Blackwell); "
                           f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}. Use 'bf16'")


def fp8_eligible(module: nn.Module, fqn: str) -> bool:
    """The linear layers float8 trains: every block's projections whose dims float8 matmuls take
    (multiples of 16); not the LM head (its logits feed the loss, kept in bf16 as is usual), not an
    MoE router (tiny, and its softmax wants precision)."""
    from torch import nn

    if not isinstance(module, nn.Linear) or fqn.endswith(("lm_head", ".gate", "shared_expert_gate")):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_fp8(model: nn.Module, precision: PrecisionConfig) -> int:
    """Swap the eligible linear layers for torchao's Float8Linear (dynamic tensorwise scaling:
    e4m3 inputs and weights, e5m2 gradients). Before parallelizing; the weights keep their names,
    so checkpoints load and export as before. Returns the number converted."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as e:
        raise ImportError(f"precision.mode='fp8' needs torchao: {TORCHAO_HINT} ({e})") from None
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=precision.fp8_emulate),
                               module_filter_fn=fp8_eligible)
    return sum(isinstance(m, Float8Linear) for m in model.modules())


class LossScaler:
    """A dynamic loss scale for fp16 (module docstring). The trainer multiplies each micro-batch's
    loss by `scale` before backward and divides the gradients by it before clipping; `update` is
    told whether the step's unscaled gradient norm was finite."""

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, min_scale: float = 1.0):
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.growth_factor, self.backoff_factor, self.min_scale = growth_factor, backoff_factor, min_scale
        self.clean_steps = 0
        self.overflows = 0

    @classmethod
    def from_config(cls, precision: PrecisionConfig) -> LossScaler | None:
        if precision.mode != "fp16":
            return None
        return cls(precision.loss_scale, precision.loss_scale_growth_interval)

    def update(self, finite: bool) -> bool:
        """Account for a step; True when it overflowed and the scale could still back off (the
        step is then a routine skip, not a bad step). At the minimum scale an overflow is the
        model's, not the scale's: False, and the trainer reports a non-finite step."""
        if finite:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps = 0
            return False
        self.clean_steps = 0
        if self.scale <= self.min_scale:
            return False
        self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        self.overflows += 1
        return True

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.overflows = int(state.get("overflows", 0))
