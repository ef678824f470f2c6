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

    torchrun --nproc-per-node 2 -m posttrain.stages.distill --config spec.json
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from posttrain.core.parallel.config import ParallelConfig
from posttrain.stages.config import DistillConfig
from posttrain.core.data.encode import Document, last_run_start
from posttrain.core.data.packing import collate_padded, collate_padding_free
from posttrain.core.losses import IGNORE_INDEX
from posttrain.core.manifest import digest
from posttrain.core.model.generate import SamplingParams, generate
from posttrain.core.objectives import distill_objective, teacher_topk, topk_distill_objective
from posttrain.core.pipeline_objectives import pipelined_distill, pipelined_topk_distill
from posttrain.stages.adapters import adapter_routing, per_adapter_loss, routed, trained_adapters
from posttrain.stages.common import Dist, StageError, parse_spec
from posttrain.stages.recipe import Plan, Session, load_frozen, run_training
from posttrain.stages.training import (DeviceLoader, doc_loader, drop_metrics, mean_loss, pipeline_of, sampling, sampling_lead,
                             sampling_unit, stage_data, to_device)

log = logging.getLogger("posttrain.distill")


def time_teacher(teacher: torch.nn.Module, session: Session) -> None:
    """The teacher's forwards count as the `teacher` phase of the step time (time/teacher_frac:
    a share of the wall time, synchronized on GPU); hooks, so the teacher stays the model the
    objectives inspect (its tp / cp groups)."""
    timing: list = []

    def enter(module, args):
        phase = session.phase("teacher")
        phase.__enter__()
        timing.append(phase)

    def leave(module, args, out):
        timing.pop().__exit__(None, None, None)

    teacher.register_forward_pre_hook(enter)
    teacher.register_forward_hook(leave)


def prompt_of(doc: Document) -> list[int]:
    """The tokens before the document's final completion (its last run of trained labels)."""
    trained = [label != IGNORE_INDEX for label in doc.labels]
    return doc.input_ids[:last_run_start(trained)] if any(trained) else []


