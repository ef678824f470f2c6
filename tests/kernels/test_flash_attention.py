"""posttrain.kernels.flash_attention (Triton, run by the interpreter) held to per-document SDPA in fp32.

Documents of lengths [5, 17, 1, 9] are packed back to back: with the interpreter's 16- and
32-wide blocks (posttrain.kernels.flash_attention.INTERPRETER_BLOCKS, unequal query and key blocks as on
the GPU) the 17-token document spans two 16-blocks, the 1-token one is a single row, and every
block has padded rows and columns to mask; a 37-token document spans two 32-blocks, so the
causal loop bounds start past 0. Head dims 24 and 40 are padded to 32 and 64. GQA groups of 2
and 4 query heads per kv head, causal and not, and an empty document.

Tolerances, compared after dividing both sides by max|reference| (outputs and gradients ~1):
  fp32  (1e-5, 1e-5): the same fp32 math in another order (online softmax over key blocks,
        tiled dK/dV sums over query blocks and GQA heads); observed <= 5e-7 of the scale.
  bf16  (4u, 2u), u = 2^-8: as FlashAttention-2 does, P and dS are rounded to bf16 (u/2) before
        their matmuls and O, dQ, dK, dV are stored in bf16, where the fp32 reference keeps all in
        fp32. Observed <= 1.3u of the scale; 4u leaves ~3x.
"""

from __future__ import annotations

import pytest
import torch

from kernel_testing import fp32_copy, launched
from posttrain.kernels import flash_attention as fa
from posttrain.kernels.dispatch import kernels_mode
from posttrain.kernels.flash_attention import flash_attn_varlen, flash_attn_varlen_reference

U_BF16 = 2.0**-8
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (4 * U_BF16, 2 * U_BF16)}


def scaled_close(actual, expected, dtype, what):
    scale = expected.detach().abs().max().clamp(min=1e-12)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.detach().float() / scale, expected.detach().float() / scale, atol=atol,
                               rtol=rtol, msg=lambda m: f"{what} ({dtype}): {m}")


def packed(lens, n_heads, n_kv_heads, head_dim, dtype):
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    q, k, v = (torch.randn(total, h, head_dim).to(dtype).requires_grad_() for h in (n_heads, n_kv_heads, n_kv_heads))
    return q, k, v, cu


@pytest.mark.parametrize("lens, n_heads, n_kv_heads, head_dim, causal, dtype", [
    ([5, 17, 1, 9], 4, 2, 24, True, torch.float32),
    ([5, 17, 1, 9], 4, 1, 40, False, torch.float32),
    ([6, 0, 37], 2, 2, 16, True, torch.float32),  # an empty document in cu_seqlens
    ([5, 17, 1, 9], 4, 2, 24, True, torch.bfloat16),
])
def test_matches_per_document_sdpa(lens, n_heads, n_kv_heads, head_dim, causal, dtype):
    q, k, v, cu = packed(lens, n_heads, n_kv_heads, head_dim, dtype)
    with launched(fa.LAUNCHES, "fwd", "bwd"):
        out = flash_attn_varlen(q, k, v, cu, max(lens), causal)
        dout = torch.randn_like(out)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    qf, kf, vf = fp32_copy(q), fp32_copy(k), fp32_copy(v)
    ref = flash_attn_varlen_reference(qf, kf, vf, cu, causal)
    rq, rk, rv = torch.autograd.grad(ref, (qf, kf, vf), dout.float())
    assert out.dtype == dtype and (dq.dtype, dk.dtype, dv.dtype) == (dtype,) * 3
    for name, a, b in (("out", out, ref), ("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        scaled_close(a, b, dtype, name)


def test_documents_do_not_attend_to_each_other():
    """Changing one document's keys and values leaves every other document's output and query
    gradients unchanged, bit for bit (no cross-document term can even round differently)."""
    q, k, v, cu = packed([7, 12, 5], 2, 1, 16, torch.float32)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[7:19] += 3.0
    v2[7:19] -= 1.0
    with launched(fa.LAUNCHES, "fwd"):
        out1 = flash_attn_varlen(q, k, v, cu, 12, causal=False)
        out2 = flash_attn_varlen(q, k2, v2, cu, 12, causal=False)
    others = torch.cat([torch.arange(0, 7), torch.arange(19, 24)])
    assert torch.equal(out1[others], out2[others])
    assert not torch.allclose(out1[7:19], out2[7:19])


def test_strided_qkv_views_and_custom_scale():
    """q, k, v sliced out of one fused (T, H + 2 H_kv, D) projection are not contiguous; outputs
    and gradients must still land in the right places."""
    n_heads, n_kv = 2, 1
    cu = torch.tensor([0, 9, 13], dtype=torch.int32)
    qkv = torch.randn(13, n_heads + 2 * n_kv, 16, requires_grad=True)
    q, k, v = qkv.split([n_heads, n_kv, n_kv], dim=1)
    with launched(fa.LAUNCHES, "fwd", "bwd"):
        out = flash_attn_varlen(q, k, v, cu, 9, True, softmax_scale=0.5)
        (grad,) = torch.autograd.grad(out.square().sum(), qkv)
    qkv_ref = fp32_copy(qkv)
    ref = flash_attn_varlen_reference(*qkv_ref.split([n_heads, n_kv, n_kv], dim=1), cu, True, 0.5)
    (grad_ref,) = torch.autograd.grad(ref.square().sum(), qkv_ref)
    scaled_close(out, ref, torch.float32, "out, strided views, scale 0.5")
    scaled_close(grad, grad_ref, torch.float32, "d qkv")


def test_reference_when_kernels_disabled_and_bad_arguments():
    q, k, v, cu = packed([3, 4], 4, 2, 16, torch.float32)
    before = fa.LAUNCHES["fwd"]
    with kernels_mode("torch"):
        out = flash_attn_varlen(q, k, v, cu, 4)
    assert fa.LAUNCHES["fwd"] == before
    assert torch.equal(out, flash_attn_varlen_reference(q, k, v, cu, True))
    with pytest.raises(ValueError, match="multiple"):
        flash_attn_varlen(q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1), cu, 4)
    with pytest.raises(ValueError, match="int32"):
        flash_attn_varlen(q, k, v, cu.long(), 4)


def test_opcheck():
    """Schema, fake kernels, autograd registration and AOT tracing of the forward op, whose
    traced backward graph calls the backward op. The backward op itself skips
    test_aot_dispatch_dynamic: it has no double-backward formula, and that tracing is covered."""
    q, k, v, cu = packed([3, 0, 6], 2, 1, 24, torch.float32)
    torch.library.opcheck(torch.ops.posttrain.flash_attn_varlen_fwd.default, (q, k, v, cu, 6, True, 0.2))
    q, k, v = q.detach(), k.detach(), v.detach()
    out, lse = torch.ops.posttrain.flash_attn_varlen_fwd(q, k, v, cu, 6, True, 0.2)
    torch.library.opcheck(torch.ops.posttrain.flash_attn_varlen_bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, cu, 6, True, 0.2),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_torch_compile_traces_without_graph_breaks():
    q, k, v, cu = packed([3, 9], 2, 1, 16, torch.float32)
    compiled = torch.compile(lambda q, k, v, cu: flash_attn_varlen(q, k, v, cu, 9), backend="aot_eager",
                             fullgraph=True)
    with launched(fa.LAUNCHES, "fwd", "bwd"):
        out = compiled(q, k, v, cu)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = flash_attn_varlen_reference(q, k, v, cu)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        scaled_close(a, b, torch.float32, f"compiled {name}")
