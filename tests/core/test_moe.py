"""MoE block: router against HF and against the published load-balancing formula."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.model import build_model, get_preset
from posttrain.core.model.args import MoEArgs
from posttrain.core.model.moe import MoE, load_balancing_loss
from posttrain.registry.hf import load_pretrained
from tests.support.hf_models import make_hf_model


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_router_logits_and_aux_loss_match_hf(family, tmp_path):
    hf = make_hf_model(family, tmp_path)
    ours = load_pretrained(tmp_path).eval()
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = hf(ids, output_router_logits=True)
        ours(ids)
    moe_layers = ours.moe_layers()
    ref_logits = [r for r in out.router_logits if r is not None]
    assert len(moe_layers) == len(ref_logits) > 0
    for m, ref in zip(moe_layers, ref_logits):
        assert (m.last_router_logits - ref.reshape(m.last_router_logits.shape)).abs().max() < 1e-5
    # With one MoE layer HF's load_balancing_loss_func equals our per-layer Switch loss.
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    m = moe_layers[0]
    ref = load_balancing_loss_func((m.last_router_logits,), m.args.num_experts, m.args.top_k)
    assert torch.allclose(m.aux_loss, ref, atol=1e-6)


def naive_switch_loss(probs: torch.Tensor, ids: torch.Tensor, E: int) -> torch.Tensor:
    N, k = ids.shape
    total = torch.zeros((), dtype=torch.float64)
    for e in range(E):
        f = sum(int(ids[t, j] == e) for t in range(N) for j in range(k)) / N
        P = probs[:, e].double().mean()
        total += f * P
    return E * total


def test_load_balancing_loss_formula():
    g = torch.Generator().manual_seed(0)
    probs = torch.randn(37, 6, generator=g).softmax(-1)
    ids = probs.topk(2, dim=-1).indices
    assert torch.allclose(load_balancing_loss(probs, ids, 6).double(), naive_switch_loss(probs, ids, 6), atol=1e-6)
    # perfectly balanced routing with uniform probabilities gives exactly k
    uniform = torch.full((6, 6), 1 / 6)
    ids = torch.stack([torch.arange(6), (torch.arange(6) + 1) % 6], dim=1)
    assert torch.allclose(load_balancing_loss(uniform, ids, 6), torch.tensor(2.0))


@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_moe_forward_equals_dense_loop(gating):
    """The sorted/grouped expert computation equals a per-token loop over its top-k experts."""
    torch.manual_seed(0)
    args = MoEArgs(num_experts=5, top_k=2, intermediate_size=24, shared_intermediate_size=16,
                   shared_expert_gate=True, gating=gating, norm_topk_prob=gating == "sigmoid")
    moe = MoE(32, args)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 7, 32)
    y = moe(x)
    flat = x.reshape(-1, 32)
    logits = flat @ moe.router.gate.weight.T
    scores = logits.softmax(-1) if gating == "softmax" else logits.sigmoid()
    w, ids = scores.topk(2, dim=-1)
    if args.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    ref = torch.zeros_like(flat)
    E = moe.experts
    for t in range(flat.shape[0]):
        for j in range(2):
            e = ids[t, j]
            h = torch.nn.functional.silu(flat[t] @ E.gate_proj[e].T) * (flat[t] @ E.up_proj[e].T)
            ref[t] += w[t, j] * (h @ E.down_proj[e].T)
    ref += moe.shared_expert(flat) * torch.sigmoid(moe.shared_expert_gate(flat))
    assert torch.allclose(y.reshape(-1, 32), ref, atol=1e-5)
    assert moe.tokens_per_expert.sum() == flat.shape[0] * 2


def test_aux_loss_free_bias_balances_and_leaves_weights_alone():
    torch.manual_seed(0)
    args = MoEArgs(num_experts=4, top_k=1, intermediate_size=8, gating="sigmoid", bias_update_rate=0.05,
                   norm_topk_prob=False)
    moe = MoE(16, args)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    with torch.no_grad():
        moe.router.gate.weight[0] += 0.5  # with positive inputs, expert 0 takes most tokens
    x = torch.randn(4, 32, 16) + 1.0

    def imbalance():
        moe.tokens_per_expert.zero_()
        moe(x)
        return (moe.tokens_per_expert.max() - moe.tokens_per_expert.min()).item()

    before = imbalance()
    for _ in range(60):
        moe(x)
        moe.update_bias()
    after = imbalance()
    assert before > 64 and after < before / 4
    assert moe.router.expert_bias[0] < 0  # the hot expert was pushed down
    # the bias changes selection only: gate weights still come from the unbiased scores
    _, scores, weights, ids = moe.router(x.reshape(-1, 16))
    assert torch.allclose(weights, scores.gather(-1, ids))


def test_model_aux_loss_and_gradients_flow():
    model = build_model(get_preset("debug-moe"))
    ids = torch.randint(0, 512, (2, 16))
    logits = model(ids)
    aux = model.aux_loss()
    assert aux is not None and aux.item() > 0
    (logits.logsumexp(-1).mean() + aux).backward()
    router = model.layers[0].mlp.router.gate.weight
    assert router.grad is not None and router.grad.abs().sum() > 0
