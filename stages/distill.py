"""Teacher -> student distillation (forward KL, reverse KL, generalized JSD, with temperature).

Modes:
  online     the frozen teacher runs in the same job, per micro-batch, under no_grad
  on_policy  as online, but a share of the micro-batches are the student's own samples for the
             batch's prompts, scored by the teacher (GKD, Agarwal et al. 2024)
  offline    the teacher's top-k log-probs on the training data, computed once into a cached,
             versioned artifact (keyed by data, teacher and k) that later runs reuse

Reports the teacher's share of step time.

    torchrun --nproc-per-node 2 -m stages.distill --config spec.json
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from core.checkpoint import CheckpointManager
from core.config import DistillConfig
from core.data.encode import Document
from core.data.packing import collate_padding_free
from core.losses import IGNORE_INDEX, chunked_cross_entropy, distill_loss_topk
from core.loop import fit
from core.manifest import digest
from core.model.generate import SamplingParams, generate
from core.objectives import CHUNK, distill_objective
from core.reliability import Reliability
from core.trainer import LossOutput
from stages.common import (Dist, StageError, close_distributed, init_distributed, load_model, parse_spec, progress,
                           stage_run)
from stages.training import (DeviceLoader, build_policy, build_trainer, doc_loader, finish,
                             mean_loss, sampling, sft_documents, to_device, total_steps)

log = logging.getLogger("posttrain.distill")


class TimedTeacher(torch.nn.Module):
    """Wraps the teacher to time its forwards (synchronized on GPU) for the step-time share."""

    def __init__(self, teacher: torch.nn.Module):
        super().__init__()
        self.teacher = teacher
        self.seconds = 0.0

    def forward(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.teacher(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t0
        return out


def prompt_of(doc: Document) -> list[int]:
    first = next(i for i, l in enumerate(doc.labels) if l != IGNORE_INDEX)
    return doc.input_ids[:first]


class OnPolicyMix:
    """Replaces a share of the loader's micro-batches by the student's samples for their prompts.
    The draw uses Python's `random` seeded per step, so a resumed run draws the same mix."""

    def __init__(self, loader, student, tok, cfg: DistillConfig, device):
        self.loader, self.student, self.tok, self.cfg, self.device = loader, student, tok, cfg, device
        self.samples = 0

    def __iter__(self):
        for batch in self.loader.loader:  # collated on CPU
            if random.Random(f"{self.cfg.seed}:{self.loader.state_dict()}").random() < self.cfg.on_policy_ratio:
                batch = self._student_batch(batch)
            yield to_device(batch, self.device)

    @torch.no_grad()
    def _student_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        ids, cu = batch["input_ids"][0].tolist(), batch["cu_seqlens"].tolist()
        labels = batch["labels"][0].tolist()
        prompts = [prompt_of(Document(ids[a:b], labels[a:b])) for a, b in zip(cu[:-1], cu[1:])]
        params = SamplingParams(max_new_tokens=self.cfg.max_new_tokens, temperature=1.0,
                                stop_token_ids=tuple(self.tok.eos_ids))
        with sampling(self.student, self.cfg.parallel):  # every rank samples at the same micro-step
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
        rows = torch.cat([torch.arange(topk["offsets"][u], topk["offsets"][u + 1]) for u in batch["units"]])
        t_ids, t_lp = topk["ids"][rows].long().to(labels.device), topk["logps"][rows].to(labels.device)
        sel = mask.reshape(-1)

        def head(h, w):
            logits = h.reshape(-1, h.shape[-1])[sel] @ w.T  # only the positions that are trained
            loss = distill_loss_topk(logits, t_ids[sel], t_lp[sel], kind=cfg.kind, temperature=cfg.temperature,
                                     beta=cfg.jsd_beta, reduction="sum")
            if cfg.ce_weight:
                loss = loss + cfg.ce_weight * chunked_cross_entropy(h, w, labels, reduction="sum")
            return loss

        return LossOutput(model(batch["input_ids"], batch["position_ids"], head=head), batch["num_target_tokens"])

    return objective


