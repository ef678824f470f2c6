"""posttrain.kernels.fused_linear_kl (Triton, run by the interpreter): `fused_linear_distill` held to
posttrain.core.losses.chunked_distill_loss and `fused_linear_logps` to posttrain.core.losses.chunked_token_logps,
in fp32 on the same values.

Shapes: V = 300 over 256-wide vocab blocks (a full block and a 44-wide ragged one: the online
logsumexps and the per-block divergence sums run across blocks), student hidden 24 and teacher
hidden 40 (distinct widths), 14 tokens in chunks of 5, masked / ignored positions mid-sequence.

Tolerances, compared after dividing both sides by max|reference| (losses ~1, gradients ~1e-2):
  fp32  (1e-5, 1e-5): the same fp32 math in another order (online vs two-pass logsumexp, the
        divergence summed per block, chunked weight-gradient sums); observed <= 1e-6 of the scale.
  bf16  (4u, 2u), u = 2^-8: the kernel path keeps the student and teacher logits in bf16 (the
        matmuls' outputs, rounded by u/2) and stores dD/dz in bf16 before the gradient matmuls;
        the reference keeps them in fp32. Observed <= 1.5u of the scale; 4u leaves ~2.5x.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.core.losses import chunked_distill_loss, chunked_token_logps
from kernel_testing import fp32_copy, launched
from posttrain.kernels import fused_linear_ce as flce
from posttrain.kernels import fused_linear_kl as flkl
from posttrain.kernels.fused_linear_kl import fused_linear_distill, fused_linear_logps
from test_fused_linear_ce import largest_allocation, make_inputs, scaled_close

U_BF16 = 2.0**-8
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (4 * U_BF16, 2 * U_BF16)}
V, HS, HT = 300, 24, 40


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    monkeypatch.setattr(flkl, "MAX_BLOCK", 256)
    monkeypatch.setattr(flce, "MAX_BLOCK", 256)


def distill_inputs(dtype, B=2, S=7):
    sh = torch.randn(B, S, HS).to(dtype).requires_grad_()
    sw = (torch.randn(V, HS) / HS**0.5).to(dtype).requires_grad_()
    th = torch.randn(B, S, HT).to(dtype)
    tw = (1.5 * torch.randn(V, HT) / HT**0.5).to(dtype)  # a sharper teacher than student
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, 2:5] = False
    mask[1, -1] = False
    return sh, sw, th, tw, mask


def check_distill(dtype, kind, temperature, beta=0.5, use_mask=True):
    sh, sw, th, tw, mask = distill_inputs(dtype)
    mask = mask if use_mask else None
    with launched(flkl.LAUNCHES, "distill_rows"):
        out = fused_linear_distill(sh, sw, th, tw, mask, kind, temperature, beta, chunk_size=5)
        gh, gw = torch.autograd.grad(2.5 * out, (sh, sw))  # a non-unit upstream gradient
    shf, swf = fp32_copy(sh), fp32_copy(sw)
    ref = chunked_distill_loss(shf, swf, th.float(), tw.float(), kind, temperature, beta, mask, chunk_size=7)
    rh, rw = torch.autograd.grad(2.5 * ref, (shf, swf))
    assert out.dtype == torch.float32 and out.dim() == 0
    assert gh.dtype == dtype and gw.dtype == dtype
    scaled_close(out, ref, dtype, f"{kind} loss")
    scaled_close(gh, rh, dtype, f"{kind} grad student hidden")
    scaled_close(gw, rw, dtype, f"{kind} grad student weight")


@pytest.mark.parametrize("kind, temperature, beta, use_mask", [
    ("forward_kl", 2.0, 0.5, True), ("reverse_kl", 1.0, 0.5, False), ("jsd", 2.0, 0.3, True),
    ("jsd", 1.0, 0.0, True),  # the reference's endpoint special case: exactly forward KL
    ("jsd", 1.0, 1.0, True),  # ... and exactly reverse KL
])
def test_distill_fp32_matches_reference(kind, temperature, beta, use_mask):
    check_distill(torch.float32, kind, temperature, beta, use_mask)


def test_distill_bf16_matches_fp32_reference():
    check_distill(torch.bfloat16, "jsd", 2.0, 0.7)


def test_distill_all_masked_gives_zero_and_teacher_gets_no_gradient():
    sh, sw, th, tw, mask = distill_inputs(torch.float32)
    th.requires_grad_()
    with launched(flkl.LAUNCHES, "distill_rows"):
        out = fused_linear_distill(sh, sw, th, tw, torch.zeros_like(mask), "jsd", 2.0, 0.3, chunk_size=8)
        out.backward()
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(sh.grad, torch.zeros_like(sh)) and torch.equal(sw.grad, torch.zeros_like(sw))
    assert th.grad is None  # the teacher is a constant


def test_distill_never_materializes_all_logits(monkeypatch):
    """As for CE: with hidden sizes 2 and 3 the largest allocation must be exactly one (chunk, V)
    logits buffer (student's or teacher's); chunk = tokens is the positive control."""
    monkeypatch.setattr(flkl, "MAX_BLOCK", 512)  # one block per row: the probe slows the interpreter
    n_tokens, chunk = 16, 4
    sh, sw, th, tw = torch.randn(n_tokens, 2), torch.randn(V, 2), torch.randn(n_tokens, 3), torch.randn(V, 3)
    keep = torch.ones(n_tokens, dtype=torch.bool)
    for c in (chunk, n_tokens):
        largest = largest_allocation(lambda: flkl._forward(sh, sw, th, tw, keep, "jsd", 2.0, 0.5, c, True, True))
        assert largest == c * V * 4, (c, largest)  # fp32 logits


def test_distill_rejects_bad_arguments():
    sh, sw, th, tw, mask = distill_inputs(torch.float32)
    with pytest.raises(ValueError, match="kind"):
        fused_linear_distill(sh, sw, th, tw, mask, "kl")
    with pytest.raises(ValueError, match="beta"):
        fused_linear_distill(sh, sw, th, tw, mask, "jsd", beta=1.5)
    with pytest.raises(ValueError, match="mask shape"):
        fused_linear_distill(sh, sw, th, tw, mask[:, 1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logps_matches_reference(dtype):
    h, w, labels = make_inputs(dtype)
    with launched(flce.LAUNCHES, "ce_rows"):
        out = fused_linear_logps(h, w, labels, chunk_size=5)
        grad_out = torch.randn_like(out)
        gh, gw = torch.autograd.grad(out, (h, w), grad_out)
    hf, wf = fp32_copy(h), fp32_copy(w)
    ref = chunked_token_logps(hf, wf, labels, chunk_size=7)
    rh, rw = torch.autograd.grad(ref, (hf, wf), grad_out)
    assert out.shape == labels.shape and (out[flce.shift_labels(labels, -100) == -100] == 0).all()
    scaled_close(out, ref, dtype, "logps")
    scaled_close(gh, rh, dtype, "logps grad hidden")
    scaled_close(gw, rw, dtype, "logps grad weight")


def test_opcheck():
    """Schema, fake kernel, autograd registration and AOT tracing (what torch.compile needs)."""
    sh, sw = torch.randn(10, 16, requires_grad=True), torch.randn(37, 16, requires_grad=True)
    keep = torch.ones(10, dtype=torch.bool)
    keep[3] = False
    torch.library.opcheck(torch.ops.posttrain.fused_linear_distill.default,
                          (sh, sw, torch.randn(10, 8), torch.randn(37, 8), keep, "jsd", 2.0, 0.3, 4, True, True))


def test_torch_compile_traces_without_graph_breaks():
    sh, sw, th, tw, mask = distill_inputs(torch.float32)
    compiled = torch.compile(lambda *a: fused_linear_distill(*a, "reverse_kl", 2.0, chunk_size=5),
                             backend="aot_eager", fullgraph=True)
    with launched(flkl.LAUNCHES, "distill_rows"):
        out = compiled(sh, sw, th, tw, mask)
        gh, gw = torch.autograd.grad(out, (sh, sw))
    ref = chunked_distill_loss(sh, sw, th, tw, "reverse_kl", 2.0, mask=mask)
    rh, rw = torch.autograd.grad(ref, (sh, sw))
    for name, a, b in (("loss", out, ref), ("grad hidden", gh, rh), ("grad weight", gw, rw)):
        scaled_close(a, b, torch.float32, f"compiled {name}")
