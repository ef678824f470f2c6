"""Direct preference optimization and its family (IPO, hinge, robust, SimPO, ORPO, KTO on pairs, ...:
docs/preference_losses.md): offline pairs from the data
(data prep's output, or the user's preference files: prompt/chosen/rejected as messages or plain
strings, or implicit-prompt chosen/rejected, in JSONL, Parquet or `datasets` directories, split by
data.val_fraction where they name no split), or on-policy pairs the policy samples itself for the
data's prompts and a reward ranks (best = chosen, worst = rejected: stages/on_policy.py). The
reference (`reference`) is the base under `disable_adapter()` for LoRA policies, a frozen copy of
the starting model (any policy: full fine-tuning too), or log-probs precomputed once and cached
beside the outputs. Chosen and rejected share one forward. Unpaired rows (prompt, completion,
label: TRL's KTO format) train `loss_type: kto` (`setup_unpaired`, docs/preference_losses.md).

    torchrun --nproc-per-node 2 -m posttrain.stages.dpo --config spec.json
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from posttrain.stages.config import DPOConfig
from posttrain.core.data.encode import PreferencePair, UnpairedExample
from posttrain.core.data.packing import collate_padding_free, collate_preference, collate_unpaired
from posttrain.core.data.prepared import data_task
from posttrain.core.lora import disable_adapter
from posttrain.core.manifest import digest
from posttrain.core.objectives import dpo_objective, kto_objective, pair_logps
from posttrain.core.pipeline_objectives import pipeline_pair_logps, pipelined_dpo
from posttrain.stages.adapters import adapter_routing, routed, trained_adapters
from posttrain.stages.common import Dist, StageError, parse_spec
from posttrain.stages.on_policy import on_policy_pairs
from posttrain.stages.recipe import Plan, Session, load_frozen, run_training
from posttrain.stages.training import DeviceLoader, drop_metrics, pair_loader, pipeline_of, stage_data, to_device

log = logging.getLogger("posttrain.dpo")


@torch.no_grad()
def reference_logps(model, pairs: list[PreferencePair], cfg: DPOConfig, d: Dist, cache: Path) -> torch.Tensor:
    """Reference log-probs of every pair's (chosen, rejected), (P, 2), computed once with the
    starting policy and cached under a digest of the pairs; all ranks compute all pairs so no
    gather is needed (cheap next to training: forward only)."""
    key = digest([[p.prompt_ids, p.chosen_ids, p.rejected_ids] for p in pairs]
                 + ([] if cfg.ld_alpha is None else [["ld_alpha", cfg.ld_alpha]]))[:16]
    path = cache / f"ref_logps-{key}.safetensors"
    if path.exists():
        return load_file(str(path))["logps"]
    was = model.training
    model.eval()
    out = []
    for i in range(0, len(pairs), cfg.data.micro_batch_size):
        pipe = pipeline_of(d)
        batch = to_device(collate_preference(pairs[i : i + cfg.data.micro_batch_size], padding_free=pipe is None),
                          d.device)
        if pipe is not None:  # a forward-only pass of the schedule, the log-probs sent from the last stage
            logps = pipeline_pair_logps(pipe, batch, cfg.pipeline_rows(), cfg.data.max_seq_len,
                                        d.mesh.group("pp"))
        else:
            logps, _ = pair_logps(model, batch, cfg.ld_alpha)
        n = batch["num_pairs"]
        out.append(torch.stack([logps[:n], logps[n:]], dim=1).float().cpu())
    model.train(was)
    result = torch.cat(out)
    if d.is_main:  # whole or absent: a save cut short by a kill must not be loaded as the cache
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file({"logps": result}, str(tmp))
        os.replace(tmp, path)
    d.barrier()
    return result


@torch.no_grad()
def reward_accuracy(model, pairs: list[PreferencePair], objective, cfg: DPOConfig, d: Dist, ref) -> dict[str, float]:
    """Mean DPO metrics (implicit-reward accuracy, margin) over held-out pairs."""
    sums: dict[str, float] = {}
    rank, world = d.data_shard
    mine = list(range(len(pairs)))[rank::world]
    # Every rank runs as many forwards as rank 0 (parallel layouts communicate inside them): a
    # rank out of pairs scores pair 0 again, with weight 0.
    for i in range(0, len(range(0, len(pairs), world)), cfg.data.micro_batch_size):
        units = mine[i : i + cfg.data.micro_batch_size]
        n, units = len(units), units or [0]
        batch = to_device(collate_preference([pairs[u] for u in units], padding_free=pipeline_of(d) is None),
                          d.device)
        if ref is not None:
            batch["ref_logps"] = torch.cat([ref[units, 0], ref[units, 1]]).to(d.device)
        out = objective(model, batch)
        for k, v in out.metrics.items():
            sums[k] = sums.get(k, 0.0) + v * n
        sums["n"] = sums.get("n", 0.0) + n
    keys = sorted(k for k in sums if k != "n")
    totals = d.all_reduce_sum([sums.get(k, 0.0) for k in keys] + [sums.get("n", 0.0)])
    return {f"val/{k.split('/', 1)[1]}": totals[i] / max(totals[-1], 1.0) for i, k in enumerate(keys)}


def mismatched_pairs(pairs: list[PreferencePair]) -> list[PreferencePair]:
    """Each pair's prompt with the previous pair's chosen and rejected responses (the first takes
    the last's): the mismatched (x, y') KTO estimates its reference point from."""
    prev = pairs[-1:] + pairs[:-1]
    return [PreferencePair(p.prompt_ids, q.chosen_ids, q.chosen_labels, q.rejected_ids, q.rejected_labels)
            for p, q in zip(pairs, prev)]


def reference_model(cfg: DPOConfig, d: Dist):
    """reference='model': a frozen copy of the starting policy, loaded again from cfg.model and
    laid out as the policy (sharded for inference under FSDP, split under TP / CP, so both score
    the same slices of each batch)."""
    return load_frozen(cfg.model, cfg.parallel, d, cfg.seed, what="reference")[0]


def live_reference(policy, ref_model=None, ld_alpha: float | None = None):
    """Reference log-probs computed with every batch: by `ref_model`, or by the policy with its
    adapters disabled (the LoRA base); LD-DPO's with `ld_alpha`."""

    @torch.no_grad()
    def reference(batch):
        if ref_model is not None:
            return pair_logps(ref_model, batch, ld_alpha)[0]
        with disable_adapter(policy):
            return pair_logps(policy, batch, ld_alpha)[0]

    return reference


