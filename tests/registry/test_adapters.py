"""Adapters trained here load with peft onto the transformers model and give the same logits."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.core.lora import apply_lora, lora_parameters
from posttrain.registry.adapters import load_adapter, save_adapter
from posttrain.registry.hf import CheckpointError, load_pretrained
from tests.support.hf_models import make_hf_model


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    make_hf_model("qwen2", path)
    return path


@pytest.mark.parametrize("use_dora", [False, True])
def test_adapter_loads_in_peft_with_same_logits(qwen_dir, tmp_path, use_dora):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ours = load_pretrained(qwen_dir).eval()
    apply_lora(ours, rank=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"], use_dora=use_dora,
               use_rslora=True)
    with torch.no_grad():  # a trained-looking adapter: B is not zero
        for p in lora_parameters(ours):
            p.add_(torch.randn_like(p) * 0.05)
    save_adapter(ours, tmp_path / "adapter", base_model=str(qwen_dir))
    hf = AutoModelForCausalLM.from_pretrained(qwen_dir, attn_implementation="sdpa")
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (peft_model(ids).logits - ours(ids)).abs().max().item()
    assert diff < 1e-4, diff

    # and back: a PEFT directory loads here onto a fresh base
    fresh = load_pretrained(qwen_dir).eval()
    wrapped = load_adapter(fresh, tmp_path / "adapter")
    assert len(wrapped) == 3 * 3  # three targets in each of the three layers
    with torch.no_grad():
        assert (fresh(ids) - ours(ids)).abs().max() < 1e-5


def test_bad_adapters_are_rejected(qwen_dir, tmp_path):
    ours = load_pretrained(qwen_dir)
    apply_lora(ours, rank=2, alpha=4, targets=["q_proj"])
    out = save_adapter(ours, tmp_path / "a")
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg["peft_type"] = "IA3"
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="peft_type 'IA3'"):
        load_adapter(load_pretrained(qwen_dir), out)
    with pytest.raises(CheckpointError, match="adapter_config.json: missing"):
        load_adapter(load_pretrained(qwen_dir), tmp_path / "nowhere")
    with pytest.raises(ValueError, match="no path parts"):
        save_adapter(ours, tmp_path / "b", name="../escape")


@pytest.mark.parametrize("quantize", [False, True])
def test_merged_export_equals_adapter_model(qwen_dir, tmp_path, quantize):
    """A LoRA (or QLoRA) model exported merged loads as a plain model with the same logits."""
    from posttrain.core.lora import merged_state_dict
    from posttrain.registry.hf import save_pretrained

    ours = load_pretrained(qwen_dir).eval()
    apply_lora(ours, rank=4, alpha=8, targets="all-linear", quantize_base="nf4" if quantize else None)
    with torch.no_grad():
        for p in lora_parameters(ours):
            p.add_(torch.randn_like(p) * 0.05)
    save_pretrained(ours, tmp_path / "merged", state=merged_state_dict(ours))
    plain = load_pretrained(tmp_path / "merged").eval()
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (plain(ids) - ours(ids)).abs().max() < 1e-4


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_expert_adapter_loads_in_peft_with_same_logits(tmp_path, family):
    """LoRA on the MoE experts (lora.experts) is peft's target_parameters on transformers'
    stacked experts: the adapter loads with peft and gives our logits, loads back here, and the
    merged export equals the adapted model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from posttrain.core.lora import merged_state_dict
    from posttrain.registry.hf import save_pretrained

    make_hf_model(family, tmp_path / "base")
    ours = load_pretrained(tmp_path / "base").eval()
    apply_lora(ours, rank=4, alpha=8, targets=["q_proj", "v_proj"], experts=True)
    assert sum(p.numel() for n, p in ours.named_parameters() if ".experts.lora." in n) > 0
    with torch.no_grad():  # a trained-looking adapter: B is not zero
        for p in lora_parameters(ours):
            p.add_(torch.randn_like(p) * 0.05)
    save_adapter(ours, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="sdpa")
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(ids)
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")(ids).logits
        assert (want - base).abs().max() > 1e-2  # the experts' update shows in the logits
        diff = (peft_model(ids).logits - want).abs().max().item()
    assert diff < 1e-4, diff

    fresh = load_pretrained(tmp_path / "base").eval()
    wrapped = load_adapter(fresh, tmp_path / "adapter")
    assert sum(".experts" in w for w in wrapped) == sum(1 for m in ours.moe_layers())
    save_pretrained(ours, tmp_path / "merged", state=merged_state_dict(ours))
    plain = load_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert (fresh(ids) - want).abs().max() < 1e-5
        assert (plain(ids) - want).abs().max() < 1e-4
