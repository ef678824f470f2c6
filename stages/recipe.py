"""The training-stage skeleton: setup -> train -> finish, the same for SFT, distillation and DPO.

A training stage is an object with a `name` and one method, `setup(session) -> Plan`: from the
policy the skeleton built (model with LoRA, parallelized; tokenizer; upstream manifest) it makes
its data loader, objective and validation. `run_training` does everything else, once, for
every stage (torchtune's recipe shape; stages share no base class):

    session = open_session(name, cfg)   # process group, policy (+ LoRA, parallel layout), tokenizer
    plan = stage.setup(session)          # the algorithm: loader, objective, validate, inputs
    train(session, plan)                 # Trainer + CheckpointManager + posttrain.core.loop.fit + throughput meter
    finish(session, plan, ...)           # export HF model / PEFT adapter, manifest, final metrics

Metrics every stage logs: the trainer's (loss, grad_norm, lr, tokens), the throughput meter's
(tokens_per_s, mfu where the device's peak is known, time/<phase>_frac for data,
forward_backward, optim_step, evaluate, checkpoint and any phase the stage times, such as the
teacher), validation as `val/*` with `val/*_initial` before training, and the plan's summary.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from posttrain.core.checkpoint import CheckpointManager
from posttrain.core.manifest import CHECKPOINTS
from posttrain.stages.config import TrainStageConfig
from posttrain.core.lora import apply_lora
from posttrain.core.loop import fit
from posttrain.core.model import Transformer
from posttrain.core.model.config import ModelConfig
from posttrain.core.monitor import ThroughputMeter, flops_per_token
from posttrain.core.parallel import ParallelDims, ParallelMesh, parallelize
from posttrain.core.parallel.config import ParallelConfig
from posttrain.core.parallel.mesh import TorchrunEnv
from posttrain.core.parallel.data_parallel import apply_activation_checkpointing, apply_compile
from posttrain.core.qat import prepare_qat
from posttrain.core.precision import (LossScaler, autocast_dtype, check_fp8_device, convert_fp8, fsdp_dtypes,
                            upcast_trainable)
from posttrain.core.reliability import Reliability
from posttrain.core.trainer import Objective, Trainer
from posttrain.stages.common import (Dist, StageError, close_distributed, load_model, load_on_meta, load_quantized,
                           load_tokenizer, streams_quantized,
                           materialize_model, progress, stage_run, start_distributed)
from posttrain.stages.adapters import log_adapters, trained_adapters
from posttrain.stages.training import clear_checkpoints, export

log = logging.getLogger("posttrain.recipe")


@dataclass
class Session:
    """What a training stage's setup gets: its config, the process layout, the policy."""

    name: str
    cfg: TrainStageConfig
    dist: Dist
    out: Path
    model: Transformer
    tok: Any  # posttrain.registry.tokenizer.Tokenizer
    upstream: dict | None  # the manifest of the stage the policy came from
    run: Any = None  # the stage's MLflow run (posttrain.core.tracking.Tracker or NullTracker)
    meter: ThroughputMeter | None = None  # started when training starts: earlier phases do not count

    def phase(self, name: str):
        """Time a part of the step (e.g. the teacher's forwards) into the throughput meter."""
        return self.meter.phase(name)


@dataclass
class Plan:
    """A training stage's algorithm: what the skeleton trains on, with, and validates."""

    loader: Any  # a StatefulLoader (state_dict / load_state_dict) yielding batches on the device
    objective: Objective
    validate: Callable[[], dict[str, float]] = dict  # "val/*" metrics on held-out data
    inputs: dict[str, str] = field(default_factory=dict)  # manifest inputs (digests) beyond the model
    summary: Callable[[], dict[str, float]] = dict  # stage-specific final metrics
    close: Callable[[], None] = lambda: None  # release what setup started (generator workers), on success or not


class TrainingStage(Protocol):
    name: str

    def setup(self, session: Session) -> Plan: ...


def run_training(stage: TrainingStage, cfg: TrainStageConfig) -> dict:
    """setup -> train -> finish; returns the manifest (rank 0) or {}."""
    try:  # the run opens first, so a stage that fails loading its model is a FAILED run too
        with stage_run(cfg, stage.name, TorchrunEnv.read().rank == 0) as run_:
            session = open_session(stage.name, cfg)
            session.run = run_
            plan = stage.setup(session)
            try:
                last, before, seconds = train(session, plan)
                manifest = finish(session, plan, last, before, seconds)
            finally:
                plan.close()
    finally:
        close_distributed()
    return manifest or {}


# ------------------------------------------------------------------------------------------- setup