class OnPolicyMix:
    """Replaces a share of the loader's micro-batches by the student's samples for their prompts
    (`prompts[i]`: document i's). The draw uses Python's `random` seeded per step, so a resumed run
    draws the same mix."""

    def __init__(self, loader, session: Session, prompts: list[list[int]], generators=None):
        self.loader, self.session, self.prompts = loader, session, prompts
        self.student, self.tok, self.cfg, self.device = session.model, session.tok, session.cfg, session.dist.device
        self.samples = self.truncated = 0
        # generation.mode disaggregated (posttrain.stages.generators.Generators): the workers sample, with the
        # weights of the step being trained; the training loop draws micro-batches in lockstep with
        # its steps, so batch b is trained by the weights after step b // grad_accum (the version)
        self.generators, self.drawn = generators, 0

    def __iter__(self):
        # A step's micro-batches are drawn together (the loader is never ahead of the step being
        # trained, so a checkpoint's data state is unchanged) and, with the colocated engine, all
        # their samples made in one call: the weights do not change within a step and each batch
        # keeps its own seed, so the samples are those of sampling batch by batch, at a batch of
        # grad_accum_steps times the prompts.
        batches = iter(self.loader.loader)  # collated on CPU
        while True:
            group, seeds = [], []
            for batch in batches:
                self.drawn += 1
                draw = random.Random(f"{self.cfg.seed}:{self.loader.state_dict()}")
                seed = None
                if draw.random() < self.cfg.on_policy_ratio:
                    # the sampling seed, as the draw, from the step and this rank's data shard: the
                    # same samples whichever rank of a tp group or pipeline draws them, and on resume
                    seed = random.Random(f"{draw.random()}:{self.session.dist.data_shard[0]}").getrandbits(62)
                group.append(batch)
                seeds.append(seed)
                if len(group) == self.cfg.optim.grad_accum_steps:
                    break
            if not group:
                return
            for batch in self._student_batches(group, seeds):
                yield to_device(batch, self.device)

    def _params(self, seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.cfg.max_new_tokens, temperature=1.0,
                              stop_token_ids=tuple(self.tok.eos_ids), seed=seed)

    @torch.no_grad()
    def _student_batches(self, group: list[dict[str, Any]], seeds: list[int | None]) -> list[dict[str, Any]]:
        """The group's batches, those with a seed replaced by the student's samples for their prompts."""
        todo = [(i, [self.prompts[j] for j in group[i]["doc_indices"]]) for i, seed in enumerate(seeds)
                if seed is not None]
        if not todo:
            return group
        with self.session.phase("student_sampling"):
            if self.generators is None and self.cfg.sampler == "engine":  # one engine call for the step
                every = iter(self._colocated([p for _, ps in todo for p in ps],
                                             [self._params(seeds[i]) for i, ps in todo for _ in ps]))
                gens = [[next(every) for _ in ps] for _, ps in todo]
            else:
                gens = [self._remote(ps, self._params(seeds[i])) if self.generators is not None else
                        self._colocated(ps, self._params(seeds[i])) for i, ps in todo]
        out = list(group)
        for (i, prompts), g in zip(todo, gens):
            out[i] = self._assemble(group[i], prompts, g)
        return out

    def _assemble(self, batch: dict[str, Any], prompts: list[list[int]], gens: list) -> dict[str, Any]:
        self.samples += len(gens)
        docs = [Document(p + g.tokens, [IGNORE_INDEX] * len(p) + g.tokens) if g.tokens else None
                for p, g in zip(prompts, gens)]
        if "attention_mask" in batch:  # pipeline parallelism: padded rows, which the samples keep
            return self._rows(batch, docs)
        docs = [doc for doc in docs if doc is not None]
        mesh = self.session.dist.mesh
        if mesh is not None and mesh.dims.cp > 1:  # the cp ranks of a batch must cut the same sequence
            group = mesh.group("cp")
            shared = [docs]
            dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
            docs = shared[0]
        return collate_padding_free(docs)

    def _colocated(self, prompts: list[list[int]], params) -> list:
        with sampling(self.student, self.cfg.parallel):  # every rank samples at the same micro-step
            if self.cfg.sampler == "engine":
                from posttrain.core.generation.engine import engine_generate

                gens = engine_generate(self.student, prompts, params)
            else:
                gens = generate(self.student, prompts, params, pad_id=self.tok.pad_id or 0)
        self.student.train()
        return gens

    def _remote(self, prompts: list[list[int]], params: SamplingParams) -> list:
        """The workers sample every data shard's prompts (a tp or cp group's ranks share theirs);
        each rank takes its shard's. Collective: the sync and the gather."""
        from posttrain.core.generation.remote import Request

        d, g = self.session.dist, self.generators
        version = (self.drawn - 1) // self.cfg.optim.grad_accum_steps
        g.sync(version)
        mine = (d.data_shard[0], prompts, params.seed)
        every = [mine]
        if d.world > 1:
            every = [None] * d.world
            dist.all_gather_object(every, mine)
        shards = {shard: (ps, seed) for shard, ps, seed in reversed(every)}
        order = sorted(shards)
        g.submit(version, [Request(shards[k][0], {**dataclasses.asdict(params), "seed": shards[k][1]})
                           for k in order])
        return g.collect(version)[order.index(d.data_shard[0])][0]

    def _rows(self, batch: dict[str, Any], docs: list[Document | None]) -> dict[str, Any]:
        """The samples packed again into the pipeline's fixed shapes: at most pipeline_rows() rows
        of max_seq_len tokens, each sample in the first row with room for it (in batch order).
        Only when none has room is the sample cut to the room left in the emptiest row (counted
        in on_policy/truncated; dropped if not one completion token fits)."""
        width, limit = self.cfg.data.max_seq_len, self.cfg.pipeline_rows()
        rows: list[list[Document]] = []
        room: list[int] = []
        for doc in (x for x in docs if x is not None):
            r = next((i for i, left in enumerate(room) if left >= len(doc)), None)
            if r is None and len(rows) < limit:
                rows.append([]), room.append(width)
                r = len(rows) - 1
            if r is None:
                self.truncated += 1
                r = max(range(len(room)), key=room.__getitem__)
                if room[r] <= sum(label == IGNORE_INDEX for label in doc.labels):
                    continue  # not one completion token fits
                doc = Document(doc.input_ids[:room[r]], doc.labels[:room[r]])
            rows[r].append(doc)
            room[r] -= len(doc)
        return collate_padded(rows, self.tok.pad_id or 0)

    def __len__(self):
        return len(self.loader)

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, s):
        self.loader.load_state_dict(s)