# ------------------------------------------------------------------------------- unpaired (KTO)


def _shifted(examples: list[UnpairedExample]) -> list:
    """Each example's prompt with the previous example's completion (the first takes the last's)."""
    prev = examples[-1:] + examples[:-1]
    return [e.with_completion_of(q) for e, q in zip(examples, prev)]


@torch.no_grad()
def unpaired_reference_logps(model, examples: list[UnpairedExample], cfg: DPOConfig, d: Dist,
                             cache: Path) -> torch.Tensor:
    """Reference log-probs (N, 2) of every unpaired example's completion and of its fixed
    mismatched pair (its prompt with the previous example's completion, `_shifted`: TRL's rotation
    over the whole list), computed once and cached under a digest of the examples, as
    `reference_logps` does for pairs."""
    key = digest([["unpaired", e.prompt_ids, e.completion_ids, e.completion_labels] for e in examples])[:16]
    path = cache / f"ref_logps-{key}.safetensors"
    if path.exists():
        return load_file(str(path))["logps"]
    was = model.training
    model.eval()
    shifted = _shifted(examples)
    out = []
    for i in range(0, len(examples), cfg.data.micro_batch_size):
        cols = []
        for docs in ([e.document for e in examples[i : i + cfg.data.micro_batch_size]],
                     shifted[i : i + cfg.data.micro_batch_size]):
            batch = collate_padding_free(docs)
            batch["num_sequences"] = len(docs)
            cols.append(pair_logps(model, to_device(batch, d.device))[0].float().cpu())
        out.append(torch.stack(cols, dim=1))
    model.train(was)
    result = torch.cat(out)
    if d.is_main:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file({"logps": result}, str(tmp))
        os.replace(tmp, path)
    d.barrier()
    return result


