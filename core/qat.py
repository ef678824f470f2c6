"""Quantization-aware training (`qat:` in every training stage): the transformer blocks' linear
layers see fake-quantized weights (int4 per group or int8 per output channel, symmetric) and,
optionally, fake-quantized inputs (int8 per token, asymmetric, dynamic) while they train, so the
model learns around the rounding it will be deployed with; the stage then converts the result to
the real quantized weights (integer codes and scales) for export.

The numerics are torchao's (`torchao.quantization.qat.IntxFakeQuantizer`: its quantization
parameters, rounding, clamping and straight-through gradient; `quantize_affine` for the codes), so
a model trained here and a model trained with torchao's own `QATConfig` see the same values
(tests/core/test_qat.py checks a layer against torchao's FakeQuantizedLinear bit for bit). What is
written here is where the fake quantizer applies, because torchao's `quantize_` swaps plain
`nn.Linear` modules and cannot see a LoRA update:

- full fine-tuning: each block linear becomes a `QATLinear` (an nn.Linear whose forward
  fake-quantizes its weight and input; same parameters and state-dict keys, so checkpoints,
  FSDP/TP and export see the usual model);
- LoRA: the *merged* weight W + s B A is fake-quantized (`LoRALinear.qat`), since the merged model
  is what gets quantized at export; the straight-through gradient reaches A and B.

The LM head, embedding and MoE routers stay as they are (the usual int4 recipes keep them in
16 bits). Conversion (`quantize_state`): per layer int8-stored codes (int4 values in [-8, 7]) and
float32 scales; `dequantize_state` gives back the exact grid values, which is also the float model
an HF loader reads (registry/quantized.py writes both).

Torch-free at import, like every config module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from posttrain.core.config import ConfigModel

if TYPE_CHECKING:
    import torch
    from torch import nn

TORCHAO_HINT = "pip install 'posttrain[optim]' (or: pip install torchao==0.18.0)"


class QATConfig(ConfigModel):
    weights: Literal["none", "int4", "int8"] = Field(
        "none", description="Fake-quantize the blocks' linear weights while training: 'int4' per group of group_size "
        "input columns, 'int8' per output channel (symmetric); 'none' = no QAT.")
    group_size: int = Field(32, ge=8, description="int4: input columns sharing one scale (a power of 2).")
    activations: Literal["none", "int8"] = Field(
        "none", description="Also fake-quantize the linear layers' inputs: 'int8' per token, asymmetric, dynamic.")

    @property
    def enabled(self) -> bool:
        return self.weights != "none"


def check_qat(qat: QATConfig, *, precision: str, multi_adapter: bool, dora: bool, quantize_base: bool,
              tp: int) -> None:
    """ValueError naming the key for what QAT does not combine with (checked at config load)."""
    if not qat.enabled:
        if qat.activations != "none":
            raise ValueError("qat.activations: activation fake quantization goes with qat.weights int4 or int8")
        return
    if qat.group_size & (qat.group_size - 1):
        raise ValueError(f"qat.group_size: {qat.group_size} is not a power of 2")
    if precision == "fp8":
        raise ValueError("qat: fake-quantized weights and precision.mode 'fp8' both replace the linear layers' math; "
                         "pick one")
    if tp > 1:
        raise ValueError(f"qat: not under tensor parallelism (parallel.tp={tp}) yet; QAT runs under FSDP, DDP, CP and "
                         "on one process")
    for flag, what in ((multi_adapter, "several adapters (lora.adapter_names)"), (dora, "DoRA (lora.use_dora)"),
                       (quantize_base, "QLoRA (lora.quantize_base)")):
        if flag:
            raise ValueError(f"qat: not with {what}; QAT fake-quantizes one merged weight per layer")


def _torchao():
    try:
        from torchao.quantization.qat import IntxFakeQuantizeConfig
        from torchao.quantization.qat.fake_quantizer import IntxFakeQuantizer
    except ImportError as e:
        raise ImportError(f"qat needs torchao: {TORCHAO_HINT} ({e})") from None
    return IntxFakeQuantizeConfig, IntxFakeQuantizer


def weight_config(qat: QATConfig):
    """torchao's IntxFakeQuantizeConfig for the weights."""
    import torch

    cfg, _ = _torchao()
    if qat.weights == "int4":
        return cfg(torch.int4, group_size=qat.group_size, is_symmetric=True)
    return cfg(torch.int8, "per_channel", is_symmetric=True)


def fake_quantizers(qat: QATConfig) -> tuple[nn.Module, nn.Module | None]:
    """(weight fake quantizer, input fake quantizer or None): stateless torchao modules."""
    import torch

    cfg, fq = _torchao()
    act = fq(cfg(torch.int8, "per_token", is_symmetric=False)) if qat.activations == "int8" else None
    return fq(weight_config(qat)), act