CACHE_CHUNK = 64  # documents per file of the offline teacher cache


class TeacherTopK:
    """The teacher's top-k log-probs at every position of every training document (offline
    distillation), kept on disk: one safetensors file of (tokens, k) ids and log-probs per chunk
    of CACHE_CHUNK documents, under a directory named by what determines it (the teacher, k and
    the documents' tokens: nothing of the student's settings), so any later run, or another
    student, with the same teacher and data reuses it. A batch reads only its documents' rows,
    memory-mapped; no rank holds the whole (tokens, k) table."""

    def __init__(self, root: Path, docs: list[Document], k: int, teacher_id: str):
        self.k = k
        self.dir = root / f"top{k}-{digest([teacher_id, k, [x.input_ids for x in docs]])[:16]}"
        self.chunks = (len(docs) + CACHE_CHUNK - 1) // CACHE_CHUNK
        self.start = [0] * len(docs)  # each document's first row within its chunk's file
        for i in range(len(docs)):
            if i % CACHE_CHUNK:
                self.start[i] = self.start[i - 1] + len(docs[i - 1])
        self.length = [len(x) for x in docs]
        self._files: dict[int, Any] = {}

    def path(self, chunk: int) -> Path:
        return self.dir / f"chunk-{chunk:06d}.safetensors"

    @property
    def complete(self) -> bool:
        return (self.dir / "complete").exists()

    def rows(self, doc_indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids (n, k) int64, log-probs (n, k)) of the documents' positions, in order."""
        from safetensors import safe_open

        ids, logps = [], []
        for u in doc_indices:
            c = u // CACHE_CHUNK
            if c not in self._files:
                if len(self._files) >= 16:  # a bounded number of open memory maps
                    self._files.pop(next(iter(self._files)))
                self._files[c] = safe_open(str(self.path(c)), "pt")
            f, a = self._files[c], self.start[u]
            ids.append(f.get_slice("ids")[a:a + self.length[u]])
            logps.append(f.get_slice("logps")[a:a + self.length[u]])
        return torch.cat(ids).long(), torch.cat(logps)


@torch.no_grad()
def score_teacher(teacher, docs: list[Document], k: int, cache: Path, teacher_id: str, d: Dist,
                  layout: ParallelConfig) -> TeacherTopK:
    """Score the documents with the teacher into its TeacherTopK cache (unless complete): the
    chunks still missing are dealt round-robin to the sampling units (each rank, or each tp group,
    whose ranks score the same chunk in lockstep: posttrain.core.objectives.teacher_topk), each unit's first
    rank writes its chunks' files (atomically, so a run killed meanwhile leaves whole files that the
    next run keeps), and every rank runs as many forwards (a unit out of chunks scores one again,
    unsaved): a sharded teacher's forwards are collective."""
    topk = TeacherTopK(cache, docs, k, teacher_id)
    if topk.complete:
        return topk
    d.barrier()  # every rank sees the same files missing
    todo = [c for c in range(topk.chunks) if not topk.path(c).exists()]
    unit, units = sampling_unit(d)
    writes = sampling_lead(d)
    mine = todo[unit::units]
    rounds = (len(todo) + units - 1) // units
    topk.dir.mkdir(parents=True, exist_ok=True)
    teacher.eval()
    # whole documents: under CP the teacher attends as an ordinary model meanwhile (each cp rank
    # scoring its own chunks); under PP its stages run one after the other (StagedModel), calling
    # their parts directly. An FSDP-sharded teacher is then gathered whole, as for sampling.
    whole = sampling(teacher, layout) if layout.cp > 1 or layout.pp > 1 else contextlib.nullcontext()
    with whole:
        for r in range(rounds):
            c = mine[r] if r < len(mine) else todo[0]
            chunk = docs[c * CACHE_CHUNK:(c + 1) * CACHE_CHUNK]
            ids, logps = teacher_topk(teacher, to_device(collate_padding_free(chunk), d.device), k)
            if r < len(mine) and writes:
                tmp = topk.path(c).with_name(f".{topk.path(c).name}.{os.getpid()}.tmp")
                save_file({"ids": ids.cpu(), "logps": logps.cpu()}, str(tmp))
                os.replace(tmp, topk.path(c))
    d.barrier()
    if d.is_main:
        missing = [c for c in range(topk.chunks) if not topk.path(c).exists()]
        if missing:
            raise StageError(f"distill: teacher cache {topk.dir} lacks chunks {missing[:5]} after scoring")
        (topk.dir / "complete").write_text(json.dumps({"teacher": teacher_id, "k": k, "chunks": topk.chunks}))
    d.barrier()
    return topk


