"""Setup shared by the training stages (SFT, distillation, DPO): model + LoRA, data loaders,
trainer, checkpoints, validation, export. Each stage composes these in its own `main`."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from core.config import DataConfig, TrainStageConfig
from core.data.encode import Document, PreferencePair
from core.data.packing import collate_padding_free, collate_preference
from core.data.sampler import BatchSampler, StatefulLoader
from core.lora import apply_lora, merged_state_dict
from core.trainer import Trainer
from core.manifest import is_stage_dir
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


def doc_loader(docs: list[Document], data: DataConfig, d: Dist, epochs: int | None,
               evaluation: bool = False) -> StatefulLoader:
    """Padding-free micro-batches of up to batch_tokens. Training keeps ranks in lockstep
    (drop_last); evaluation must see every document once, so it keeps the ragged tail."""
    sampler = BatchSampler([len(x) for x in docs], batch_tokens=data.batch_tokens or data.max_seq_len,
                           rank=d.rank, world_size=d.world, seed=data.seed, num_epochs=epochs,
                           shuffle=not evaluation, drop_last=not evaluation)
    return StatefulLoader(sampler, lambda units: collate_padding_free([docs[i] for i in units]))


def pair_loader(pairs: list[PreferencePair], cfg: TrainStageConfig, d: Dist, epochs: int | None,
                extra: Callable[[list[int], dict], None] | None = None) -> StatefulLoader:
    sampler = BatchSampler([len(p.chosen) + len(p.rejected) for p in pairs], micro_batch_size=cfg.data.micro_batch_size,
                           rank=d.rank, world_size=d.world, seed=cfg.data.seed, num_epochs=epochs)

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
    """The model being trained (LoRA applied when enabled), its tokenizer and upstream manifest."""
    torch.manual_seed(cfg.seed)
    model, upstream = load_model(cfg.model, d.device, cfg.seed)
    tok = load_tokenizer(cfg.model.tokenizer, cfg.model.name_or_path, *cfg.data.sources)
    if tok.vocab_size > model.args.vocab_size:
        raise StageError(f"tokenizer has {tok.vocab_size} tokens but the model's vocab is {model.args.vocab_size}")
    if cfg.lora.enabled:
        apply_lora(model, cfg.lora)
    return model, tok, upstream


def build_trainer(model, cfg: TrainStageConfig, d: Dist, total_steps: int) -> Trainer:
    autocast = torch.bfloat16 if cfg.model.dtype == "bfloat16" and d.device.type == "cuda" else None
    group = dist.group.WORLD if d.world > 1 else None
    return Trainer(model, cfg.optim, total_steps, autocast_dtype=autocast, dp_group=group, sync_grads=True)


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
        total += float(out.loss_sum)
        n += float(out.num_tokens)
    model.train(was)
    total, n = d.all_reduce_sum([total, n])
    return total / max(n, 1.0)


def export(model, tok, cfg: TrainStageConfig, out: Path, d: Dist) -> dict[str, str]:
    """Write the stage's model outputs on rank 0: HF weights (LoRA merged) + tokenizer, and the
    PEFT adapter when LoRA was trained. Returns manifest outputs."""
    from registry.hf import save_adapter, save_pretrained

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


def clear_checkpoints(out: Path, d: Dist) -> None:
    """Checkpoints are for resuming this stage; once its outputs are written they go."""
    if d.is_main:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
