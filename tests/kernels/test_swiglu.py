"""posttrain.kernels.swiglu: the Triton path (interpreter) against the fp32 reference."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import assert_close, fp32_copy, launched, leaf

# Not `from kernels import swiglu`: the package re-exports the function under the module's name.
K = importlib.import_module("posttrain.kernels.swiglu")

# u = unit roundoff: bf16 2^-8 = 3.9e-3, fp16 2^-11 = 4.9e-4.
TOL = {
    # Same fp32 formulas; exp and the sigmoid's division round differently in the last bits.
    torch.float32: (1e-6, 1e-5),
    # Each output is rounded once from fp32 math on the same (exactly upcast) inputs: <= u
    # relative, so rtol 2u; no cancellation except dgate's (1 + g(1 - sig)) factor crossing
    # zero near g = -1.28, where atol u * |dy * up| (~3.9e-3 * 4) covers it.
    torch.bfloat16: (1.6e-2, 8e-3),
    # The same with fp16's u.
    torch.float16: (2e-3, 1e-3),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(3, 5, 100), (7, 257)], ids=str)
def test_matches_fp32_reference(shape, dtype, monkeypatch):
    monkeypatch.setattr(K, "MAX_BLOCK", 64 if shape[-1] == 100 else 128)  # ragged column blocks
    gate, up = leaf(shape, dtype, scale=2.0), leaf(shape, dtype)
    with launched(K.LAUNCHES, "swiglu_fwd", "swiglu_bwd"):
        y = K.swiglu(gate, up)
        dy = torch.randn(shape).to(dtype)
        y.backward(dy)
    gf, uf = fp32_copy(gate), fp32_copy(up)
    y_ref = K.swiglu_reference(gf, uf)
    y_ref.backward(dy.float())
    assert y.dtype == dtype
    assert_close(y, y_ref, TOL[dtype], "y")
    assert_close(gate.grad, gf.grad, TOL[dtype], "dgate")
    assert_close(up.grad, uf.grad, TOL[dtype], "dup")


def test_strided_halves_of_fused_gate_up():
    """gate/up as the two halves of one (N, 2H) projection: row-strided views, no copies."""
    gate_up = torch.randn(7, 2 * 100, requires_grad=True)
    gate, up = gate_up.chunk(2, dim=-1)
    with launched(K.LAUNCHES, "swiglu_fwd", "swiglu_bwd"):
        y = K.swiglu(gate, up)
        y.sum().backward()
    ref_in = gate_up.detach().requires_grad_()
    g_ref, u_ref = ref_in.chunk(2, dim=-1)
    (F.silu(g_ref) * u_ref).sum().backward()
    assert_close(y, F.silu(g_ref) * u_ref, TOL[torch.float32], "y")
    assert_close(gate_up.grad, ref_in.grad, TOL[torch.float32], "d(gate_up)")


def test_backward_saves_inputs_not_silu():
    """Only gate and up are kept for backward (silu(gate) is recomputed)."""
    gate, up = torch.randn(4, 100, requires_grad=True), torch.randn(4, 100, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        K.swiglu(gate, up)
    assert sorted(s.data_ptr() for s in saved) == sorted([gate.data_ptr(), up.data_ptr()])
    assert all(s.shape == gate.shape for s in saved)


def test_opcheck():
    gate, up = torch.randn(5, 100, requires_grad=True), torch.randn(5, 100, requires_grad=True)
    torch.library.opcheck(torch.ops.posttrain.swiglu.default, (gate, up))
    torch.library.opcheck(torch.ops.posttrain.swiglu_backward.default,
                          (torch.randn(5, 100), gate.detach(), up.detach()),
                          test_utils=("test_schema", "test_faketensor"))
