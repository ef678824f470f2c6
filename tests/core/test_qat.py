"""qat: (core/qat.py) against torchao: a QAT model's forward is torchao's FakeQuantizedLinear model's
bit for bit; a LoRA layer fake-quantizes its merged weight and the gradient reaches the adapter;
the exported codes dequantize to exactly the fake-quantized weights; the SFT stage trains with
QAT (full and LoRA) and writes the quantized model beside the float one; what QAT cannot combine
with is refused when the config loads."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from pydantic import ValidationError
from torch.nn import functional as F

from posttrain.core.model import build_model, get_preset
from posttrain.core.qat import (QATConfig, dequantize_state, dequantize_weight, eligible, fake_quantizers, prepare_qat,
                      quantize_state, quantize_weight, quantized_layers)
from posttrain.stages.config import SFTConfig

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                reason="torchao not installed (pip install 'posttrain[optim]')")

SCHEMES = [QATConfig(weights="int4", group_size=32), QATConfig(weights="int8"),
           QATConfig(weights="int4", group_size=16, activations="int8")]


@pytest.mark.parametrize("kw,match", [
    ({"qat": {"weights": "int4"}, "precision": "fp8"}, r"qat: .* precision.mode 'fp8'"),
    ({"qat": {"weights": "int4"}, "lora": {"enabled": True, "adapter_names": ["a", "b"]}}, r"several adapters"),
    ({"qat": {"weights": "int4"}, "lora": {"enabled": True, "use_dora": True}}, r"DoRA"),
    ({"qat": {"weights": "int4"}, "parallel": {"tp": 2}}, r"qat: not under tensor parallelism"),
    ({"qat": {"weights": "int4", "group_size": 24}}, r"qat.group_size: 24 is not a power of 2"),
    ({"qat": {"activations": "int8"}}, r"qat.activations"),
])
def test_what_qat_cannot_combine_with_is_refused_when_the_config_loads(kw, match):
    with pytest.raises(ValidationError, match=match):
        SFTConfig.model_validate(kw)


@pytest.mark.parametrize("qat", SCHEMES, ids=["int4-g32", "int8-channel", "int4-g16-act8"])
def test_a_qat_model_is_torchaos_fake_quantized_model(qat):
    """The same model prepared by prepare_qat and by torchao's own QATConfig on the same layers:
    identical logits, identical gradients."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import IntxFakeQuantizeConfig
    from torchao.quantization.qat import QATConfig as TorchaoQAT

    from posttrain.core.qat import weight_config

    torch.manual_seed(0)
    ours = build_model(get_preset("debug"))
    theirs = copy.deepcopy(ours)
    n = prepare_qat(ours, qat)
    act = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False) if qat.activations == "int8" else None
    quantize_(theirs, TorchaoQAT(activation_config=act, weight_config=weight_config(qat), step="prepare"),
              filter_fn=lambda m, fqn: eligible(m, fqn, qat))
    # q k v o gate up down per block; int4 g32 leaves down_proj (input 176 = 5.5 groups) in float
    assert n == (6 if qat.group_size == 32 and qat.weights == "int4" else 7) * ours.args.num_layers
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    ids = torch.randint(0, 512, (2, 17))
    a, b = ours(ids), theirs(ids)
    assert torch.equal(a, b)
    a.square().mean().backward()
    b.square().mean().backward()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(p.grad, q.grad), name
    plain = build_model(get_preset("debug"))
    plain.load_state_dict(ours.state_dict())
    assert not torch.allclose(plain(ids), a, atol=1e-3)  # the rounding is really there


def test_lora_fake_quantizes_the_merged_weight_and_trains_the_adapter():
    from posttrain.core.lora import apply_lora

    qat = QATConfig(weights="int4", group_size=32)
    torch.manual_seed(0)
    model = build_model(get_preset("debug"))
    apply_lora(model, rank=4, alpha=8.0, targets="all-linear")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    prepare_qat(model, qat)
    layer = model.layers[0].attn.q_proj
    x = torch.randn(3, 5, layer.in_features)
    weight_fq, _ = fake_quantizers(qat)
    merged = layer.weight + layer.scaling["default"] * layer.lora_B["default"] @ layer.lora_A["default"]
    assert torch.allclose(layer(x), F.linear(x, weight_fq(merged)), atol=1e-6)
    layer(x).sum().backward()
    assert layer.lora_A["default"].grad.abs().sum() > 0 and layer.lora_B["default"].grad.abs().sum() > 0
    assert layer.weight.grad is None  # the base stays frozen


