"""posttrain.core.losses held to naive fp64 implementations of the published formulas, written out here.

Tolerances: fp64-vs-fp64 comparisons use 1e-10 (only summation order differs); fp32 chunked CE vs
torch's fp32 cross entropy uses atol 1e-5 (the brief's bound, ~100x fp32 eps at |loss| ~ 7);
fp32 against the fp64 reference uses 1e-5 for the same reason.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from posttrain.core import losses as L

V = 1003  # odd vocab, not a multiple of any chunk size
IGN = -100
F64 = dict(rtol=1e-10, atol=1e-10)
F32 = dict(rtol=1e-5, atol=1e-5)


def make_ce_inputs(B=2, S=37, H=16, vocab=V, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, H, generator=g) / H**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (B, S), generator=g)
    labels[torch.rand(B, S, generator=g) < 0.3] = IGN
    labels[0, :5] = IGN
    return hidden, weight, labels


def naive_ce(hidden, weight, labels, reduction="mean", shift=True, softcap=None):
    """CE_t = logsumexp_v z_tv - z_t,y with y = labels[t+1], one token at a time, fp64."""
    h, w = hidden.double(), weight.double()
    B, S = labels.shape
    rows, n = [], 0
    for b in range(B):
        for t in range(S):
            y = (labels[b, t + 1] if t + 1 < S else IGN) if shift else labels[b, t]
            if y == IGN:
                rows.append(h.new_zeros(()))
                continue
            z = w @ h[b, t]
            if softcap is not None:
                z = softcap * torch.tanh(z / softcap)
            m = z.max().detach()
            rows.append(torch.log(torch.exp(z - m).sum()) + m - z[y])
            n += 1
    per_token = torch.stack(rows).view(B, S)
    if reduction == "none":
        return per_token
    return per_token.sum() / max(n, 1) if reduction == "mean" else per_token.sum()


def shifted(labels):
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGN)], dim=1)


def upstream(reduction, shape, seed=1):
    """A random upstream gradient for `none` (exercises the per-token backward), else 1."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) if reduction == "none" else 1.0


def grads(out, inputs, up=1.0):
    return torch.autograd.grad((out * up).sum(), inputs, retain_graph=True)


def assert_all_close(xs, ys, **tol):
    for x, y in zip(xs, ys, strict=True):
        torch.testing.assert_close(x.to(y.dtype), y, **tol)


# --------------------------------------------------------------------------- cross entropy


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk_size", [1, 10, 74, 4096])
def test_chunked_ce_matches_torch_cross_entropy(reduction, chunk_size):
    hidden, weight, labels = make_ce_inputs()
    logits = hidden @ weight.T  # (2, 37, 1003) fp32, materialized for the reference only
    ref = F.cross_entropy(logits.reshape(-1, V), shifted(labels).reshape(-1), ignore_index=IGN,
                          reduction=reduction)
    ref = ref.view(labels.shape) if reduction == "none" else ref
    out = L.chunked_cross_entropy(hidden, weight, labels, chunk_size=chunk_size, reduction=reduction)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out, ref, **F32)
    up = upstream(reduction, labels.shape)
    assert_all_close(grads(out, (hidden, weight), up), grads(ref, (hidden, weight), up), **F32)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_ce_matches_naive_formula(reduction, softcap):
    hidden, weight, labels = make_ce_inputs(dtype=torch.float64)
    ref = naive_ce(hidden, weight, labels, reduction, softcap=softcap)
    up = upstream(reduction, labels.shape).double() if reduction == "none" else 1.0
    ref_grads = grads(ref, (hidden, weight), up)
    chunked = L.chunked_cross_entropy(hidden, weight, labels, chunk_size=9, reduction=reduction, softcap=softcap)
    plain = L.cross_entropy(hidden @ weight.T, labels, reduction=reduction, softcap=softcap)
    for out in (chunked, plain):
        torch.testing.assert_close(out, ref, **F64)
        assert_all_close(grads(out, (hidden, weight), up), ref_grads, **F64)
    # fp32 inputs against the fp64 formula
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    out32 = L.chunked_cross_entropy(h32, w32, labels, chunk_size=9, reduction=reduction, softcap=softcap)
    torch.testing.assert_close(out32, ref.float(), **F32)
    assert_all_close(grads(out32, (h32, w32), up), [g.float() for g in ref_grads], **F32)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_chunked_ce_gradcheck(reduction, softcap):
    hidden, weight, labels = make_ce_inputs(B=3, S=4, H=3, vocab=7, dtype=torch.float64, seed=3)
    def fn(h, w):
        return L.chunked_cross_entropy(h, w, labels, chunk_size=5, reduction=reduction, softcap=softcap)

    assert torch.autograd.gradcheck(fn, (hidden, weight))


