"""The quantized model a QAT run (or post-training quantization) exports (core/qat.py):

    quantized/
      config.json, model.safetensors, tokenizer files   an ordinary HF checkpoint whose quantized
                                                         layers hold their grid values (codes x
                                                         scales): any HF loader, the evaluate stage
                                                         and transformers read it as it is
      quantized.safetensors                              the real quantized weights under HF names:
                                                         <layer>.qweight (int8 codes; int4 values
                                                         in [-8, 7]) and <layer>.scales (float32)
      quantization.json                                  the scheme: weights, group_size,
                                                         activations, the layers

The float image and the codes agree exactly (`load_codes` + posttrain.core.qat.dequantize_state give the
image's weights bit for bit). Activation quantization (qat.activations: int8) is recorded in
quantization.json for the runtime; the float image computes with float inputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from posttrain.core.qat import QATConfig, dequantize_weight, quantize_weight, quantized_layers
from posttrain.registry.hf import ADAPTERS, save_pretrained

CODES = "quantized.safetensors"
SCHEME = "quantization.json"


def save_quantized(model, path: str | Path, qat: QATConfig, state: dict[str, torch.Tensor] | None = None,
                   dtype: torch.dtype | None = None) -> Path:
    """Quantize `model`'s weights (or `state`, e.g. LoRA-merged, under the model's own names) by
    qat's scheme and write the directory above at `path`."""
    path = Path(path)
    state = dict(model.state_dict() if state is None else state)
    adapter = ADAPTERS[model.args.family]
    names = quantized_layers(model, qat)
    codes: dict[str, torch.Tensor] = {}
    for key in names:
        weight = state[key]
        q, scales = quantize_weight(weight, qat)
        state[key] = dequantize_weight(q, scales, dtype or weight.dtype)
        [(hf_name, _)] = list(adapter.to_hf(key, weight))  # a linear weight: one HF tensor
        stem = hf_name.removesuffix(".weight")
        codes[f"{stem}.qweight"], codes[f"{stem}.scales"] = q.contiguous(), scales.contiguous()
    save_pretrained(model, path, dtype=dtype, state=state)
    save_file(codes, str(path / CODES), metadata={"format": "posttrain-qat"})
    hf_layers = sorted(k.removesuffix(".qweight") for k in codes if k.endswith(".qweight"))
    (path / SCHEME).write_text(json.dumps({"weights": qat.weights, "group_size": qat.group_size if qat.weights == "int4"
                                           else None, "granularity": "per_group" if qat.weights == "int4"
                                           else "per_channel", "symmetric": True, "activations": qat.activations,
                                           "layers": hf_layers}, indent=2) + "\n")
    return path


def load_codes(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The real quantized weights (HF names) and the scheme of a `save_quantized` directory."""
    path = Path(path)
    return load_file(str(path / CODES)), json.loads((path / SCHEME).read_text())
