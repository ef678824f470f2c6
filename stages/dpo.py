"""Direct preference optimization and its family (IPO, hinge, robust, SimPO, ORPO, KTO on pairs, ...:
docs/preference_losses.md): offline pairs from the data
(data prep's output, or the user's preference files: prompt/chosen/rejected as messages or plain
strings, or implicit-prompt chosen/rejected, in JSONL, Parquet or `datasets` directories, split by
data.val_fraction where they name no split), or on-policy pairs the policy samples itself for the
data's prompts and a reward ranks (best = chosen, worst = rejected: stages/on_policy.py). The
reference (`reference`) is the base under `disable_adapter()` for LoRA policies, a frozen copy of
the starting model (any policy: full fine-tuning too), or log-probs precomputed once and cached
beside the outputs. Chosen and rejected share one forward.

    torchrun --nproc-per-node 2 -m stages.dpo --config spec.json
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from stages.config import DPOConfig
from core.data.encode import PreferencePair
from core.data.packing import collate_preference
from core.lora import disable_adapter
from core.manifest import digest
from core.objectives import dpo_objective, pair_logps
from core.pipeline_objectives import pipeline_pair_logps, pipelined_dpo
from stages.adapters import adapter_routing, routed, trained_adapters
from stages.common import Dist, StageError, parse_spec
from stages.on_policy import on_policy_pairs
from stages.recipe import Plan, Session, load_frozen, run_training
from stages.training import DeviceLoader, drop_metrics, pair_loader, pipeline_of, stage_data, to_device

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


class DPO:
    name = "dpo"

    def setup(self, s: Session) -> Plan:
        cfg, d, model, tok = s.cfg, s.dist, s.model, s.tok
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