def test_ce_without_shift_and_flat_shapes():
    hidden, weight, labels = make_ce_inputs()
    h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)  # (T, H), (T,)
    ref = F.cross_entropy(h @ weight.T, y, ignore_index=IGN)
    torch.testing.assert_close(L.chunked_cross_entropy(h, weight, y, chunk_size=7, shift=False), ref, **F32)
    torch.testing.assert_close(L.cross_entropy(h @ weight.T, y, shift=False), ref, **F32)
    with pytest.raises(ValueError, match="shapes do not match"):
        L.chunked_cross_entropy(hidden, weight, y)
    with pytest.raises(ValueError, match="valid: mean, sum, none"):
        L.chunked_cross_entropy(hidden, weight, labels, reduction="avg")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero_not_nan(reduction):
    hidden, weight, labels = make_ce_inputs()
    labels = torch.full_like(labels, IGN)
    for out in (L.chunked_cross_entropy(hidden, weight, labels, chunk_size=10, reduction=reduction),
                L.cross_entropy(hidden @ weight.T, labels, reduction=reduction)):
        assert torch.all(out == 0)
        for g in grads(out, (hidden, weight)):
            assert torch.all(g == 0)
    seq = L.chunked_sequence_logps(hidden, weight, labels, average=True, chunk_size=10)
    assert torch.all(seq == 0)


