"""Objectives: what a micro-batch costs for SFT, DPO and distillation, as `Trainer` objectives.

Each returns a LossOutput whose `loss_sum` is summed over target tokens (SFT, distillation) or
preference pairs (DPO), so the trainer's single division by the step's total is exact. The loss
head runs inside the model's forward (`model(..., head=...)`), so the (tokens x vocab) logits are
never materialized and parallel wrappers see a single forward call.

Under tensor parallelism (posttrain.core.parallel.parallelize with tp > 1) the lm_head is column-parallel:
each rank holds a vocab slice of it. Each head then runs the lm_head module (which gathers
sequence-parallel hidden states) and the vocab-parallel loss of posttrain.core.parallel.losses on its slice
of the logits, so the full vocabulary is never gathered; the single-process path is untouched.

Under context parallelism (`model.cp_group`, set by parallelize with cp > 1) each objective first
takes this rank's share of the packed batch (posttrain.core.parallel.context.shard_batch: labels shifted on
the whole sequence, then cut into the load-balanced chunks), and scores it with shift=False. Token
losses are then sums over the shard, and the trainer's count of the step's tokens adds the shards
up. Per-sequence log-probs (DPO) are summed over the cp ranks (`sum_over_shards`), so chosen and
rejected of a pair meet in one loss on every rank, each rank taking 1/cp of it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from posttrain.core.data.packing import sequence_sums
from posttrain.core.losses import IGNORE_INDEX, chunked_cross_entropy, distill_loss_topk, dpo_loss
from posttrain.core.preference import REFERENCE_FREE_LOSSES, kto_kl, kto_loss, length_desensitized_logps, wpo_weights
from posttrain.core.model.moe import routed_tokens
from posttrain.core.parallel.context import CP_KEY, shard_batch, shard_like, sum_over_shards
from posttrain.core.parallel.losses import (vocab_parallel_cross_entropy, vocab_parallel_distill_loss,
                                  vocab_parallel_distill_topk, vocab_parallel_token_logps, vocab_parallel_topk)
from posttrain.core.trainer import LossOutput
from posttrain.kernels.fused_linear_ce import fused_linear_cross_entropy
from posttrain.kernels.fused_linear_kl import fused_linear_distill, fused_linear_logps

CHUNK = 1024  # tokens per logits chunk: bounds the head's memory at CHUNK x vocab


def _tp_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The tp group when parallelize split the lm_head by vocab (column-parallel), else None."""
    return getattr(getattr(model, "lm_head", None), "tp_group", None)


def _cp_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The cp group when parallelize installed ring attention (cp > 1), else None."""
    return getattr(model, "cp_group", None)


def cp_view(model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
    """The batch as this rank computes on it: under context parallelism its share (once: a batch
    already cut is returned as is), else the batch itself."""
    group = _cp_group(model)
    if group is None or CP_KEY in batch:
        return batch
    lm_head = getattr(model, "lm_head", None)
    sp = getattr(lm_head, "input_mode", None) == "sequence"  # tp ranks split each shard again
    return shard_batch(batch, group, dist.get_world_size(lm_head.tp_group) if sp else 1)


def shifted(batch: dict[str, Any]) -> bool:
    """Whether the batch's labels still need shifting by the loss (not when cut by shard_batch)."""
    return CP_KEY not in batch


def response_mask(batch: dict[str, Any]) -> torch.Tensor:
    """True at the positions whose next token is a target (those a token loss scores)."""
    labels = batch["labels"]
    if not shifted(batch):
        return labels != IGNORE_INDEX
    mask = torch.zeros_like(labels, dtype=torch.bool)
    mask[..., :-1] = labels[..., 1:] != IGNORE_INDEX
    return mask


def _head(model: nn.Module, batch: dict[str, Any], fused: Callable, vocab_parallel: Callable) -> Callable:
    """`fused(hidden, weight)` on one process; under tp, `vocab_parallel(logits, group)` on this
    rank's (B, T, V/tp) slice of the logits (the padding `_forward` added stripped again)."""
    group = _tp_group(model)
    if group is None:
        return fused
    T = batch["input_ids"].shape[-1]
    return lambda h, w: vocab_parallel(model.lm_head(h)[:, :T], group)