def open_session(name: str, cfg: TrainStageConfig) -> Session:
    """Join the process group, build the policy on the meta device (LoRA applied when enabled),
    check the tokenizer, apply cfg.parallel (checked against the world before the group is made,
    against the model once it is built), then give each rank its shards of the weights
    (posttrain.stages.common.materialize_model). DoRA and PiSSA load the whole model first instead, and QLoRA
    from a checkpoint quantizes each weight as it reads it (posttrain.stages.common.load_quantized)."""
    from posttrain.kernels.dispatch import set_mode

    set_mode(cfg.model.kernels)
    d = start_layout(cfg)
    try:
        check_fp8_device(cfg.precision, d.device)
    except RuntimeError as e:
        raise StageError(str(e)) from None
    torch.manual_seed(cfg.seed)
    meta = load_on_meta(cfg.lora)  # built on meta, each rank then loads only its shards
    streamed = streams_quantized(cfg.model, cfg.lora)  # QLoRA: each weight quantized as it is read
    if streamed:
        model, upstream = load_quantized(cfg.model, cfg.lora, d.device)
    else:
        model, upstream = load_model(cfg.model, d.device, cfg.seed, meta=meta)
    tok = policy_tokenizer(cfg)
    if tok.vocab_size > model.args.vocab_size:
        raise StageError(f"tokenizer has {tok.vocab_size} tokens but the model's vocab is {model.args.vocab_size}")
    if cfg.lora.enabled and not streamed:
        apply_lora(model, cfg.lora)
    apply_precision(model, cfg)
    if cfg.qat.enabled:
        try:
            n = prepare_qat(model, cfg.qat)
        except (ImportError, ValueError) as e:
            raise StageError(str(e)) from None
        log.info("qat: %d linear layers train against %s weights%s", n, cfg.qat.weights,
                 f" and {cfg.qat.activations} inputs" if cfg.qat.activations != "none" else "")
    d.mesh = parallelize_policy(model, cfg, d)
    if meta:
        materialize_model(model, cfg.model, d.device, cfg.seed)
    s = Session(name, cfg, d, Path(cfg.output_dir or name), model, tok, upstream)
    s.meter = make_meter(s)
    return s


def generator_model(cfg_json: str, kind: str) -> Transformer:
    """The policy whole on one process's CPU, built as open_session builds it (LoRA applied,
    QLoRA's base quantized) but without a layout: what a disaggregated generator worker runs
    (posttrain.core.generation.remote.WorkerSpec.build; `kind` names the stage's config class in
    posttrain.stages.config, which cfg_json is a dump of). Its weights are then the trainer's by sync."""
    import posttrain.stages.config as configs

    cfg = getattr(configs, kind).model_validate_json(cfg_json)
    cpu = torch.device("cpu")
    if streams_quantized(cfg.model, cfg.lora):
        return load_quantized(cfg.model, cfg.lora, cpu)[0]
    model = load_model(cfg.model, cpu, cfg.seed)[0]
    if cfg.lora.enabled:
        apply_lora(model, cfg.lora)
    return model


def apply_precision(model: Transformer, cfg: TrainStageConfig) -> None:
    """The policy's side of cfg.precision (core/precision.py), before parallelizing: in a mixed
    mode the trainable parameters become float32 master weights; fp8 swaps the eligible linear
    layers for torchao's Float8Linear."""
    if not cfg.precision.mixed:
        return
    upcast_trainable(model)
    if cfg.precision.mode == "fp8":
        try:
            n = convert_fp8(model, cfg.precision)
        except ImportError as e:
            raise StageError(str(e)) from None
        log.info("precision fp8: %d linear layers train in float8%s", n,
                 " (emulated)" if cfg.precision.fp8_emulate else "")


def policy_layout(cfg: TrainStageConfig) -> ParallelConfig:
    """cfg.parallel with FSDP's mixed precision from cfg.precision (posttrain.core.precision.fsdp_dtypes)."""
    p = cfg.parallel
    param, reduce = fsdp_dtypes(cfg.precision, p.mixed_precision_param, p.mixed_precision_reduce)
    return p.model_copy(update={"mixed_precision_param": param, "mixed_precision_reduce": reduce})


def policy_tokenizer(cfg: TrainStageConfig):
    """The tokenizer the stage encodes its data with: model.tokenizer when set (it must be one),
    else the model directory's (a stage output's), else data prep's among the data sources. A
    preset model trained on the user's raw files has none of these: model.tokenizer is needed."""
    if cfg.model.tokenizer is not None:
        try:
            return load_tokenizer(cfg.model.tokenizer)
        except StageError:
            raise StageError(f"model.tokenizer={cfg.model.tokenizer!r}: no tokenizer.json there (nor in the "
                             "tokenizer or model output it names)") from None
    try:
        return load_tokenizer(cfg.model.name_or_path, *cfg.data.sources)
    except StageError as e:
        raise StageError(f"{e}: set model.tokenizer to a tokenizer directory (the model "
                         f"{cfg.model.name_or_path!r} and the data sources carry none)") from None


