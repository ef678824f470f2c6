"""The preference-loss family (posttrain.core.preference) against the published formulas written out here
in plain torch, and against TRL's trainers where TRL has the same name: TRL's DPOTrainer,
KTOTrainer and ORPOTrainer loss code is called on the same tensors through a stand-in `self`
whose model returns given per-token log-probs. Then DPOConfig's checks, and short DPO stage runs
with some of the new losses."""

from __future__ import annotations

import math
import types
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

from posttrain.core import preference as P
from posttrain.core.losses import dpo_loss

F64 = dict(rtol=1e-9, atol=1e-10)
ls, sg = F.logsigmoid, torch.sigmoid


# --------------------------------------------------------------------------- inputs


def token_inputs(B=6, T=12, seed=0, equal_chosen=False):
    """Per-token log-probs (2B, T-1) of B pairs in TRL's layout (chosen rows, then rejected), the
    completion mask (2B, T) (a 2-4 token prompt, then a completion of 2..), and reference
    log-probs near the policy's."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(2 * B, T, dtype=torch.long)
    for i in range(2 * B):
        start = int(torch.randint(2, 5, (1,), generator=g))
        end = T if equal_chosen and i < B else int(torch.randint(start + 2, T + 1, (1,), generator=g))
        if equal_chosen and i < B:
            start = 3
        mask[i, start:end] = 1
    shift = mask[:, 1:].double()
    tok = (-(0.05 + 1.5 * torch.rand(2 * B, T - 1, generator=g, dtype=torch.float64)) * shift).requires_grad_()
    seq = (tok.detach() * shift).sum(1)
    ref = seq + 0.8 * torch.randn(2 * B, generator=g, dtype=torch.float64)
    return tok, mask, ref[:B], ref[B:]


def sums(tok, mask):
    B = tok.shape[0] // 2
    s = tok.sum(1)  # already 0 off the completion, as TRL sums it
    n = mask.sum(1)
    return s[:B], s[B:], n[:B], n[B:]


def grads(loss, x):
    return torch.autograd.grad(loss, x, retain_graph=True)[0]


def response_grads(loss, tok, mask):
    """The gradient at the completion's positions (elsewhere the per-token log-probs are 0 in
    both layouts, and TRL and posttrain differ in whether they route a gradient there)."""
    return grads(loss, tok) * mask[:, 1:]


# --------------------------------------------------------------------------- TRL, called on the same tensors


class _Accelerator:
    device = torch.device("cpu")

    def gather_for_metrics(self, x):
        return torch.as_tensor(x)

    gather = gather_for_metrics

    def unwrap_model(self, m):
        return m


class _LM:
    """Stands in for TRL's patched model: returns the given per-token log-probs (by input_ids)."""

    training = True

    def __init__(self, outputs):
        self.outputs = outputs  # id(input_ids) -> (log_probs, log_sum_sq_probs)

    def __call__(self, input_ids, **kw):
        lp, lss = self.outputs[id(input_ids)]
        z = torch.zeros_like(lp)
        return types.SimpleNamespace(log_probs=lp, entropy=z, mean_logits=z, is_top1=z.bool(),
                                     log_sum_sq_probs=lss, aux_loss=None)


def _fake_self(model, **attrs):
    base = dict(accelerator=_Accelerator(), model=model, precompute_ref_logps=True, aux_loss_enabled=False,
                _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0,
                _tp_size=1)
    return types.SimpleNamespace(**{**base, **attrs})


def trl_dpo(tok, mask, rc, rr, loss_type, beta=0.1, loss_weights=None, label_smoothing=0.0, ld_alpha=None,
            f_divergence_type="reverse_kl", f_alpha_divergence_coef=0.5, discopop_tau=0.05, lss=None):
    from trl import DPOTrainer

    ids = torch.zeros_like(mask)
    model = _LM({id(ids): (tok, lss)})
    loss_types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    me = _fake_self(model, beta=beta, loss_types=loss_types, loss_weights=loss_weights or [1.0] * len(loss_types),
                    label_smoothing=label_smoothing, ld_alpha=ld_alpha, f_divergence_type=f_divergence_type,
                    f_alpha_divergence_coef=f_alpha_divergence_coef, use_weighting=lss is not None,
                    args=types.SimpleNamespace(discopop_tau=discopop_tau, gradient_checkpointing_kwargs=None))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(mask), "completion_mask": mask,
              "ref_chosen_logps": rc, "ref_rejected_logps": rr}
    return DPOTrainer._compute_loss(me, model, inputs, False)


# --------------------------------------------------------------------------- direct formulas