def eligible(module: nn.Module, fqn: str, qat: QATConfig) -> bool:
    """The linear layers QAT trains: the blocks' projections (not the head, not an MoE router),
    whose input width divides into int4 groups."""
    from torch import nn

    from posttrain.core.lora.layer import LoRALinear

    if not isinstance(module, (nn.Linear, LoRALinear)) or not fqn.startswith("layers."):
        return False
    if fqn.endswith((".gate", "shared_expert_gate")):
        return False
    return qat.weights != "int4" or module.in_features % qat.group_size == 0


def prepare_qat(model: nn.Module, qat: QATConfig) -> int:
    """Fake quantization on every eligible layer, in place (before parallelizing); returns how
    many layers got it."""
    from posttrain.core.lora.layer import LoRALinear

    n = 0
    for fqn, module in list(model.named_modules()):
        if not eligible(module, fqn, qat):
            continue
        weight_fq, act_fq = fake_quantizers(qat)
        if isinstance(module, LoRALinear):
            module.qat_weight, module.qat_input = weight_fq, act_fq
        else:
            module.__class__ = qat_linear_class()
            module.qat_weight, module.qat_input = weight_fq, act_fq
        n += 1
    if n == 0:
        raise ValueError(f"qat: no linear layer takes {qat.weights} quantization (int4 needs input widths divisible "
                         f"by group_size={qat.group_size})")
    return n


_QAT_LINEAR: type | None = None


def qat_linear_class() -> type:
    """QATLinear: built on first use (it needs torch; this module imports without it)."""
    global _QAT_LINEAR
    if _QAT_LINEAR is not None:
        return _QAT_LINEAR
    from torch import nn
    from torch.nn import functional as F

    class QATLinear(nn.Linear):
        """nn.Linear training against its deployed rounding: forward(x) = fq_in(x) fq_w(W)^T + b.
        Same parameters, same state-dict keys (the fake quantizers hold no state)."""

        qat_weight: nn.Module
        qat_input: nn.Module | None

        def forward(self, x):
            if self.qat_input is not None:
                x = self.qat_input(x)
            return F.linear(x, self.qat_weight(self.weight), self.bias)

    _QAT_LINEAR = QATLinear
    return QATLinear


def quantized_layers(model: nn.Module, qat: QATConfig) -> list[str]:
    """The HF-side names (`<module>.weight`) of the weights `quantize_state` converts: the layers
    `prepare_qat` fake-quantizes."""
    return [f"{fqn}.weight" for fqn, m in model.named_modules() if eligible(m, fqn, qat)]


def quantize_weight(w: torch.Tensor, qat: QATConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of one weight (out, in) under qat's scheme, with the fake quantizer's
    parameters: codes int8 (int4 values in [-8, 7]), scales float32 (out, in / group_size) or
    (out, 1). dequantize_weight(codes, scales) is exactly the fake-quantized weight."""
    import torch
    from torchao.quantization.quant_primitives import quantize_affine

    weight_fq, _ = fake_quantizers(qat)
    with torch.no_grad():
        weight_fq(w.float())  # computes the quantization parameters, as in training
        lo, hi = (-8, 7) if qat.weights == "int4" else (-128, 127)
        codes = quantize_affine(w.float(), _block(w, qat), weight_fq.scale, weight_fq.zero_point, torch.int8, lo, hi)
    return codes, weight_fq.scale.float().reshape(w.shape[0], -1)


def dequantize_weight(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The grid values codes x scale (symmetric: no zero point), each scale over its group."""
    import torch

    group = codes.shape[1] // scales.shape[1]
    w = codes.float().reshape(codes.shape[0], scales.shape[1], group) * scales.float()[..., None]
    return w.reshape(codes.shape).to(dtype or torch.float32)


def _block(w: torch.Tensor, qat: QATConfig) -> tuple[int, int]:
    return (1, qat.group_size) if qat.weights == "int4" else (1, w.shape[1])


def quantize_state(state: dict[str, torch.Tensor], names: list[str], qat: QATConfig) -> dict[str, torch.Tensor]:
    """The converted model: for each name in `names`, `<name>.qweight` (int8 codes) and
    `<name>.scales`; every other tensor as it is."""
    out = {}
    for key, value in state.items():
        if key in names:
            codes, scales = quantize_weight(value, qat)
            stem = key.removesuffix(".weight")
            out[f"{stem}.qweight"], out[f"{stem}.scales"] = codes, scales
        else:
            out[key] = value
    return out


def dequantize_state(quantized: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """quantize_state's inverse up to the rounding: each `.qweight`/`.scales` pair back to a
    `.weight` of grid values."""
    out = {}
    for key, value in quantized.items():
        if key.endswith(".scales"):
            continue
        if key.endswith(".qweight"):
            stem = key.removesuffix(".qweight")
            out[f"{stem}.weight"] = dequantize_weight(value, quantized[f"{stem}.scales"], dtype)
        else:
            out[key] = value
    return out