def _forward(model: nn.Module, batch: dict[str, Any], head: Callable) -> Any:
    ids, pos, mask = batch["input_ids"], batch.get("position_ids"), batch.get("attention_mask")
    lm_head = getattr(model, "lm_head", None)
    # Sequence parallelism splits the tokens over tp, so their number must divide by it. Pad at
    # the end: under causal attention the real tokens never see the padding (`_head` drops it).
    sp = getattr(lm_head, "input_mode", None) == "sequence"
    pad = -ids.shape[-1] % dist.get_world_size(lm_head.tp_group) if sp else 0
    # MoE balancing counts real tokens only: padding (sequence id -1) of a padded batch, or of
    # shard_batch's layout under context parallelism, does not
    real = batch["sequence_ids"] >= 0 if "sequence_ids" in batch else None
    if real is not None and CP_KEY not in batch and bool(real.all()):
        real = None
    if pad:
        real = F.pad(torch.ones_like(ids, dtype=torch.bool) if real is None else real, (0, pad), value=False)
        ids = F.pad(ids, (0, pad))
        pos = None if pos is None else F.pad(pos, (0, pad))
        mask = None if mask is None else F.pad(mask, (0, pad))
    with routed_tokens(model, real):  # MoE balancing sees only the real tokens
        return model(ids, pos, mask, head=head)


def token_logps(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """log p(label_{t+1} | ..t) at every position (0 where the label is ignored), (B, T); under
    context parallelism at every position of this rank's share (`cp_view`)."""
    batch = cp_view(model, batch)
    labels, shift = batch["labels"], shifted(batch)
    return _forward(model, batch, _head(model, batch,
                                        lambda h, w: fused_linear_logps(h, w, labels, shift=shift, chunk_size=CHUNK),
                                        lambda z, g: vocab_parallel_token_logps(z, labels, g, shift=shift)))


def sft_objective(model: nn.Module, batch: dict[str, Any]) -> LossOutput:
    """Next-token cross entropy on the response tokens."""
    batch = cp_view(model, batch)
    labels, shift = batch["labels"], shifted(batch)
    loss = _forward(model, batch, _head(
        model, batch,
        lambda h, w: fused_linear_cross_entropy(h, w, labels, reduction="sum", shift=shift, chunk_size=CHUNK),
        lambda z, g: vocab_parallel_cross_entropy(z, labels, g, reduction="sum", shift=shift)))
    return LossOutput(loss, batch["num_target_tokens"])


def pair_logps(model: nn.Module, batch: dict[str, Any], ld_alpha: float | None = None,
               wpo: bool = False) -> tuple[torch.Tensor, ...]:
    """Summed log-probs of every sequence of a preference batch (chosen first, then rejected) and
    the number of target tokens of each, both (2N,); whole sequences' on every rank under
    context parallelism too. With `ld_alpha` the sums are LD-DPO's
    (posttrain.core.preference.length_desensitized_logps; not under context parallelism). With `wpo` a
    third value: WPO's detached per-pair weights (N,) (posttrain.core.preference.wpo_weights), which need
    log sum_v p(v)^2 per token: an extra no-grad pass over the lm_head, chunked (one process or
    FSDP only: not under tensor or context parallelism)."""
    batch = cp_view(model, batch)
    # a pair batch holds 2N sequences; an unpaired one (KTO, collate_unpaired) says how many
    n_seq = batch["num_sequences"] if "num_sequences" in batch else 2 * batch["num_pairs"]
    group = _cp_group(model)
    if (ld_alpha is not None or wpo) and (group is not None or _tp_group(model) is not None and wpo):
        raise ValueError("ld_alpha and use_weighting need whole sequences (ld_alpha: not under context "
                         "parallelism; use_weighting: neither under tensor parallelism)")
    mask = response_mask(batch)
    if wpo:
        labels, shift = batch["labels"], shifted(batch)

        def head(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            tok = fused_linear_logps(h, w, labels, shift=shift, chunk_size=CHUNK)
            with torch.no_grad():  # log sum_v p(v)^2 = logsumexp(2 z) - 2 logsumexp(z)
                flat = h.reshape(-1, h.shape[-1])
                lss = torch.cat([_log_sum_sq(flat[j:j + CHUNK] @ w.T) for j in range(0, flat.shape[0], CHUNK)])
            return tok, lss.view(h.shape[:-1])

        per_token, lss = _forward(model, batch, head)
    else:
        per_token = token_logps(model, batch)
    targets = mask.to(per_token.dtype)
    if ld_alpha is not None:
        if "num_pairs" not in batch:
            raise ValueError("ld_alpha (LD-DPO) compares the two responses of a pair: not for unpaired data")
        sums = length_desensitized_logps(per_token, mask, batch["sequence_ids"], batch["num_pairs"], ld_alpha)
    else:
        sums = sequence_sums(per_token, batch["sequence_ids"], n_seq)
    lengths = sequence_sums(targets, batch["sequence_ids"], n_seq)
    if group is not None:
        sums, lengths = sum_over_shards(sums, group), sum_over_shards(lengths, group)
    if wpo:
        aligned = sequence_sums((per_token.detach() - lss.to(per_token.dtype)) * targets, batch["sequence_ids"], n_seq)
        return sums, lengths, wpo_weights(aligned, lengths)
    return sums, lengths


def _log_sum_sq(z: torch.Tensor) -> torch.Tensor:
    z = z.float()
    return torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1)


def dpo_objective(beta: float, loss_type: str | Sequence[str] = "sigmoid", label_smoothing: float = 0.0,
                  simpo_gamma: float = 0.5, sft_weight: float = 0.0,
                  reference: Callable[[dict[str, Any]], torch.Tensor] | None = None, ld_alpha: float | None = None,
                  use_weighting: bool = False, **loss_kwargs: Any) -> Callable:
    """The preference-loss family (posttrain.core.preference.dpo_loss) over a collate_preference batch;
    chosen and rejected in one forward. `loss_kwargs`: dpo_loss's further knobs (loss_weights,
    f_divergence_type, ...); ld_alpha (LD-DPO) and use_weighting (WPO) act on the log-probs.

    reference(batch) -> (2N,) reference log-probs: precomputed ones read from the batch
    (`batch["ref_logps"]`, LD-DPO's when ld_alpha is set), or computed under `disable_adapter()`
    for LoRA policies (by `live_reference`, which applies ld_alpha too).

    KTO: a batch carrying `batch["kto_kl_batch"]` (a collate_preference batch of mismatched
    pairs: each prompt with another pair's responses) gets its reference point z0 from them
    (posttrain.core.preference.kto_kl over the policy's and the reference's log-probs of all its sequences,
    both no-grad; needs a live `reference`); otherwise dpo_loss's batch estimate."""
    types = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)
    reference_free = set(types) <= set(REFERENCE_FREE_LOSSES)

    def objective(model: nn.Module, batch: dict[str, Any]) -> LossOutput:
        batch = cp_view(model, batch)
        n = batch["num_pairs"]
        logps, lengths, *weights = pair_logps(model, batch, ld_alpha, use_weighting)
        ref = None
        if not reference_free:
            ref = batch["ref_logps"] if reference is None else reference(batch)
            ref = ref.to(logps.dtype)
        z0 = _mismatched_kl(model, batch, reference, ld_alpha) if "kto_kl_batch" in batch else None
        out = dpo_loss(logps[:n], logps[n:], None if ref is None else ref[:n], None if ref is None else ref[n:],
                       beta=beta, loss_type=types, label_smoothing=label_smoothing,
                       simpo_gamma=simpo_gamma, chosen_lengths=lengths[:n], rejected_lengths=lengths[n:],
                       sft_weight=sft_weight, pair_weights=weights[0] if weights else None, kto_kl=z0,
                       **loss_kwargs)
        metrics = {"rewards/chosen": float(out.chosen_rewards.mean()),
                   "rewards/rejected": float(out.rejected_rewards.mean()),
                   "rewards/margin": float(out.margins.mean()),
                   "rewards/accuracy": float(out.accuracy)}
        if weights:
            metrics["rewards/wpo_weight"] = float(weights[0].mean())
        if z0 is not None:
            metrics["rewards/kto_kl"] = float(z0)
        # Under context parallelism every cp rank holds the whole loss: each takes 1/cp of it.
        shares = dist.get_world_size(_cp_group(model)) if _cp_group(model) is not None else 1
        return LossOutput(out.losses.sum() / shares, n / shares, metrics)

    return objective


