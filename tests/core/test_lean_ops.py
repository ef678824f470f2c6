"""The plain-torch autograd Functions that run where the Triton kernels do not (CPU): same
values as autograd through each reference, analytic gradients (gradcheck in fp64), and less
saved for backward, which is their point."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.lora import apply_lora, disable_adapter
from posttrain.core.model.args import ModelArgs
from posttrain.core.model.layers import MLP
from posttrain.kernels.lora import (LoRALinearTorchFunction, SwiGLULoRALinearTorchFunction, lora_linear,
                          lora_linear_reference, swiglu_lora_linear)
from posttrain.kernels.rmsnorm import RMSNormTorchFunction, rms_norm, rms_norm_reference
from posttrain.kernels.swiglu import SwiGLUTorchFunction, swiglu, swiglu_reference


def saved_bytes(fn, *inputs):
    """fn(*inputs) and the bytes of the distinct storages autograd saved for its backward."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    return out, sum(seen.values())


@pytest.mark.parametrize("shape", [(3, 5, 33), (1, 1), (7, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_torch_function_matches_reference(shape, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).requires_grad_()
    dy = torch.randn(shape, generator=g).to(dtype)
    got = rms_norm(x, w, 1e-6)
    assert got.grad_fn.name().endswith("RMSNormTorchFunctionBackward")
    ref = rms_norm_reference(x, w, 1e-6)
    assert torch.equal(got, ref)  # same forward ops in the same order
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    for a, b in zip(torch.autograd.grad(got, (x, w), dy), torch.autograd.grad(ref, (x, w), dy)):
        torch.testing.assert_close(a, b, **tol)


def test_rms_norm_torch_function_gradcheck_and_frozen_weight():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 9, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: RMSNormTorchFunction.apply(a, b, 1e-6), (x, w))
    w.requires_grad_(False)  # LoRA: the norm weight is frozen, only dx is computed
    out = rms_norm(x, w, 1e-6)
    (dx,) = torch.autograd.grad(out.sum(), (x,))
    (ref,) = torch.autograd.grad(rms_norm_reference(x, w, 1e-6).sum(), (x,))
    torch.testing.assert_close(dx, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_torch_function_matches_reference(dtype):
    g = torch.Generator().manual_seed(0)
    gate = (3 * torch.randn(5, 7, 41, generator=g)).to(dtype).requires_grad_()
    up = torch.randn(5, 7, 41, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(5, 7, 41, generator=g).to(dtype)
    got = swiglu(gate, up)
    assert got.grad_fn.name().endswith("SwiGLUTorchFunctionBackward")
    ref = swiglu_reference(gate, up)
    assert torch.equal(got, ref)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(torch.autograd.grad(got, (gate, up), dy), torch.autograd.grad(ref, (gate, up), dy)):
        torch.testing.assert_close(a, b, **tol)
    gate64 = torch.randn(3, 6, dtype=torch.float64, generator=g, requires_grad=True)
    up64 = torch.randn(3, 6, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(SwiGLUTorchFunction.apply, (gate64, up64))


def test_lean_functions_save_less_than_the_reference():
    """What autograd keeps for backward, in bytes of distinct storages."""
    x = torch.randn(64, 256, requires_grad=True)
    w = torch.ones(256, requires_grad=True)
    _, lean = saved_bytes(lambda a, b: rms_norm(a, b, 1e-6), x, w)
    _, ref = saved_bytes(lambda a, b: rms_norm_reference(a, b, 1e-6), x, w)
    assert lean < ref and lean <= x.nbytes + w.nbytes + 64 * 4
    gate, up = torch.randn(64, 256, requires_grad=True), torch.randn(64, 256, requires_grad=True)
    _, lean = saved_bytes(swiglu, gate, up)
    _, ref = saved_bytes(swiglu_reference, gate, up)
    assert lean == gate.nbytes + up.nbytes < ref


def assert_as_close_as_reference(got, ref, exact, what=""):
    """bf16: both paths round differently (accumulation order), so compare each with the fp32
    result of the same math: ours may be off by at most twice what the reference is, plus 1%
    of the result's scale."""
    e_got = (got.float() - exact).abs().max().item()
    e_ref = (ref.float() - exact).abs().max().item()
    assert e_got <= 2 * e_ref + 1e-2 * exact.abs().max().item(), (what, e_got, e_ref)


def _lora_inputs(shape, n_out, rank, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_in = shape[-1]
    x = torch.randn(shape, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(n_out, n_in, generator=g) / n_in**0.5).to(dtype)
    b = torch.randn(n_out, generator=g).to(dtype)
    a = (torch.randn(rank, n_in, generator=g) / n_in**0.5).to(dtype).requires_grad_()
    bb = torch.randn(n_out, rank, generator=g).to(dtype).requires_grad_()
    return x, w, b, a, bb


@pytest.mark.parametrize("shape,n_out,rank", [((3, 7, 33), 19, 4), ((1, 64), 128, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_linear_torch_function_matches_reference(shape, n_out, rank, dtype):
    x, w, b, a, bb = _lora_inputs(shape, n_out, rank, dtype)
    got = lora_linear(x, w, b, a, bb, 0.7)
    assert got.grad_fn.name().endswith("LoRALinearTorchFunctionBackward")
    ref = lora_linear_reference(x, w, b, a, bb, 0.7)
    dy = torch.randn(got.shape, generator=torch.Generator().manual_seed(9)).to(dtype)
    grads, refs = torch.autograd.grad(got, (x, a, bb), dy), torch.autograd.grad(ref, (x, a, bb), dy)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        for p, q in zip(grads, refs):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
        return
    leaves = [t.detach().float().requires_grad_() for t in (x, a, bb)]
    exact = lora_linear_reference(leaves[0], w.float(), b.float(), leaves[1], leaves[2], 0.7)
    assert_as_close_as_reference(got, ref, exact.detach(), "y")
    for name, p, q, e in zip("xAB", grads, refs, torch.autograd.grad(exact, leaves, dy.float())):
        assert_as_close_as_reference(p, q, e, name)


def test_lora_torch_functions_gradcheck():
    x, w, b, a, bb = _lora_inputs((2, 3, 6), 5, 2, torch.float64)
    assert torch.autograd.gradcheck(lambda x, a, bb: LoRALinearTorchFunction.apply(x, w, b, a, bb, 1.5), (x, a, bb))
    up = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda g, u, a, bb: SwiGLULoRALinearTorchFunction.apply(g, u, w, None, a, bb, 0.5), (x, up, a, bb))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_lora_linear_matches_unfused_and_saves_no_product(dtype):
    gate, w, b, a, bb = _lora_inputs((4, 9, 40), 24, 8, dtype, seed=1)
    up = torch.randn(gate.shape, generator=torch.Generator().manual_seed(2)).to(dtype).requires_grad_()
    got, fused_saved = saved_bytes(lambda *t: swiglu_lora_linear(*t, 2.0), gate, up, w, b, a, bb)
    assert got.grad_fn.name().endswith("SwiGLULoRALinearTorchFunctionBackward")
    ref, ref_saved = saved_bytes(lambda g, u, *rest: lora_linear_reference(swiglu_reference(g, u), *rest, 2.0),
                                 gate, up, w, b, a, bb)
    dy = torch.randn(got.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    names = ("gate", "up", "A", "B")
    grads = torch.autograd.grad(got, (gate, up, a, bb), dy)
    refs = torch.autograd.grad(ref, (gate, up, a, bb), dy)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        for name, p, q in zip(names, grads, refs):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=name)
    else:
        leaves = [t.detach().float().requires_grad_() for t in (gate, up, a, bb)]
        exact = lora_linear_reference(swiglu_reference(leaves[0], leaves[1]), w.float(), b.float(), leaves[2],
                                      leaves[3], 2.0)
        assert_as_close_as_reference(got, ref, exact.detach(), "y")
        for name, p, q, e in zip(names, grads, refs, torch.autograd.grad(exact, leaves, dy.float())):
            assert_as_close_as_reference(p, q, e, name)
    assert fused_saved < ref_saved - gate.nbytes  # at least silu(gate) * up is not kept


def test_mlp_fuses_only_a_plain_lora_down_projection():
    torch.manual_seed(0)
    mlp = MLP(16, 24).double()
    apply_lora(mlp, rank=4, alpha=8, targets=["down_proj", "gate_proj"])
    torch.nn.init.normal_(mlp.down_proj.lora_B["default"])
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    fused = mlp(x)
    assert fused.grad_fn.name().endswith("SwiGLULoRALinearTorchFunctionBackward")
    unfused = mlp.down_proj(swiglu(mlp.gate_proj(x), mlp.up_proj(x)))
    torch.testing.assert_close(fused, unfused)
    gf = torch.autograd.grad(fused.sum(), [x] + [p for p in mlp.parameters() if p.requires_grad])
    gu = torch.autograd.grad(unfused.sum(), [x] + [p for p in mlp.parameters() if p.requires_grad])
    for p, q in zip(gf, gu):
        torch.testing.assert_close(p, q)
    handle = mlp.down_proj.register_forward_hook(lambda mod, args, out: out * 2)  # hooks must still run
    assert not mlp(x).grad_fn.name().endswith("SwiGLULoRALinearTorchFunctionBackward")
    torch.testing.assert_close(mlp(x), 2 * unfused)
    handle.remove()
    with disable_adapter(mlp):  # the DPO reference: base weights only, not through the fused op
        base = mlp(x)
    assert not base.grad_fn.name().endswith("SwiGLULoRALinearTorchFunctionBackward")
    w = lambda m: m.weight  # noqa: E731
    torch.testing.assert_close(base, torch.nn.functional.linear(
        swiglu_reference(x @ w(mlp.gate_proj).T, x @ w(mlp.up_proj).T), w(mlp.down_proj)))


def test_lora_under_autocast_takes_the_reference():
    """Autocast casts per op; the Function's in-place accumulation would mix dtypes, so autocast
    regions run the reference (same result as peft-style autograd under autocast)."""
    x, w, b, a, bb = _lora_inputs((4, 16), 8, 2, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = lora_linear(x, w, b, a, bb, 1.0)
        fused = swiglu_lora_linear(x, x * 2, w, b, a, bb, 1.0)
        ref = lora_linear_reference(x, w, b, a, bb, 1.0)
    assert got.dtype == torch.bfloat16 and not got.grad_fn.name().startswith("LoRALinearTorchFunction")
    assert not fused.grad_fn.name().startswith("SwiGLULoRALinearTorchFunction")
    torch.testing.assert_close(got, ref)
    got.float().sum().backward()
    assert a.grad is not None and bb.grad is not None


def test_lora_function_skips_gradients_nobody_needs():
    x, w, b, a, bb = _lora_inputs((5, 12), 6, 3, torch.float32)
    bb.requires_grad_(False)  # e.g. a frozen second adapter factor
    out = LoRALinearTorchFunction.apply(x, w, b, a, bb, 0.5)
    gx, ga = torch.autograd.grad(out.sum(), (x, a))
    rx, ra = torch.autograd.grad(lora_linear_reference(x, w, b, a, bb, 0.5).sum(), (x, a))
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(ga, ra)


def _with_mask(seed, shape, p):
    """The mask the Functions draw first after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    return torch.empty(shape, dtype=torch.bool).bernoulli_(1 - p)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_lora_dropout_matches_the_formula_with_the_same_mask(p):
    x, w, b, a, bb = _lora_inputs((3, 5, 24), 10, 4, torch.float64)
    keep = _with_mask(7, (15, 24), p).view(3, 5, 24)
    torch.manual_seed(7)
    got = LoRALinearTorchFunction.apply(x, w, b, a, bb, 0.5, p)
    ref = torch.nn.functional.linear(x, w, b) + 0.5 * (x * keep / (1 - p)) @ a.T @ bb.T
    torch.testing.assert_close(got, ref)
    dy = torch.randn(got.shape, dtype=torch.float64)
    for g, r in zip(torch.autograd.grad(got, (x, a, bb), dy), torch.autograd.grad(ref, (x, a, bb), dy)):
        torch.testing.assert_close(g, r)

    def reseeded(x, a, bb):
        torch.manual_seed(3)
        return LoRALinearTorchFunction.apply(x, w, b, a, bb, 0.5, p)

    assert torch.autograd.gradcheck(reseeded, (x, a, bb))


def test_swiglu_lora_dropout_matches_the_formula_with_the_same_mask():
    p = 0.25
    gate, w, b, a, bb = _lora_inputs((2, 3, 16), 8, 2, torch.float64, seed=4)
    up = torch.randn(gate.shape, dtype=torch.float64, requires_grad=True)
    keep = _with_mask(11, (6, 16), p).view(2, 3, 16)
    torch.manual_seed(11)
    got = swiglu_lora_linear(gate, up, w, b, a, bb, 2.0, p)
    assert got.grad_fn.name().endswith("SwiGLULoRALinearTorchFunctionBackward")
    h = swiglu_reference(gate, up)
    ref = torch.nn.functional.linear(h, w, b) + 2.0 * (h * keep / (1 - p)) @ a.T @ bb.T
    torch.testing.assert_close(got, ref)
    dy = torch.randn(got.shape, dtype=torch.float64)
    for g, r in zip(torch.autograd.grad(got, (gate, up, a, bb), dy), torch.autograd.grad(ref, (gate, up, a, bb), dy)):
        torch.testing.assert_close(g, r)


def test_lora_module_with_dropout_trains_through_the_function_and_evaluates_without():
    torch.manual_seed(0)
    mlp = MLP(12, 20).double()
    apply_lora(mlp, rank=4, alpha=8, targets="all-linear", dropout=0.3)
    torch.nn.init.normal_(mlp.down_proj.lora_B["default"])
    x = torch.randn(4, 12, dtype=torch.float64)
    mlp.train()
    assert mlp(x).grad_fn.name().endswith("SwiGLULoRALinearTorchFunctionBackward")
    assert mlp.gate_proj(x).grad_fn.name().endswith("LoRALinearTorchFunctionBackward")
    torch.manual_seed(1)
    first = mlp(x)
    torch.manual_seed(1)
    torch.testing.assert_close(mlp(x), first)  # the mask comes from torch's RNG: seeded, reproducible
    assert not torch.allclose(mlp(x), first)  # and differs between draws
    mlp.eval()
    d = mlp.down_proj
    h = swiglu_reference(mlp.gate_proj(x), mlp.up_proj(x))
    expected = h @ d.weight.T + d.scaling["default"] * h @ d.lora_A["default"].T @ d.lora_B["default"].T
    torch.testing.assert_close(mlp(x), expected)  # eval: no dropout