@torch.no_grad()
def kto_validation(model, examples: list[UnpairedExample], objective, cfg: DPOConfig, d: Dist, ref,
                   shifted: list | None = None) -> dict[str, float]:
    """Held-out KTO metrics: the mean reward of the desirable and the undesirable examples
    (val/chosen, val/rejected, val/margin), the per-example loss (val/kto_loss) and the mean z0
    (val/kto_kl), summed over ranks. Every rank runs as many forwards (a rank out of examples
    scores example 0 again, with weight 0)."""
    rank, world = d.data_shard
    mine = list(range(len(examples)))[rank::world]
    sums = {"chosen": 0.0, "n_chosen": 0.0, "rejected": 0.0, "n_rejected": 0.0, "loss": 0.0, "n": 0.0,
            "kto_kl": 0.0, "batches": 0.0}
    was = model.training
    model.eval()
    for i in range(0, len(range(0, len(examples), world)), cfg.data.micro_batch_size):
        units = mine[i : i + cfg.data.micro_batch_size]
        n, units = len(units), units or [0]
        batch = collate_unpaired([examples[u] for u in units])
        attach_unpaired_ref(batch, units, examples, ref, shifted)
        out = objective(model, to_device(batch, d.device))
        if not n:
            continue
        good = int(batch["desirable"].sum())
        sums["chosen"] += out.metrics.get("rewards/chosen", 0.0) * good
        sums["n_chosen"] += good
        sums["rejected"] += out.metrics.get("rewards/rejected", 0.0) * (n - good)
        sums["n_rejected"] += n - good
        sums["loss"] += float(out.loss_sum)
        sums["n"] += n
        sums["kto_kl"] += out.metrics["rewards/kto_kl"]
        sums["batches"] += 1
    model.train(was)
    keys = sorted(sums)
    t = dict(zip(keys, d.all_reduce_sum([sums[k] for k in keys])))
    res = {"val/kto_loss": t["loss"] / max(t["n"], 1.0), "val/kto_kl": t["kto_kl"] / max(t["batches"], 1.0)}
    if t["n_chosen"]:
        res["val/chosen"] = t["chosen"] / t["n_chosen"]
    if t["n_rejected"]:
        res["val/rejected"] = t["rejected"] / t["n_rejected"]
    if t["n_chosen"] and t["n_rejected"]:
        res["val/margin"] = res["val/chosen"] - res["val/rejected"]
    return res


def attach_unpaired_ref(batch: dict, units: list[int], examples: list[UnpairedExample], ref, shifted) -> None:
    """Precomputed reference log-probs onto an unpaired batch: its examples' (`ref_logps`) and
    those of their fixed mismatched pairs (`ref_kl_logps`), whose sequences then replace the
    batch's rotation (`kto_kl_batch`), so the policy scores the same mismatched pairs."""
    if ref is None:
        return
    batch["ref_logps"] = ref[units, 0]
    batch["ref_kl_logps"] = ref[units, 1]
    kl = collate_padding_free([shifted[u] for u in units])
    kl["num_sequences"] = len(units)
    batch["kto_kl_batch"] = kl


def check_unpaired(cfg: DPOConfig, sources: str) -> None:
    """What unpaired rows cannot train with: StageError naming the key."""
    if cfg.loss_types != ("kto",):
        raise StageError(f"dpo: {sources} hold unpaired preference rows (prompt, completion, label), which train "
                         f"with loss_type: kto only; got loss_type={cfg.loss_type!r}")
    for key, bad in (("ld_alpha", cfg.ld_alpha is not None), ("use_weighting", cfg.use_weighting),
                     ("sft_weight", bool(cfg.sft_weight))):
        if bad:
            raise StageError(f"dpo: {key} needs paired data; {sources} hold unpaired rows (KTO)")
    if trained_adapters(cfg):
        raise StageError("dpo: unpaired KTO is not wired for several adapters at once (lora.adapters)")
    if cfg.parallel.pp > 1:
        raise StageError("dpo: unpaired KTO is not wired under parallel.pp > 1")
    if cfg.data.batch_tokens is None and cfg.data.micro_batch_size < 2:
        raise StageError("dpo: unpaired KTO needs data.micro_batch_size >= 2: z0 comes from mismatched pairs "
                         "within the micro-batch (with one example it is the example's own reward)")


