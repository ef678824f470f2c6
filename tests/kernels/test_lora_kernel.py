"""posttrain.kernels.lora: the fused LoRA matmuls (interpreter) against the fp32 reference and posttrain.core.lora."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_close, fp32_copy, launched

from posttrain.kernels import lora as K

# Compared with assert_close(scaled=True): atol is relative to max|expected| (see kernel_testing).
# u = unit roundoff: bf16 2^-8 = 3.9e-3, fp16 2^-11 = 4.9e-4.
TOL = {
    # fp32 accumulation either way, sums of <= 100 terms in another order: ~sqrt(K) * 2^-24 of
    # the largest term (measured <= 1.4e-7 * max|y|); 2e-6 leaves 10x.
    torch.float32: (2e-6, 1e-5),
    # The output is rounded once (rtol 2u). The rank-r product (x A^T, or dy B in backward) is
    # rounded to bf16 as F.linear would before meeting B (A): each term of the next sum moves by
    # <= u, with random signs: measured <= 1.1e-3 * max|expected| (dA, a 37-token sum). atol u.
    torch.bfloat16: (4e-3, 8e-3),
    # The same two roundings with fp16's u; measured <= 2e-4 * max|expected|; atol 2u.
    torch.float16: (1e-3, 1e-3),
}


def _inputs(dtype, n_rows, n_in, n_out, rank, n_adapters=None, bias=True):
    """x ~ N(0, 1) and W ~ N(0, 1/in) (|y| ~ 1), A ~ N(0, 1/in), B ~ N(0, 1/4): a trained-ish
    adapter, B non-zero so dA is not trivially zero."""
    lead = () if n_adapters is None else (n_adapters,)
    x = torch.randn(n_rows, n_in).to(dtype).requires_grad_()
    weight = (torch.randn(n_out, n_in) / n_in**0.5).to(dtype)
    b = torch.randn(n_out).to(dtype) if bias else None
    lora_a = (torch.randn(*lead, rank, n_in) / n_in**0.5).to(dtype).requires_grad_()
    lora_b = (torch.randn(*lead, n_out, rank) * 0.5).to(dtype).requires_grad_()
    return x, weight, b, lora_a, lora_b


def _check(fn, ref_fn, args, extra, dtype):
    """Run the Triton path (asserting it launched) and the fp32 reference; compare y and grads."""
    x, weight, bias, lora_a, lora_b = args
    with launched(K.LAUNCHES, "lora_fwd", "lora_bwd"):
        y = fn(x, weight, bias, lora_a, lora_b, *extra)
        dy = torch.randn_like(y)
        y.backward(dy)
    xf, wf, bf, af, bf_ = (fp32_copy(t) for t in args)
    y_ref = ref_fn(xf, wf, bf, af, bf_, *extra)
    y_ref.backward(dy.float())
    assert y.dtype == dtype
    assert_close(y, y_ref, TOL[dtype], "y", scaled=True)
    assert_close(x.grad, xf.grad, TOL[dtype], "dx", scaled=True)
    assert_close(lora_a.grad, af.grad, TOL[dtype], "dA", scaled=True)
    assert_close(lora_b.grad, bf_.grad, TOL[dtype], "dB", scaled=True)
    return lora_a.grad, lora_b.grad


@pytest.fixture
def small_tiles(monkeypatch):
    """16-wide tiles: several tiles in M, N and K, each with a ragged tail, on tiny shapes."""
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        monkeypatch.setattr(K, name, 16)


@pytest.mark.parametrize(("dtype", "bias"), [(torch.float32, True), (torch.bfloat16, True), (torch.float16, False)],
                         ids=["float32-bias", "bfloat16-bias", "float16-no_bias"])
def test_lora_linear(dtype, bias):
    args = _inputs(dtype, n_rows=37, n_in=100, n_out=67, rank=5, bias=bias)  # r=5: masked rank lanes
    _check(K.lora_linear, K.lora_linear_reference, args, (2.0,), dtype)


def _ids(n_rows):
    """Adapters 0 and 1 routed in runs of rows (as the examples of a batch are), one run with
    no adapter (-1); the runs do not align with the row tiles."""
    return torch.tensor([0, 1, -1, 1, 0, 1])[torch.arange(n_rows) * 6 // n_rows]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_lora_linear_multi(dtype):
    args = _inputs(dtype, n_rows=37, n_in=40, n_out=24, rank=5, n_adapters=3)
    scales = torch.tensor([2.0, 0.5, 1.0])
    da, db = _check(K.lora_linear_multi, K.lora_linear_multi_reference, args, (scales, _ids(37)), dtype)
    assert not da[2].any() and not db[2].any()  # adapter 2 has no rows: exactly zero gradient


def test_several_tiles(small_tiles):
    """fp32 (tight tolerance: any indexing slip shows) over 2 ragged tiles in M, N and K."""
    args = _inputs(torch.float32, n_rows=20, n_in=24, n_out=20, rank=5, n_adapters=2)
    _check(K.lora_linear_multi, K.lora_linear_multi_reference, args,
           (torch.tensor([1.5, 0.5]), _ids(20)), torch.float32)
    args = _inputs(torch.float32, n_rows=20, n_in=24, n_out=20, rank=17, bias=False)  # 32-wide rank tile
    _check(K.lora_linear, K.lora_linear_reference, args, (0.75,), torch.float32)


def test_matches_core_lora_module():
    """Same output and adapter gradients as posttrain.core.lora.LoRALinear (one adapter, no dropout)."""
    from posttrain.core.lora import LoRALinear

    layer = LoRALinear(torch.nn.Linear(48, 24))
    layer.add_adapter("default", rank=4, alpha=8.0)
    with torch.no_grad():
        layer.lora_B["default"].normal_()  # B starts at zero: make the LoRA path count
    x = torch.randn(2, 7, 48)
    expected = layer(x)
    expected.sum().backward()
    a, b = layer.lora_A["default"], layer.lora_B["default"]
    grads = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    with launched(K.LAUNCHES, "lora_fwd", "lora_bwd"):
        y = K.lora_linear(x, layer.weight, layer.bias, a, b, layer.scaling["default"])
        y.sum().backward()
    assert_close(y, expected, TOL[torch.float32], "y", scaled=True)
    assert_close(a.grad, grads[0], TOL[torch.float32], "dA", scaled=True)
    assert_close(b.grad, grads[1], TOL[torch.float32], "dB", scaled=True)


def test_routed_adapters_take_the_multi_adapter_kernel():
    """posttrain.core.lora's per-token routing (several adapters of different ranks, tokens of no adapter)
    runs the multi-adapter kernel and matches its torch path (kernels mode "torch")."""
    from posttrain.core.lora import LoRALinear
    from posttrain.kernels.dispatch import kernels_mode

    layer = LoRALinear(torch.nn.Linear(48, 24))
    for name, rank in (("a", 4), ("b", 2), ("c", 8)):
        layer.add_adapter(name, rank=rank, alpha=8.0)
    with torch.no_grad():
        for p in layer.lora_B.values():
            p.normal_()
    x = torch.randn(2, 9, 48)
    layer.routing = torch.tensor([[0, 0, 1, 1, 1, 3, 2, 2, 0], [2, 2, 2, 2, 0, 0, 3, 3, 3]])  # 3: none
    params = [layer.lora_A[n] for n in "abc"] + [layer.lora_B[n] for n in "abc"]
    with kernels_mode("torch"):
        expected = layer(x)
        expected.sum().backward()
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    with launched(K.LAUNCHES, "lora_fwd", "lora_bwd"):
        y = layer(x)
        y.sum().backward()
    assert_close(y, expected, TOL[torch.float32], "y", scaled=True)
    for p, g in zip(params, grads):
        assert_close(p.grad, g, TOL[torch.float32], "grad", scaled=True)


def test_dispatch_rules():
    x, weight, bias, lora_a, lora_b = _inputs(torch.float32, 5, 20, 12, 4)
    before = K.LAUNCHES["lora_fwd"]
    y = K.lora_linear(x, weight.requires_grad_(), bias, lora_a, lora_b, 1.0)  # trainable base
    y.sum().backward()
    assert K.LAUNCHES["lora_fwd"] == before and weight.grad is not None
    with pytest.raises(ValueError, match="do not fit"):
        K.lora_linear(x, weight, bias, lora_a.mT, lora_b, 1.0)
    with pytest.raises(ValueError, match="one id per row"):
        K.lora_linear_multi(x, weight, bias, lora_a[None], lora_b[None], torch.ones(1), torch.zeros(4))


def test_opcheck():
    x, weight, bias, lora_a, lora_b = _inputs(torch.float32, 5, 20, 12, 4)
    torch.library.opcheck(torch.ops.posttrain.lora_linear.default, (x, weight, bias, lora_a, lora_b, 2.0))
    a3, b3 = lora_a.detach()[None].repeat(2, 1, 1), lora_b.detach()[None].repeat(2, 1, 1)
    scales, ids = torch.tensor([1.0, 2.0]), torch.tensor([0, 1, -1, 1, 0], dtype=torch.int32)
    torch.library.opcheck(torch.ops.posttrain.lora_linear_multi.default,
                          (x, weight, None, a3.requires_grad_(), b3.requires_grad_(), scales, ids))
    # The backward ops have no autograd of their own; aot_dispatch above traced their fakes.
    y, xa = torch.ops.posttrain.lora_linear(x.detach(), weight, bias, lora_a.detach(), lora_b.detach(), 2.0)
    dy, utils = torch.randn_like(y), ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.posttrain.lora_linear_backward.default,
                          (dy, x.detach(), weight, lora_a.detach(), lora_b.detach(), xa, 2.0), test_utils=utils)
    torch.library.opcheck(torch.ops.posttrain.lora_linear_multi_backward.default,
                          (dy, x.detach(), weight, a3.detach(), b3.detach(), xa, scales, ids), test_utils=utils)