def direct(loss_type, pc, pr, rc, rr, nc, nr, beta=0.1, eps=0.0, tau=0.05, gamma=0.5):
    """Each paper's loss, per pair, written from its formula."""
    rw, rl = pc - rc, pr - rr
    h = rw - rl
    if loss_type == "exo_pair":  # EXO eq. 16, K = 2: KL(softmax(b r) || (1 - eps, eps))
        q = torch.stack([sg(beta * h), sg(-beta * h)])
        p = torch.tensor([1 - eps, eps], dtype=q.dtype)[:, None]
        return (q * (q.log() - p.log())).sum(0)
    if loss_type == "nca_pair":  # NCA pairwise: -log sg(b r_w) - 1/2 sum_y log sg(-b r_y)
        return -torch.log(sg(beta * rw)) - 0.5 * torch.log(sg(-beta * rw)) - 0.5 * torch.log(sg(-beta * rl))
    if loss_type == "bco_pair":  # BCO: -log sg(b r_w - delta) - log sg(-(b r_l - delta)), delta = 0
        return -torch.log(sg(beta * rw)) - torch.log(1 - sg(beta * rl))
    if loss_type == "sppo_hard":  # SPPO eq. 4.7, P = 1 / 0: (r_w - (1 - 1/2)/b)^2 + (r_l - (0 - 1/2)/b)^2
        return (rw - 0.5 / beta) ** 2 + (rl + 0.5 / beta) ** 2
    if loss_type in ("aot", "aot_pair"):  # AOT: sorted policy margins vs sorted reference margins
        d = (pc - pr).sort().values - (rc - rr).sort().values
        return -(1 - eps) * torch.log(sg(beta * d)) - eps * torch.log(sg(-beta * d))
    if loss_type == "aot_unpaired":
        d = rw.sort().values - rl.sort().values
        return -(1 - eps) * torch.log(sg(beta * d)) - eps * torch.log(sg(-beta * d))
    if loss_type == "apo_zero":  # APO eq. 7
        return 1 - sg(beta * rw) + sg(beta * rl)
    if loss_type == "apo_down":  # APO eq. 8
        return sg(beta * rw) + 1 - sg(beta * (rw - rl))
    if loss_type == "discopop":  # DiscoPOP eq. 5 (log-ratio modulated loss)
        z = beta * h
        m = 1 / (1 + torch.exp(-z / tau))
        return (1 - m) * torch.log1p(torch.exp(-z)) + m * torch.exp(-z)
    if loss_type == "sigmoid_norm":
        return -torch.log(sg(beta * (rw / nc - rl / nr)))
    if loss_type == "sft":
        return -pc / nc
    if loss_type == "orpo":  # ORPO eq. 4-7 on token-mean log-probs
        aw, al = pc / nc, pr / nr
        odds = lambda a: torch.exp(a) / (1 - torch.exp(a))  # noqa: E731
        return -aw - beta * torch.log(sg(torch.log(odds(aw) / odds(al))))
    if loss_type == "kto":  # KTO eq. 7 on pairs, z0 = max(0, mean log-ratio) detached
        z0 = torch.cat([rw, rl]).mean().detach().clamp(min=0)
        return ((1 - sg(beta * (rw - z0))) + (1 - sg(beta * (z0 - rl)))) / 2
    if loss_type == "sigmoid":
        return -torch.log(sg(beta * h))
    raise AssertionError(loss_type)


NEW = ["exo_pair", "nca_pair", "bco_pair", "sppo_hard", "aot", "aot_pair", "aot_unpaired", "apo_zero", "apo_down",
       "discopop", "sigmoid_norm", "sft", "orpo", "kto"]


@pytest.mark.parametrize("loss_type", NEW)
def test_each_loss_matches_its_formula_values_and_gradients(loss_type):
    tok, mask, rc, rr = token_inputs()
    pc, pr, nc, nr = sums(tok, mask)
    eps = 1e-3 if loss_type == "exo_pair" else 0.1 if loss_type.startswith("aot") else 0.0
    beta = 0.5
    out = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=eps, chosen_lengths=nc,
                   rejected_lengths=nr, discopop_tau=0.3)
    want = direct(loss_type, pc, pr, rc, rr, nc.double(), nr.double(), beta=beta, eps=eps, tau=0.3)
    torch.testing.assert_close(out.losses, want, **F64)
    torch.testing.assert_close(grads(out.loss, tok), grads(want.mean(), tok), **F64)
    assert torch.isfinite(out.loss)


TRL_SAME = ["sigmoid", "robust", "ipo", "hinge", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "aot",
            "aot_unpaired", "apo_zero", "apo_down", "discopop", "sigmoid_norm"]


