"""The preference-loss family (DPO and its relatives, ORPO, KTO) as pure functions.

Tensors in, tensors out: per-sequence summed log-probs (B,) of the policy and the reference for
each pair's chosen (y_w) and rejected (y_l) response. `dpo_loss` is re-exported by posttrain.core.losses;
docs/preference_losses.md lists every loss with its formula and where posttrain's conventions
differ from TRL's DPOTrainer on the same name. All math runs in at least fp32 (fp64 stays fp64).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.kernels.chunked_losses import check_choice, compute_dtype

from posttrain.core.preference_types import (  # noqa: F401  (re-exported)
    DPO_LOSS_TYPES,
    F_DIVERGENCE_LOSSES,
    F_DIVERGENCES,
    REFERENCE_FREE_LOSSES,
    SMOOTHED_LOSSES,
    SORTING_LOSSES,
)


class DPOOutput(NamedTuple):
    loss: Tensor  # scalar: mean of `losses`
    chosen_rewards: Tensor  # (B,), detached
    rejected_rewards: Tensor  # (B,), detached
    margins: Tensor  # (B,) chosen_rewards - rejected_rewards
    accuracy: Tensor  # scalar: fraction with chosen_rewards > rejected_rewards
    losses: Tensor  # (B,) per-example loss, SFT term included


def f_divergence_score(logratio: Tensor, kind: str = "reverse_kl", alpha: float = 0.5) -> Tensor:
    """f'(u) at u = pi/ref = exp(logratio), the per-response score of f-DPO (Wang et al. 2023,
    arXiv 2309.16240) that replaces the log-ratio in the DPO margin:

    - reverse_kl        f'(u) = log u + 1  ->  logratio (the constant cancels in the margin; DPO)
    - forward_kl        f'(u) = 1 - 1/u    ->  1 - exp(-logratio)
    - js_divergence     f'(u) = log(2u / (1 + u))  ->  log 2 + logsigmoid(logratio)
    - alpha_divergence  f'(u) = (u^(alpha-1) - 1) / (alpha - 1); alpha = 1 is the limit log u.
      The exponent is clamped at 80 (TRL does the same) so exp stays finite in fp32.
    """
    check_choice("f_divergence_type", kind, F_DIVERGENCES)
    if kind == "reverse_kl" or (kind == "alpha_divergence" and abs(alpha - 1.0) < 1e-6):
        return logratio
    if kind == "forward_kl":
        return 1 - torch.exp(-logratio)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(logratio)
    return (torch.exp(((alpha - 1.0) * logratio).clamp(max=80.0)) - 1.0) / (alpha - 1.0)


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends (Maechler 2012)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def kto_kl(policy_kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """KTO's reference point z0 = max(0, mean over the batch of log pi(y'|x) - log ref(y'|x)),
    detached, from mismatched pairs (x, y') (each prompt with another example's response, as
    TRL's KTOTrainer builds them by shifting the completions by one within the batch)."""
    return (policy_kl_logps - ref_kl_logps).mean().detach().clamp(min=0)


def kto_loss(policy_logps: Tensor, ref_logps: Tensor, desirable: Tensor, beta: float = 0.1,
             kl: Tensor | float = 0.0, desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> Tensor:
    """KTO, Ethayarajh et al. 2024 (arXiv 2402.01306), eq. 7, per example (B,) of unpaired data.
    With r = log pi(y|x) - log ref(y|x) and z0 = `kl` (see `kto_kl`; a constant in the gradient):

        desirable:    lambda_D (1 - sigmoid(b (r - z0)))
        undesirable:  lambda_U (1 - sigmoid(b (z0 - r)))

    lambda_D = desirable_weight, lambda_U = undesirable_weight; the loss is the mean over examples."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    dt = compute_dtype(policy_logps.dtype)
    r = policy_logps.to(dt) - ref_logps.to(dt)
    z0 = torch.as_tensor(kl, dtype=dt, device=r.device).detach()
    good = desirable.to(torch.bool)
    return torch.where(good, desirable_weight * (1 - torch.sigmoid(beta * (r - z0))),
                       undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r))))


def wpo_weights(aligned_logp_sums: Tensor, lengths: Tensor) -> Tensor:
    """WPO's per-pair weight (Zhou et al. 2024, arXiv 2406.11827, eq. 2, in TRL's length-normalized,
    "aligned" form), detached: for each response w(y) = exp(mean_t [log p(y_t) - log sum_v p(v)^2]),
    and a pair weighs w(y_w) w(y_l). Takes the per-sequence sums (2B,) of the per-token
    log p(y_t) - log sum_v p(v)^2 (chosen first, then rejected) and the token counts (2B,)."""
    w = torch.exp(aligned_logp_sums.detach() / lengths.detach().to(aligned_logp_sums.dtype).clamp(min=1))
    chosen, rejected = w.chunk(2)
    return chosen * rejected


def _check(loss_types: tuple[str, ...], weights: tuple[float, ...], beta: float, eps: float, f_div: str,
           pair_weights: Tensor | None) -> None:
    if not loss_types:
        raise ValueError("loss_type: name at least one loss")
    for t in loss_types:
        check_choice("loss_type", t, DPO_LOSS_TYPES)
    if len(weights) != len(loss_types):
        raise ValueError(f"loss_weights has {len(weights)} weights for {len(loss_types)} loss types")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    for t in loss_types:
        if t in ("ipo", "hinge") and eps != 0:
            raise ValueError(f"label_smoothing must be 0 for loss_type={t!r}, got {eps}")
    robust = "robust" in loss_types
    if not 0 <= eps <= 0.5 or (robust and eps == 0.5):
        bound = "< 0.5" if robust else "<= 0.5"
        raise ValueError(f"label_smoothing must satisfy 0 <= label_smoothing {bound} for {loss_types}, got {eps}")
    if "exo_pair" in loss_types and eps == 0:
        raise ValueError("loss_type='exo_pair' needs label_smoothing > 0 (EXO's epsilon; the paper uses 1e-3)")
    check_choice("f_divergence_type", f_div, F_DIVERGENCES)
    if f_div != "reverse_kl" and not set(loss_types) <= set(F_DIVERGENCE_LOSSES):
        raise ValueError(f"f_divergence_type={f_div!r} applies only to loss types {F_DIVERGENCE_LOSSES}, "
                         f"got {loss_types}")
    if pair_weights is not None and set(loss_types) & set(SORTING_LOSSES):
        raise ValueError("WPO weights (use_weighting) cannot apply to aot losses: they sort the pairs")


def dpo_loss(policy_chosen_logps: Tensor, policy_rejected_logps: Tensor, ref_chosen_logps: Tensor | None = None,
             ref_rejected_logps: Tensor | None = None, beta: float = 0.1, loss_type: str | Sequence[str] = "sigmoid",
             label_smoothing: float = 0.0, simpo_gamma: float = 0.5, chosen_lengths: Tensor | None = None,
             rejected_lengths: Tensor | None = None, sft_weight: float = 0.0,
             policy_chosen_nll: Tensor | None = None, loss_weights: Sequence[float] | None = None,
             f_divergence_type: str = "reverse_kl", f_alpha_divergence_coef: float = 0.5,
             discopop_tau: float = 0.05, pair_weights: Tensor | None = None, kto_kl: Tensor | float | None = None,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> DPOOutput:
    """Preference losses on per-sequence log-probs (B,). With the log-ratios
    r_w = log pi(y_w|x) - log ref(y_w|x), r_l likewise, their f-DPO scores s_w = f'(r_w), s_l
    (`f_divergence_score`; plain r_w, r_l for the default reverse KL), h = s_w - s_l, b = beta,
    eps = label_smoothing, sg = sigmoid, ls = logsigmoid:

    - sigmoid   DPO, Rafailov et al. 2023 (arXiv 2305.18290): -ls(b h); with eps it is cDPO,
                -(1 - eps) ls(b h) - eps ls(-b h). TRL's sigmoid ignores label_smoothing.
    - robust    rDPO, Chowdhury et al. 2024 (arXiv 2403.00409): ((1-eps)(-ls(b h)) + eps ls(-b h)) / (1-2 eps).
    - ipo       IPO, Azar et al. 2023 (arXiv 2310.12036), eq. 17: (h' - 1/(2b))^2 with h' built
                from length-averaged scores s_w / |y_w| - s_l / |y_l| (as TRL).
    - hinge     SLiC-HF, Zhao et al. 2023 (arXiv 2305.10425): relu(1 - b h).
    - simpo     SimPO, Meng et al. 2024 (arXiv 2405.14734), reference-free, with a_w the token-mean
                log pi(y_w|x): -ls(b (a_w - a_l) - simpo_gamma) (eps as in cDPO, as TRL's CPO).
    - exo_pair  EXO, Ji et al. 2024 (arXiv 2402.00856), eq. 16: KL(q || p) between
                q = (sg(b h), sg(-b h)) and p = (1 - eps, eps):
                sg(b h)(ls(b h) - log(1-eps)) + sg(-b h)(ls(-b h) - log eps); needs eps > 0.
    - nca_pair  NCA, Chen et al. 2024 (arXiv 2402.05369): -ls(b r_w) - ls(-b r_w)/2 - ls(-b r_l)/2.
    - bco_pair  BCO on pairs, Jung et al. 2024 (arXiv 2404.04656): -ls(b r_w) - ls(-b r_l). BCO's
                running reward shift delta (a moving mean of the rewards) is not kept: delta = 0,
                as TRL's DPOTrainer's bco_pair does (its BCOTrainer keeps one).
    - sppo_hard SPPO, Wu et al. 2024 (arXiv 2405.00675), hard labels (P = 1 for the winner):
                (r_w - 1/(2b))^2 + (r_l + 1/(2b))^2.
    - aot       AOT paired, Melnyk et al. 2024 (arXiv 2406.05882): with d = sort_batch(log pi(y_w) -
                log pi(y_l)) - sort_batch(log ref(y_w) - log ref(y_l)), -(1-eps) ls(b d) - eps ls(-b d).
                `aot_pair` is the same loss under the name older TRL versions gave it.
    - aot_unpaired  AOT unpaired: d = sort_batch(r_w) - sort_batch(r_l), the same loss of d.
                Both sort within the micro-batch (a pipeline microbatch under pipeline parallelism).
    - apo_zero  APO, D'Oosterlinck et al. 2024 (arXiv 2408.06266), eq. 7: (1 - sg(b r_w)) + sg(b r_l).
    - apo_down  APO eq. 8: sg(b r_w) + (1 - sg(b (r_w - r_l))).
    - discopop  DiscoPOP, Lu et al. 2024 (arXiv 2406.08414), eq. 5, z = b h, m = sg(z / tau):
                (1 - m)(-ls(z)) + m exp(-z),  tau = discopop_tau.
    - sigmoid_norm  -ls(b h') with the length-averaged h' of ipo (TRL's name).
    - sft       the token-mean NLL of the chosen response, -log pi(y_w|x) / |y_w|, per pair (TRL's
                sft averages over all the batch's chosen tokens instead; equal for equal lengths).
    - orpo      ORPO, Hong et al. 2024 (arXiv 2403.07691), reference-free, with a_w, a_l token-mean
                log-probs: NLL(y_w) - b ls(log odds(a_w) - log odds(a_l)), odds(a) = e^a / (1 - e^a);
                b is ORPO's lambda (TRL's ORPOTrainer uses beta the same way). NLL as for sft.
    - kto       KTO (`kto_loss`) on pairs, y_w desirable and y_l undesirable (as the KTO paper does
                with paired data): (lambda_D (1 - sg(b (r_w - z0))) + lambda_U (1 - sg(b (z0 - r_l)))) / 2,
                the mean over the 2B responses as in TRL's KTOTrainer. z0 = `kto_kl` if given (e.g. from
                mismatched pairs, see `kto_kl`), else the batch estimate max(0, mean(r_w, r_l)), detached.

    `loss_type` may be a list, combined as sum_k loss_weights[k] * loss_k (weights default to 1),
    TRL's combination. `pair_weights` (B,), e.g. `wpo_weights`, multiply every loss per pair.
    Length normalization: pass summed log-probs and `chosen_lengths`/`rejected_lengths` (token
    counts), or averaged log-probs and no lengths. With sft_weight > 0 each pair's loss gains
    sft_weight * NLL(y_w) as in RPO (Pang et al. 2024, arXiv 2404.19733): `policy_chosen_nll`
    or -policy_chosen_logps / chosen_lengths (per pair; TRL's RPO averages over the batch's tokens).

    Rewards: b r per response (from averaged log-probs when the first loss is ipo or
    sigmoid_norm); b a (token-mean log pi) when it is reference-free.
    """
    loss_types = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)
    weights = tuple(float(w) for w in loss_weights) if loss_weights is not None else (1.0,) * len(loss_types)
    eps = float(label_smoothing)
    _check(loss_types, weights, beta, eps, f_divergence_type, pair_weights)
    if policy_chosen_logps.dim() != 1 or policy_chosen_logps.shape != policy_rejected_logps.shape:
        raise ValueError(f"policy log-probs must both be (B,), got {tuple(policy_chosen_logps.shape)} and "
                         f"{tuple(policy_rejected_logps.shape)}")
    if (chosen_lengths is None) != (rejected_lengths is None):
        raise ValueError("pass both chosen_lengths and rejected_lengths, or neither")
    reference_free = set(loss_types) <= set(REFERENCE_FREE_LOSSES)
    if not reference_free and (ref_chosen_logps is None or ref_rejected_logps is None):
        need = [t for t in loss_types if t not in REFERENCE_FREE_LOSSES]
        raise ValueError(f"loss_type={need[0]!r} needs ref_chosen_logps and ref_rejected_logps "
                         f"(reference-free: {', '.join(REFERENCE_FREE_LOSSES)})")

    dt = compute_dtype(policy_chosen_logps.dtype)
    pc, pr = policy_chosen_logps.to(dt), policy_rejected_logps.to(dt)
    if chosen_lengths is not None:
        nc, nr = chosen_lengths.to(dt).clamp(min=1), rejected_lengths.to(dt).clamp(min=1)
    else:
        nc = nr = torch.ones((), dtype=dt, device=pc.device)
    if not reference_free:
        rc, rr = ref_chosen_logps.to(dt), ref_rejected_logps.to(dt)
        lw, ll = pc - rc, pr - rr  # log-ratios
        sw = f_divergence_score(lw, f_divergence_type, f_alpha_divergence_coef)
        sl = f_divergence_score(ll, f_divergence_type, f_alpha_divergence_coef)
        h = sw - sl
    nll = None

    def chosen_nll() -> Tensor:
        if policy_chosen_nll is not None:
            return policy_chosen_nll.to(dt)
        if chosen_lengths is None:
            raise ValueError("an sft/orpo term or sft_weight > 0 needs policy_chosen_nll or chosen_lengths")
        return -pc / nc

    def smoothed(z: Tensor) -> Tensor:
        return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)

    total = torch.zeros_like(pc)
    for t, w in zip(loss_types, weights):
        if t in ("sigmoid",):
            losses = smoothed(beta * h)
        elif t == "robust":
            losses = ((1 - eps) * -F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
        elif t in ("ipo", "sigmoid_norm"):
            h_avg = sw / nc - sl / nr
            losses = (h_avg - 1 / (2 * beta)) ** 2 if t == "ipo" else -F.logsigmoid(beta * h_avg)
        elif t == "hinge":
            losses = torch.relu(1 - beta * h)
        elif t == "simpo":
            losses = smoothed(beta * (pc / nc - pr / nr) - simpo_gamma)
        elif t == "exo_pair":
            z = beta * h
            losses = (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps))
                      + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps)))
        elif t == "nca_pair":
            losses = (-F.logsigmoid(beta * lw) - 0.5 * F.logsigmoid(-beta * lw) - 0.5 * F.logsigmoid(-beta * ll))
        elif t == "bco_pair":
            losses = -F.logsigmoid(beta * lw) - F.logsigmoid(-beta * ll)
        elif t == "sppo_hard":
            losses = (lw - 0.5 / beta) ** 2 + (ll + 0.5 / beta) ** 2
        elif t in ("aot", "aot_pair"):
            losses = smoothed(beta * (torch.sort(pc - pr).values - torch.sort(rc - rr).values))
        elif t == "aot_unpaired":
            losses = smoothed(beta * (torch.sort(lw).values - torch.sort(ll).values))
        elif t == "apo_zero":
            losses = (1 - torch.sigmoid(beta * lw)) + torch.sigmoid(beta * ll)
        elif t == "apo_down":
            losses = torch.sigmoid(beta * lw) + (1 - torch.sigmoid(beta * (lw - ll)))
        elif t == "discopop":
            z = beta * h
            m = torch.sigmoid(z / discopop_tau)
            losses = (1 - m) * -F.logsigmoid(z) + m * torch.exp(-z)
        elif t == "sft":
            nll = chosen_nll() if nll is None else nll
            losses = nll
        elif t == "orpo":
            nll = chosen_nll() if nll is None else nll
            aw, al = pc / nc, pr / nr
            log_odds = (aw - al) - (log1mexp(aw) - log1mexp(al))
            losses = nll - beta * F.logsigmoid(log_odds)
        else:  # kto
            z0 = ((lw + ll) / 2).mean().detach().clamp(min=0) if kto_kl is None else kto_kl
            losses = (kto_loss(pc, rc, torch.ones_like(pc, dtype=torch.bool), beta, z0, desirable_weight)
                      + kto_loss(pr, rr, torch.zeros_like(pr, dtype=torch.bool), beta, z0, 1.0,
                                 undesirable_weight)) / 2
        if pair_weights is not None:
            losses = losses * pair_weights.detach().to(dt)
        total = total + w * losses.expand_as(pc)

    if sft_weight:
        total = total + sft_weight * (chosen_nll() if nll is None else nll)

    if reference_free:
        chosen_rewards, rejected_rewards = beta * pc / nc, beta * pr / nr
    elif loss_types[0] in ("ipo", "sigmoid_norm"):
        chosen_rewards, rejected_rewards = beta * (pc / nc - rc / nc), beta * (pr / nr - rr / nr)
    else:
        chosen_rewards, rejected_rewards = beta * lw, beta * ll
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return DPOOutput(loss=total.mean(), chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards,
                     margins=chosen_rewards - rejected_rewards,
                     accuracy=(chosen_rewards > rejected_rewards).to(dt).mean(), losses=total)


def length_desensitized_logps(per_token: Tensor, targets: Tensor, sequence_ids: Tensor, num_pairs: int,
                              alpha: float) -> Tensor:
    """LD-DPO's log-probs (Liu et al. 2024, arXiv 2409.06411): with l_p = min(|y_w|, |y_l|) of a
    pair, each of its responses scores

        log pi_ld(y|x) = sum_{t <= l_p} log p(y_t) + alpha * sum_{t > l_p} log p(y_t),

    so the part of the longer response past the shorter one's length counts alpha times
    (alpha = 1: plain DPO). Works on per-token log-probs of any layout whose sequences are
    contiguous (packed or padded rows): `per_token` and `targets` (bool, the scored positions)
    alike shaped, `sequence_ids` giving each position's sequence (chosen 0..N-1, rejected N..2N-1,
    -1 padding), as posttrain.core.data.packing.collate_preference lays them out. Returns (2N,)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"ld_alpha must be in [0, 1], got {alpha}")
    n_seq = 2 * num_pairs
    v, s = per_token.reshape(-1), sequence_ids.reshape(-1).to(per_token.device)
    keep = s >= 0
    m = (targets.reshape(-1) & keep).to(v.dtype)
    sid = s.clamp(min=0)
    lengths = torch.zeros(n_seq, dtype=v.dtype, device=v.device).index_add(0, sid[keep], m[keep])
    count = torch.cumsum(m, 0)  # targets up to and including each position
    idx = torch.arange(v.numel(), device=v.device)
    first = torch.full((n_seq,), v.numel() - 1, dtype=idx.dtype, device=v.device)
    first = first.scatter_reduce(0, sid[keep], idx[keep], reduce="amin")
    before = count[first] - m[first]  # targets before each sequence's first position
    rank = count - before[sid]  # 1-based rank of a target within its response
    shared = torch.minimum(lengths[:num_pairs], lengths[num_pairs:]).repeat(2)
    in_shared = (m > 0) & (rank <= shared[sid])
    vv = torch.where(keep, v, torch.zeros_like(v))
    total = torch.zeros(n_seq, dtype=v.dtype, device=v.device).index_add(0, sid, vv * m)
    head = torch.zeros(n_seq, dtype=v.dtype, device=v.device).index_add(0, sid, vv * in_shared)
    return head + alpha * (total - head)