def start_layout(cfg: TrainStageConfig) -> Dist:
    """The process group for cfg.parallel, after the checks that need no model."""
    p = cfg.parallel
    try:
        cfg.check_stage_layout()  # what this stage cannot run (also checked when the config loads)
    except ValueError as e:
        raise StageError(str(e)) from None
    try:
        ParallelDims.from_config(p, TorchrunEnv.read().world_size)  # before any group: ranks would wait
    except ValueError as e:
        raise StageError(f"parallel: {e}") from None
    return start_distributed(p, cfg.reliability.collective_timeout_s)


def parallelize_policy(model: Transformer, cfg: TrainStageConfig, d: Dist) -> ParallelMesh | None:
    """Apply cfg.parallel to the policy in place (posttrain.core.parallel.parallelize); the mesh, or None
    on one process (no mesh: only parallelize's model-local steps)."""
    p = policy_layout(cfg)
    try:
        dims = ParallelDims.from_config(p, d.world, model.args)
    except ValueError as e:
        raise StageError(f"parallel: {e}") from None
    if cfg.optim.offload and (d.world == 1 or dims.pp > 1):
        raise StageError("optim.offload: CPU offload of the optimizer state is FSDP's (CPUOffloadPolicy) and needs "
                         "FSDP over several processes (parallel.dp_shard > 1, no pipeline parallelism yet); "
                         f"this run has {d.world} process(es){', pp > 1' if dims.pp > 1 else ''}")
    if d.world == 1:
        apply_activation_checkpointing(list(model.layers), cfg.model.checkpoint_every)
        if cfg.model.compile:
            apply_compile(list(model.layers))
        return None
    mesh = ParallelMesh(dims, d.device.type)
    if dims.pp > 1:
        parallelize_stages(model, cfg, mesh, d)
    else:
        try:
            parallelize(model, p, mesh, activation_checkpointing=cfg.model.checkpoint_every,
                        compile=cfg.model.compile, offload=cfg.optim.offload)
        except ValueError as e:  # a weight this layout cannot split (e.g. an NF4 block)
            raise StageError(f"parallel: {e}") from None
    log.info("parallelized over %s", mesh)
    return mesh


def parallelize_stages(model: Transformer, cfg: TrainStageConfig, mesh: ParallelMesh, d: Dist) -> None:
    """Pipeline parallelism: split the policy (on meta) into cfg.parallel's stages, parallelize
    each with the rest of the layout (TP, FSDP/DDP), and keep only this rank's stages in `model`
    (posttrain.core.parallel.pipeline.keep_own_stages; `model.pipeline` is the schedule). Every step runs
    on micro-batches of data.micro_batch_size padded rows of data.max_seq_len tokens (the
    schedule's fixed shapes; the config checked they divide), the loss a token sum normalized by
    the trainer (posttrain.core.pipeline_objectives)."""
    from posttrain.core.pipeline_objectives import PipelineLoss, pipeline_token_loss
    from posttrain.core.parallel import parallelize_pipeline
    from posttrain.core.parallel.pipeline import keep_own_stages

    p = policy_layout(cfg)
    microbatches = p.pp_microbatches or p.pp
    tp = mesh.group("tp") if mesh.dims.tp > 1 else None
    loss_fn = PipelineLoss(pipeline_token_loss(tp), tp)  # SFT's; DPO swaps in its own per step
    pipe = parallelize_pipeline(model, p, mesh, loss_fn, d.device, cfg.pipeline_rows() // microbatches,
                                cfg.data.max_seq_len // mesh.dims.cp, packed=True, scale_grads=False,
                                activation_checkpointing=cfg.model.checkpoint_every,
                                compile=cfg.model.compile)
    pipe.loss = loss_fn
    keep_own_stages(model, pipe)
    d.pipeline = pipe


def load_frozen(model_cfg: ModelConfig, layout: ParallelConfig, d: Dist, seed: int = 0,
                what: str = "teacher") -> tuple[Transformer, dict | None]:
    """A frozen model beside the policy, built on the meta device, laid out by `layout`
    (parallelize_frozen), then each rank reads only its shards; and its upstream manifest."""
    model, manifest = load_model(model_cfg, d.device, seed, meta=True)
    parallelize_frozen(model, layout, d, compile=model_cfg.compile, what=what)
    materialize_model(model, model_cfg, d.device, seed)
    return model, manifest