@pytest.mark.parametrize("loss_type", TRL_SAME)
def test_matches_trl_dpo_trainer(loss_type):
    tok, mask, rc, rr = token_inputs(seed=1)
    pc, pr, nc, nr = sums(tok, mask)
    eps = {"exo_pair": 1e-3, "robust": 0.2, "aot": 0.1, "aot_unpaired": 0.1}.get(loss_type, 0.0)
    ours = dpo_loss(pc, pr, rc, rr, beta=0.3, loss_type=loss_type, label_smoothing=eps, chosen_lengths=nc,
                    rejected_lengths=nr, discopop_tau=0.05).loss
    theirs = trl_dpo(tok, mask, rc, rr, loss_type, beta=0.3, label_smoothing=eps)
    tol = dict(rtol=1e-6, atol=1e-8) if loss_type == "exo_pair" else F64  # TRL takes log(eps) in fp32
    torch.testing.assert_close(ours, theirs, **tol)
    torch.testing.assert_close(response_grads(ours, tok, mask), response_grads(theirs, tok, mask), **tol)


def test_aot_pair_is_older_trls_name_for_paired_aot():
    tok, mask, rc, rr = token_inputs(seed=2)
    pc, pr, _, _ = sums(tok, mask)
    a = dpo_loss(pc, pr, rc, rr, loss_type="aot_pair").losses
    torch.testing.assert_close(a, dpo_loss(pc, pr, rc, rr, loss_type="aot").losses, **F64)


@pytest.mark.parametrize("kind,alpha", [("forward_kl", 0.5), ("js_divergence", 0.5), ("alpha_divergence", 0.3),
                                        ("alpha_divergence", 1.0)])
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "sigmoid_norm", "discopop"])
def test_f_divergences_match_trl(kind, alpha, loss_type):
    tok, mask, rc, rr = token_inputs(seed=3)
    tol = F64
    if kind == "alpha_divergence" and alpha != 1.0:  # TRL's alpha divergence runs in fp16/bf16/fp32 only
        tok, rc, rr = tok.detach().float().requires_grad_(), rc.float(), rr.float()
        tol = dict(rtol=1e-5, atol=1e-6)
    pc, pr, nc, nr = sums(tok, mask)
    ours = dpo_loss(pc, pr, rc, rr, beta=0.2, loss_type=loss_type, chosen_lengths=nc, rejected_lengths=nr,
                    f_divergence_type=kind, f_alpha_divergence_coef=alpha).loss
    theirs = trl_dpo(tok, mask, rc, rr, loss_type, beta=0.2, f_divergence_type=kind, f_alpha_divergence_coef=alpha)
    torch.testing.assert_close(ours, theirs, **tol)
    torch.testing.assert_close(response_grads(ours, tok, mask), response_grads(theirs, tok, mask), **tol)


def test_f_divergence_scores_are_the_derivatives_of_f():
    """f-DPO: the score is f'(u) at u = pi / ref, for f of each divergence (written out here)."""
    lr = torch.linspace(-2, 2, 9, dtype=torch.float64)
    u = lr.exp()
    fs = {"reverse_kl": lambda t: t * torch.log(t), "forward_kl": lambda t: -torch.log(t),
          "js_divergence": lambda t: t * torch.log(t) - (t + 1) * torch.log((t + 1) / 2),
          "alpha_divergence": lambda t: (t ** 0.3 - 0.3 * t - 0.7) / (0.3 * (0.3 - 1))}
    for kind, f in fs.items():
        t = u.clone().requires_grad_()
        fprime = torch.autograd.grad(f(t).sum(), t)[0]
        score = P.f_divergence_score(lr, kind, 0.3)
        # f' up to an additive constant (which cancels in the chosen-minus-rejected margin)
        torch.testing.assert_close(score - score[0], fprime - fprime[0], **F64)


