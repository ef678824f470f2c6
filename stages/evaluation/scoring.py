"""One model's (or the judge's) numbers on this rank's rows, and their gathering over ranks.

Rows go to ranks in whole batches of `batch_size` (batch b to rank b % world; under tensor
parallelism to tp group b % (world / tp), whose ranks hold one model split), so a batch's rows,
its padding and its sampling seed are the same whatever the number of ranks, and the gathered
per-row records (hence the metrics) equal a single process's. Everything that can fail on a row
(its prompt, its tokens, a model path) is checked by `encode` and `check_model` before any model
loads; a verifier or judge failure on one rank is gathered and raised on every rank alike, so no
rank is left waiting in a collective.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from posttrain.core.data.dataset import read_template
from posttrain.core.data.encode import Document, Encoder, PreferencePair
from posttrain.core.data.errors import DataError, RowError
from posttrain.core.data.formats import Preference, PromptCompletion
from posttrain.core.data.rows import PromptRow, prompt_text
from posttrain.core.losses import IGNORE_INDEX
from posttrain.core.manifest import digest
from posttrain.core.model.generate import SamplingParams, generate
from posttrain.core.objectives import token_logps
from posttrain.core.rewards import VerifierError, exact_match, load_verifier, normalized_match
from posttrain.stages.common import Dist, StageError, resolve_model_dir
from posttrain.stages.config import EvalConfig
from posttrain.stages.evaluation.metrics import GenRecord
from posttrain.stages.evaluation.plan import EvalData, Plan, fail
from posttrain.core.parallel.context import without_context_parallel
from posttrain.stages.training import sampling, sampling_unit

log = logging.getLogger("posttrain.evaluate")


def my_batches(n: int, size: int, d: Dist) -> list[range]:
    """This rank's batches of row indices: whole batches, dealt round-robin to the ranks (under
    tensor parallelism to the tp groups, whose ranks run the same batches together). With the
    models sharded over the ranks (d.lockstep) every rank gets as many, a short one empty ranges:
    it then runs a filler forward (`filler`) whose results are dropped."""
    unit, units = sampling_unit(d)
    batches = [range(s, min(s + size, n)) for s in range(0, n, size)]
    mine = batches[unit::units]
    if d.lockstep is not None:
        mine += [range(0)] * (-(-len(batches) // units) - len(mine))
    return mine


def filler(pad_id: int) -> Document:
    """A two-token document with no target: what a rank with nothing to score runs in lockstep."""
    return Document([pad_id, pad_id], [IGNORE_INDEX, IGNORE_INDEX])


def sample_seed(seed: int, batch_start: int, repetition: int) -> int:
    """The sampling seed of one repetition of one batch (by its first row), stable across runs and
    world sizes; every repetition draws its own stream, so a prompt's samples differ."""
    return int(digest([seed, batch_start, repetition])[:15], 16)


# ------------------------------------------------------------------------------------ encoding


@dataclass
class Encoded:
    """One tokenizer's view of the data; None marks a row the truncation policy dropped."""

    prompt_ids: list[list[int]] = field(default_factory=list)
    docs: list[Document | None] = field(default_factory=list)
    pairs: list[PreferencePair | None] = field(default_factory=list)

    def max_id(self) -> int:
        ids = [max(p, default=0) for p in self.prompt_ids]
        ids += [max(d.input_ids, default=0) for d in self.docs if d is not None]
        ids += [max(p.chosen.input_ids + p.rejected.input_ids, default=0) for p in self.pairs if p is not None]
        return max(ids, default=0)


def template_kwargs(cfg: EvalConfig) -> dict[str, Any]:
    template = read_template(cfg.data.chat_template)
    return {} if template is None else {"chat_template": template}


def encode_prompt(tok, prompt: Any, kwargs: dict[str, Any]) -> list[int]:
    """Token ids a generation starts from: a string as plain text (BOS as the tokenizer adds it), chat
    messages through the chat template with the assistant's generation prompt."""
    if isinstance(prompt, str):
        ids = tok.encode(prompt)
        return ids[:-1] if len(ids) > 1 and ids[-1] in tok.eos_ids else ids  # a post-processor's EOS
    return tok.apply_chat_template(prompt, add_generation_prompt=True, **kwargs)


