"""The pieces training stages share beside the skeleton (stages/recipe.py): data readers and
loaders, sampling from a sharded policy, validation loss, and export.

Under a mesh (posttrain.stages.recipe.parallelize_policy: FSDP2, DDP, HSDP, TP with or without sequence
parallelism, TP x FSDP) data is dealt by data-parallel rank (tp ranks read the same batches),
files are written by global rank 0, and every rank runs the same number of forwards (FSDP and TP
communicate inside them). One process keeps the plain model: no mesh, no process group.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from posttrain.core.data.config import DataConfig
from posttrain.core.parallel.config import ParallelConfig
from posttrain.stages.config import TrainStageConfig
from posttrain.core.data import build_loader, load_documents, load_splits
from posttrain.core.data.encode import Document, PreferencePair
from posttrain.core.data.errors import DropStats
from posttrain.core.data.routing import AdapterRouting
from posttrain.core.data.sampler import StatefulLoader
from posttrain.core.lora import apply_lora, merged_state_dict
from posttrain.core.manifest import CHECKPOINTS
from posttrain.core.model import Transformer
from posttrain.core.parallel import full_state_dict
from posttrain.stages.adapters import export_adapters, trained_adapters
from posttrain.stages.common import DTYPES, Dist

log = logging.getLogger("posttrain.training")


def sft_documents(sources: list[str], split: str, tok, cfg, routing: AdapterRouting | None = None
                  ) -> list[Document]:
    """Tokenized SFT documents of `split`: data prep's Parquet (stored labels) for a data-prep
    stage dir; raw user sources are validated, tokenized and split here by content hash. With
    `routing` (several adapters) each document is tagged with its adapter."""
    return load_documents(sources, split, tok, cfg, routing)


def stage_data(sources: list[str], task: str, tok, cfg: DataConfig, routing: AdapterRouting | None = None
               ) -> tuple[list, list, DropStats]:
    """(train, validation, skipped rows) of a training stage's data, `task` "sft" (Documents) or
    "preference" ((PreferencePair, row)): data prep's output split by split, a raw source read,
    validated and tokenized once and split by data.val_fraction (or by the split a saved
    DatasetDict names). Every bad row is raised or, with data.on_bad_row='skip', counted here,
    before training starts. With `routing` (several adapters) every item is tagged with its adapter."""
    stats = DropStats()
    got = load_splits(sources, task, ("train", "validation"), tok, cfg, stats, routing)
    if stats.total_dropped:
        first = "; ".join(m for shown in stats.examples.values() for m in shown[:1])
        log.warning("data: skipped rows (%s); e.g. %s", stats, first)
    return got["train"], got["validation"], stats


def drop_metrics(stats: DropStats) -> dict[str, float]:
    """`data/kept`, `data/dropped`, `data/dropped/<reason>` of raw sources (none for data prep's output)."""
    return {f"data/{k}": v for k, v in stats.to_dict().items()} if stats.kept or stats.total_dropped else {}


def doc_loader(docs: list[Document], data: DataConfig, d: Dist, epochs: int | None,
               evaluation: bool = False) -> StatefulLoader:
    """posttrain.core.data.build_loader over documents: data.packing, micro_batch_size / batch_tokens.
    Training keeps ranks in lockstep (drop_last); evaluation sees every document once, and under a
    mesh every rank runs as many forwards (a short rank's filler batch is marked `padding`).
    Under pipeline parallelism the packed rows stay rows (padded (B, L)): the schedule runs on
    fixed shapes (posttrain.core.pipeline_objectives.pipeline_rows)."""
    rank, world = d.data_shard
    lockstep = evaluation and d.mesh is not None
    return build_loader(docs, data, rank=rank, world_size=world, num_epochs=epochs, evaluation=evaluation,
                        lockstep=lockstep, padding_free=pipeline_of(d) is None)


def pipeline_of(d: Dist):
    """The policy's pipeline schedule under pipeline parallelism (posttrain.core.parallel.pipeline), else None."""
    return d.pipeline if d.mesh is not None and d.mesh.dims.pp > 1 else None


def pair_loader(pairs: list[PreferencePair], cfg: TrainStageConfig, d: Dist, epochs: int | None,
                extra: Callable[[list[int], dict], None] | None = None) -> StatefulLoader:
    rank, world = d.data_shard
    loader = build_loader(pairs, cfg.data, rank=rank, world_size=world, num_epochs=epochs,
                          padding_free=pipeline_of(d) is None)  # pipeline parallelism: padded rows
    if extra is not None:
        collate = loader.collate

        def collate_extra(indices: list[int]) -> dict:
            batch = collate(indices)
            extra(indices, batch)
            return batch

        loader.collate = collate_extra
    return loader


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


def sampling_unit(d: Dist) -> tuple[int, int]:
    """(index, count) of the groups of ranks that work on the same rows: each rank alone, or under
    tensor parallelism its tp group (tp is the mesh's innermost dimension), whose ranks decode
    and score the same rows in lockstep; under pipeline parallelism (pp the outermost) with the
    same coordinates in every stage."""
    tp = d.mesh.dims.tp if d.mesh is not None else 1
    pp = d.mesh.dims.pp if d.mesh is not None else 1
    per_stage = d.world // pp
    return (d.rank % per_stage) // tp, per_stage // tp


def sampling_lead(d: Dist) -> bool:
    """Whether this rank is the first of its sampling unit (the one that writes what they share)."""
    tp = d.mesh.dims.tp if d.mesh is not None else 1
    return d.rank < d.world // (d.mesh.dims.pp if d.mesh is not None else 1) and d.rank % tp == 0


@contextlib.contextmanager
def sampling(model, cfg: ParallelConfig, gather: bool = True):
    """Around token-by-token generation from the policy. Under FSDP each unit is gathered once
    and kept for the duration instead of at every forward, so ranks sample without collectives
    (and may stop at different steps); resharded after. Under context parallelism the policy
    attends as an ordinary model meanwhile; under tensor parallelism it decodes without the
    sequence split, each tp group in lockstep (posttrain.core.model.generate). gather=False: FSDP units
    stay sharded, gathered per forward as in training (a model one rank cannot hold whole;
    decoding is then collective: generate(lockstep=...)). Collective: every rank enters it."""
    from posttrain.core.parallel.context import without_context_parallel
    from posttrain.core.parallel.tensor import decode_without_sequence_parallel

    pipe = getattr(model, "pipeline", None)
    roots = list(pipe.modules) if pipe is not None else [model]  # under PP: this rank's stages
    units = [m for r in roots for m in r.modules() if isinstance(m, FSDPModule)] if gather else []
    if not units:
        with without_context_parallel(model), decode_without_sequence_parallel(model):
            yield
        return
    for r in roots:
        r.set_reshard_after_forward(False)
    if pipe is not None:  # the decode loop calls a stage's blocks, not the stage
        pipe.claim_fsdp_roots()
    for m in units:
        m.unshard()
    try:
        # whole sequences, token by token, on each rank alone (under TP: with its tp group, unsplit by sequence)
        with without_context_parallel(model), decode_without_sequence_parallel(model):
            yield
    finally:
        for m in units:
            m.reshard()
        # Back to parallelize's setting (apply_fsdp), and a root keeps its weights after forward
        # as FSDP does by default (backward needs them at once). Pipeline stages keep theirs
        # gathered between microbatches unless told always to reshard.
        again = cfg.fsdp_reshard_after_forward == "always" or (pipe is None and cfg.fsdp_reshard_after_forward
                                                                != "never")
        for r in roots:
            r.set_reshard_after_forward(again)
            if pipe is None:
                r.set_reshard_after_forward(False, recurse=False)


@torch.no_grad()
def mean_loss(model, loader, objective, d: Dist) -> float:
    """Token-weighted mean of `objective` over a loader, summed over ranks."""
    was = model.training
    model.eval()
    total = n = 0.0
    for batch in loader:
        out = objective(model, batch)
        if not batch.get("padding"):  # a lockstep evaluation loader's filler
            total += float(out.loss_sum)
            n += float(out.num_tokens)
    model.train(was)
    total, n = d.all_reduce_sum([total, n])
    return total / max(n, 1.0)


def export(model, tok, cfg: TrainStageConfig, out: Path, d: Dist) -> dict[str, str]:
    """Write the stage's model outputs on rank 0: HF weights (LoRA merged) + tokenizer, and the
    PEFT adapter when LoRA was trained (each adapter on its own when several were: stages/adapters.py).
    Returns manifest outputs. Collective."""
    from posttrain.registry.adapters import save_adapter
    from posttrain.registry.hf import save_pretrained

    if any(isinstance(p, DTensor) for p in model.parameters()) or pipeline_of(d) is not None:
        model = gathered_copy(model, cfg, d)  # sharded (FSDP), split (TP) or staged (PP): None off rank 0
    outputs: dict[str, str] = {}
    if d.is_main and trained_adapters(cfg):
        outputs.update(export_adapters(model, tok, cfg, out))  # each adapter on its own (stages/adapters.py)
    elif d.is_main:
        lora = cfg.lora.enabled
        name = cfg.lora.adapter_names[0]
        if cfg.save == "full" or cfg.export_merged:
            state = merged_state_dict(model, name) if lora else None
            # mixed precision trained float32 master weights: the checkpoint keeps model.dtype
            dtype = DTYPES[cfg.model.dtype] if cfg.precision.mixed else None
            save_pretrained(model, out / "model", dtype=dtype, state=state)
            tok.save_pretrained(out / "model")
            outputs["model"] = "model"
        if lora:
            save_adapter(model, out / "adapter", name=name, base_model=cfg.model.name_or_path)
            outputs["adapter"] = "adapter"
        if cfg.qat.enabled:  # the converted model: codes + scales, and their float image (registry/quantized.py)
            from posttrain.registry.quantized import save_quantized

            save_quantized(model, out / "quantized", cfg.qat, state=merged_state_dict(model, name) if lora else None,
                           dtype=DTYPES[cfg.model.dtype])
            tok.save_pretrained(out / "quantized")
            outputs["quantized"] = "quantized"
    if d.is_main:
        tok.save_pretrained(out / "tokenizer")
        outputs["tokenizer"] = "tokenizer"
    d.barrier()
    return outputs


def gathered_copy(model, cfg: TrainStageConfig, d: Dist) -> Transformer | None:
    """A plain copy of a parallelized policy on rank 0's CPU (None on other ranks), LoRA layers
    included, so the single-process export runs on it unchanged. Collective: the weights are
    gathered one tensor at a time (posttrain.core.parallel.full_state_dict), the pipeline stages' parts
    then meet on rank 0."""
    state = full_state_dict(model, d.mesh.group("pp") if pipeline_of(d) is not None else None)
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


def clear_checkpoints(out: Path, d: Dist) -> None:
    """Checkpoints are for resuming this stage; once its outputs are written they go."""
    if d.is_main:
        shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