def test_weighted_combination_matches_trl_and_the_sum():
    tok, mask, rc, rr = token_inputs(seed=4, equal_chosen=True)
    pc, pr, nc, nr = sums(tok, mask)
    combo = dpo_loss(pc, pr, rc, rr, loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0],
                     chosen_lengths=nc, rejected_lengths=nr)
    parts = [dpo_loss(pc, pr, rc, rr, loss_type=t, chosen_lengths=nc, rejected_lengths=nr).loss
             for t in ("sigmoid", "bco_pair", "sft")]
    torch.testing.assert_close(combo.loss, 0.8 * parts[0] + 0.2 * parts[1] + parts[2], **F64)
    theirs = trl_dpo(tok, mask, rc, rr, ["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0])
    torch.testing.assert_close(combo.loss, theirs, **F64)  # equal chosen lengths: both NLL means agree
    torch.testing.assert_close(response_grads(combo.loss, tok, mask), response_grads(theirs, tok, mask), **F64)


def test_sft_per_pair_differs_from_trls_batch_token_mean_with_unequal_lengths():
    tok, mask, rc, rr = token_inputs(seed=5)
    pc, pr, nc, nr = sums(tok, mask)
    assert len(set(nc.tolist())) > 1
    ours = dpo_loss(pc, pr, rc, rr, loss_type="sft", chosen_lengths=nc, rejected_lengths=nr).loss
    torch.testing.assert_close(ours, (-pc / nc).mean(), **F64)  # the mean of per-pair token means
    theirs = trl_dpo(tok, mask, rc, rr, "sft")
    torch.testing.assert_close(theirs, -pc.sum() / nc.sum(), **F64)  # one mean over all chosen tokens
    assert not torch.isclose(ours, theirs)


def test_cdpo_label_smoothing_is_posttrains_sigmoid_convention():
    """posttrain's sigmoid reads label_smoothing (cDPO); TRL's sigmoid ignores it: equal at 0."""
    tok, mask, rc, rr = token_inputs(seed=6)
    pc, pr, _, _ = sums(tok, mask)
    trl = trl_dpo(tok, mask, rc, rr, "sigmoid", label_smoothing=0.2)
    torch.testing.assert_close(dpo_loss(pc, pr, rc, rr, label_smoothing=0.0).loss, trl, **F64)
    assert not torch.isclose(dpo_loss(pc, pr, rc, rr, label_smoothing=0.2).loss, trl)


def test_rpo_sft_weight_is_per_pair_and_equals_trls_sft_term_for_equal_lengths():
    tok, mask, rc, rr = token_inputs(seed=7, equal_chosen=True)
    pc, pr, nc, nr = sums(tok, mask)
    ours = dpo_loss(pc, pr, rc, rr, sft_weight=0.5, chosen_lengths=nc, rejected_lengths=nr).loss
    theirs = trl_dpo(tok, mask, rc, rr, ["sigmoid", "sft"], loss_weights=[1.0, 0.5])
    torch.testing.assert_close(ours, theirs, **F64)


def test_ld_alpha_split_matches_trl():
    tok, mask, rc, rr = token_inputs(seed=8)
    B = tok.shape[0] // 2
    targets = mask[:, 1:].bool()
    rows = torch.arange(2 * B)[:, None].expand_as(targets)  # padded layout: one row per sequence
    for alpha in (0.0, 0.4, 1.0):
        lp = P.length_desensitized_logps(tok, targets, rows, B, alpha)
        # the reference log-probs are LD's too in TRL: feed both its and ours the same precomputed ones
        ours = dpo_loss(lp[:B], lp[B:], rc, rr, beta=0.2).loss
        theirs = trl_dpo(tok, mask, rc, rr, "sigmoid", beta=0.2, ld_alpha=alpha)
        torch.testing.assert_close(ours, theirs, **F64)
        torch.testing.assert_close(response_grads(ours, tok, mask), response_grads(theirs, tok, mask), **F64)


def test_ld_alpha_direct_formula_on_a_packed_row():
    """Packed layout (one row, sequences side by side, -1 padding): the first min(|y_w|, |y_l|)
    response tokens count fully, the rest alpha times."""
    chosen = [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-0.5])]
    rejected = [torch.tensor([-4.0]), torch.tensor([-1.0, -1.5, -2.5, -0.25])]
    seqs = chosen + rejected
    vals, tgt, sid = [], [], []
    for i, s in enumerate(seqs):  # a 2-position prompt (not scored) before each response
        vals += [0.0, 0.0] + s.tolist()
        tgt += [False, False] + [True] * len(s)
        sid += [i] * (2 + len(s))
    vals += [0.0, 0.0]
    tgt += [False, False]
    sid += [-1, -1]
    lp = P.length_desensitized_logps(torch.tensor([vals], dtype=torch.float64), torch.tensor([tgt]),
                                     torch.tensor([sid]), 2, 0.25)
    shared = [1, 1, 1, 1]
    want = [float(s[:k].sum() + 0.25 * s[k:].sum()) for s, k in zip(seqs, shared)]
    torch.testing.assert_close(lp, torch.tensor(want, dtype=torch.float64), **F64)