def check_balance(examples: list[UnpairedExample], cfg: DPOConfig, sources: str) -> dict[str, float]:
    """Counts of desirable / undesirable training examples; a warning when one kind is missing, or
    when the weights do not balance the kinds as the KTO paper advises (TRL's warning: lambda_D n_D
    / (lambda_U n_U) in [1, 4/3])."""
    n_good = sum(1 for e in examples if e.label)
    n_bad = len(examples) - n_good
    if not n_good or not n_bad:
        log.warning("dpo: the training split of %s has no %s examples (label %s): KTO then only %s the "
                    "completions it has, relative to z0", sources, "desirable" if not n_good else "undesirable",
                    "true" if not n_good else "false", "pushes down" if not n_good else "pulls up")
    elif n_good != n_bad:
        ratio = cfg.kto_desirable_weight * n_good / (cfg.kto_undesirable_weight * n_bad)
        if not 1 <= ratio <= 4 / 3:
            lo, hi = n_bad * cfg.kto_undesirable_weight / n_good, n_bad * cfg.kto_undesirable_weight / n_good * 4 / 3
            log.warning("dpo: %d desirable and %d undesirable training examples with desirable_weight=%g and "
                        "undesirable_weight=%g: desirable_weight * n_desirable / (undesirable_weight * "
                        "n_undesirable) = %.2f, outside [1, 4/3] (the KTO paper's advice, TRL's warning); e.g. "
                        "desirable_weight in [%.2f, %.2f]", n_good, n_bad, cfg.kto_desirable_weight,
                        cfg.kto_undesirable_weight, ratio, lo, hi)
    return {"train_desirable": n_good, "train_undesirable": n_bad}


def kl_reduction(d: Dist):
    """(group, reduce) for z0's mean over the data-parallel ranks."""
    if d.mesh is not None:
        return (d.mesh.group("dp"), True) if d.mesh.size("dp") > 1 else (None, False)
    return None, d.world > 1


def setup_unpaired(s: Session) -> Plan:
    """The DPO stage on unpaired data: KTO as TRL's KTOTrainer trains it."""
    cfg, d, model, tok = s.cfg, s.dist, s.model, s.tok
    sources = ", ".join(map(str, cfg.data.sources))
    check_unpaired(cfg, sources)
    train_data, val_data, stats = stage_data(cfg.data.sources, "unpaired", tok, cfg.data, adapter_routing(cfg.lora))
    examples, val_examples, extra = [e for e, _ in train_data], [e for e, _ in val_data], drop_metrics(stats)
    if not examples:
        raise StageError(f"dpo: no training examples in {sources}")
    extra.update(check_balance(examples, cfg, sources))

    ref_train = ref_val = reference = None
    shifted, val_shifted = _shifted(examples), _shifted(val_examples)
    if cfg.reference == "precomputed":
        ref_train = unpaired_reference_logps(model, examples, cfg, d, s.out / "reference")
        ref_val = unpaired_reference_logps(model, val_examples, cfg, d, s.out / "reference") if val_examples else None
    else:
        ref_model = reference_model(cfg, d) if cfg.reference == "model" else None
        reference = live_reference(model, ref_model)
    group, reduce = kl_reduction(d)
    objective = kto_objective(cfg.beta, reference, cfg.kto_desirable_weight, cfg.kto_undesirable_weight,
                              group, reduce)
    train = DeviceLoader(pair_loader(examples, cfg, d, epochs=cfg.epochs,
                                     extra=lambda units, batch: attach_unpaired_ref(batch, units, examples,
                                                                                    ref_train, shifted)), d.device)

    def validate() -> dict[str, float]:
        if not val_examples:
            return {}
        return kto_validation(model, val_examples, objective, cfg, d, ref_val, val_shifted)

    return Plan(train, objective, validate, summary=lambda: {"train_examples": len(examples), **extra})