def encode(tok, cfg: EvalConfig, data: EvalData, plan: Plan) -> Encoded:
    """Every row the plan needs, tokenized; StageError naming the row and field for one that cannot be."""
    kwargs = template_kwargs(cfg)
    out = Encoded()
    if plan.generates:
        for r in data.prompts:
            try:
                ids = encode_prompt(tok, r.prompt, kwargs)
            except Exception as e:  # chat templates are user code
                raise fail(f"{r.where}, field prompt: cannot be tokenized with {tok.origin}: {type(e).__name__}: "
                           f"{e}") from None
            if not ids:
                raise fail(f"{r.where}, field prompt: no tokens to generate from")
            out.prompt_ids.append(ids)
    encoder = Encoder(tok, cfg.data.max_seq_len, cfg.data.truncation, True, kwargs.get("chat_template"))

    def item(r: PromptRow, example: Any) -> Any:
        try:
            return encoder(example)
        except RowError as e:
            if e.always_skip or cfg.data.on_bad_row == "skip":
                log.warning("evaluate: %s skipped (%s: %s)", r.where, e.field, e.detail)
                return None
            raise fail(f"{r.where}, field {e.field}: {e.detail}") from None
        except DataError as e:
            raise fail(f"{r.where}: {e}") from None

    if plan.has("perplexity"):
        out.docs = [item(r, PromptCompletion(r.prompt, r.completion)) for r in data.completions]
    if plan.has("preference_accuracy"):
        out.pairs = [item(r, Preference(r.prompt, r.chosen, r.rejected)) for r in data.pairs]
    return out


def check_model(path: str) -> None:
    """StageError for a model that cannot load: no such directory, no HF config, unknown preset."""
    from posttrain.core.model import get_preset

    model_dir, _ = resolve_model_dir(path)
    if model_dir is None:
        try:
            get_preset(path)
        except KeyError as e:
            raise fail(f"model {path!r}: {e.args[0]}") from None
    elif not (model_dir / "config.json").exists():
        raise fail(f"model {path!r}: {model_dir} has no config.json (not a Hugging Face checkpoint)")


def check_vocab(model, enc: Encoded, tok, path: str) -> None:
    vocab = model.args.vocab_size
    if enc.max_id() >= vocab:
        raise fail(f"model {path!r} has {vocab} token embeddings but its tokenizer ({tok.origin}) gives id "
                   f"{enc.max_id()}; set `tokenizer` to the model's own")


# ------------------------------------------------------------------------------------ scores


class Scorer:
    """A prompt's samples -> GenRecord: the metrics' per-sample scores and the primary score."""

    def __init__(self, cfg: EvalConfig, plan: Plan):
        self.col = cfg.reference_column
        self.builtin = [m for m in ("exact_match", "normalized_match") if plan.has(m)]
        self.reward = plan.has("reward")
        self.primary = plan.scorer
        self.spec = cfg.verifier
        self.verifier = None
        if cfg.verifier is not None:
            try:
                self.verifier = load_verifier(cfg.verifier, cfg.reference_column, cfg.allow_unsafe_exec)
            except VerifierError as e:
                raise fail(str(e)) from None

    def __call__(self, row: PromptRow, texts: list[str]) -> GenRecord:
        ref = row.fields.get(self.col)
        rec = GenRecord(texts)
        for name in self.builtin:
            compare = exact_match if name == "exact_match" else normalized_match
            rec.scores[name] = [compare(ref, t) for t in texts]
        rewards = None
        if self.verifier is not None:
            prompt = prompt_text(row.prompt)
            rewards = [self.verifier(prompt, t, dict(row.fields)) for t in texts]
            if self.reward:
                rec.scores["reward"] = rewards
        if self.primary == "verifier":
            rec.primary = rewards
        elif self.primary == "exact_match":
            rec.primary = rec.scores.get("exact_match") or [exact_match(ref, t) for t in texts]
        return rec