def run(cfg: DistillConfig) -> dict:
    d = init_distributed(cfg.reliability.collective_timeout_s)
    out = Path(cfg.output_dir or "distill")
    if cfg.mode != "online" and cfg.parallel.tp > 1:  # sampling with a KV cache / full-vocab top-k logits
        raise StageError(f"distill: mode={cfg.mode!r} does not support tensor parallelism yet; set parallel.tp=1 "
                         f"(parallel.tp={cfg.parallel.tp}) or mode='online'")
    student, tok, upstream, d = build_policy(cfg, d)  # d: now with the mesh
    teacher, teacher_manifest = load_model(cfg.teacher, d.device, cfg.seed)
    teacher.requires_grad_(False).eval()
    if teacher.args.vocab_size != student.args.vocab_size:
        raise SystemExit(f"distill: teacher vocab {teacher.args.vocab_size} != student vocab "
                         f"{student.args.vocab_size}; they must share the tokenizer")
    timed = TimedTeacher(teacher)
    train_docs = sft_documents(cfg.data.sources, "train", tok, cfg.data)
    val_docs = sft_documents(cfg.data.sources, "val", tok, cfg.data)
    base = doc_loader(train_docs, cfg.data, d, epochs=cfg.epochs)
    online = distill_objective(timed, cfg.kind, cfg.temperature, cfg.jsd_beta, cfg.ce_weight)

    with stage_run(cfg, "distill", d.is_main) as run_:
        if cfg.mode == "offline":
            teacher_id = (teacher_manifest or {}).get("digest", cfg.teacher.name_or_path)
            t0 = time.perf_counter()
            topk = teacher_topk(teacher, train_docs, cfg.top_k, out / "teacher_cache", teacher_id, d)
            timed.seconds += time.perf_counter() - t0
            collate = base.collate
            base.collate = lambda units: {**collate(units), "units": units}
            objective = offline_objective(cfg, topk)
            train = DeviceLoader(base, d.device)
        elif cfg.mode == "on_policy":
            objective = online
            train = OnPolicyMix(DeviceLoader(base, d.device), student, tok, cfg, d.device)
        else:
            objective = online
            train = DeviceLoader(base, d.device)
        steps = total_steps(cfg, len(train))
        trainer = build_trainer(student, cfg, d, steps)
        manager = CheckpointManager.from_config(out / "checkpoints", cfg.checkpoint, trainable_only=cfg.lora.enabled,
                                                config=cfg.model_dump(mode="json"))

        def validate() -> dict[str, float]:
            if not val_docs:
                return {}
            val = DeviceLoader(doc_loader(val_docs, cfg.data, d, epochs=1, evaluation=True), d.device)
            return {"val/kl": mean_loss(student, val, online, d)}

        before = validate()
        t_start = time.perf_counter()

        def log_metrics(metrics: dict[str, float], step: int) -> None:
            elapsed = time.perf_counter() - t_start
            run_.log_metrics({**metrics, "time/teacher_frac": timed.seconds / max(elapsed, 1e-9)}, step=step)

        with progress(steps, "distill", d.is_main) as advance:
            last = fit(trainer, train, objective, max_steps=steps, grad_accum=cfg.optim.grad_accum_steps,
                       manager=manager, resume=cfg.checkpoint.resume, log_every=cfg.tracking.log_every,
                       on_metrics=log_metrics, evaluate=validate, eval_every=cfg.eval_interval,
                       advance=lambda n, **kw: advance(n, **kw),
                       reliability=Reliability.from_config(cfg.reliability, out / "watchdog"))
        manager.close()
        elapsed = time.perf_counter() - t_start
        metrics = {"train/loss": last.get("loss"), "val/kl": last.get("val/kl"),
                   "val/kl_initial": before.get("val/kl"), "steps": trainer.step,
                   "time/teacher_frac": timed.seconds / max(elapsed, 1e-9)}
        if isinstance(train, OnPolicyMix):
            metrics["on_policy/samples"] = train.samples
        manifest = finish("distill", student, tok, cfg, out, d, run_, metrics,
                          inputs={"student": (upstream or {}).get("digest", cfg.model.name_or_path),
                                  "teacher": (teacher_manifest or {}).get("digest", cfg.teacher.name_or_path)},
                          step=trainer.step)
    close_distributed()
    return manifest or {}


def main(argv: list[str] | None = None) -> None:
    run(parse_spec(DistillConfig, argv))


if __name__ == "__main__":
    main()
