"""posttrain.kernels.dispatch: the kernels mode a stage sets from ModelConfig.kernels ("auto" | "torch"),
its relation to POSTTRAIN_KERNELS, and that "torch" keeps every op off its Triton kernel even
where the dispatch rule would choose it."""

from __future__ import annotations

import importlib

import pytest
import torch

from posttrain.kernels import dispatch
from posttrain.kernels.dispatch import kernels_mode, mode, set_mode, use_triton

OP_MODULES = ("rmsnorm", "swiglu", "rope", "lora", "nf4", "flash_attention", "fused_linear_ce", "fused_linear_kl")


@pytest.fixture(autouse=True)
def _clean_mode(monkeypatch):
    monkeypatch.delenv("POSTTRAIN_KERNELS", raising=False)
    old = set_mode(None)
    yield
    set_mode(old)


@pytest.fixture
def kernel_rule_says_triton(monkeypatch):
    """CPU tensors under TRITON_INTERPRET=1 with Triton present: the rule picks the kernels."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    assert use_triton(torch.zeros(1))


def _launches() -> dict[str, int]:
    return {f"{m}.{k}": v for m in OP_MODULES for k, v in importlib.import_module(f"posttrain.kernels.{m}").LAUNCHES.items()}


def test_torch_mode_overrides_the_kernel_choice(kernel_rule_says_triton):
    x = torch.zeros(2, 3)
    set_mode("torch")
    assert mode() == "torch" and not use_triton(x)
    set_mode("auto")
    assert mode() == "auto" and use_triton(x)


def test_torch_mode_runs_every_op_on_its_torch_path(kernel_rule_says_triton):
    from posttrain.kernels import (apply_rope, dequantize_nf4, flash_attn_varlen, fused_linear_cross_entropy,
                         fused_linear_distill, fused_linear_logps, lora_linear, nf4_linear, rms_norm, swiglu)
    from posttrain.kernels.nf4 import quantize_nf4

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, generator=g, requires_grad=True)
    w = torch.randn(8, 8, generator=g)
    labels = torch.randint(0, 8, (2, 4), generator=g)
    q = torch.randn(2, 2, 4, 8, generator=g)
    cos, sin = torch.ones(1, 4, 8), torch.zeros(1, 4, 8)
    before = _launches()
    set_mode("torch")
    y = rms_norm(x, torch.ones(8, requires_grad=True), 1e-6)
    assert y.grad_fn.name().endswith("RMSNormTorchFunctionBackward")
    outs = [y, swiglu(x, x), lora_linear(x, w, None, torch.randn(2, 8, generator=g), torch.zeros(8, 2), 1.0),
            *apply_rope(q, q, cos, sin), dequantize_nf4(quantize_nf4(w)), nf4_linear(x, quantize_nf4(w)),
            flash_attn_varlen(x.view(8, 1, 8), x.view(8, 1, 8), x.view(8, 1, 8),
                              torch.tensor([0, 3, 8], dtype=torch.int32), 5),
            fused_linear_cross_entropy(x, w, labels), fused_linear_logps(x, w, labels),
            fused_linear_distill(x, w, x.detach(), w)]
    sum(o.float().sum() for o in outs).backward()
    assert _launches() == before, "a Triton kernel launched in 'torch' mode"


def test_env_var_is_the_default_and_set_mode_wins(monkeypatch):
    assert mode() == "auto"  # nothing set anywhere
    monkeypatch.setenv("POSTTRAIN_KERNELS", "torch")
    assert mode() == "torch"
    set_mode("auto")
    assert mode() == "auto"
    set_mode(None)
    assert mode() == "torch"
    monkeypatch.setenv("POSTTRAIN_KERNELS", "cuda")
    with pytest.raises(ValueError, match="POSTTRAIN_KERNELS"):
        mode()
    set_mode("torch")  # an explicit mode does not read the variable
    assert mode() == "torch"


def test_set_mode_validates_and_returns_the_previous_setting():
    assert set_mode("torch") is None
    assert set_mode("auto") == "torch"
    with pytest.raises(ValueError, match="kernels mode"):
        set_mode("triton")
    assert mode() == "auto"  # unchanged by the rejected value
    assert set_mode(None) == "auto"


def test_kernels_mode_is_scoped():
    set_mode("auto")
    with kernels_mode("torch"):
        assert mode() == "torch"
    assert mode() == "auto"
    with pytest.raises(RuntimeError), kernels_mode("torch"):
        raise RuntimeError
    assert mode() == "auto"
    with pytest.raises(ValueError), kernels_mode("fast"):
        pass
    assert mode() == "auto"
