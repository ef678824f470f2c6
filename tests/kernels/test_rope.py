"""posttrain.kernels.rope: the Triton rotation (interpreter) against posttrain.core.model.rope in fp32."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_close, launched

from posttrain.core.model.rope import apply_rope as rope_one, rope_cos_sin, rope_frequencies
from posttrain.kernels import rope as K

# u = unit roundoff: bf16 2^-8 = 3.9e-3, fp16 2^-11 = 4.9e-4.
TOL = {
    # Two products and a sum in fp32 either way (measured <= 5e-7 on |y| <= 4).
    torch.float32: (1e-6, 1e-5),
    # cos/sin are rounded to bf16 by rope_cos_sin and both sides use those very values, so only
    # the kernel's one output rounding (u) remains, against the reference's fp32 result. y1 =
    # c1 x1 - s1 x2 can cancel to near zero, so atol is u * max|x| (~3.9e-3 * 4); rtol is 2u.
    torch.bfloat16: (1.6e-2, 8e-3),
    # The same with fp16's u.
    torch.float16: (2e-3, 1e-3),
}


def _cos_sin(bsz, seq, head_dim, dtype, packed=False):
    inv_freq, scale = rope_frequencies(head_dim, 10000.0, None, 4096)
    pos = torch.arange(seq).expand(bsz, seq)
    if packed:  # two documents packed per row: positions restart mid-row
        pos = torch.cat([torch.arange(3), torch.arange(seq - 3)]).expand(bsz, seq) + torch.arange(bsz)[:, None]
    return rope_cos_sin(inv_freq, pos, scale, dtype)


def _heads(t, head_dim):
    bsz, seq, _ = t.shape
    return t.view(bsz, seq, -1, head_dim).transpose(1, 2)  # (B, heads, T, hd), not contiguous


def _qk(x, layout, n_heads, head_dim):
    """q, k from the activation x as the model makes them. x * 1 stands for a projection: its
    output is a non-leaf whose views may be written in place."""
    if layout == "projections":  # q_proj(x), k_proj(x): separate tensors (posttrain.core.model.model)
        q_part, k_part = x[..., : n_heads * head_dim] * 1, x[..., n_heads * head_dim:] * 1
    else:  # one fused qkv projection split in two: views autograd will not let us overwrite
        q_part, k_part = (x * 1).split([n_heads * head_dim, x.shape[-1] - n_heads * head_dim], dim=-1)
    return _heads(q_part, head_dim), _heads(k_part, head_dim)


# (B, n_heads, n_kv, T, head_dim) and how q/k are made: GQA from separate projections (rotated in
# place), MHA from a split fused qkv (rotated out of place).
CASES = [((2, 3, 1, 7, 10), "projections"), ((1, 5, 5, 9, 34), "fused_qkv")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("dims", "layout"), CASES, ids=["gqa-inplace", "mha-fused_qkv"])
def test_matches_fp32_reference(dims, layout, dtype):
    bsz, n_heads, n_kv, seq, head_dim = dims  # head_dim/2 = 5 or 17: masked lanes; odd T
    cos, sin = _cos_sin(bsz, seq, head_dim, dtype, packed=True)
    x = torch.randn(bsz, seq, (n_heads + n_kv) * head_dim).to(dtype).requires_grad_()
    q, k = _qk(x, layout, n_heads, head_dim)
    with launched(K.LAUNCHES, "rope_fwd", "rope_bwd"):
        q_out, k_out = K.apply_rope(q, k, cos, sin)
        dq, dk = torch.randn_like(q_out), torch.randn_like(k_out)
        torch.autograd.backward([q_out, k_out], [dq, dk])
    assert (q_out is q and k_out is k) == (layout == "projections")  # in place when allowed
    xf = x.detach().float().requires_grad_()
    qf, kf = _qk(xf, layout, n_heads, head_dim)
    cf, sf = cos.float(), sin.float()
    q_ref, k_ref = rope_one(qf, cf, sf), rope_one(kf, cf, sf)
    torch.autograd.backward([q_ref, k_ref], [dq.float(), dk.float()])
    assert_close(q_out, q_ref, TOL[dtype], "q")
    assert_close(k_out, k_ref, TOL[dtype], "k")
    assert_close(x.grad, xf.grad, TOL[dtype], "dx")


def test_backward_is_inverse_rotation_and_leaves_grad_untouched():
    """The gradient of a rotation is the rotation by -sin: with dq = rope(z), dL/dq_in = z."""
    cos, sin = _cos_sin(2, 5, 8, torch.float32)
    x = torch.randn(2, 5, 3 * 8, requires_grad=True)
    q, k = _qk(x, "projections", 2, 8)
    q_out, k_out = K.apply_rope(q, k, cos, sin)
    z_q, z_k = torch.randn_like(q_out), torch.randn_like(k_out)
    dq, dk = rope_one(z_q, cos, sin), rope_one(z_k, cos, sin)
    dq_copy = dq.clone()
    (gx,) = torch.autograd.grad([q_out, k_out], [x], [dq, dk])  # q itself is now the output
    assert_close(_heads(gx[..., :16], 8), z_q, TOL[torch.float32], "dq")
    assert_close(_heads(gx[..., 16:], 8), z_k, TOL[torch.float32], "dk")
    assert torch.equal(dq, dq_copy)  # the incoming gradient is not overwritten


def test_broadcast_cos_sin_and_dispatch_rules():
    cos, sin = _cos_sin(1, 6, 12, torch.float32)  # (1, T, hd) shared by the whole batch
    q, k = torch.randn(3, 4, 6, 12), torch.randn(3, 2, 6, 12)
    expected = rope_one(q, cos, sin), rope_one(k, cos, sin)
    with launched(K.LAUNCHES, "rope_fwd"):
        q_out, k_out = K.apply_rope(q.clone(), k.clone(), cos, sin)
    assert_close(q_out, expected[0], TOL[torch.float32], "q")
    assert_close(k_out, expected[1], TOL[torch.float32], "k")
    before = K.LAUNCHES["rope_fwd"]
    q_ref, _ = K.apply_rope(q, k, cos.requires_grad_(), sin)  # learned cos/sin: reference
    assert K.LAUNCHES["rope_fwd"] == before and q_ref is not q
    with pytest.raises(ValueError, match="cos"):
        K.apply_rope(q, k, cos[:, :5], sin[:, :5])


def test_opcheck():
    cos, sin = _cos_sin(2, 5, 8, torch.float32)
    q = torch.randn(2, 5, 3, 8).transpose(1, 2)  # (B, H, T, hd) strided like the model's q
    torch.library.opcheck(torch.ops.posttrain.rope_.default, (q, cos, sin))
    torch.library.opcheck(torch.ops.posttrain.rope.default, (q.requires_grad_(), cos, sin, False))
    torch.library.opcheck(torch.ops.posttrain.rope.default, (q, cos, sin, True),
                          test_utils=("test_schema", "test_faketensor"))