@pytest.mark.parametrize("qat", SCHEMES[:2], ids=["int4-g32", "int8-channel"])
def test_codes_dequantize_to_exactly_the_fake_quantized_weight(qat):
    torch.manual_seed(0)
    w = torch.randn(48, 64) * 0.05
    codes, scales = quantize_weight(w, qat)
    lo, hi = (-8, 7) if qat.weights == "int4" else (-128, 127)
    assert codes.dtype == torch.int8 and lo <= int(codes.min()) and int(codes.max()) <= hi
    assert scales.shape == ((48, 64 // qat.group_size) if qat.weights == "int4" else (48, 1))
    weight_fq, _ = fake_quantizers(qat)
    assert torch.equal(dequantize_weight(codes, scales), weight_fq(w))
    model = build_model(get_preset("debug"))
    names = quantized_layers(model, qat)
    state = quantize_state(model.state_dict(), names, qat)
    back = dequantize_state(state)
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[k], fake_quantizers(qat)[0](v)) for k, v in model.state_dict().items() if k in names)


# -- the SFT stage -------------------------------------------------------------------------------------

from tests.stages.test_stage_parallel import STEPS, in_process, optim, root, sft_config, steps_of  # noqa: E402,F401,I001


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_sft_stage_trains_with_qat_and_exports_the_quantized_model(root, lora):
    import json

    from posttrain.registry.hf import load_pretrained
    from posttrain.registry.quantized import load_codes

    name = f"qat-{'lora' if lora else 'full'}"
    qat = {"weights": "int4", "group_size": 16, "activations": "int8"}
    cfg = sft_config(root, name, optim=optim(2, lr=1e-2 if lora else 1e-3), qat=qat,
                     lora={"enabled": lora, "rank": 4})
    records = steps_of(in_process(cfg))
    losses = [records[s]["loss"] for s in range(1, STEPS + 1)]
    assert losses[-1] < losses[0], losses
    out = root / name
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["outputs"]["quantized"] == "quantized"
    codes, scheme = load_codes(out / "quantized")
    assert scheme["weights"] == "int4" and scheme["activations"] == "int8" and len(scheme["layers"]) == 14
    image = load_pretrained(out / "quantized").state_dict()  # the float image any HF loader reads
    float_model = load_pretrained(out / "model")
    from posttrain.core.qat import QATConfig as Q

    q = Q(**qat)
    weight_fq, _ = fake_quantizers(q)
    hf = {k.removesuffix(".qweight"): v for k, v in codes.items() if k.endswith(".qweight")}
    assert len(hf) == 14
    for key in quantized_layers(float_model, q):  # image == codes x scales == fake-quant of the trained weights
        assert torch.equal(image[key], weight_fq(float_model.state_dict()[key])), key
    from safetensors.torch import load_file

    image_hf = load_file(out / "quantized" / "model.safetensors")  # under HF names, as the codes
    for stem, q_codes in hf.items():
        assert torch.equal(dequantize_weight(q_codes, codes[f"{stem}.scales"]), image_hf[f"{stem}.weight"]), stem
    untouched = [k for k in image if k not in quantized_layers(float_model, q)]
    assert untouched and all(torch.equal(image[k], float_model.state_dict()[k]) for k in untouched)


@pytest.mark.slow
def test_qat_under_fsdp_matches_one_process(root):
    """QAT with the weights sharded by FSDP (each layer's weight gathered for its forward, then
    fake-quantized whole) against the one-process QAT run. Step 1 (the same weights) agrees to
    1e-6 / 1e-5; after it the weights differ by FSDP's reduction order (~1e-7), and a weight that
    ends up on the other side of an int4 rounding boundary moves its fake-quantized value by a
    whole step: measured 2e-4 on the loss and 7e-3 on the gradient norm by step 3, so later steps
    are held to 1e-3 and 2e-2. The exported codes agree on more than 97% of the weights."""
    import math

    from safetensors.torch import load_file

    from tests.stages.test_stage_parallel import torchrun_stage

    qat = {"weights": "int4", "group_size": 16}
    one = steps_of(in_process(sft_config(root, "qat-one", optim=optim(2), qat=qat)))
    fsdp = steps_of(torchrun_stage(sft_config(root, "qat-fsdp", optim=optim(1), qat=qat, parallel={"dp_shard": 2}),
                                   root / ".work-qat-fsdp", 2))
    assert sorted(one) == sorted(fsdp) == list(range(1, STEPS + 1))
    for s in one:
        assert one[s]["tokens"] == fsdp[s]["tokens"]
        assert math.isclose(one[s]["loss"], fsdp[s]["loss"], rel_tol=1e-3 if s > 1 else 1e-6), s
        assert math.isclose(one[s]["grad_norm"], fsdp[s]["grad_norm"], rel_tol=2e-2 if s > 1 else 1e-5), s
    a = load_file(root / "qat-one" / "quantized" / "quantized.safetensors")
    b = load_file(root / "qat-fsdp" / "quantized" / "quantized.safetensors")
    assert a.keys() == b.keys()
    codes = [k for k in a if k.endswith(".qweight")]
    same = sum(int((a[k] == b[k]).sum()) for k in codes) / sum(a[k].numel() for k in codes)
    assert same > 0.97, same  # measured 98.6%: the boundary flips above, compounded over 4 steps
