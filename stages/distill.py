"""Teacher -> student distillation (forward KL, reverse KL, generalized JSD, with temperature).

Modes:
  online     the frozen teacher runs in the same job, per micro-batch, under no_grad
  on_policy  as online, but a share of the micro-batches are the student's own samples for the
             batch's prompts, scored by the teacher (GKD, Agarwal et al. 2024)
  offline    the teacher's top-k log-probs on the training data, computed once into a cached,
             versioned artifact (keyed by data, teacher and k) that later runs reuse

The data is data prep's output or the user's own SFT files (TRL messages or prompt/completion, in
JSONL, Parquet or `datasets` directories; split by data.val_fraction where they name no split),
every row validated and tokenized before training. on_policy samples the student for each
document's prompt: everything before its final completion (the last assistant reply), taken from
the same rows whatever data.mask_prompt.

Reports the teacher's share of the step time (time/teacher_frac), and the student's sampling
share in on_policy mode (time/student_sampling_frac).

    torchrun --nproc-per-node 2 -m stages.distill --config spec.json
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from stages.config import DistillConfig
from core.data.encode import Document, last_run_start
from core.data.packing import collate_padding_free
from core.losses import IGNORE_INDEX, chunked_cross_entropy, distill_loss_topk
from core.manifest import digest
from core.model.generate import SamplingParams, generate
from core.objectives import CHUNK, distill_objective
from core.trainer import LossOutput
from stages.adapters import adapter_routing, routed, trained_adapters
from stages.common import Dist, StageError, load_model, parse_spec
from stages.recipe import Plan, Session, run_training
from stages.training import DeviceLoader, doc_loader, drop_metrics, mean_loss, sampling, stage_data, to_device

log = logging.getLogger("posttrain.distill")


class TimedTeacher(torch.nn.Module):
    """Wraps the teacher so its forwards count as the `teacher` phase of the step time
    (time/teacher_frac: a share of the wall time, synchronized on GPU)."""

    def __init__(self, teacher: torch.nn.Module, session: Session):
        super().__init__()
        self.teacher, self.session = teacher, session

    def forward(self, *args, **kwargs):
        with self.session.phase("teacher"):
            return self.teacher(*args, **kwargs)


def prompt_of(doc: Document) -> list[int]:
    """The tokens before the document's final completion (its last run of trained labels)."""
    trained = [label != IGNORE_INDEX for label in doc.labels]
    return doc.input_ids[:last_run_start(trained)] if any(trained) else []


class OnPolicyMix:
    """Replaces a share of the loader's micro-batches by the student's samples for their prompts
    (`prompts[i]`: document i's). The draw uses Python's `random` seeded per step, so a resumed run
    draws the same mix."""

    def __init__(self, loader, session: Session, prompts: list[list[int]]):
        self.loader, self.session, self.prompts = loader, session, prompts
        self.student, self.tok, self.cfg, self.device = session.model, session.tok, session.cfg, session.dist.device
        self.samples = 0

    def __iter__(self):
        for batch in self.loader.loader:  # collated on CPU
            if random.Random(f"{self.cfg.seed}:{self.loader.state_dict()}").random() < self.cfg.on_policy_ratio:
                batch = self._student_batch(batch)
            yield to_device(batch, self.device)

    @torch.no_grad()
    def _student_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        prompts = [self.prompts[i] for i in batch["doc_indices"]]
        params = SamplingParams(max_new_tokens=self.cfg.max_new_tokens, temperature=1.0,
                                stop_token_ids=tuple(self.tok.eos_ids))
        with sampling(self.student, self.cfg.parallel), self.session.phase("student_sampling"):
            # every rank samples at the same micro-step
            gens = generate(self.student, prompts, params, pad_id=self.tok.pad_id or 0)
        self.student.train()
        self.samples += len(gens)
        docs = [Document(p + g.tokens, [IGNORE_INDEX] * len(p) + g.tokens) for p, g in zip(prompts, gens) if g.tokens]
        return collate_padding_free(docs)

    def __len__(self):
        return len(self.loader)

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, s):
        self.loader.load_state_dict(s)


@torch.no_grad()
def teacher_topk(teacher, docs: list[Document], k: int, cache: Path, teacher_id: str, d: Dist) -> dict[str, torch.Tensor]:
    """Top-k teacher log-probs at every position of every doc, concatenated over docs
    ({"ids": (N, k) int32, "logps": (N, k) float32, "offsets": (D+1,)}), cached by content."""
    key = digest([teacher_id, k, [x.input_ids for x in docs]])[:16]
    path = cache / f"teacher_top{k}-{key}.safetensors"
    if path.exists():
        return load_file(str(path))
    ids, logps, offsets = [], [], [0]
    teacher.eval()
    for i in range(0, len(docs), 64):
        chunk = docs[i : i + 64]
        batch = to_device(collate_padding_free(chunk), d.device)
        h, w = teacher(batch["input_ids"], batch["position_ids"], head=lambda h, w: (h, w))
        for j in range(0, h.shape[1], CHUNK):  # chunked so the full logits never exist
            lp = (h[0, j : j + CHUNK].float() @ w.float().T).log_softmax(-1)
            top = lp.topk(k, dim=-1)
            ids.append(top.indices.int().cpu())
            logps.append(top.values.cpu())
        offsets.extend(offsets[-1] + len(x) for x in chunk)
    result = {"ids": torch.cat(ids), "logps": torch.cat(logps), "offsets": torch.tensor(offsets)}
    if d.is_main:
        cache.mkdir(parents=True, exist_ok=True)
        save_file(result, str(path))
    d.barrier()
    return result


