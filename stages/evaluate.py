"""Evaluation: the models of `models`, side by side, on the user's data or data prep's held-out split.

    torchrun --nproc-per-node 2 -m posttrain.stages.evaluate --config spec.json

Before any model loads, the rows are read (stages/evaluation/plan.py), the metrics chosen and
checked against the data, every model path and verifier resolved and every row tokenized with each
model's tokenizer: a bad row, a metric the data cannot give or a missing model is a StageError
naming the file, row and field, never a failure halfway through. Then, one model at a time (and
the judge last), each rank generates for its batches of prompts (batched KV-cache sampling,
`num_samples` per prompt), scores them (exact / normalized match against `reference_column`, the
verifier), and computes completion NLL and preference-pair log-probs with the model's forward;
the per-row records are gathered, so every metric is computed from all rows the same way on any
number of ranks (stages/evaluation/metrics.py has the definitions, stages/evaluation/outputs.py
the output and MLflow layout, stages/evaluation/__init__.py the metric keys).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from posttrain.core.data.rows import prompt_text
from posttrain.core.model.config import ModelConfig
from posttrain.core.parallel.config import ParallelConfig
from posttrain.stages.common import (Dist, close_distributed, find_tokenizer_dir, load_model, load_tokenizer,
                           materialize_model, parse_spec, progress, stage_run, start_distributed)
from posttrain.stages.config import EvalConfig
from posttrain.stages.training import sampling_unit
from posttrain.stages.evaluation import metrics as M
from posttrain.stages.evaluation.outputs import write_outputs
from posttrain.stages.evaluation.plan import EvalData, Plan, fail, group_of, load_eval_data, model_names, plan_metrics
from posttrain.stages.evaluation.scoring import (Scorer, check_model, check_vocab, completion_nll, encode,
                                       gather, generate_records, judge_scores, pair_logps, raise_errors)

log = logging.getLogger("posttrain.evaluate")


class Model:
    """One evaluated model: its path as given, name, tokenizer and tokenized data."""

    def __init__(self, path: str, name: str, cfg: EvalConfig, data: EvalData, plan: Plan, tokenizers: dict):
        self.path, self.name = path, name
        tok_dir = find_tokenizer_dir(cfg.tokenizer, path, *cfg.data.sources)
        if tok_dir not in tokenizers:
            tok = load_tokenizer(tok_dir)
            tokenizers[tok_dir] = (tok, encode(tok, cfg, data, plan))
        self.tok, self.enc = tokenizers[tok_dir]

    def load(self, cfg: EvalConfig, d: Dist):
        model = load_split(ModelConfig(name_or_path=self.path, dtype=cfg.dtype), cfg, d)
        check_vocab(model, self.enc, self.tok, self.path)
        return model.eval()


def sharded(cfg: EvalConfig) -> bool:
    """Whether the models are sharded over the ranks (parallel.dp_shard > 1 set explicitly, cp or
    ep > 1), so every forward is collective and the ranks score their batches in lockstep; by
    default (dp_shard -1) each data-parallel rank holds a replica, which is faster when it fits."""
    p = cfg.parallel
    return p.dp_shard > 1 or p.cp > 1 or p.ep > 1


def load_split(model_cfg: ModelConfig, cfg: EvalConfig, d: Dist):
    """An evaluated model (or the judge) on this rank: whole, or under parallel.tp > 1 split over
    its tp group (built on meta, each rank reading its shards), the data-parallel ranks holding
    replicas and scoring their own batches; or sharded (`sharded`): FSDP for inference (blocks
    gathered per forward and freed after), experts spread over ep, ring attention off (cp ranks
    score whole rows), each rank still scoring its own batches, all in lockstep (d.lockstep). The
    mesh is made with the first model."""
    if cfg.parallel.pp > 1:
        return load_staged(model_cfg, cfg, d)
    if cfg.parallel.tp == 1 and not sharded(cfg):
        return load_model(model_cfg, d.device, cfg.seed)[0]
    import torch.distributed as dist

    from posttrain.core.parallel import ParallelDims, ParallelMesh, parallelize

    model, _ = load_model(model_cfg, d.device, cfg.seed, meta=True)
    try:
        whole_rows = rows_whole(cfg.parallel, d.world)
        # ep spreads an MoE's experts; a dense model evaluated beside it is just sharded
        layout = whole_rows if model.args.moe is not None else whole_rows.model_copy(update={"ep": 1})
        dims = ParallelDims.from_config(layout, d.world, model.args)
        if d.mesh is None:  # one mesh for every model: the layout as given
            d.mesh = ParallelMesh(ParallelDims.from_config(whole_rows, d.world), d.device.type)
    except ValueError as e:
        raise fail(f"parallel: {e} (model {model_cfg.name_or_path!r})") from None
    fsdp = sharded(cfg) and dims.fsdp
    parallelize(model.requires_grad_(False), whole_rows, d.mesh, data_parallel=fsdp)
    if fsdp:  # inference: each block gathered for its forward only; the root (embedding, head) kept
        model.set_reshard_after_forward(True)
        model.set_reshard_after_forward(False, recurse=False)
    if sharded(cfg) and d.world > 1:
        d.lockstep = dist.group.WORLD
        log.info("evaluate: %s sharded over %s (fsdp=%s), the ranks in lockstep", model_cfg.name_or_path, d.mesh, fsdp)
    materialize_model(model, model_cfg, d.device, cfg.seed)
    return model


def rows_whole(p: ParallelConfig, world: int) -> ParallelConfig:
    """The layout evaluation runs `p` as: cp ranks score whole rows (no ring attention: sampling
    and padded scoring batches cannot be cut over a ring), so cp joins dp_shard, over which FSDP
    shards the weights and ep borrows ranks just as over dp_shard x cp."""
    if p.cp == 1:
        return p
    from posttrain.core.parallel import ParallelDims

    dims = ParallelDims.from_config(p, world)
    return p.model_copy(update={"dp_shard": dims.dp_shard * dims.cp, "cp": 1})


def load_staged(model_cfg: ModelConfig, cfg: EvalConfig, d: Dist):
    """Under parallel.pp: the model split into pipeline stages (x tp), each rank building and
    reading only its stages' blocks (posttrain.core.parallel.pipeline.keep_own_stages). Its forward walks
    the stages in turn and generation decodes stage by stage (posttrain.core.parallel.pipeline_decode); the
    ranks of a pipeline (and their tp groups) score the same batches, the data-parallel replicas
    their own. No sequence split under tp (whole rows, as for decoding). Sharded (`sharded`:
    dp_shard > 1 or cp, which joins dp_shard as rows are whole), each stage is FSDP for
    inference as in load_split: its blocks gathered for their forward only, its embedding, norm
    and head kept whole (the stage walk calls them directly), the ranks in lockstep."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from posttrain.core.parallel import ParallelDims, ParallelMesh, parallelize_pipeline
    from posttrain.core.parallel.pipeline import keep_own_stages

    model, _ = load_model(model_cfg, d.device, cfg.seed, meta=True)
    layout = rows_whole(cfg.parallel, d.world).model_copy(update={"ep": 1, "sequence_parallel": False})
    try:
        ParallelDims.from_config(layout, d.world, model.args)
        if d.mesh is None:  # one mesh for every model
            d.mesh = ParallelMesh(ParallelDims.from_config(layout, d.world), d.device.type)
    except ValueError as e:
        raise fail(f"parallel: {e} (model {model_cfg.name_or_path!r})") from None
    fsdp = sharded(cfg) and d.mesh.dims.fsdp
    pipe = parallelize_pipeline(model.requires_grad_(False), layout, d.mesh, lambda logits, target: logits.sum(),
                                d.device, 1, 1, data_parallel=fsdp)
    keep_own_stages(model, pipe)
    materialize_model(model, model_cfg, d.device, cfg.seed)
    if fsdp:
        pipe.claim_fsdp_roots()
    for stage in pipe.modules if fsdp else ():
        if isinstance(stage, FSDPModule):
            stage.set_reshard_after_forward(True)
            stage.set_reshard_after_forward(False, recurse=False)
            stage.unshard()  # the root's own parameters only (not recursive)
    if sharded(cfg) and d.world > 1:
        d.lockstep = dist.group.WORLD
    log.info("evaluate: %s split into pipeline stages over %s%s", model_cfg.name_or_path, d.mesh,
             ", sharded (fsdp), the ranks in lockstep" if d.lockstep is not None else "")
    return model


