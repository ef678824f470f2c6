"""posttrain.kernels.rmsnorm: the Triton path (interpreter) against the fp32 reference and the model."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_close, fp32_copy, launched, leaf

from posttrain.core.model.layers import RMSNorm
from posttrain.kernels import rmsnorm as K

EPS = 1e-6
# u = unit roundoff (half an ulp, relative): fp32 2^-24, bf16 2^-8 = 3.9e-3, fp16 2^-11 = 4.9e-4.
FWD_TOL = {
    # Same fp32 math; only the order of the row sum and rsqrt's last bit differ (measured 7e-7).
    torch.float32: (1e-5, 1e-5),
    # y is rounded up to three times (h = x + r, n = h * rstd, w * n), each <= u: 3u = 1.2e-2.
    # No cancellation in forward, so the error is relative; atol only covers exact zeros.
    torch.bfloat16: (1e-4, 1.6e-2),
    # Same three roundings with fp16's u: 3u = 1.5e-3.
    torch.float16: (1e-5, 2e-3),
}
BWD_TOL = {
    # fp32 sums of <= 257 terms in another order: a few ulps of the largest term (dw ~ 20).
    torch.float32: (1e-5, 1e-5),
    # One rounding of dx/dw (u relative), plus, with a residual, the forward's rounded h: n differs
    # from the fp32 reference's by u, which moves dx by ~u * |dy * w| <= 4e-3 * 4 and dw (a sum
    # over <= 15 rows of dy * n, random signs) by ~sqrt(15) * u * |dy| ~ 1.5e-2 near zero. atol
    # 5e-2 is 3x that; rtol is 2u plus margin for the rounded-h term.
    torch.bfloat16: (5e-2, 1.6e-2),
    # The same budget with fp16's u (8x smaller).
    torch.float16: (6e-3, 2e-3),
}
# Non-power-of-two widths; 15 and 9 rows over backward's 4 programs: 4+4+4+3, and 3+3+3+0.
CASES = [((3, 5, 100), False), ((9, 257), True)]


def _run(shape, dtype, with_residual):
    x = leaf(shape, dtype)
    residual = leaf(shape, dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(shape[-1])).to(dtype).requires_grad_()
    with launched(K.LAUNCHES, "rms_norm_fwd", "rms_norm_bwd"):
        out = K.rms_norm(x, weight, EPS, residual)
        y, h = out if with_residual else (out, None)
        dy, dh = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
        torch.autograd.backward([y, h] if with_residual else [y], [dy, dh] if with_residual else [dy])
    xf, wf, rf = fp32_copy(x), fp32_copy(weight), fp32_copy(residual)
    ref = K.rms_norm_reference(xf, wf, EPS, rf)
    yf, hf = ref if with_residual else (ref, None)
    torch.autograd.backward([yf, hf] if with_residual else [yf],
                            [dy.float(), dh.float()] if with_residual else [dy.float()])
    return (x, weight, residual, y, h), (xf, wf, rf, yf, hf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("shape", "with_residual"), CASES, ids=["plain", "residual"])
def test_matches_fp32_reference(shape, with_residual, dtype):
    (x, w, r, y, h), (xf, wf, rf, yf, hf) = _run(shape, dtype, with_residual)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, yf, FWD_TOL[dtype], "y")
    assert_close(x.grad, xf.grad, BWD_TOL[dtype], "dx")
    assert_close(w.grad, wf.grad, BWD_TOL[dtype], "dweight")
    if with_residual:
        assert h.dtype == dtype
        assert_close(h, hf, FWD_TOL[dtype], "h = x + residual")
        assert_close(r.grad, rf.grad, BWD_TOL[dtype], "dresidual")
        assert torch.equal(r.grad, x.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_follows_model_convention(dtype):
    """Normalize in fp32, cast, then scale: the kernel and posttrain.core.model.layers.RMSNorm agree to
    the bit except where the fp32 rstd (summed in another order) straddles a rounding boundary.
    Scaling in fp32 before the cast (the other common convention) differs on ~1/4 of elements."""
    x = torch.randn(16, 257).to(dtype)
    norm = RMSNorm(257, EPS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(257))
        with launched(K.LAUNCHES, "rms_norm_fwd"):
            y = K.rms_norm(x, norm.weight, EPS)
        expected = norm(x)
        h = x + x.flip(0)
        y2, h2 = K.rms_norm(x, norm.weight, EPS, x.flip(0))
    assert (y != expected).float().mean() < 0.01
    ulp = torch.finfo(dtype).eps * expected.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((y.float() - expected.float()).abs() <= ulp).all()
    assert torch.equal(h2, h)  # the fused add rounds exactly like the model's x + residual
    assert (y2 != norm(h)).float().mean() < 0.01


def test_rows_not_unit_stride_and_dispatch_rules():
    x = torch.randn(6, 2 * 100)[:, ::2]  # non-unit column stride: copied, still correct
    w = torch.randn(100)
    with launched(K.LAUNCHES, "rms_norm_fwd"):
        y = K.rms_norm(x, w, EPS)
    assert_close(y, K.rms_norm_reference(x, w, EPS), FWD_TOL[torch.float32])
    before = K.LAUNCHES["rms_norm_fwd"]
    K.rms_norm(x.double(), w.double(), EPS)  # fp64 is not a kernel dtype: reference
    assert K.LAUNCHES["rms_norm_fwd"] == before
    with pytest.raises(ValueError, match="do not match"):
        K.rms_norm(x, torch.randn(99), EPS)


def test_opcheck():
    x, r = torch.randn(5, 100, requires_grad=True), torch.randn(5, 100, requires_grad=True)
    w = torch.randn(100, requires_grad=True)
    torch.library.opcheck(torch.ops.posttrain.rms_norm.default, (x, w, EPS))
    torch.library.opcheck(torch.ops.posttrain.add_rms_norm.default, (x, r, w, EPS))
    # The backward op has no autograd of its own; aot_dispatch above already traced its fake.
    y, rstd = torch.ops.posttrain.rms_norm(x.detach(), w.detach(), EPS)
    torch.library.opcheck(torch.ops.posttrain.rms_norm_backward.default,
                          (torch.randn_like(y), torch.randn_like(y), x.detach(), w.detach(), rstd),
                          test_utils=("test_schema", "test_faketensor"))
