"""The model's loss and gradients with the Triton kernels on equal those with them off (the torch
references), for a dense and a MoE debug model, packed batch included."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.losses import chunked_cross_entropy
from posttrain.core.model import build_model, get_preset
from posttrain.kernels import dispatch
import importlib

# fp32 end to end: the kernels and references differ only in summation order (~1e-7 relative
# per op); through two layers, a softmax and a mean that stays below 2e-5 absolute.
ATOL, RTOL = 2e-5, 1e-4


def launches() -> int:
    mods = ("rmsnorm", "rope", "swiglu")
    return sum(sum(importlib.import_module(f"posttrain.kernels.{m}").LAUNCHES.values()) for m in mods)


def loss_and_grads(model, ids, pos, labels):
    model.zero_grad(set_to_none=True)
    loss = model(ids, pos, head=lambda h, w: chunked_cross_entropy(h, w, labels, chunk_size=8))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("preset", ["debug", "debug-moe"])
@pytest.mark.slow
def test_kernels_on_equals_off(preset):
    args = get_preset(preset, hidden_size=48, num_heads=4, num_kv_heads=2, intermediate_size=72, vocab_size=101)
    model = build_model(args, seed=0)
    g = torch.Generator().manual_seed(0)
    lengths = [5, 7, 3]
    ids = torch.randint(0, 101, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    with dispatch.kernels_mode("torch"):
        ref_loss, ref_grads = loss_and_grads(model, ids, pos, labels)
    before = launches()
    with dispatch.kernels_mode("auto"):
        loss, grads = loss_and_grads(model, ids, pos, labels)
    assert launches() > before, "no Triton kernel ran: the test compared the reference to itself"
    assert torch.allclose(loss, ref_loss, atol=ATOL, rtol=RTOL)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert torch.allclose(grads[name], ref_grads[name], atol=ATOL, rtol=RTOL), name