def load_judge(cfg: EvalConfig, tok, d: Dist):
    judge = load_split(ModelConfig(name_or_path=cfg.judge, dtype=cfg.dtype), cfg, d)
    if tok.vocab_size > judge.args.vocab_size:
        raise fail(f"judge {cfg.judge!r} has {judge.args.vocab_size} token embeddings but its tokenizer "
                   f"({tok.origin}) has {tok.vocab_size} tokens; set `tokenizer` to the judge's own")
    return judge.eval()


def evaluate_model(m: Model, cfg: EvalConfig, data: EvalData, plan: Plan, scorer: Scorer, d: Dist,
                   advance) -> dict[str, dict[int, Any]]:
    """Records of one model over all rows (gathered): gen {row: GenRecord}, nll, pairs."""
    model = m.load(cfg, d)
    out: dict[str, dict[int, Any]] = {"gen": {}, "nll": {}, "pairs": {}}
    if plan.generates:
        local, errors = generate_records(model, m.tok, m.enc, data, cfg, d, scorer, advance)
        raise_errors(d, errors)
        out["gen"] = gather(d, local)
    if plan.has("perplexity"):
        out["nll"] = gather(d, completion_nll(model, m.tok, m.enc, cfg, d, advance))
    if plan.has("preference_accuracy"):
        out["pairs"] = gather(d, pair_logps(model, m.tok, m.enc, cfg, d, advance))
    del model
    return out