def parallelize_frozen(model: Transformer, layout: ParallelConfig, d: Dist, compile: bool = False,
                       what: str = "teacher") -> Transformer:
    """A frozen model beside the policy (a distillation teacher, a DPO reference) under `layout`
    over the job's ranks, for inference: no gradients, no optimizer; under FSDP its blocks are
    gathered for each forward and freed after it (its root, the embedding and head, stays
    gathered: the loss reads the head's weight after the forward); under TP / CP it splits like
    the policy, so the loss meets both on the same vocab slice and sequence chunk. On one process
    it stays whole (compiled when asked)."""
    model.requires_grad_(False).eval()
    if d.mesh is None:
        if compile:
            apply_compile(list(model.layers))
        return model
    try:
        dims = ParallelDims.from_config(layout, d.world, model.args)
    except ValueError as e:
        raise StageError(f"{what}.parallel: {e}") from None
    mesh = d.mesh if dims == d.mesh.dims else ParallelMesh(dims, d.device.type)
    if dims.pp > 1:  # split into stages like the policy, forward-only: its logits land on the same last stage
        from posttrain.core.pipeline_objectives import PipelineLoss
        from posttrain.core.parallel import parallelize_pipeline
        from posttrain.core.parallel.pipeline import keep_own_stages

        if d.pipeline is None:
            raise StageError(f"{what}.parallel.pp={dims.pp}: only beside a policy under the same pipeline parallelism")
        loss = PipelineLoss(lambda logits, target: logits.new_zeros(()), mesh.group("tp") if dims.tp > 1 else None)
        pipe = parallelize_pipeline(model, layout, mesh, loss, d.device, d.pipeline.microbatch_size,
                                    d.pipeline.seq_len, packed=True, scale_grads=False, compile=compile,
                                    data_parallel=dims.fsdp)
        pipe.loss = loss
        keep_own_stages(model, pipe)
        log.info("%s split into pipeline stages over %s", what, mesh)
        return model
    # DDP has nothing to synchronize without gradients: replicas stay plain copies
    parallelize(model, layout, mesh, compile=compile, data_parallel=dims.fsdp)
    if dims.fsdp:
        model.set_reshard_after_forward(True)
        model.set_reshard_after_forward(False, recurse=False)
    log.info("%s parallelized over %s", what, mesh)
    return model


def build_trainer(s: Session, total_steps: int) -> Trainer:
    """The Trainer for the policy's layout (the optimizer is made here, after parallelizing)."""
    cfg, d = s.cfg, s.dist
    autocast = autocast_dtype(cfg.precision, cfg.model.dtype, d.device)  # core/precision.py
    common = dict(adapters=trained_adapters(cfg), adapter_lr=cfg.lora.adapter_lr,  # stages/adapters.py
                  loss_scaler=LossScaler.from_config(cfg.precision))
    if d.mesh is None:
        return Trainer(s.model, cfg.optim, total_steps, autocast_dtype=autocast, **common)
    # Tokens are distinct across dp x cp ranks (tp ranks share them), and FSDP / DDP average
    # the gradients over exactly those ranks; MoE layers route a share of the tokens on each tp rank.
    dims = d.mesh.dims
    shares = dict(aux_group=d.mesh.group("cp_tp"), aux_scale=float(dims.cp)) if dims.tp * dims.cp > 1 else {}
    pp = dict(pp_group=d.mesh.group("pp")) if dims.pp > 1 else {}  # the objective runs the schedule
    return Trainer(s.model, cfg.optim, total_steps, autocast_dtype=autocast, dp_group=d.mesh.group("dp_cp"),
                   grads_are_averaged=dims.fsdp or dims.ddp, stats_group=d.mesh.group("dp_cp_tp"), **common,
                   **shares, **pp)


def total_steps(cfg: TrainStageConfig, batches_per_epoch: int) -> int:
    by_epochs = cfg.epochs * batches_per_epoch // cfg.optim.grad_accum_steps
    steps = min(cfg.max_steps, by_epochs) if cfg.max_steps else by_epochs
    if steps < 1:
        raise StageError(f"no training step fits: {batches_per_epoch} micro-batches per epoch on this rank, "
                         f"grad_accum_steps={cfg.optim.grad_accum_steps}")
    return steps