class Distill:
    name = "distill"

    def setup(self, s: Session) -> Plan:
        cfg, d, student, tok = s.cfg, s.dist, s.model, s.tok
        # sharded for inference (teacher.parallel, default the student's layout), each rank reading its
        # shards; under CP it scores the student's share of each batch with ring attention (offline:
        # whole documents, before training)
        teacher, teacher_manifest = load_frozen(cfg.teacher, cfg.teacher_layout(), d, cfg.seed)
        if teacher.args.vocab_size != student.args.vocab_size:
            raise StageError(f"distill: teacher vocab {teacher.args.vocab_size} != student vocab "
                             f"{student.args.vocab_size}; they must share the tokenizer")
        time_teacher(teacher, s)

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
        pipe = pipeline_of(d)
        kd = (cfg.divergence, cfg.temperature, cfg.jsd_beta, cfg.ce_weight)
        if pipe is not None:  # both split into the same stages: each micro-batch runs both schedules
            online = pipelined_distill(pipe, teacher.pipeline, cfg.pipeline_rows(), cfg.data.max_seq_len,
                                       d.mesh.group("pp"), *kd, teacher_phase=lambda: s.phase("teacher"))
        else:
            online = distill_objective(teacher, *kd)
        teacher_id = (teacher_manifest or {}).get("digest", cfg.teacher.name_or_path)
        train = DeviceLoader(base, d.device)
        objective = online
        if cfg.mode == "offline":  # before training: not part of the step time
            cache = Path(cfg.teacher_cache) if cfg.teacher_cache else s.out / "teacher_cache"
            topk = score_teacher(teacher, train_docs, cfg.top_k, cache, teacher_id, d, cfg.teacher_layout())
            objective = topk_distill_objective(topk.rows, *kd) if pipe is None else \
                pipelined_topk_distill(pipe, topk.rows, cfg.pipeline_rows(), cfg.data.max_seq_len, d.mesh.group("pp"),
                                       *kd)
        elif cfg.mode == "on_policy":
            generators = None
            if cfg.generation.mode == "disaggregated":
                from posttrain.stages.generators import Generators

                generators = Generators(s)
            train = OnPolicyMix(train, s, prompts, generators)

        names = trained_adapters(cfg)
        if names:  # each document through its adapter (on_policy is refused with several)
            objective, online = routed(objective, names), routed(online, names)

        def val_kl(docs) -> float:
            val = DeviceLoader(doc_loader(docs, cfg.data, d, epochs=1, evaluation=True), d.device)
            return mean_loss(student, val, online, d)

        def validate() -> dict[str, float]:
            if not val_docs:
                return {}
            if names:  # val/kl/<adapter> too
                return per_adapter_loss(val_docs, names, val_kl, "val/kl")
            return {"val/kl": val_kl(val_docs)}

        def summary() -> dict[str, float]:
            extra = {"on_policy/samples": train.samples, "on_policy/truncated": train.truncated} \
                if isinstance(train, OnPolicyMix) else {}
            if isinstance(train, OnPolicyMix) and train.generators is not None:
                extra.update({f"on_policy/{k}": v for k, v in train.generators.stats.items()})
            if extra.get("on_policy/truncated"):
                log.warning("distill: %d samples were cut to fit the pipeline's rows of max_seq_len=%d tokens; "
                            "data.packing=false (one document a row) leaves each sample its row",
                            extra["on_policy/truncated"], cfg.data.max_seq_len)
            return {**extra, **drop_metrics(stats)}

        generators = train.generators if isinstance(train, OnPolicyMix) else None
        return Plan(train, objective, validate, inputs={"teacher": teacher_id}, summary=summary,
                    **({"close": generators.close} if generators is not None else {}))


def run(cfg: DistillConfig) -> dict:
    return run_training(Distill(), cfg)


def main(argv: list[str] | None = None) -> None:
    run(parse_spec(DistillConfig, argv))


if __name__ == "__main__":
    main()
