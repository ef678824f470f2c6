"""Setup shared by the training stages (SFT, distillation, DPO): model + LoRA, data loaders,
trainer, checkpoints, validation, export. Each stage composes these in its own `main`.

Parallelism: on more than one process `build_policy` builds the mesh from `cfg.parallel` and
applies core.parallel.parallelize (FSDP2 by default, DDP with dp_replicate, HSDP, TP with or
without sequence parallelism, and TP x FSDP); the returned ParallelDist carries the mesh. Data
is dealt by data-parallel rank (tp ranks read the same batches), files are written by global
rank 0, and every rank runs the same number of forwards (FSDP and TP communicate inside them).
One process keeps the plain model: no mesh, no process group.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from core.config import DataConfig, ParallelConfig, TrainStageConfig
from core.data.encode import Document, PreferencePair
from core.data.packing import collate_padding_free, collate_preference
from core.data.sampler import BatchSampler, StatefulLoader
from core.lora import apply_lora, merged_state_dict
from core.manifest import is_stage_dir
from core.model import Transformer
from core.parallel import ParallelDims, ParallelMesh, full_state_dict, init_distributed, parallelize
from core.parallel.data_parallel import apply_activation_checkpointing, apply_compile
from core.trainer import Trainer
from stages.common import Dist, StageError, data_files, load_model, load_tokenizer

log = logging.getLogger("posttrain.training")


def read_parquet(files: list[Path]) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    for f in files:
        rows.extend(pq.read_table(f).to_pylist())
    return rows


SPLIT_NAMES = {"train": "train", "val": "validation", "test": "test"}


def sft_documents(sources: list[str], split: str, tok, cfg) -> list[Document]:
    """Tokenized SFT documents of `split`: data prep's pre-tokenized Parquet for a data-prep
    stage dir; raw user sources are validated, tokenized and split here by content hash."""
    docs: list[Document] = []
    for src in sources:
        if is_stage_dir(src):
            rows = read_parquet(data_files(src, "sft", split))
            docs.extend(Document(r["input_ids"][: cfg.max_seq_len], r["labels"][: cfg.max_seq_len]) for r in rows)
        else:
            from core.data import load_data

            data_files(src, "sft", split)  # a clear error for a missing path
            docs.extend(load_data(cfg.model_copy(update={"sources": [src]}), tok)[SPLIT_NAMES[split]])
    return docs


def preference_pairs(sources: list[str], split: str) -> list[tuple[PreferencePair, dict]]:
    out = []
    for src in sources:
        for r in read_parquet(data_files(src, "preference", split)):
            out.append((PreferencePair(r["prompt_ids"], r["chosen_ids"], r["chosen_ids"],
                                       r["rejected_ids"], r["rejected_ids"]), r))
    return out


@dataclass
class ParallelDist(Dist):
    """The stage's Dist once its policy is parallelized: the mesh (None on one process)."""

    mesh: ParallelMesh | None = None

    @property
    def data_shard(self) -> tuple[int, int]:
        """(this rank's shard, shards) of the data: tp ranks read the same batches."""
        return (self.mesh.local_rank("dp"), self.mesh.size("dp")) if self.mesh is not None else (self.rank, self.world)


def data_shard(d: Dist) -> tuple[int, int]:
    return d.data_shard if isinstance(d, ParallelDist) else (d.rank, d.world)


