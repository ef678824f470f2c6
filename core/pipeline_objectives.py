"""Objectives under pipeline parallelism (posttrain.core.parallel.pipeline): SFT, DPO and online and offline
distillation for the Trainer, each running the schedule's forward and backward itself.

The schedule runs fixed shapes, so a micro-batch is re-laid as `rows` padded rows of `seq_len`
tokens (`pipeline_rows`); its loss function, fixed when the schedule is built, is a
`PipelineLoss` whose `fn` each objective swaps in for its step: a token cross entropy (SFT), the
DPO loss of a microbatch's pairs, or the divergence to the teacher's logits. Each is a *sum* the
trainer normalizes once per step (the schedule built with scale_grads=False), as every other
layout's objectives are, and the last stage's loss is shared over the stages afterwards so every
rank reports it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from posttrain.core.losses import IGNORE_INDEX, distill_loss, distill_loss_topk, dpo_loss
from posttrain.core.losses import token_logps as core_token_logps
from posttrain.core.parallel.losses import (vocab_parallel_cross_entropy, vocab_parallel_distill_loss, vocab_parallel_distill_topk,
                                  vocab_parallel_token_logps)
from posttrain.core.trainer import LossOutput


def pipeline_token_loss(tp_group: dist.ProcessGroup | None) -> Callable:
    """The last pipeline stage's loss of one microbatch: next-token cross entropy *summed* over
    its target tokens (`target` = labels already shifted, see `pipelined_sft`), on the full logits
    or on this rank's vocab slice of them under tensor parallelism."""
    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if tp_group is not None:
            return vocab_parallel_cross_entropy(logits, target, tp_group, reduction="sum", shift=False)
        return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    return loss_fn


def pipeline_rows(batch: dict[str, Any], rows: int, seq_len: int) -> tuple[torch.Tensor, ...]:
    """(input_ids, position_ids, shifted labels, target tokens per row) of a padded (B, L) batch
    as fixed (rows, seq_len) tensors, the shapes every pipeline step runs on: extra rows and
    columns are padding (a document of their own, no targets)."""
    ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
    B, L = ids.shape
    if B > rows or L > seq_len:
        raise ValueError(f"a ({B}, {L}) batch does not fit the pipeline's ({rows}, {seq_len}) microbatches")
    out_ids = ids.new_zeros(rows, seq_len)
    out_pos = torch.arange(seq_len, device=ids.device).repeat(rows, 1)
    target = labels.new_full((rows, seq_len), IGNORE_INDEX)
    out_ids[:B, :L], out_pos[:B, :L] = ids, pos
    out_pos[:B, L:] = torch.arange(seq_len - L, device=ids.device)
    target[:B, :L - 1] = labels[:, 1:]  # the label of position t + 1 is position t's target
    return out_ids, out_pos, target, (target != IGNORE_INDEX).sum(1)