@torch.no_grad()
def generate_records(model, tok, enc: Encoded, data: EvalData, cfg: EvalConfig, d: Dist, scorer: Scorer,
                     advance: Callable) -> tuple[dict[int, GenRecord], list[str]]:
    """{row: GenRecord} of this rank's prompts, and the errors the scorer raised (which stop it)."""
    out: dict[int, GenRecord] = {}
    errors: list[str] = []
    stop = tuple(sorted(tok.eos_ids))
    pad = tok.pad_id if tok.pad_id is not None else 0
    for batch in my_batches(len(data.prompts), cfg.batch_size, d):
        texts: list[list[str]] = [[] for _ in batch]
        prompts = [enc.prompt_ids[i] for i in batch] or [[pad]]  # a lockstep filler: one dummy row
        if cfg.sampler == "engine" and batch:  # every sample of a prompt in one call, sharing its blocks
            from posttrain.core.generation.engine import engine_generate

            n = cfg.num_samples
            params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                    stop_token_ids=stop, seed=sample_seed(cfg.seed, batch.start, 0))
            with sampling(model, cfg.parallel, gather=True):  # under tp: decode mode (no sequence split)
                gens = engine_generate(model, prompts, params, n=n)
            for j, t in enumerate(texts):
                t.extend(tok.decode(g.tokens, skip_special_tokens=True) for g in gens[j * n:(j + 1) * n])
        for k in range(cfg.num_samples if cfg.sampler == "static" else 0):
            params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                    stop_token_ids=stop, seed=sample_seed(cfg.seed, batch.start, k))
            with sampling(model, cfg.parallel, gather=d.lockstep is None):
                gens = generate(model, prompts, params, pad_id=pad, lockstep=d.lockstep)
            for t, g in zip(texts, gens):
                t.append(tok.decode(g.tokens, skip_special_tokens=True))
        for i, t in zip(batch, texts):
            row = data.prompts[i]
            try:
                if not errors:
                    out[i] = scorer(row, t)
            except Exception as e:  # the user's verifier
                errors.append(f"{row.where}: verifier {scorer.spec!r} failed: {type(e).__name__}: {e}")
                if d.lockstep is None:  # alone, stop now; in lockstep the others still need this rank's forwards
                    return out, errors
        advance(len(batch) * cfg.num_samples)
    return out, errors


@torch.no_grad()
def sequence_logps(model, docs: list[Document], pad_id: int) -> list[tuple[float, int]]:
    """(summed log-prob of each document's labelled tokens, their number), one right-padded forward."""
    device = next(model.parameters()).device  # (a pipeline stage's part may hold no embedding)
    width = max(len(doc) for doc in docs)
    ids = torch.full((len(docs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(docs), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(docs), width), dtype=torch.long)
    for b, doc in enumerate(docs):
        n = len(doc)
        ids[b, :n], labels[b, :n], mask[b, :n] = torch.tensor(doc.input_ids), torch.tensor(doc.labels), 1
    batch = {"input_ids": ids.to(device), "labels": labels.to(device), "attention_mask": mask.to(device)}
    with without_context_parallel(model):  # whole padded rows on each rank (ring attention off)
        sums = token_logps(model, batch).double().sum(-1).tolist()
    counts = (labels[:, 1:] != IGNORE_INDEX).sum(-1).tolist()
    return [(float(s), int(c)) for s, c in zip(sums, counts)]


def completion_nll(model, tok, enc: Encoded, cfg: EvalConfig, d: Dist, advance: Callable) -> dict[int, tuple]:
    """{row: (summed NLL of its completion tokens, their number)} for this rank's completion rows."""
    out: dict[int, tuple] = {}
    for batch in my_batches(len(enc.docs), cfg.batch_size, d):
        idx = [i for i in batch if enc.docs[i] is not None]
        if idx:
            for i, (s, n) in zip(idx, sequence_logps(model, [enc.docs[i] for i in idx], tok.pad_id or 0)):
                out[i] = (-s, n)
        elif d.lockstep is not None:
            sequence_logps(model, [filler(tok.pad_id or 0)], tok.pad_id or 0)
        advance(len(batch))
    return out


def pair_logps(model, tok, enc: Encoded, cfg: EvalConfig, d: Dist, advance: Callable) -> dict[int, tuple]:
    """{pair: (summed log-prob of chosen, of rejected), each given the prompt} for this rank's pairs."""
    out: dict[int, tuple] = {}
    for batch in my_batches(len(enc.pairs), cfg.batch_size, d):
        idx = [i for i in batch if enc.pairs[i] is not None]
        if idx:
            docs = [enc.pairs[i].chosen for i in idx] + [enc.pairs[i].rejected for i in idx]
            logps = sequence_logps(model, docs, tok.pad_id or 0)
            for j, i in enumerate(idx):
                out[i] = (logps[j][0], logps[len(idx) + j][0])
        elif d.lockstep is not None:
            sequence_logps(model, [filler(tok.pad_id or 0)], tok.pad_id or 0)
        advance(len(batch))
    return out


def judge_document(tok, prompt: Any, completion: str, kwargs: dict[str, Any]) -> Document:
    ids, mask = tok.encode_prompt_completion(prompt, completion, **kwargs)
    return Document(ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)])