def kto_objective(beta: float, reference: Callable[[dict[str, Any]], torch.Tensor] | None = None,
                  desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
                  kl_group: dist.ProcessGroup | None = None, kl_reduce: bool = False) -> Callable:
    """KTO on unpaired data (posttrain.core.preference.kto_loss) over a collate_unpaired batch: each
    example's completion log-prob under the policy and the reference (`reference(batch)`, or the
    precomputed `batch["ref_logps"]` (N,) when None), the reference point z0 from the batch's
    mismatched pairs (`batch["kto_kl_batch"]`: the policy's and reference's log-probs, no grad;
    precomputed reference log-probs of them in `batch["ref_kl_logps"]`), as TRL's KTOTrainer: the
    micro-batch mean of the log-ratios, averaged over the data-parallel ranks (`kl_reduce`: an
    all-reduce over `kl_group`, None = the default group) and then clamped at 0. The loss is summed
    per example (the trainer divides by the step's examples: a per-example mean).

    Metrics, as the DPO stage names them: rewards/chosen and rewards/rejected (the mean of
    b (log pi - log ref) over the batch's desirable / undesirable examples, when it has any),
    rewards/margin (their difference, when both), rewards/kto_kl (z0)."""

    def objective(model: nn.Module, batch: dict[str, Any]) -> LossOutput:
        batch = cp_view(model, batch)
        n = batch["num_sequences"]
        logps, _ = pair_logps(model, batch)
        ref = (batch["ref_logps"] if reference is None else reference(batch)).detach().to(logps.dtype)
        z0 = unpaired_kl(model, batch, reference, kl_group if kl_reduce else None, kl_reduce)
        good = batch["desirable"].to(logps.device)
        losses = kto_loss(logps, ref, good, beta, z0, desirable_weight, undesirable_weight)
        rewards = beta * (logps.detach().to(losses.dtype) - ref.to(losses.dtype))
        metrics = {"rewards/kto_kl": float(z0)}
        if bool(good.any()):
            metrics["rewards/chosen"] = float(rewards[good].mean())
        if not bool(good.all()):
            metrics["rewards/rejected"] = float(rewards[~good].mean())
        if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
            metrics["rewards/margin"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        shares = dist.get_world_size(_cp_group(model)) if _cp_group(model) is not None else 1
        return LossOutput(losses.sum() / shares, n / shares, metrics)

    return objective


@torch.no_grad()
def unpaired_kl(model: nn.Module, batch: dict[str, Any], reference: Callable | None,
                group: dist.ProcessGroup | None = None, reduce: bool = False) -> torch.Tensor:
    """KTO's z0 of an unpaired batch: max(0, mean over its mismatched pairs of log pi - log ref),
    the per-rank means averaged over `group`'s ranks first when `reduce` (TRL gathers them)."""
    device = batch["input_ids"].device
    kl_batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch["kto_kl_batch"].items()}
    policy = pair_logps(model, kl_batch)[0]
    ref = batch["ref_kl_logps"].to(device) if reference is None else reference(kl_batch)
    mean = (policy.double() - ref.double()).mean()
    if reduce:
        dist.all_reduce(mean, group=group)
        mean = mean / dist.get_world_size(group)
    return mean.clamp(min=0).to(policy.dtype)