def model_metrics(rec: dict[str, dict[int, Any]], data: EvalData, plan: Plan, cfg: EvalConfig) -> dict[str, float]:
    g = plan.group_by
    out: dict[str, float] = {}
    if plan.generates:
        idx = sorted(rec["gen"])
        out.update(M.with_groups(lambda rs: M.generation_metrics(rs, plan.metrics, cfg.pass_k),
                                 [rec["gen"][i] for i in idx], [group_of(data.prompts[i], g) for i in idx], g))
    if plan.has("perplexity"):
        idx = sorted(rec["nll"])
        out.update(M.with_groups(M.nll_metrics, [rec["nll"][i] for i in idx],
                                 [group_of(data.completions[i], g) for i in idx], g))
    if plan.has("preference_accuracy"):
        idx = sorted(rec["pairs"])
        out.update(M.with_groups(M.preference_metrics, [rec["pairs"][i] for i in idx],
                                 [group_of(data.pairs[i], g) for i in idx], g))
    return out


def samples_of(records: dict[str, dict[str, dict[int, Any]]], data: EvalData, cfg: EvalConfig) -> list[dict]:
    samples = []
    for name, rec in records.items():
        for i in sorted(rec["gen"]):
            r, row = rec["gen"][i], data.prompts[i]
            for k, text in enumerate(r.completions):
                s = {"model": name, "index": i, "sample": k, "prompt": prompt_text(row.prompt),
                     "reference": row.fields.get(cfg.reference_column), "completion": text,
                     "score": r.primary[k] if r.primary is not None else None,
                     "group": group_of(row, cfg.group_by)}
                s.update({m: v[k] for m, v in r.scores.items()})
                if r.judge is not None:
                    s["judge"] = r.judge[k]
                samples.append(s)
    return samples


def run(cfg: EvalConfig) -> dict:
    from posttrain.kernels.dispatch import set_mode

    set_mode(cfg.kernels)
    d = start_distributed(cfg.parallel)
    try:
        return _run(cfg, d)
    finally:
        close_distributed()


def _run(cfg: EvalConfig, d: Dist) -> dict:
    out = Path(cfg.output_dir or "evaluate")
    out.mkdir(parents=True, exist_ok=True)
    # Everything that can be wrong with the inputs, before a model loads.
    data = load_eval_data(cfg)
    plan = plan_metrics(cfg, data)
    for path in [*cfg.models, *([cfg.judge] if cfg.judge else [])]:
        check_model(path)
    tokenizers: dict = {}
    models = [Model(p, n, cfg, data, plan, tokenizers) for p, n in zip(cfg.models, model_names(cfg.models))]
    judge_tok = load_tokenizer(cfg.tokenizer, cfg.judge, *cfg.data.sources) if cfg.judge else None
    scorer = Scorer(cfg, plan)
    log.info("evaluate: %d model(s) on %d prompt(s), %d completion(s), %d pair(s) of %s: %s", len(models),
             len(data.prompts), len(data.completions), len(data.pairs), data.sources, ", ".join(plan.metrics))

    units = sum([len(data.prompts) * cfg.num_samples * plan.generates, len(data.completions) * plan.has("perplexity"),
                 len(data.pairs) * plan.has("preference_accuracy")]) * len(models)
    with stage_run(cfg, "evaluate", d.is_main) as tracker, \
            progress(-(-units // sampling_unit(d)[1]), "evaluate", d.is_main) as advance:  # rank 0's share
        records = {m.name: evaluate_model(m, cfg, data, plan, scorer, d, advance) for m in models}
        if judge_tok is not None and plan.has("win_rate"):
            judge = load_judge(cfg, judge_tok, d)
            local, errors = judge_scores(judge, judge_tok, data, {n: r["gen"] for n, r in records.items()}, cfg, d)
            del judge
            raise_errors(d, errors)
            for i, by_model in gather(d, local).items():
                for name, scores in by_model.items():
                    records[name]["gen"][i].judge = scores
        results = {name: model_metrics(rec, data, plan, cfg) for name, rec in records.items()}
        names = [m.name for m in models]
        if plan.has("win_rate"):
            idx = sorted(records[names[0]]["gen"])
            M.with_win_rates(results, {n: [records[n]["gen"][i] for i in idx] for n in names},
                             [group_of(data.prompts[i], plan.group_by) for i in idx], plan.group_by,
                             by_judge=cfg.judge is not None)
        selected = None
        if cfg.select is not None:
            try:
                selected = M.select_model(results, names, list(cfg.models), cfg.select.metric, cfg.select.mode)
            except ValueError as e:
                raise fail(str(e)) from None
            log.info("evaluate: selected %s (%s=%.4g)", selected["name"], selected["metric"], selected["value"])
        manifest: dict = {}
        if d.is_main:
            counts = {"prompts": len(data.prompts), "samples_per_prompt": cfg.num_samples,
                      "completions": len(data.completions), "pairs": len(data.pairs),
                      "bad_rows_skipped": data.dropped.total_dropped}
            manifest = write_outputs(cfg, out, tracker, names, results, M.flat_metrics(results, names),
                                     samples_of(records, data, cfg), counts, plan.metrics, selected)
        d.barrier()
    return manifest


def main(argv: list[str] | None = None) -> None:
    run(parse_spec(EvalConfig, argv))


if __name__ == "__main__":
    main()