def test_wpo_weights_match_trl():
    tok, mask, rc, rr = token_inputs(seed=9)
    pc, pr, nc, nr = sums(tok, mask)
    g = torch.Generator().manual_seed(0)
    lss = -0.5 - torch.rand(tok.shape, generator=g, dtype=torch.float64)  # log sum_v p(v)^2 < 0
    shift = mask[:, 1:].double()
    aligned = ((tok.detach() - lss) * shift).sum(1)
    w = P.wpo_weights(aligned, shift.sum(1))
    direct_w = torch.exp(aligned / shift.sum(1))
    torch.testing.assert_close(w, direct_w[:len(pc)] * direct_w[len(pc):], **F64)
    for loss_type in ("sigmoid", "ipo"):
        ours = dpo_loss(pc, pr, rc, rr, loss_type=loss_type, chosen_lengths=nc, rejected_lengths=nr,
                        pair_weights=w).loss
        theirs = trl_dpo(tok, mask, rc, rr, loss_type, lss=lss)
        torch.testing.assert_close(ours, theirs, **F64)
        # the weights are detached in both
        torch.testing.assert_close(response_grads(ours, tok, mask), response_grads(theirs, tok, mask), **F64)


def test_orpo_matches_trl_odds_ratio_and_formula():
    from trl.experimental.orpo import ORPOTrainer

    tok, mask, _, _ = token_inputs(seed=10, equal_chosen=True)
    pc, pr, nc, nr = sums(tok, mask)
    ours = dpo_loss(pc, pr, loss_type="orpo", beta=0.1, chosen_lengths=nc, rejected_lengths=nr)
    me = types.SimpleNamespace(beta=0.1, accelerator=_Accelerator())
    ratio_losses = ORPOTrainer.odds_ratio_loss(me, pc / nc, pr / nr)[0]
    nll = -(tok[: len(pc)] * mask[: len(pc), 1:]).sum() / mask[: len(pc), 1:].sum()  # TRL's CE over the chosen
    theirs = nll - ratio_losses.mean()
    torch.testing.assert_close(ours.loss, theirs.double(), rtol=1e-6, atol=1e-7)  # TRL computes it in fp32
    assert ours.accuracy.shape == () and torch.isfinite(ours.loss)


def test_kto_loss_matches_trl_kto_trainer():
    from trl import KTOTrainer

    g = torch.Generator().manual_seed(11)
    N, T = 8, 10
    mask = torch.zeros(N, T, dtype=torch.long)
    mask[:, 3:] = 1
    shift = mask[:, 1:].double()
    tok = (-(0.1 + torch.rand(N, T - 1, generator=g, dtype=torch.float64)) * shift).requires_grad_()
    kl_tok = -(0.1 + torch.rand(N, T - 1, generator=g, dtype=torch.float64)) * shift
    label = torch.tensor([True, False, True, True, False, False, True, False])
    logps, kl_logps = tok.sum(1), kl_tok.sum(1)
    ref, ref_kl = logps.detach() + torch.randn(N, generator=g, dtype=torch.float64), kl_logps - 2.0
    ids, kl_ids = torch.zeros_like(mask), torch.ones_like(mask)
    model = _LM({id(ids): (tok, None), id(kl_ids): (kl_tok, None)})
    me = _fake_self(model, beta=0.2, loss_type="kto", calculate_KL=True, desirable_weight=1.3,
                    undesirable_weight=0.7, args=types.SimpleNamespace(gradient_checkpointing_kwargs=None))
    me._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, me)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(mask), "completion_mask": mask, "label": label,
              "ref_logps": ref, "ref_KL_logps": ref_kl, "KL_input_ids": kl_ids,
              "KL_attention_mask": torch.ones_like(mask), "KL_completion_mask": mask}
    theirs = KTOTrainer._compute_loss(me, model, inputs, False)
    z0 = P.kto_kl(kl_logps, ref_kl)
    ours = P.kto_loss(logps, ref, label, beta=0.2, kl=z0, desirable_weight=1.3, undesirable_weight=0.7)
    torch.testing.assert_close(ours.mean(), theirs, **F64)
    torch.testing.assert_close(response_grads(ours.mean(), tok, mask), response_grads(theirs, tok, mask), **F64)
    # the formula: z0 = max(0, mean KL-pair log-ratio); lambda_D (1 - sg(b (r - z0))), lambda_U (1 - sg(b (z0 - r)))
    r = logps - ref
    want = torch.where(label, 1.3 * (1 - sg(0.2 * (r - z0))), 0.7 * (1 - sg(0.2 * (z0 - r))))
    torch.testing.assert_close(ours, want, **F64)
    assert float(z0) == pytest.approx(max(0.0, float((kl_logps - ref_kl).mean())))