class LockstepLoader(StatefulLoader):
    """An evaluation loader that yields as many batches on every rank, ceil(global batches /
    ranks): under a mesh each forward communicates, so a rank short of the ragged tail repeats
    the first batch, marked `padding` (run, not counted)."""

    def __iter__(self):
        short = len(self) - len(self.sampler)
        yield from super().__iter__()
        for _ in range(short):
            yield {**self.collate(self.sampler.global_batches(0)[0]), "padding": True}

    def __len__(self) -> int:
        return -(-len(self.sampler.global_batches(0)) // self.sampler.world_size)


def doc_loader(docs: list[Document], data: DataConfig, d: Dist, epochs: int | None,
               evaluation: bool = False) -> StatefulLoader:
    """Padding-free micro-batches of up to batch_tokens. Training keeps ranks in lockstep
    (drop_last); evaluation must see every document once, so it keeps the ragged tail."""
    rank, world = data_shard(d)
    sampler = BatchSampler([len(x) for x in docs], batch_tokens=data.batch_tokens or data.max_seq_len,
                           rank=rank, world_size=world, seed=data.seed, num_epochs=epochs,
                           shuffle=not evaluation, drop_last=not evaluation)
    lockstep = evaluation and isinstance(d, ParallelDist) and d.mesh is not None
    return (LockstepLoader if lockstep else StatefulLoader)(
        sampler, lambda units: collate_padding_free([docs[i] for i in units]))


def pair_loader(pairs: list[PreferencePair], cfg: TrainStageConfig, d: Dist, epochs: int | None,
                extra: Callable[[list[int], dict], None] | None = None) -> StatefulLoader:
    rank, world = data_shard(d)
    sampler = BatchSampler([len(p.chosen) + len(p.rejected) for p in pairs], micro_batch_size=cfg.data.micro_batch_size,
                           rank=rank, world_size=world, seed=cfg.data.seed, num_epochs=epochs)

    def collate(units: list[int]) -> dict:
        batch = collate_preference([pairs[i] for i in units])
        if extra is not None:
            extra(units, batch)
        return batch

    return StatefulLoader(sampler, collate)


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class DeviceLoader:
    """A StatefulLoader whose batches land on the training device."""

    def __init__(self, loader: StatefulLoader, device: torch.device):
        self.loader, self.device = loader, device

    def __iter__(self):
        return (to_device(b, self.device) for b in self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, s):
        self.loader.load_state_dict(s)


def build_policy(cfg: TrainStageConfig, d: Dist):
    """The model being trained (LoRA applied when enabled, then parallelized over cfg.parallel),
    its tokenizer, upstream manifest, and the ParallelDist the rest of the stage uses."""
    torch.manual_seed(cfg.seed)
    model, upstream = load_model(cfg.model, d.device, cfg.seed)
    tok = load_tokenizer(cfg.model.tokenizer, cfg.model.name_or_path, *cfg.data.sources)
    if tok.vocab_size > model.args.vocab_size:
        raise StageError(f"tokenizer has {tok.vocab_size} tokens but the model's vocab is {model.args.vocab_size}")
    if cfg.lora.enabled:
        apply_lora(model, cfg.lora)
    return model, tok, upstream, parallelize_policy(model, cfg, d)


def parallelize_policy(model: Transformer, cfg: TrainStageConfig, d: Dist) -> ParallelDist:
    """Apply cfg.parallel to the policy in place (core.parallel.parallelize); the layout is
    checked against the world and the model before any group is made."""
    p = cfg.parallel
    for key in ("pp", "cp", "ep"):
        if getattr(p, key) > 1:
            raise StageError(f"parallel.{key}={getattr(p, key)}: the training stages support data parallelism "
                             f"(FSDP, DDP, HSDP) and tensor parallelism only; set parallel.{key}=1")
    try:
        dims = ParallelDims.from_config(p, d.world, model.args)
    except ValueError as e:
        raise StageError(f"parallel: {e}") from None
    if d.world == 1:  # no mesh (it would need a process group): only parallelize's model-local steps
        if cfg.model.activation_checkpointing:
            apply_activation_checkpointing(list(model.layers))
        if cfg.model.compile:
            apply_compile(list(model.layers))
        return ParallelDist(d.rank, d.world, d.local_rank, d.device)
    if cfg.lora.quantize_base and (dims.fsdp or dims.tp > 1):
        raise StageError(f"lora.quantize_base={cfg.lora.quantize_base!r} (QLoRA) cannot be sharded (FSDP) or split "
                         f"(tp); replicate it instead: parallel.dp_replicate={d.world}, parallel.tp=1")
    mesh, device = init_distributed(p, model.args, cfg.reliability.collective_timeout_s)
    if device.type != d.device.type:
        raise StageError(f"parallel.device={p.device!r} but the stage runs on {d.device.type}")
    parallelize(model, p, mesh, activation_checkpointing=cfg.model.activation_checkpointing, compile=cfg.model.compile)
    log.info("parallelized over %s", mesh)
    return ParallelDist(d.rank, d.world, d.local_rank, d.device, mesh=mesh)


def build_trainer(model, cfg: TrainStageConfig, d: ParallelDist, total_steps: int) -> Trainer:
    """The Trainer for the policy's layout (the optimizer is made here, after parallelizing)."""
    autocast = torch.bfloat16 if cfg.model.dtype == "bfloat16" and d.device.type == "cuda" else None
    if d.mesh is None:
        return Trainer(model, cfg.optim, total_steps, autocast_dtype=autocast)
    # Tokens are distinct across dp x cp ranks (tp ranks share them), and FSDP / DDP average
    # the gradients over exactly those ranks; MoE layers route a share of the tokens on each tp rank.
    dims = d.mesh.dims
    return Trainer(model, cfg.optim, total_steps, autocast_dtype=autocast, dp_group=d.mesh.group("dp_cp"),
                   grads_are_averaged=dims.fsdp or dims.ddp, stats_group=d.mesh.group("dp_cp_tp"))


@contextlib.contextmanager
def sampling(model, cfg: ParallelConfig):
    """Around token-by-token generation from the policy. Under FSDP each unit is gathered once
    and kept for the duration instead of at every forward, so ranks sample without collectives
    (and may stop at different steps); resharded after. Collective: every rank enters it."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield
        return
    model.set_reshard_after_forward(False)
    for m in units:
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()
        # Back to parallelize's setting (apply_fsdp; pp = 1 here), and the root keeps its weights
        # after forward as FSDP does by default (backward needs them at once).
        model.set_reshard_after_forward(cfg.fsdp_reshard_after_forward != "never")
        model.set_reshard_after_forward(False, recurse=False)


def total_steps(cfg: TrainStageConfig, batches_per_epoch: int) -> int:
    by_epochs = cfg.epochs * batches_per_epoch // cfg.optim.grad_accum_steps
    steps = min(cfg.max_steps, by_epochs) if cfg.max_steps else by_epochs
    if steps < 1:
        raise StageError(f"no training step fits: {batches_per_epoch} micro-batches per epoch on this rank, "
                         f"grad_accum_steps={cfg.optim.grad_accum_steps}")
    return steps


@torch.no_grad()
def mean_loss(model, loader, objective, d: Dist) -> float:
    """Token-weighted mean of `objective` over a loader, summed over ranks."""
    was = model.training
    model.eval()
    total = n = 0.0
    for batch in loader:
        out = objective(model, batch)
        if not batch.get("padding"):  # LockstepLoader's filler
            total += float(out.loss_sum)
            n += float(out.num_tokens)
    model.train(was)
    total, n = d.all_reduce_sum([total, n])
    return total / max(n, 1.0)


def export(model, tok, cfg: TrainStageConfig, out: Path, d: Dist) -> dict[str, str]:
    """Write the stage's model outputs on rank 0: HF weights (LoRA merged) + tokenizer, and the
    PEFT adapter when LoRA was trained. Returns manifest outputs. Collective."""
    from registry.adapters import save_adapter
    from registry.hf import save_pretrained

    if any(isinstance(p, DTensor) for p in model.parameters()):
        model = gathered_copy(model, cfg)  # sharded (FSDP) or split (TP): None off rank 0
    outputs: dict[str, str] = {}
    if d.is_main:
        lora = cfg.lora.enabled
        if cfg.save == "full" or cfg.export_merged:
            state = merged_state_dict(model) if lora else None
            save_pretrained(model, out / "model", state=state)
            tok.save_pretrained(out / "model")
            outputs["model"] = "model"
        if lora:
            save_adapter(model, out / "adapter", base_model=cfg.model.name_or_path)
            outputs["adapter"] = "adapter"
        tok.save_pretrained(out / "tokenizer")
        outputs["tokenizer"] = "tokenizer"
    d.barrier()
    return outputs


def gathered_copy(model, cfg: TrainStageConfig) -> Transformer | None:
    """A plain copy of a parallelized policy on rank 0's CPU (None on other ranks), LoRA layers
    included, so the single-process export runs on it unchanged. Collective: the weights are
    gathered one tensor at a time (core.parallel.full_state_dict)."""
    state = full_state_dict(model)
    if state is None:
        return None
    with torch.device("meta"):
        copy = Transformer(model.args)
        if cfg.lora.enabled:
            apply_lora(copy, cfg.lora)
    copy.load_state_dict(state, assign=True)
    copy.tie_weights()
    copy.init_buffers()
    return copy


def finish(stage: str, model, tok, cfg: TrainStageConfig, out: Path, d, run_, metrics: dict[str, Any],
           inputs: dict[str, str], step: int) -> dict | None:
    """What every training stage does last: export the model, write the manifest (rank 0), log
    the final metrics and the manifest to the stage's run, and drop the resume checkpoints."""
    from core.manifest import write_manifest

    metrics = {k: v for k, v in metrics.items() if v is not None}
    outputs = export(model, tok, cfg, out, d)
    manifest = None
    if d.is_main:
        manifest = write_manifest(out, stage, outputs, metrics=metrics, config=cfg.model_dump(mode="json"),
                                  inputs=inputs, extra={"mlflow_run_id": run_.run_id})
        run_.log_metrics(metrics, step=step)
        run_.log_artifact(str(out / "manifest.json"))
    clear_checkpoints(out, d)
    return manifest


def clear_checkpoints(out: Path, d: Dist) -> None:
    """Checkpoints are for resuming this stage; once its outputs are written they go."""
    if d.is_main:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