@torch.no_grad()
def judge_scores(judge, tok, data: EvalData, gen: dict[str, dict[int, GenRecord]], cfg: EvalConfig,
                 d: Dist) -> tuple[dict[int, dict[str, list[float]]], list[str]]:
    """{row: {model: the judge's mean per-token log-likelihood of each sample given the prompt}} for
    this rank's prompts (-inf for a completion with no token to score), and any errors."""
    kwargs = template_kwargs(cfg)
    out: dict[int, dict[str, list[float]]] = {}
    errors: list[str] = []
    for batch in my_batches(len(data.prompts), cfg.batch_size, d):
        slots, docs = [], []
        for i in batch:
            row = data.prompts[i]
            for name, records in gen.items():
                for text in records[i].completions:
                    try:
                        docs.append(judge_document(tok, row.prompt, text, kwargs))
                    except Exception as e:
                        errors.append(f"{row.where}: the judge's tokenizer ({tok.origin}) cannot encode a "
                                      f"completion of {name}: {type(e).__name__}: {e}")
                        if d.lockstep is None:
                            return out, errors
                    slots.append((i, name))
        if errors:  # (lockstep: keep the group's forwards going, score nothing more)
            docs, slots = [], []
        scored: list[tuple[float, int]] = []
        starts = list(range(0, len(docs), cfg.batch_size))
        if d.lockstep is not None:  # as many forwards as the rank with the most documents
            most = torch.tensor(len(starts))
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=d.lockstep)
            starts += [None] * (int(most) - len(starts))
        for s in starts:
            if s is None:
                sequence_logps(judge, [filler(tok.pad_id or 0)], tok.pad_id or 0)
            else:
                scored += sequence_logps(judge, docs[s : s + cfg.batch_size], tok.pad_id or 0)
        for (i, name), (total, n) in zip(slots, scored):
            out.setdefault(i, {}).setdefault(name, []).append(total / n if n else -math.inf)
    return out, errors


# ------------------------------------------------------------------------------------ ranks


def gather(d: Dist, local: dict[int, Any]) -> dict[int, Any]:
    """Every rank's {row: record}, merged (collective)."""
    if d.world == 1:
        return dict(local)
    parts: list[Any] = [None] * d.world
    dist.all_gather_object(parts, local)
    merged: dict[int, Any] = {}
    for p in parts:
        merged.update(p)
    return merged


def raise_errors(d: Dist, errors: list[str]) -> None:
    """Raise the errors of any rank on every rank (collective)."""
    every = gather(d, {d.rank: errors})
    found = [e for r in sorted(every) for e in every[r]]
    if found:
        raise StageError("evaluate: " + "; ".join(found[:3]))