def test_kto_on_pairs_is_kto_loss_with_chosen_desirable():
    tok, mask, rc, rr = token_inputs(seed=12)
    pc, pr, _, _ = sums(tok, mask)
    out = dpo_loss(pc, pr, rc, rr, loss_type="kto", beta=0.3, desirable_weight=1.5, undesirable_weight=0.5)
    z0 = torch.cat([pc - rc, pr - rr]).mean().detach().clamp(min=0)
    flat = P.kto_loss(torch.cat([pc, pr]), torch.cat([rc, rr]), torch.arange(2 * len(pc)) < len(pc), 0.3, z0,
                      1.5, 0.5)
    torch.testing.assert_close(out.loss, flat.mean(), **F64)
    given = dpo_loss(pc, pr, rc, rr, loss_type="kto", beta=0.3, kto_kl=torch.tensor(2.0, dtype=torch.float64))
    assert not torch.isclose(given.loss, out.loss)


def test_ipo_length_average_matches_trl_and_sum_version_differs():
    tok, mask, rc, rr = token_inputs(seed=13)
    pc, pr, nc, nr = sums(tok, mask)
    theirs = trl_dpo(tok, mask, rc, rr, "ipo", beta=0.5)
    torch.testing.assert_close(dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="ipo", chosen_lengths=nc,
                                        rejected_lengths=nr).loss, theirs, **F64)
    assert not torch.isclose(dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="ipo").loss, theirs)  # no lengths: sums


def test_loss_errors():
    tok, mask, rc, rr = token_inputs()
    pc, pr, nc, nr = sums(tok, mask)
    with pytest.raises(ValueError, match="needs label_smoothing > 0"):
        dpo_loss(pc, pr, rc, rr, loss_type="exo_pair")
    with pytest.raises(ValueError, match="loss_weights has 1 weights for 2"):
        dpo_loss(pc, pr, rc, rr, loss_type=["sigmoid", "sft"], loss_weights=[1.0], chosen_lengths=nc,
                 rejected_lengths=nr)
    with pytest.raises(ValueError, match="f_divergence_type='js_divergence' applies only"):
        dpo_loss(pc, pr, rc, rr, loss_type="nca_pair", f_divergence_type="js_divergence")
    with pytest.raises(ValueError, match="cannot apply to aot"):
        dpo_loss(pc, pr, rc, rr, loss_type="aot", pair_weights=torch.ones_like(pc))
    with pytest.raises(ValueError, match="needs ref_chosen_logps"):
        dpo_loss(pc, pr, loss_type=["orpo", "sigmoid"], chosen_lengths=nc, rejected_lengths=nr)
    dpo_loss(pc, pr, loss_type=["orpo", "sft"], chosen_lengths=nc, rejected_lengths=nr)  # reference-free
    with pytest.raises(ValueError, match=r"ld_alpha must be in \[0, 1\]"):
        P.length_desensitized_logps(tok, mask[:, 1:].bool(), torch.zeros_like(tok).long(), 6, 1.5)


# --------------------------------------------------------------------------- config


def test_config_accepts_every_loss_and_lists():
    import typing

    from posttrain.stages.config import DPOConfig, PreferenceLoss

    assert set(typing.get_args(PreferenceLoss)) == set(P.DPO_LOSS_TYPES)
    for t in P.DPO_LOSS_TYPES:
        DPOConfig(loss_type=t, label_smoothing=1e-3 if t == "exo_pair" else 0.0)
    c = DPOConfig(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.3], ld_alpha=0.5, use_weighting=True)
    assert c.loss_kwargs()["loss_type"] == ("sigmoid", "sft") and not c.reference_free
    assert DPOConfig(loss_type="orpo", reference="model", lora={"enabled": False}).reference_free
    # reference-free losses need no LoRA base
    DPOConfig(loss_type=["orpo", "sft"], lora={"enabled": False})


@pytest.mark.parametrize("kw,key", [
    ({"ld_alpha": 1.5}, "ld_alpha"),
    ({"ld_alpha": -0.1}, "ld_alpha"),
    ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}, "loss_weights"),
    ({"loss_type": "exo_pair"}, "exo_pair"),
    ({"loss_type": "nca_pair", "f_divergence_type": "js_divergence"}, "f_divergence_type"),
    ({"loss_type": "aot", "use_weighting": True}, "use_weighting"),
    ({"ld_alpha": 0.5, "parallel": {"pp": 2}}, "ld_alpha"),
    ({"use_weighting": True, "parallel": {"tp": 2}}, "use_weighting"),
    ({"loss_type": "hinge", "label_smoothing": 0.1}, "label_smoothing"),
    ({"loss_type": "kto", "kto_desirable_weight": 0}, "kto_desirable_weight"),
    ({"discopop_tau": 0}, "discopop_tau"),
    ({"loss_type": "nope"}, "loss_type"),
    ({"loss_type": "sigmoid", "kto_kl_estimate": "mismatched"}, "kto_kl_estimate"),
    ({"loss_type": "kto", "kto_kl_estimate": "mismatched", "reference": "precomputed"}, "kto_kl_estimate"),
    ({"loss_type": "kto", "kto_kl_estimate": "mismatched", "data": {"micro_batch_size": 1}}, "kto_kl_estimate"),
    ({"loss_type": "kto", "kto_kl_estimate": "mismatched", "parallel": {"pp": 2}}, "kto_kl_estimate"),
    ({"loss_type": "kto", "lora": {"enabled": False}}, "disable_adapter"),
])
def test_config_refuses_invalid_combinations(kw, key):
    from pydantic import ValidationError

    from posttrain.stages.config import DPOConfig

    with pytest.raises((ValueError, ValidationError), match=key):
        DPOConfig(**kw)