def offline_objective(cfg: DistillConfig, topk: dict[str, torch.Tensor]) -> Any:
    """Distillation from the cached top-k: positions gathered by each batch's document indices."""

    def objective(model, batch):
        labels = batch["labels"]
        mask = torch.zeros_like(labels, dtype=torch.bool)
        mask[..., :-1] = labels[..., 1:] != IGNORE_INDEX
        rows = torch.cat([torch.arange(topk["offsets"][u], topk["offsets"][u + 1]) for u in batch["doc_indices"]])
        t_ids, t_lp = topk["ids"][rows].long().to(labels.device), topk["logps"][rows].to(labels.device)
        sel = mask.reshape(-1)

        def head(h, w):
            logits = h.reshape(-1, h.shape[-1])[sel] @ w.T  # only the positions that are trained
            loss = distill_loss_topk(logits, t_ids[sel], t_lp[sel], kind=cfg.divergence, temperature=cfg.temperature,
                                     beta=cfg.jsd_beta, reduction="sum")
            if cfg.ce_weight:
                loss = loss + cfg.ce_weight * chunked_cross_entropy(h, w, labels, reduction="sum")
            return loss

        return LossOutput(model(batch["input_ids"], batch["position_ids"], head=head), batch["num_target_tokens"])

    return objective


class Distill:
    name = "distill"

    def setup(self, s: Session) -> Plan:
        cfg, d, student, tok = s.cfg, s.dist, s.model, s.tok
        if cfg.mode != "online" and cfg.parallel.tp > 1:  # sampling with a KV cache / full-vocab top-k logits
            raise StageError(f"distill: mode={cfg.mode!r} does not support tensor parallelism yet; set "
                             f"parallel.tp=1 (parallel.tp={cfg.parallel.tp}) or mode='online'")
        teacher, teacher_manifest = load_model(cfg.teacher, d.device, cfg.seed)
        teacher.requires_grad_(False).eval()
        if teacher.args.vocab_size != student.args.vocab_size:
            raise StageError(f"distill: teacher vocab {teacher.args.vocab_size} != student vocab "
                             f"{student.args.vocab_size}; they must share the tokenizer")
        timed = TimedTeacher(teacher, s)
        # on_policy reads the prompts off the completion masks, so the rows are loaded masked
        data = cfg.data.model_copy(update={"mask_prompt": True}) if cfg.mode == "on_policy" else cfg.data
        train_docs, val_docs, stats = stage_data(cfg.data.sources, "sft", tok, data, adapter_routing(cfg.lora))
        prompts: list[list[int]] = []
        if cfg.mode == "on_policy":
            prompts = [prompt_of(doc) for doc in train_docs]
            if not all(prompts):
                i = next(i for i, p in enumerate(prompts) if not p)
                text = tok.decode(train_docs[i].input_ids)[:80]
                raise StageError(f"distill: mode='on_policy' samples a completion for each prompt, but training "
                                 f"document {i} ({text!r}) has no tokens before its completion")
            if not cfg.data.mask_prompt:
                train_docs = [Document(x.input_ids, list(x.input_ids)) for x in train_docs]
                val_docs = [Document(x.input_ids, list(x.input_ids)) for x in val_docs]
        base = doc_loader(train_docs, cfg.data, d, epochs=cfg.epochs)
        online = distill_objective(timed, cfg.divergence, cfg.temperature, cfg.jsd_beta, cfg.ce_weight)
        teacher_id = (teacher_manifest or {}).get("digest", cfg.teacher.name_or_path)
        if cfg.mode == "offline":  # before training: not part of the step time
            topk = teacher_topk(teacher, train_docs, cfg.top_k, s.out / "teacher_cache", teacher_id, d)
            objective, train = offline_objective(cfg, topk), DeviceLoader(base, d.device)
        elif cfg.mode == "on_policy":
            objective, train = online, OnPolicyMix(DeviceLoader(base, d.device), s, prompts)
        else:
            objective, train = online, DeviceLoader(base, d.device)

        names = trained_adapters(cfg)
        if names:  # each document through its adapter (on_policy is refused with several)
            objective, online = routed(objective, names), routed(online, names)

        def validate() -> dict[str, float]:
            if not val_docs:
                return {}
            val = DeviceLoader(doc_loader(val_docs, cfg.data, d, epochs=1, evaluation=True), d.device)
            return {"val/kl": mean_loss(student, val, online, d)}

        def summary() -> dict[str, float]:
            extra = {"on_policy/samples": train.samples} if isinstance(train, OnPolicyMix) else {}
            return {**extra, **drop_metrics(stats)}

        return Plan(train, objective, validate, inputs={"teacher": teacher_id}, summary=summary)


def run(cfg: DistillConfig) -> dict:
    return run_training(Distill(), cfg)


def main(argv: list[str] | None = None) -> None:
    run(parse_spec(DistillConfig, argv))


if __name__ == "__main__":
    main()
