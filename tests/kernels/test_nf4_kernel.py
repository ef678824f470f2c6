"""posttrain.kernels.nf4: Triton NF4 dequantize (bit-exact against posttrain.core.quant) and the fused NF4 matmul."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_close, launched

from posttrain.core.quant import NF4Weight, dequantize_nf4 as dequantize_reference, quantize_nf4
from posttrain.kernels import nf4 as K

# For nf4_linear, compared with assert_close(scaled=True): atol relative to max|expected|.
# The kernel's dequantized tile equals dequantize_nf4(t, x.dtype) to the bit (tested below), so
# against the fp32 matmul of those same values only the sum order and the output rounding differ.
# u = unit roundoff: bf16 2^-8 = 3.9e-3, fp16 2^-11 = 4.9e-4.
TOL = {
    # Sums of <= 100 exact products in another order: ~sqrt(K) * 2^-24 * max (measured ~1e-7).
    torch.float32: (2e-6, 1e-5),
    # Exact 16-bit products, fp32 accumulation, one output rounding: <= u relative (rtol 2u);
    # the fp32 sum-order noise is ~1e-7 * max: atol 1e-5 * max covers it 100x.
    torch.bfloat16: (1e-5, 8e-3),
    # The same with fp16's u.
    torch.float16: (1e-5, 1e-3),
}


def _weight(n_out, n_in, double_quant, dtype=torch.bfloat16):
    # dq_block_size=8: several double-quant blocks even on a tiny weight.
    return quantize_nf4(torch.randn(n_out, n_in).to(dtype) / n_in**0.5, double_quant=double_quant, dq_block_size=8)


@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "double_quant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_dequantize_bit_exact(dtype, double_quant):
    """67 x 100: the 6700 elements end in a partial block and blocks of 64 straddle rows."""
    t = _weight(67, 100, double_quant)
    with launched(K.LAUNCHES, "nf4_dequantize"):
        w = K.dequantize_nf4(t, dtype)
    expected = dequantize_reference(t, dtype)
    assert w.dtype == dtype and w.shape == (67, 100)
    assert torch.equal(w, expected)


def test_dequantize_module_and_default_dtype():
    mod = NF4Weight(_weight(8, 64, double_quant=True))  # the buffers posttrain.core.lora keeps
    with launched(K.LAUNCHES, "nf4_dequantize"):
        w = K.dequantize_nf4(mod)
    assert w.dtype == torch.bfloat16 and torch.equal(w, mod.dequantize())


def _check(n_rows, n_in, n_out, dtype, bias, double_quant):
    t = _weight(n_out, n_in, double_quant, dtype)
    x = torch.randn(n_rows, n_in).to(dtype).requires_grad_()
    b = torch.randn(n_out).to(dtype) if bias else None
    with launched(K.LAUNCHES, "nf4_matmul_fwd", "nf4_matmul_bwd"):
        y = K.nf4_linear(x, t, b)
        dy = torch.randn_like(y)
        y.backward(dy)
    w = dequantize_reference(t, dtype).float()  # the weight the kernel sees, exactly
    xf = x.detach().float().requires_grad_()
    y_ref = torch.nn.functional.linear(xf, w, None if b is None else b.float())
    y_ref.backward(dy.float())
    assert y.dtype == dtype
    assert_close(y, y_ref, TOL[dtype], "y", scaled=True)
    assert_close(x.grad, xf.grad, TOL[dtype], "dx", scaled=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_nf4_linear(dtype):
    _check(37, 100, 67, dtype, bias=True, double_quant=dtype == torch.bfloat16)


def test_nf4_linear_several_tiles(monkeypatch):
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        monkeypatch.setattr(K, name, 16)
    _check(20, 40, 35, torch.bfloat16, bias=False, double_quant=True)  # 2, 3, 3 tiles, ragged


def test_matches_core_quant_nf4_linear():
    """Same output and input gradient as posttrain.core.quant.nf4_linear (what QLoRA calls today)."""
    from posttrain.core.quant import nf4_linear as core_nf4_linear

    t = _weight(24, 64, double_quant=True, dtype=torch.float32)
    x = torch.randn(2, 5, 64, requires_grad=True)
    expected = core_nf4_linear(x, t)
    (gx_ref,) = torch.autograd.grad(expected.square().sum(), x)
    with launched(K.LAUNCHES, "nf4_matmul_fwd"):
        y = K.nf4_linear(x, t)
    (gx,) = torch.autograd.grad(y.square().sum(), x)
    assert_close(y, expected, TOL[torch.float32], "y", scaled=True)
    assert_close(gx, gx_ref, TOL[torch.float32], "dx", scaled=True)


def test_opcheck():
    t = _weight(24, 40, double_quant=False, dtype=torch.float32)
    x = torch.randn(5, 40, requires_grad=True)
    torch.library.opcheck(torch.ops.posttrain.nf4_linear.default, (x, t.packed, t.absmax, torch.randn(24), 24, 64))
    torch.library.opcheck(torch.ops.posttrain.nf4_linear_backward.default,
                          (torch.randn(5, 24), t.packed, t.absmax, 40, 64),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.posttrain.nf4_dequantize.default,
                          (t.packed, t.absmax, 24, 40, 64, torch.bfloat16),
                          test_utils=("test_schema", "test_faketensor"))