def make_meter(s: Session) -> ThroughputMeter:
    """Tokens/s over the data-parallel ranks, and MFU from the policy's FLOPs per token."""
    params = list(s.model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad) / max(sum(p.numel() for p in params), 1)
    fpt = flops_per_token(s.model.args, s.cfg.data.max_seq_len, trainable_fraction=trainable)
    return ThroughputMeter(fpt, s.dist.device, world_size=s.dist.data_shard[1])


# ------------------------------------------------------------------------------------------- train

def train(s: Session, plan: Plan) -> tuple[dict[str, float], dict[str, float], float]:
    """Validate, fit (resuming from the stage's own checkpoints), return (last metrics, initial
    validation, seconds)."""
    cfg = s.cfg
    steps = total_steps(cfg, len(plan.loader))
    trainer = build_trainer(s, steps)
    manager = CheckpointManager.from_config(s.out / CHECKPOINTS, cfg.checkpoint, trainable_only=cfg.lora.enabled,
                                            config=cfg.model_dump(mode="json"))
    before = plan.validate()
    s.run.log_metrics(before, step=0)  # the validation curves start at step 0 (the manifest: <key>_initial)
    t0 = time.time()
    s.meter.start()
    with progress(steps, s.name, s.dist.is_main) as advance:
        last = fit(trainer, plan.loader, plan.objective, max_steps=steps, grad_accum=cfg.optim.grad_accum_steps,
                   manager=manager, resume=cfg.checkpoint.resume, log_every=cfg.tracking.log_every,
                   on_metrics=lambda m, step: s.run.log_metrics(run_metric_names(m, s.name), step),
                   evaluate=plan.validate, eval_every=cfg.eval_interval,
                   advance=advance, meter=s.meter,
                   reliability=Reliability.from_config(cfg.reliability, s.out / "watchdog"))
    manager.close()
    last = {**last, "steps": trainer.step}
    return last, before, time.time() - t0


# The stage run's metric names, the same scheme in every training stage (docs/pipelines.md):
#   train/<objective>_loss   the step's objective (sft_loss, kd_loss, dpo_loss): its own name, so a
#                            compare view never puts different losses in one row
#   train/...                the rest of the step: grad_norm, lr, tokens, skipped, rewards/*, moe/*,
#                            per-adapter tokens/<a>, grad_norm/<a>
#   val/...                  held-out metrics, from step 0 (before training) to the last step
#   time/..., memory/...     throughput and memory (posttrain.core.monitor); data/... what the data kept
# The summary at the end (steps, train/seconds, time totals, data/...) is logged once, at the last step.
OBJECTIVE_LOSS = {"sft": "train/sft_loss", "distill": "train/kd_loss", "dpo": "train/dpo_loss",
                  "grpo": "train/grpo_loss"}


def run_metric_names(metrics: dict[str, float], stage: str) -> dict[str, float]:
    """The trainer's per-step metrics under the run's names (above)."""
    out = {}
    for k, v in metrics.items():
        if k == "loss":
            k = OBJECTIVE_LOSS.get(stage, f"train/{stage}_loss")
        elif not k.startswith(("val/", "time/", "memory/", "data/", "system/")):
            k = f"train/{k}"
        out[k] = v
    return out


# ------------------------------------------------------------------------------------------ finish

def finish(s: Session, plan: Plan, last: dict[str, float], before: dict[str, float], seconds: float) -> dict | None:
    """Export the model, write the manifest (rank 0), log the final metrics and the manifest to
    the stage's run, and drop the resume checkpoints."""
    from posttrain.core.manifest import write_manifest

    d, cfg, out = s.dist, s.cfg, s.out
    metrics = {"train/loss": last.get("loss"), "steps": last["steps"], "train/seconds": seconds,
               **{k: v for k, v in last.items() if k.startswith("val/")},
               **{f"{k}_initial": v for k, v in before.items()},
               **s.meter.totals(), **plan.summary()}
    metrics = {k: v for k, v in metrics.items() if v is not None}
    outputs = export(s.model, s.tok, cfg, out, d)
    manifest = None
    if d.is_main:
        inputs = {"model": (s.upstream or {}).get("digest", cfg.model.name_or_path), **plan.inputs}
        manifest = write_manifest(out, s.name, outputs, metrics=metrics, config=cfg.model_dump(mode="json"),
                                  inputs=inputs, extra={"mlflow_run_id": s.run.run_id})
        # the summary only: the curves (val/*, the objective) were logged as they went
        s.run.log_metrics({k: v for k, v in metrics.items() if not k.startswith("val/") and k != "train/loss"
                           and not k.endswith("_initial")}, step=last["steps"])
        log_adapters(s.run, out, outputs)
        s.run.log_artifact(str(out / "manifest.json"))
    clear_checkpoints(out, d)
    return manifest