def test_chunked_ce_bf16_and_no_grad():
    hidden, weight, labels = make_ce_inputs(dtype=torch.bfloat16)
    h32, w32 = (hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_())
    ref = L.cross_entropy(h32 @ w32.T, labels)
    out = L.chunked_cross_entropy(hidden, weight, labels, chunk_size=16)
    assert out.dtype == torch.float32
    # bf16 logits carry a relative rounding of 2^-8; the mean over ~45 tokens keeps it under 1e-2
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-2)
    gh, gw = grads(out, (hidden, weight))
    assert gh.dtype == gw.dtype == torch.bfloat16
    rh, rw = grads(ref, (h32, w32))
    torch.testing.assert_close(gh.float(), rh, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(gw.float(), rw, rtol=2e-2, atol=2e-3)
    with torch.no_grad():
        torch.testing.assert_close(L.chunked_cross_entropy(h32, w32, labels, chunk_size=16), ref.detach(), **F32)


class MaxNumel(TorchDispatchMode):
    """Records the largest tensor any op produces (CPU memory profiling is unreliable)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_chunked_ce_never_materializes_full_logits(reduction):
    hidden, weight, labels = make_ce_inputs(B=2, S=64, H=16)
    tokens = labels.numel()
    assert weight.numel() < tokens * V  # the (V, H) grad accumulator must not trip the check
    with MaxNumel() as naive:  # the check itself must catch materialized logits
        F.cross_entropy((hidden @ weight.T).view(-1, V), labels.view(-1), ignore_index=IGN)
    assert naive.max_numel >= tokens * V
    with MaxNumel() as mode:
        out = L.chunked_cross_entropy(hidden, weight, labels, chunk_size=16, reduction=reduction)
        grads(out, (hidden, weight), upstream(reduction, labels.shape))
    assert mode.max_numel <= max(16 * V, weight.numel(), hidden.numel()) < tokens * V


class Shapes(TorchDispatchMode):
    """Records the shape of every op output."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes.update(tuple(t.shape) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out


def test_chunked_ce_under_no_grad_skips_gradient_work():
    hidden, weight, labels = make_ce_inputs()
    with Shapes() as train:
        L.chunked_cross_entropy(hidden, weight, labels, chunk_size=16)
    assert tuple(weight.shape) in train.shapes  # the (V, H) grad accumulator
    with torch.no_grad(), Shapes() as evaluation:
        L.chunked_cross_entropy(hidden, weight, labels, chunk_size=16)
    assert tuple(weight.shape) not in evaluation.shapes


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_chunked_ce_runs_the_head_on_scored_tokens_only(reduction):
    """Prompt positions (label ignored) get no lm_head work: every logits chunk, forward and
    backward, has as many rows as there are scored tokens, not tokens."""
    hidden, weight, labels = make_ce_inputs(B=2, S=40, H=16)
    labels[:, :30] = IGN  # a long prompt
    scored = int((shifted(labels) != IGN).sum())
    with Shapes() as mode:
        out = L.chunked_cross_entropy(hidden, weight, labels, chunk_size=1024, reduction=reduction)
        grads(out, (hidden, weight), upstream(reduction, labels.shape))
    H = hidden.shape[-1]
    vocab_rows = {shape[0] for shape in mode.shapes if len(shape) == 2 and shape[1] == V and shape != (H, V)}
    assert scored != H and vocab_rows == {scored}, (vocab_rows, scored)  # (H, V): weight.T
    ref = F.cross_entropy((hidden @ weight.T).view(-1, V), shifted(labels).view(-1), ignore_index=IGN,
                          reduction=reduction)
    torch.testing.assert_close(out, ref.view(labels.shape) if reduction == "none" else ref, **F32)


def test_token_and_sequence_logps():
    hidden, weight, labels = make_ce_inputs(dtype=torch.float64)
    naive_tok = -naive_ce(hidden, weight, labels, "none")
    n = (shifted(labels) != IGN).sum(-1)
    torch.testing.assert_close(L.num_target_tokens(labels), n)
    up = torch.randn(labels.shape[0], dtype=torch.float64)
    for average in (False, True):
        ref = naive_tok.sum(-1) / (n if average else 1)
        ref_grads = grads(ref, (hidden, weight), up)
        for out in (L.sequence_logps(hidden @ weight.T, labels, average=average),
                    L.chunked_sequence_logps(hidden, weight, labels, average=average, chunk_size=11)):
            torch.testing.assert_close(out, ref, **F64)
            assert_all_close(grads(out, (hidden, weight), up), ref_grads, **F64)
    torch.testing.assert_close(L.token_logps(hidden @ weight.T, labels), naive_tok, **F64)
    torch.testing.assert_close(L.chunked_token_logps(hidden, weight, labels, chunk_size=5), naive_tok, **F64)


# --------------------------------------------------------------------------- DPO family


def logsig(x):
    return torch.log(torch.sigmoid(x))


def naive_dpo(pc, pr, rc, rr, beta, loss_type, eps=0.0, gamma=0.5, nc=None, nr=None):
    """Per-example losses from the papers' formulas, one example at a time (fp64 0-d tensors)."""
    out = []
    for i in range(len(pc)):
        if loss_type in ("ipo", "simpo") and nc is not None:
            pci, pri = pc[i] / nc[i], pr[i] / nr[i]
            rci, rri = (rc[i] / nc[i], rr[i] / nr[i]) if rc is not None else (None, None)
        else:
            pci, pri, rci, rri = pc[i], pr[i], rc[i], rr[i]
        if loss_type == "simpo":
            x = beta * (pci - pri) - gamma
            out.append(-(1 - eps) * logsig(x) - eps * logsig(-x))
            continue
        h = (pci - rci) - (pri - rri)
        if loss_type == "sigmoid":
            out.append(-(1 - eps) * logsig(beta * h) - eps * logsig(-beta * h))
        elif loss_type == "robust":
            out.append(((1 - eps) * -logsig(beta * h) + eps * logsig(-beta * h)) / (1 - 2 * eps))
        elif loss_type == "ipo":
            out.append((h - 1 / (2 * beta)) ** 2)
        elif loss_type == "hinge":
            out.append(torch.clamp(1 - beta * h, min=0))
    return torch.stack(out)


def dpo_inputs(B=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    pc, pr, rc, rr = (-40 + 10 * torch.randn(B, generator=g, dtype=torch.float64) for _ in range(4))
    nc, nr = (torch.randint(5, 40, (B,), generator=g) for _ in range(2))
    return pc.requires_grad_(), pr.requires_grad_(), rc, rr, nc, nr


@pytest.mark.parametrize("loss_type,eps,use_lengths", [
    ("sigmoid", 0.0, False), ("sigmoid", 0.2, False), ("robust", 0.0, False), ("robust", 0.2, False),
    ("ipo", 0.0, True), ("ipo", 0.0, False), ("hinge", 0.0, False), ("simpo", 0.0, True), ("simpo", 0.1, True),
])
def test_dpo_loss_types_match_formulas(loss_type, eps, use_lengths):
    pc, pr, rc, rr, nc, nr = dpo_inputs()
    beta = 2.0 if loss_type == "simpo" else 0.1
    lengths = (nc, nr) if use_lengths else (None, None)
    refs = (None, None) if loss_type == "simpo" else (rc, rr)
    ref = naive_dpo(pc, pr, *refs, beta, loss_type, eps, 0.7, *lengths)
    out = L.dpo_loss(pc, pr, *refs, beta=beta, loss_type=loss_type, label_smoothing=eps, simpo_gamma=0.7,
                     chosen_lengths=lengths[0], rejected_lengths=lengths[1])
    torch.testing.assert_close(out.losses, ref, **F64)
    torch.testing.assert_close(out.loss, ref.mean(), **F64)
    assert_all_close(grads(out.loss, (pc, pr)), grads(ref.mean(), (pc, pr)), **F64)


def test_dpo_rewards_margins_accuracy():
    pc, pr, rc, rr, nc, nr = dpo_inputs()
    out = L.dpo_loss(pc, pr, rc, rr, beta=0.1)
    cr, rj = 0.1 * (pc - rc), 0.1 * (pr - rr)
    torch.testing.assert_close(out.chosen_rewards, cr.detach(), **F64)
    torch.testing.assert_close(out.rejected_rewards, rj.detach(), **F64)
    torch.testing.assert_close(out.margins, (cr - rj).detach(), **F64)
    assert out.accuracy.item() == pytest.approx((cr > rj).double().mean().item())
    assert not out.chosen_rewards.requires_grad
    simpo = L.dpo_loss(pc, pr, beta=2.0, loss_type="simpo", chosen_lengths=nc, rejected_lengths=nr)
    torch.testing.assert_close(simpo.chosen_rewards, (2.0 * pc / nc).detach(), **F64)
    ipo = L.dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="ipo", chosen_lengths=nc, rejected_lengths=nr)
    torch.testing.assert_close(ipo.chosen_rewards, (0.1 * (pc - rc) / nc).detach(), **F64)


def test_dpo_smoothing_zero_is_sigmoid_and_simpo_length_normalization():
    pc, pr, rc, rr, nc, nr = dpo_inputs()
    base = L.dpo_loss(pc, pr, rc, rr).losses
    torch.testing.assert_close(L.dpo_loss(pc, pr, rc, rr, label_smoothing=0.0).losses, base, **F64)
    torch.testing.assert_close(L.dpo_loss(pc, pr, rc, rr, loss_type="robust").losses, base, **F64)
    summed = L.dpo_loss(pc, pr, beta=2.0, loss_type="simpo", chosen_lengths=nc, rejected_lengths=nr)
    averaged = L.dpo_loss(pc / nc, pr / nr, beta=2.0, loss_type="simpo")
    torch.testing.assert_close(summed.losses, averaged.losses, **F64)
    # SimPO ignores reference log-probs entirely
    with_ref = L.dpo_loss(pc / nc, pr / nr, rc, rr, beta=2.0, loss_type="simpo")
    torch.testing.assert_close(with_ref.losses, averaged.losses, **F64)


def test_dpo_sft_term():
    pc, pr, rc, rr, nc, nr = dpo_inputs()
    base = L.dpo_loss(pc, pr, rc, rr).losses
    nll = torch.rand(8, dtype=torch.float64)
    torch.testing.assert_close(L.dpo_loss(pc, pr, rc, rr, sft_weight=0.5, policy_chosen_nll=nll).losses,
                               base + 0.5 * nll, **F64)
    out = L.dpo_loss(pc, pr, rc, rr, sft_weight=0.5, chosen_lengths=nc, rejected_lengths=nr)
    torch.testing.assert_close(out.losses, base + 0.5 * (-pc / nc), **F64)
    g = grads(out.loss, (pc,))[0]
    torch.testing.assert_close(g, grads(base.mean(), (pc,))[0] - 0.5 / nc.double() / 8, **F64)


def test_dpo_errors():
    pc, pr, rc, rr, nc, nr = dpo_inputs()
    with pytest.raises(ValueError, match="valid: sigmoid, robust, ipo, hinge, simpo, exo_pair"):
        L.dpo_loss(pc, pr, rc, rr, loss_type="nope")
    with pytest.raises(ValueError, match="needs ref_chosen_logps and ref_rejected_logps"):
        L.dpo_loss(pc, pr, None, rr)
    with pytest.raises(ValueError, match="needs policy_chosen_nll or chosen_lengths"):
        L.dpo_loss(pc, pr, rc, rr, sft_weight=1.0)
    with pytest.raises(ValueError, match="both chosen_lengths and rejected_lengths"):
        L.dpo_loss(pc, pr, rc, rr, chosen_lengths=nc)
    with pytest.raises(ValueError, match="must be 0 for loss_type='ipo'"):
        L.dpo_loss(pc, pr, rc, rr, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="< 0.5"):
        L.dpo_loss(pc, pr, rc, rr, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match=r"\(B,\)"):
        L.dpo_loss(pc[:4], pr, rc, rr)


# --------------------------------------------------------------------------- distillation


def naive_kl(p, q):
    return sum(p[v] * (torch.log(p[v]) - torch.log(q[v])) for v in range(len(p)) if p[v] > 0)


def naive_distill(s_logits, t_logits, kind, T=1.0, beta=0.5, mask=None, scale=True):
    """Per-token softmaxes and KLs from their definitions, then the masked mean (fp64)."""
    s2, t2 = (x.reshape(-1, x.shape[-1]).double() for x in (s_logits, t_logits))
    keep = torch.ones(len(s2), dtype=torch.bool) if mask is None else mask.reshape(-1)
    rows = []
    for i in range(len(s2)):
        if not keep[i]:
            continue
        p_s = torch.exp(s2[i] / T) / torch.exp(s2[i] / T).sum()
        p_t = torch.exp(t2[i] / T) / torch.exp(t2[i] / T).sum()
        if kind == "forward_kl":
            d = naive_kl(p_t, p_s)
        elif kind == "reverse_kl":
            d = naive_kl(p_s, p_t)
        else:
            m = beta * p_t + (1 - beta) * p_s
            d = beta * naive_kl(p_t, m) + (1 - beta) * naive_kl(p_s, m)
        rows.append(d * (T**2 if scale else 1.0))
    return torch.stack(rows).sum() / max(len(rows), 1) if rows else s2.sum() * 0


def distill_inputs(B=2, S=5, vocab=31, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    s = (2 * torch.randn(B, S, vocab, generator=g)).to(dtype).requires_grad_()
    t = (2 * torch.randn(B, S, vocab, generator=g)).to(dtype)
    mask = torch.rand(B, S, generator=g) > 0.3
    return s, t, mask


@pytest.mark.parametrize("kind,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.5), ("jsd", 0.3)])
def test_distill_matches_formula(kind, beta):
    s, t, mask = distill_inputs()
    ref = naive_distill(s, t, kind, T=2.0, beta=beta, mask=mask)
    out = L.distill_loss(s, t, kind, temperature=2.0, beta=beta, mask=mask)
    torch.testing.assert_close(out, ref, **F64)
    assert_all_close(grads(out, (s,)), grads(ref, (s,)), **F64)


def test_forward_kl_matches_torch_kl_div_and_reductions():
    s, t, mask = distill_inputs(dtype=torch.float32)
    per_token = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(L.distill_loss(s, t, mask=mask), per_token[mask].mean(), **F32)
    torch.testing.assert_close(L.distill_loss(s, t, mask=mask, reduction="sum"), per_token[mask].sum(), **F32)
    torch.testing.assert_close(L.distill_loss(s, t, mask=mask, reduction="none"),
                               torch.where(mask, per_token, 0), **F32)
    torch.testing.assert_close(L.distill_loss(s, t), per_token.mean(), **F32)


def test_jsd_endpoints_as_documented():
    s, t, _ = distill_inputs()
    fwd, rev = L.distill_loss(s, t, "forward_kl"), L.distill_loss(s, t, "reverse_kl")
    torch.testing.assert_close(L.distill_loss(s, t, "jsd", beta=0.0), fwd, **F64)
    torch.testing.assert_close(L.distill_loss(s, t, "jsd", beta=1.0), rev, **F64)
    # the unnormalized mixture formula itself vanishes near the endpoints: a jump, not a limit
    assert L.distill_loss(s, t, "jsd", beta=1e-6).item() < 1e-4 * fwd.item()
    assert L.distill_loss(s, t, "jsd", beta=1 - 1e-6).item() < 1e-4 * rev.item()
    with pytest.raises(ValueError, match="0 <= beta <= 1"):
        L.distill_loss(s, t, "jsd", beta=1.5)
    with pytest.raises(ValueError, match="valid: forward_kl, reverse_kl, jsd"):
        L.distill_loss(s, t, "tvd")
    with pytest.raises(ValueError, match="mask shape"):
        L.distill_loss(s, t, mask=torch.ones(2, 1, dtype=torch.bool))


def test_distill_temperature_scaling():
    s, t, mask = distill_inputs()
    for kind in L.DISTILL_KINDS:
        soft = L.distill_loss(s / 3.0, t / 3.0, kind, mask=mask)
        torch.testing.assert_close(L.distill_loss(s, t, kind, temperature=3.0, mask=mask), 9.0 * soft, **F64)
        torch.testing.assert_close(L.distill_loss(s, t, kind, temperature=3.0, mask=mask, scale_by_t2=False),
                                   soft, **F64)


def test_distill_mask_ignores_positions_and_all_masked_is_zero():
    s, t, mask = distill_inputs()
    noisy = t.clone()
    noisy[~mask] = 1e3 * torch.randn_like(noisy[~mask])
    for kind in L.DISTILL_KINDS:
        torch.testing.assert_close(L.distill_loss(s, noisy, kind, mask=mask), L.distill_loss(s, t, kind, mask=mask),
                                   **F64)
        out = L.distill_loss(s, t, kind, mask=torch.zeros_like(mask))
        assert out.item() == 0.0
        assert torch.all(grads(out, (s,))[0] == 0)


def naive_topk(s_logits, ids, t_logps, kind, T=1.0, beta=0.5):
    """Teacher renormalized over its k ids; student full-vocab for forward KL, renormalized otherwise."""
    s2, i2, t2 = (x.reshape(-1, x.shape[-1]) for x in (s_logits, ids, t_logps))
    rows = []
    for r in range(len(s2)):
        p_t = torch.exp(t2[r] / T) / torch.exp(t2[r] / T).sum()
        p_s = (torch.exp(s2[r] / T) / torch.exp(s2[r] / T).sum())[i2[r]]
        if kind != "forward_kl":
            p_s = p_s / p_s.sum()
        if kind == "forward_kl":
            rows.append(naive_kl(p_t, p_s))
        elif kind == "reverse_kl":
            rows.append(naive_kl(p_s, p_t))
        else:
            m = beta * p_t + (1 - beta) * p_s
            rows.append(beta * naive_kl(p_t, m) + (1 - beta) * naive_kl(p_s, m))
    return torch.stack(rows).mean() * T**2


def test_topk_with_k_equal_vocab_is_full_distillation():
    s, t, mask = distill_inputs()
    logp_t = F.log_softmax(t, -1)
    ids = torch.argsort(logp_t, dim=-1, descending=True)
    for kind in L.DISTILL_KINDS:
        full = L.distill_loss(s, t, kind, temperature=1.5, mask=mask)
        topk = L.distill_loss_topk(s, ids, logp_t.gather(-1, ids), kind, temperature=1.5, mask=mask)
        torch.testing.assert_close(topk, full, **F64)
        assert_all_close(grads(topk, (s,)), grads(full, (s,)), **F64)


@pytest.mark.parametrize("kind", L.DISTILL_KINDS)
def test_topk_matches_formula(kind):
    s, t, _ = distill_inputs()
    logp_t = F.log_softmax(t, -1)
    vals, ids = logp_t.topk(5, dim=-1)
    ref = naive_topk(s, ids, vals, kind, T=2.0, beta=0.4)
    out = L.distill_loss_topk(s, ids, vals, kind, temperature=2.0, beta=0.4)
    torch.testing.assert_close(out, ref, **F64)
    assert_all_close(grads(out, (s,)), grads(ref, (s,)), **F64)
    # renormalization: raw teacher logits (log-probs + a per-token constant) give the same loss
    shifted_vals = vals + 7.0 * torch.randn(vals.shape[:-1] + (1,), dtype=vals.dtype)
    torch.testing.assert_close(L.distill_loss_topk(s, ids, shifted_vals, kind, temperature=2.0, beta=0.4), out, **F64)
    assert out.item() >= 0


@pytest.mark.parametrize("kind", L.DISTILL_KINDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_chunked_distill_equals_unchunked(kind, reduction):
    g = torch.Generator().manual_seed(0)
    B, S, Hs, Ht, vocab = 2, 13, 8, 12, 101
    s_h = torch.randn(B, S, Hs, generator=g, dtype=torch.float64, requires_grad=True)
    s_w = torch.randn(vocab, Hs, generator=g, dtype=torch.float64, requires_grad=True)
    t_h = torch.randn(B, S, Ht, generator=g, dtype=torch.float64)
    t_w = torch.randn(vocab, Ht, generator=g, dtype=torch.float64)
    mask = torch.rand(B, S, generator=g) > 0.2
    ref = L.distill_loss(s_h @ s_w.T, t_h @ t_w.T, kind, temperature=1.5, beta=0.3, mask=mask, reduction=reduction)
    up = upstream(reduction, mask.shape).double() if reduction == "none" else 1.0
    with MaxNumel() as mode:
        out = L.chunked_distill_loss(s_h, s_w, t_h, t_w, kind, temperature=1.5, beta=0.3, mask=mask,
                                     reduction=reduction, chunk_size=5)
        out_grads = grads(out, (s_h, s_w), up)
    torch.testing.assert_close(out, ref, **F64)
    assert_all_close(out_grads, grads(ref, (s_h, s_w), up), **F64)
    assert mode.max_numel < B * S * vocab  # only (chunk, V) logits, never (tokens, V)