# --------------------------------------------------------------------------- the stage, in process


@pytest.fixture(scope="module")
def pair_data(tmp_path_factory):
    from posttrain.stages.config import DataPrepConfig
    from posttrain.stages.data_prep import prepare
    from posttrain.core.tracking import TrackingConfig

    root = tmp_path_factory.mktemp("pref")
    prepare(DataPrepConfig(output_dir=str(root / "data"), synthetic_size=120, tracking=TrackingConfig(enabled=False)))
    return root


@pytest.mark.parametrize("kw", [
    {"loss_type": ["apo_zero", "sft"], "loss_weights": [1.0, 0.1], "use_weighting": True},
    {"loss_type": "kto", "ld_alpha": 0.5, "reference": "precomputed"},
    {"loss_type": "orpo"},
    {"loss_type": "kto", "kto_kl_estimate": "mismatched"},
])
def test_dpo_stage_runs_new_losses(pair_data, kw):
    from posttrain.core.tracking import TrackingConfig
    from posttrain.stages.config import DPOConfig
    from posttrain.stages.dpo import run

    name = "-".join(f"{k}={v}" for k, v in kw.items()).replace("'", "").replace(" ", "")[:60]
    cfg = DPOConfig(output_dir=str(pair_data / f"dpo-{name}"), model={"name_or_path": "debug"},
                    data={"sources": [str(pair_data / "data")], "micro_batch_size": 8, "batch_tokens": 512,
                          "max_seq_len": 128},
                    tracking=TrackingConfig(enabled=False), max_steps=6, eval_interval=3,
                    optim={"lr": 5e-3, "warmup_steps": 1}, **kw)
    m = run(cfg)["metrics"]
    losses = [v for k, v in m.items() if "loss" in k and isinstance(v, float)]
    assert losses and all(math.isfinite(v) for v in losses), m
    # the implicit reward margin on held-out pairs grows (from 0 where the policy starts as its reference)
    assert m["val/margin"] > m["val/margin_initial"] and m["val/accuracy"] > m["val/accuracy_initial"]
    if kw.get("use_weighting"):
        assert 0 < m["val/wpo_weight"]
    if kw.get("reference") == "precomputed":  # LD-DPO's reference log-probs, cached under their own key
        assert list((pair_data / f"dpo-{name}" / "reference").glob("ref_logps-*.safetensors"))


# --------------------------------------------------------------------------- the objective's log-probs