@torch.no_grad()
def _mismatched_kl(model: nn.Module, batch: dict[str, Any], reference: Callable | None,
                   ld_alpha: float | None) -> torch.Tensor:
    """KTO's z0 from the batch's mismatched pairs (`batch["kto_kl_batch"]`), policy and reference."""
    if reference is None:
        raise ValueError("KTO's mismatched-pair KL estimate needs a live reference, not precomputed log-probs")
    device = batch["input_ids"].device
    kl_batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch["kto_kl_batch"].items()}
    return kto_kl(pair_logps(model, kl_batch, ld_alpha)[0], reference(kl_batch))


def distill_objective(teacher: nn.Module, kind: str = "forward_kl", temperature: float = 1.0,
                      beta: float = 0.5, ce_weight: float = 0.0) -> Callable:
    """Online distillation: the teacher's hidden states per micro-batch (no grad), the divergence
    to the student's distribution on response positions, computed chunk by chunk. Under tensor
    parallelism the teacher is split like the student, and its logits of this rank's vocab
    slice meet the student's in the vocab-parallel loss."""

    def objective(model: nn.Module, batch: dict[str, Any]) -> LossOutput:
        batch = cp_view(model, batch)  # the teacher then runs on this rank's share too (ring attention)
        labels, shift = batch["labels"], shifted(batch)
        mask = response_mask(batch)  # positions that predict a response token
        t_logits = None
        with torch.no_grad():
            if _tp_group(teacher) is not None:  # split like the student: its logits of this rank's vocab slice
                T = batch["input_ids"].shape[-1]
                t_logits = _forward(teacher, batch, lambda h, w: teacher.lm_head(h)[:, :T])
            else:
                t_hidden, t_weight = _forward(teacher, batch, lambda h, w: (h, w))

        def head(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            # the fused op returns the mean over masked positions; the trainer wants the sum
            loss = fused_linear_distill(h, w, t_hidden.to(h.dtype), t_weight.to(w.dtype), mask, kind=kind,
                                        temperature=temperature, beta=beta, chunk_size=CHUNK) * mask.sum()
            if ce_weight:
                loss = loss + ce_weight * fused_linear_cross_entropy(h, w, labels, reduction="sum", shift=shift,
                                                                     chunk_size=CHUNK)
            return loss

        def vocab_parallel_head(z: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
            if t_logits is not None:
                t_z = t_logits.to(z.dtype)
            else:  # a whole teacher: its logits for this rank's vocab slice only
                t_w = t_weight.chunk(dist.get_world_size(group))[dist.get_rank(group)]
                t_z = t_hidden.to(z.dtype) @ t_w.to(z.dtype).T
            loss = vocab_parallel_distill_loss(z, t_z, group, kind, temperature, beta, mask, reduction="sum")
            return _plus_ce(loss, ce_weight, z, labels, group, shift)

        return _token_output(model, batch, head, vocab_parallel_head)

    return objective


def _plus_ce(loss: torch.Tensor, ce_weight: float, z: torch.Tensor, labels: torch.Tensor,
             group: dist.ProcessGroup, shift: bool) -> torch.Tensor:
    """A vocab-parallel distillation loss plus ce_weight x the hard-label cross entropy (summed)."""
    if not ce_weight:
        return loss
    return loss + ce_weight * vocab_parallel_cross_entropy(z, labels, group, reduction="sum", shift=shift)


def _token_output(model: nn.Module, batch: dict[str, Any], head: Callable, vocab_parallel_head: Callable
                  ) -> LossOutput:
    """The forward with the loss head (fused on one process, vocab-parallel under tp), over the
    batch's target tokens."""
    return LossOutput(_forward(model, batch, _head(model, batch, head, vocab_parallel_head)),
                      batch["num_target_tokens"])


def topk_distill_objective(rows: Callable, kind: str = "forward_kl", temperature: float = 1.0, beta: float = 0.5,
                           ce_weight: float = 0.0) -> Callable:
    """Offline distillation from a cached teacher top-k: `rows(doc_indices)` gives the (T, k) ids
    and log-probs of the batch's positions (posttrain.stages.distill.TeacherTopK). Only the trained
    positions' logits are computed; under context parallelism the rows of this rank's share are
    taken, under tensor parallelism the loss is vocab-parallel (the cache holds global ids)."""

    def objective(model: nn.Module, batch: dict[str, Any]) -> LossOutput:
        batch = cp_view(model, batch)
        labels, mask, shift = batch["labels"], response_mask(batch), shifted(batch)
        t_ids, t_lp = rows(batch["doc_indices"])
        t_ids, t_lp = t_ids.to(labels.device), t_lp.to(labels.device)
        if CP_KEY in batch:  # the rows of this rank's share of the positions
            t_ids, t_lp = shard_like(batch, t_ids), shard_like(batch, t_lp)
        sel = mask.reshape(-1)

        def head(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            logits = h.reshape(-1, h.shape[-1])[sel] @ w.T  # only the positions that are trained
            loss = distill_loss_topk(logits, t_ids[sel], t_lp[sel], kind=kind, temperature=temperature, beta=beta,
                                     reduction="sum")
            if ce_weight:
                loss = loss + ce_weight * chunked_cross_entropy(h, w, labels, reduction="sum", shift=shift)
            return loss

        def vocab_parallel_head(z: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
            loss = vocab_parallel_distill_topk(z.reshape(-1, z.shape[-1])[sel], t_ids[sel], t_lp[sel], group, kind,
                                               temperature, beta, reduction="sum")
            return _plus_ce(loss, ce_weight, z, labels, group, shift)

        return _token_output(model, batch, head, vocab_parallel_head)

    return objective


@torch.no_grad()
def teacher_topk(teacher: nn.Module, batch: dict[str, Any], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k (ids int32, log-probs) at every position of a padding-free batch,
    (T, k), taken in the forward's head, chunked, so the full logits never exist. Under tensor
    parallelism (the teacher split like the student) from its vocab-split logits
    (vocab_parallel_topk), every rank of the tp group getting the same rows; sequence parallelism
    is switched off for it. Under pipeline parallelism the last stage takes them and the
    pipeline's other ranks get them too (a pipeline-split model's forward)."""
    from posttrain.core.parallel.tensor import decode_without_sequence_parallel

    def head(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        group = _tp_group(teacher)  # looked up here: under pp only the last stage holds the head
        ids, logps = [], []
        for j in range(0, h.shape[1], CHUNK):
            if group is None:
                top = (h[0, j:j + CHUNK].float() @ w.float().T).log_softmax(-1).topk(k, dim=-1)
                top_ids, top_lp = top.indices, top.values
            else:
                top_ids, top_lp = vocab_parallel_topk(teacher.lm_head(h[:, j:j + CHUNK])[0], k, group)
            ids.append(top_ids.int())
            logps.append(top_lp)
        return torch.cat(ids), torch.cat(logps)

    with decode_without_sequence_parallel(teacher):  # whole sequences on every tp rank
        return teacher(batch["input_ids"], batch["position_ids"], head=head)