def cp_local(pipe, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under context parallelism (pipeline stages with ring attention), this rank's share of each
    (rows, seq_len, ...) tensor laid out as the pipeline's rows: the two load-balanced chunks of
    every row (posttrain.core.parallel.context.context_parallel_shard; labels were shifted on the whole
    row, so a chunk's last target is right); else the tensors as they are."""
    group = _cp_group(pipe)
    if group is None:
        return rows
    from posttrain.core.parallel.context import context_parallel_shard

    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    return tuple(context_parallel_shard(t, rank, cp, dim=1) for t in rows)


def _cp_group(pipe) -> dist.ProcessGroup | None:
    return getattr(pipe.modules[0], "cp_group", None)


def _whole_rows(pipe, per_row: torch.Tensor) -> torch.Tensor:
    """Per-row sums over this rank's chunks (rows,) -> the whole rows', on every cp rank
    (differentiable for a loss each of the cp ranks takes 1/cp of); as they are without cp."""
    group = _cp_group(pipe)
    if group is None:
        return per_row
    from posttrain.core.parallel.context import sum_over_shards

    return sum_over_shards(per_row, group)


def _rows(pipe, batch: dict[str, Any], rows: int, seq_len: int) -> tuple[torch.Tensor, ...]:
    """pipeline_rows, this rank's share of them under context parallelism (`cp_local`), the
    target tokens per row counted on that share (the cp ranks' counts add up to the batch's)."""
    ids, pos, target, per_row = pipeline_rows(batch, rows, seq_len)
    if _cp_group(pipe) is None:
        return ids, pos, target, per_row
    ids, pos, target = cp_local(pipe, ids, pos, target)
    return ids, pos, target, (target != IGNORE_INDEX).sum(1)


def real_tokens(batch: dict[str, Any], rows: int, seq_len: int) -> torch.Tensor:
    """(rows, seq_len) bool, True at the batch's real tokens as `pipeline_rows` lays them out (its
    padding, and the batch's own: sequence id -1 or attention_mask 0, False): what MoE balancing
    counts (Pipeline.step's token_mask)."""
    ids = batch["input_ids"]
    B, L = ids.shape
    if "sequence_ids" in batch:
        mine = batch["sequence_ids"] >= 0
    elif "attention_mask" in batch:
        mine = batch["attention_mask"].bool()
    else:
        mine = torch.ones(B, L, dtype=torch.bool, device=ids.device)
    out = torch.zeros(rows, seq_len, dtype=torch.bool, device=ids.device)
    out[:B, :L] = mine
    return out


def _step_kwargs(pipe, batch: dict[str, Any], rows: int, seq_len: int, weights: list[float]) -> dict[str, Any]:
    """Pipeline.step's arguments beside the tokens, laid out as `pipeline_rows` lays the batch:
    for an MoE model each microbatch's aux-loss weight (what the trainer weights model.aux_loss()
    by without pipelining: the objective's num_tokens) and its real tokens; with several adapters
    (inside Pipeline.routing) each token's adapter."""
    kw: dict[str, Any] = {}
    if any(m.moe_layers() for m in pipe.modules):
        kw.update(aux_weights=weights, token_mask=cp_local(pipe, real_tokens(batch, rows, seq_len))[0])
    if pipe.adapter_names is not None:
        ids = batch["adapter_ids"]
        laid = ids.new_full((rows, seq_len), -1)
        laid[:ids.shape[0], :ids.shape[1]] = ids
        kw["adapter_ids"] = cp_local(pipe, laid)[0]
    return kw


def moe_metrics(pipe, pp_group: dist.ProcessGroup) -> dict[str, float]:
    """moe/aux_loss of the last step (the microbatches' mean, every stage's layers summed over the
    pipeline), as the trainer logs it without pipelining; {} for a dense model."""
    if not any(m.moe_layers() for m in pipe.modules):  # (the same on every rank: the model's args)
        return {}
    aux = torch.as_tensor(pipe.aux_loss(), dtype=torch.float64).reshape(())
    dist.all_reduce(aux, group=pp_group)
    return {"moe/aux_loss": float(aux)}


class PipelineLoss:
    """The schedule's loss_fn (fixed when the schedule is built): the last stage's loss of one
    microbatch, `fn(logits, target)`, which an objective may swap for its step (`using`)."""

    def __init__(self, fn: Callable, tp_group: dist.ProcessGroup | None = None):
        self.fn, self.tp_group = fn, tp_group

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.fn(logits, target)

    @contextlib.contextmanager
    def using(self, fn: Callable):
        prev, self.fn = self.fn, fn
        try:
            yield
        finally:
            self.fn = prev

    def row_logps(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed log-probs of each row's (already shifted) target tokens, (rows,)."""
        if self.tp_group is not None:
            return vocab_parallel_token_logps(logits, labels, self.tp_group, shift=False).sum(-1)
        return core_token_logps(logits.float(), labels, shift=False).sum(-1)


def pipelined_sft(pipe, rows: int, seq_len: int, pp_group: dist.ProcessGroup) -> Callable:
    """sft_objective under pipeline parallelism, for the Trainer: each micro-batch (padded rows,
    `pipeline_rows`) runs the schedule's forward and backward over its microbatches (forward only
    under no_grad: validation), the loss a token sum on the last stage (pipeline_token_loss, the
    schedule built with scale_grads=False), so the trainer's one division per step stays exact.
    The loss is then shared over the stages (one scalar), so every rank reports it. MoE aux
    losses are attached inside the stages, weighted by each microbatch's target tokens, as the
    trainer weights model.aux_loss() by the micro-batch's, and taken over its real tokens only
    (`real_tokens`: the pipeline's padding rows and columns do not count in the balancing)."""
    def objective(model: nn.Module, batch: dict[str, Any]) -> LossOutput:
        ids, pos, target, per_row = _rows(pipe, batch, rows, seq_len)
        train = torch.is_grad_enabled()
        weights = [float(n) for n in per_row.view(pipe.microbatches, -1).sum(1)]
        kw = _step_kwargs(pipe, batch, rows, seq_len, weights)
        losses = pipe.step(ids, pos, target=target, backward=train, **kw)
        loss = losses.sum().float() if losses is not None else torch.zeros((), device=ids.device)
        dist.all_reduce(loss, group=pp_group)  # only the last stage had it
        return LossOutput(loss, per_row.sum(), moe_metrics(pipe, pp_group) if train else {}, backward_done=train)
    return objective


def _pair_rows(batch: dict[str, Any], rows: int, seq_len: int):
    """A padded preference batch (chosen rows first, then rejected) as pipeline rows with each
    pair's chosen and rejected side by side (c0, r0, c1, r1, ...), so a pipeline microbatch of an
    even number of rows holds whole pairs: (pipeline_rows' tensors, the row order taken, the batch
    in that order)."""
    n = batch["num_pairs"]
    order = torch.arange(2 * n, device=batch["input_ids"].device).view(2, n).t().reshape(-1)
    keys = ("input_ids", "position_ids", "labels", "sequence_ids", "attention_mask", "adapter_ids")
    picked = {k: batch[k][order] for k in keys if k in batch}
    return pipeline_rows(picked, rows, seq_len), order, picked


def _last_stage(pp_group: dist.ProcessGroup) -> int:
    return dist.get_global_rank(pp_group, dist.get_world_size(pp_group) - 1)


@torch.no_grad()
def pipeline_pair_logps(pipe, batch: dict[str, Any], rows: int, seq_len: int, pp_group: dist.ProcessGroup
                        ) -> torch.Tensor:
    """pair_logps' summed log-probs (2N,), chosen first, of a padded preference batch under
    pipeline parallelism: one forward-only pass of the schedule, on every rank (sent from the
    last stage)."""
    (ids, pos, target, _), _, picked = _pair_rows(batch, rows, seq_len)
    ids, pos, target = cp_local(pipe, ids, pos, target)
    got: list[torch.Tensor] = []

    def stash(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        got.append(_whole_rows(pipe, pipe.loss.row_logps(logits, labels).float()))
        return torch.zeros((), device=logits.device)

    with pipe.loss.using(stash):
        pipe.step(ids, pos, target=target, backward=False, **_step_kwargs(pipe, picked, rows, seq_len, []))
    logps = torch.cat(got) if got else torch.zeros(rows, device=ids.device)
    dist.broadcast(logps, _last_stage(pp_group), group=pp_group)
    n = batch["num_pairs"]
    return logps[:2 * n].view(n, 2).t().reshape(-1)


def pipelined_dpo(pipe, rows: int, seq_len: int, pp_group: dist.ProcessGroup, beta: float, loss_type: str = "sigmoid",
                  label_smoothing: float = 0.0, simpo_gamma: float = 0.5, sft_weight: float = 0.0,
                  reference: str = "batch", reference_pipe=None, loss_kwargs: dict[str, Any] | None = None) -> Callable:
    """dpo_objective under pipeline parallelism: each micro-batch of pairs (padded rows, chosen
    and rejected side by side: `_pair_rows`) runs the schedule, the last stage's loss of a
    microbatch the DPO loss summed over its pairs (filler pairs weigh 0), the reference log-probs
    riding in the target beside the labels: `reference` "batch" (precomputed, batch["ref_logps"]),
    "disable_adapter" (the LoRA base: a forward-only pass first), "model" (a frozen copy split
    into the same stages, `reference_pipe`: its forward-only pass first) or "none" (SimPO). The
    loss and the reward metrics are then shared over the stages. `loss_kwargs`: dpo_loss's further
    knobs (loss_weights, f_divergence_type, ...; not ld_alpha or WPO weights, which the config
    refuses under pipeline parallelism)."""

    def objective(model: nn.Module, batch: dict[str, Any]) -> LossOutput:
        from posttrain.core.lora import disable_adapter

        n, train = batch["num_pairs"], torch.is_grad_enabled()
        ref = None
        if reference == "disable_adapter":
            with disable_adapter(model):
                ref = pipeline_pair_logps(pipe, batch, rows, seq_len, pp_group)
        elif reference == "model":
            ref = pipeline_pair_logps(reference_pipe, batch, rows, seq_len, pp_group)
        elif reference == "batch":
            ref = batch["ref_logps"]
        (ids, pos, labels, _), order, picked = _pair_rows(batch, rows, seq_len)
        ids, pos, labels = cp_local(pipe, ids, pos, labels)  # under cp: this rank's chunks of each row
        shares = dist.get_world_size(_cp_group(pipe)) if _cp_group(pipe) is not None else 1
        R, L = labels.shape
        pairs = (torch.arange(R // 2) < n).view(pipe.microbatches, -1).sum(1)  # real pairs per microbatch
        kw = _step_kwargs(pipe, picked, rows, seq_len, [float(k) for k in pairs])
        target = torch.zeros(R, L + 2, dtype=torch.float64, device=ids.device)
        target[:, :L] = labels
        if ref is not None:
            target[:2 * n, L] = ref.to(ids.device, torch.float64)[order]
        target[:2 * n, L + 1] = 1  # real pairs (the rest fill the fixed shape)
        sums: list[torch.Tensor] = []

        def dpo_fn(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            lab = t[:, :L].long()
            logps = _whole_rows(pipe, pipe.loss.row_logps(logits, lab))  # a pair meets whole on every cp rank
            lengths = _whole_rows(pipe, (lab != IGNORE_INDEX).sum(-1).to(logps.dtype))
            rc, rr = (t[0::2, L].to(logps.dtype), t[1::2, L].to(logps.dtype)) if ref is not None else (None, None)
            out = dpo_loss(logps[0::2], logps[1::2], rc, rr, beta=beta, loss_type=loss_type,
                           label_smoothing=label_smoothing, simpo_gamma=simpo_gamma, chosen_lengths=lengths[0::2],
                           rejected_lengths=lengths[1::2], sft_weight=sft_weight, **(loss_kwargs or {}))
            real = t[0::2, L + 1].to(logps.dtype)
            sums.append(torch.stack([(out.chosen_rewards * real).sum(), (out.rejected_rewards * real).sum(),
                                     (out.margins * real).sum(),
                                     ((out.chosen_rewards > out.rejected_rewards) * real).sum()]).double())
            return (out.losses * real).sum() / shares  # every cp rank holds the whole loss: 1/cp each

        with pipe.loss.using(dpo_fn):
            losses = pipe.step(ids, pos, target=target, backward=train, **kw)
        stats = torch.zeros(5, dtype=torch.float64, device=ids.device)
        if losses is not None:
            stats[0] = losses.sum().double()
            stats[1:] = torch.stack(sums).sum(0)
        dist.all_reduce(stats, group=pp_group)  # only the last stage had them
        metrics = {k: float(v) / n for k, v in zip(("rewards/chosen", "rewards/rejected", "rewards/margin",
                                                     "rewards/accuracy"), stats[1:])}
        if train:
            metrics.update(moe_metrics(pipe, pp_group))
        return LossOutput(stats[0].float(), n / shares, metrics, backward_done=train)

    return objective


def pipelined_distill(pipe, teacher_pipe, rows: int, seq_len: int, pp_group: dist.ProcessGroup,
                      kind: str = "forward_kl", temperature: float = 1.0, beta: float = 0.5, ce_weight: float = 0.0,
                      teacher_phase: Callable[[], Any] | None = None) -> Callable:
    """distill_objective under pipeline parallelism: the teacher, split into the same stages
    (posttrain.stages.recipe.parallelize_frozen), runs each micro-batch's rows forward-only first, its last
    stage keeping each microbatch's logits; then the student's schedule runs, its last stage's loss
    of a microbatch the divergence to those logits summed over the microbatch's target positions
    (+ ce_weight x the token cross entropy), vocab-parallel under tensor parallelism.
    teacher_phase: a context manager timing the teacher's pass (the throughput meter's phase)."""

    def objective(model: nn.Module, batch: dict[str, Any]) -> LossOutput:
        ids, pos, target, per_row = _rows(pipe, batch, rows, seq_len)
        train = torch.is_grad_enabled()
        teacher_logits: list[torch.Tensor] = []

        def keep(logits: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
            teacher_logits.append(logits.detach())
            return logits.new_zeros(())

        with torch.no_grad(), teacher_pipe.loss.using(keep), \
                (teacher_phase() if teacher_phase is not None else contextlib.nullcontext()):
            teacher_pipe.step(ids, pos, target=target, backward=False)
        queue = iter(teacher_logits)  # the schedules run the last stage's microbatches in order
        group = pipe.loss.tp_group

        def kd(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            t_logits, mask = next(queue).to(logits.dtype), t != IGNORE_INDEX
            if group is not None:
                loss = vocab_parallel_distill_loss(logits, t_logits, group, kind, temperature, beta, mask,
                                                   reduction="sum")
            else:
                loss = distill_loss(logits, t_logits, kind, temperature, beta, mask=mask, reduction="sum")
            return _plus_ce(loss, ce_weight, logits, t, group)

        return _run_kd(pipe, kd, batch, ids, pos, target, per_row, pp_group, train)

    return objective


def pipelined_topk_distill(pipe, rows_of: Callable, rows: int, seq_len: int, pp_group: dist.ProcessGroup,
                           kind: str = "forward_kl", temperature: float = 1.0, beta: float = 0.5,
                           ce_weight: float = 0.0) -> Callable:
    """topk_distill_objective under pipeline parallelism: the cached teacher top-k of the batch's
    documents (`rows_of(doc_indices)`: (T, k) ids and log-probs, the documents' positions in
    order) laid out as the pipeline's rows (each row's documents one after the other, as
    `pipeline_rows` lays their tokens), cut into the schedule's microbatches, and met on the last
    stage by the divergence over each microbatch's target positions (vocab-parallel under TP)."""

    def objective(model: nn.Module, batch: dict[str, Any]) -> LossOutput:
        ids, pos, target, per_row = _rows(pipe, batch, rows, seq_len)
        t_ids, t_lp = rows_of(batch["doc_indices"])
        k = t_ids.shape[-1]
        top_ids = torch.zeros(rows, seq_len, k, dtype=torch.long, device=ids.device)
        top_lp = torch.zeros(rows, seq_len, k, dtype=t_lp.dtype, device=ids.device)
        start = 0
        for b, n in enumerate(batch["attention_mask"].sum(-1).tolist()):  # each row's real tokens
            top_ids[b, :n], top_lp[b, :n] = t_ids[start:start + n], t_lp[start:start + n]
            start += n
        top_ids, top_lp = cp_local(pipe, top_ids, top_lp)
        mb = rows // pipe.microbatches
        queue = iter(range(pipe.microbatches))  # the schedules run the last stage's microbatches in order
        group = pipe.loss.tp_group

        def kd(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            m = next(queue)
            sel = t != IGNORE_INDEX
            z, ti, tl = logits[sel], top_ids[m * mb:(m + 1) * mb][sel], top_lp[m * mb:(m + 1) * mb][sel]
            if group is not None:
                loss = vocab_parallel_distill_topk(z, ti, tl.to(z.dtype), group, kind, temperature, beta,
                                                   reduction="sum")
            else:
                loss = distill_loss_topk(z, ti, tl.to(z.dtype), kind, temperature, beta, reduction="sum")
            return _plus_ce(loss, ce_weight, logits, t, group)

        return _run_kd(pipe, kd, batch, ids, pos, target, per_row, pp_group, torch.is_grad_enabled())

    return objective


def _plus_ce(loss: torch.Tensor, ce_weight: float, logits: torch.Tensor, t: torch.Tensor,
             group: dist.ProcessGroup | None) -> torch.Tensor:
    """loss + ce_weight x the token cross entropy of a microbatch (summed; vocab-parallel under tp)."""
    if not ce_weight:
        return loss
    if group is not None:
        return loss + ce_weight * vocab_parallel_cross_entropy(logits, t, group, reduction="sum", shift=False)
    return loss + ce_weight * F.cross_entropy(logits.flatten(0, 1).float(), t.flatten(), ignore_index=IGNORE_INDEX,
                                              reduction="sum")


def _run_kd(pipe, kd: Callable, batch: dict[str, Any], ids, pos, target, per_row, pp_group, train: bool
            ) -> LossOutput:
    """The student's schedule with `kd` as the last stage's loss; the loss shared over the stages
    (an MoE student's aux losses weighted by each microbatch's target tokens, as in SFT)."""
    kw = _step_kwargs(pipe, batch, *ids.shape, [float(n) for n in per_row.view(pipe.microbatches, -1).sum(1)])
    with pipe.loss.using(kd):
        losses = pipe.step(ids, pos, target=target, backward=train, **kw)
    loss = losses.sum().float() if losses is not None else torch.zeros((), device=ids.device)
    dist.all_reduce(loss, group=pp_group)  # only the last stage had it
    return LossOutput(loss, per_row.sum(), moe_metrics(pipe, pp_group) if train else {}, backward_done=train)