@pytest.mark.parametrize("padding_free", [True, False])
def test_pair_logps_ld_and_wpo_match_full_logits(padding_free):
    """pair_logps with ld_alpha and wpo (the fused head plus the no-grad log sum p^2 pass) against
    each sequence run alone through the model with its full logits."""
    from posttrain.core.data import collate_preference
    from posttrain.core.data.encode import PreferencePair
    from posttrain.core.model import build_model, get_preset
    from posttrain.core.objectives import pair_logps

    torch.manual_seed(0)
    model = build_model(get_preset("debug"), seed=0).eval()
    g = torch.Generator().manual_seed(1)
    V = model.lm_head.weight.shape[0]
    ids = lambda n: torch.randint(5, V, (n,), generator=g).tolist()  # noqa: E731
    pairs = []
    for lp, lc, lr in [(3, 4, 7), (5, 6, 2), (2, 3, 3)]:
        c, r = ids(lc), ids(lr)
        pairs.append(PreferencePair(ids(lp), c, c, r, r))
    batch = collate_preference(pairs, padding_free=padding_free)
    alpha = 0.3
    with torch.no_grad():
        got, lengths, w = pair_logps(model, batch, ld_alpha=alpha, wpo=True)
        docs = [p.chosen for p in pairs] + [p.rejected for p in pairs]
        per_doc, lss_doc = [], []
        for d in docs:
            logits = model(torch.tensor([d.input_ids])).float()[0, :-1]
            logp = logits.log_softmax(-1)
            tgt = torch.tensor(d.labels[1:])
            keep = tgt != -100
            per_doc.append(logp[keep].gather(-1, tgt[keep, None])[:, 0])
            lss_doc.append(torch.logsumexp(2 * logp[keep], -1))
    n = len(pairs)
    want, aligned = [], []
    for i, tok in enumerate(per_doc):
        shared = min(len(per_doc[i % n]), len(per_doc[i % n + n]))
        want.append(tok[:shared].sum() + alpha * tok[shared:].sum())
        aligned.append((tok - lss_doc[i]).mean())
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lengths, torch.tensor([float(len(t)) for t in per_doc]))
    a = torch.stack(aligned).exp()
    torch.testing.assert_close(w, a[:n] * a[n:], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_new_losses_under_pipeline_parallelism_match_one_process(tmp_path):
    """pipelined_dpo passes the loss list, its weights and the f-divergence through: pp=2 under
    torchrun trains as one process does."""
    from tests.stages.test_stage_parallel import assert_same_run, dpo_config, in_process, optim, torchrun_stage

    from posttrain.core.tracking import TrackingConfig
    from posttrain.stages.config import DataPrepConfig
    from posttrain.stages.data_prep import prepare

    prepare(DataPrepConfig(output_dir=str(tmp_path / "data"), synthetic_size=120,
                           tracking=TrackingConfig(enabled=False)))
    kw = dict(loss_type=["sigmoid", "discopop", "sft"], loss_weights=[1.0, 0.5, 0.2],
              f_divergence_type="js_divergence", optim=optim(2, lr=5e-3))
    ref = in_process(dpo_config(tmp_path, "one", **kw))
    records = torchrun_stage(dpo_config(tmp_path, "pp", parallel={"pp": 2}, **kw), tmp_path / ".work-pp", 2)
    assert_same_run(records, ref, tmp_path / "pp", tmp_path / "one",
                    ("val/accuracy", "val/margin", "val/chosen", "val/rejected"))


def test_kto_mismatched_reference_point_in_the_objective():
    """With batch["kto_kl_batch"] (each prompt with the previous pair's responses, as TRL builds
    them) the objective's KTO z0 is kto_kl over the policy's and reference's log-probs of those."""
    from posttrain.core.data import collate_preference
    from posttrain.core.data.encode import PreferencePair
    from posttrain.core.model import build_model, get_preset
    from posttrain.core.objectives import dpo_objective, pair_logps
    from posttrain.stages.dpo import mismatched_pairs

    policy = build_model(get_preset("debug"), seed=0).eval()
    ref_model = build_model(get_preset("debug"), seed=1).eval()
    g = torch.Generator().manual_seed(2)
    ids = lambda n: torch.randint(5, 200, (n,), generator=g).tolist()  # noqa: E731
    pairs = [PreferencePair(ids(3), c, c, r, r) for c, r in ((ids(4), ids(5)), (ids(2), ids(6)), (ids(5), ids(3)))]
    mm = mismatched_pairs(pairs)
    assert [m.prompt_ids for m in mm] == [p.prompt_ids for p in pairs]
    assert [m.chosen_ids for m in mm] == [pairs[2].chosen_ids, pairs[0].chosen_ids, pairs[1].chosen_ids]
    assert [m.rejected_ids for m in mm] == [pairs[2].rejected_ids, pairs[0].rejected_ids, pairs[1].rejected_ids]
    batch = collate_preference(pairs)
    batch["kto_kl_batch"] = collate_preference(mm)
    reference = lambda b: pair_logps(ref_model, b)[0]  # noqa: E731
    out = dpo_objective(0.3, "kto", reference=reference)(policy, batch)
    with torch.no_grad():
        kl_batch = batch["kto_kl_batch"]
        z0 = P.kto_kl(pair_logps(policy, kl_batch)[0], reference(kl_batch))
        lp, n = pair_logps(policy, batch)
        rf = reference(batch)
        want = dpo_loss(lp[:3], lp[3:], rf[:3], rf[3:], beta=0.3, loss_type="kto", kto_kl=z0).losses.sum()
    torch.testing.assert_close(out.loss_sum.detach(), want, rtol=1e-5, atol=1e-6)
    assert out.metrics["rewards/kto_kl"] == pytest.approx(float(z0))
    del batch["kto_kl_batch"]  # without it: the batch estimate
    with torch.no_grad():
        batch_est = dpo_loss(lp[:3], lp[3:], rf[:3], rf[3:], beta=0.3, loss_type="kto").losses.sum()
    torch.testing.assert_close(dpo_objective(0.3, "kto", reference=reference)(policy, batch).loss_sum.detach(),
                               batch_est, rtol=1e-5, atol=1e-6)