class DPO:
    name = "dpo"

    def setup(self, s: Session) -> Plan:
        cfg, d, model, tok = s.cfg, s.dist, s.model, s.tok
        # unpaired rows (prompt, completion, label: TRL's KTO format) train KTO as TRL's KTOTrainer
        if cfg.pairs == "offline" and cfg.data.sources and data_task(cfg.data.sources, cfg.data.format) == "unpaired":
            return setup_unpaired(s)
        if cfg.pairs == "on_policy":
            pairs, val_pairs, extra = on_policy_pairs(s)
            s.run.log_metrics(extra, step=0)
            if not pairs:
                raise StageError(f"dpo: on-policy sampling gave no pairs: for all {extra['on_policy/prompts']} "
                                 "prompts every sample scored the same (see on_policy/train.jsonl)")
        else:
            train_data, val_data, stats = stage_data(cfg.data.sources, "preference", tok, cfg.data,
                                                     adapter_routing(cfg.lora))
            pairs, val_pairs, extra = [p for p, _ in train_data], [p for p, _ in val_data], drop_metrics(stats)
            if not pairs:
                raise StageError(f"dpo: no training pairs in {', '.join(map(str, cfg.data.sources))}")

        ref_train = ref_val = reference = ref_model = None
        if not cfg.reference_free and cfg.reference == "precomputed":
            ref_train = reference_logps(model, pairs, cfg, d, s.out / "reference")
            ref_val = reference_logps(model, val_pairs, cfg, d, s.out / "reference") if val_pairs else None
        elif not cfg.reference_free:  # simpo, orpo, sft need no reference
            ref_model = reference_model(cfg, d) if cfg.reference == "model" else None
            reference = live_reference(model, ref_model, cfg.ld_alpha)

        mismatched = cfg.kto_kl_estimate == "mismatched"
        if mismatched and trained_adapters(cfg):
            raise StageError("dpo: kto_kl_estimate='mismatched' is not wired for several adapters at once")

        def attach_ref(units: list[int], batch: dict) -> None:
            if ref_train is not None:
                batch["ref_logps"] = torch.cat([ref_train[units, 0], ref_train[units, 1]])
            if mismatched:  # KTO's reference point: each prompt with the previous pair's responses (as TRL)
                batch["kto_kl_batch"] = collate_preference(mismatched_pairs([pairs[u] for u in units]))

        objective = dpo_objective(cfg.beta, reference=reference, ld_alpha=cfg.ld_alpha,
                                  use_weighting=cfg.use_weighting, **cfg.loss_kwargs())
        pipe = pipeline_of(d)
        if pipe is not None:  # the schedule runs each micro-batch's pairs as microbatches
            ref_mode = "none" if cfg.reference_free else "batch" if ref_train is not None else \
                "model" if ref_model is not None else "disable_adapter"
            loss_kwargs = cfg.loss_kwargs()
            objective = pipelined_dpo(pipe, cfg.pipeline_rows(), cfg.data.max_seq_len, d.mesh.group("pp"),
                                      cfg.beta, loss_kwargs.pop("loss_type"), loss_kwargs.pop("label_smoothing"),
                                      loss_kwargs.pop("simpo_gamma"), loss_kwargs.pop("sft_weight"),
                                      reference=ref_mode, loss_kwargs=loss_kwargs,
                                      reference_pipe=ref_model.pipeline if ref_model is not None else None)
        if trained_adapters(cfg):  # each pair through its adapter; the reference stays the base
            objective = routed(objective, trained_adapters(cfg))
        train = DeviceLoader(pair_loader(pairs, cfg, d, epochs=cfg.epochs, extra=attach_ref), d.device)

        names = trained_adapters(cfg)

        def validate() -> dict[str, float]:
            if not val_pairs:
                return {}
            out = reward_accuracy(model, val_pairs, objective, cfg, d, ref_val)
            for i, name in enumerate(names):  # several adapters: each on its own held-out pairs too
                idx = [j for j, p in enumerate(val_pairs) if p.adapter == i]
                if idx:
                    sub = reward_accuracy(model, [val_pairs[j] for j in idx], objective, cfg, d,
                                          ref_val[idx] if ref_val is not None else None)
                    out.update({f"{k}/{name}": v for k, v in sub.items()})
            return out

        return Plan(train, objective, validate, summary=lambda: {"train_pairs": len(pairs), **extra})


def run(cfg: DPOConfig) -> dict:
    return run_training(DPO(), cfg)


def main(argv: list[str] | None = None) -> None:
    run(parse_spec(DPOConfig, argv))


if __name__ == "__main__":
    main()
