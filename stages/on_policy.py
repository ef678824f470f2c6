"""On-policy preference pairs for DPO (`pairs: on_policy`): the policy samples completions for the
data's prompts, a reward ranks them, the best is chosen and the worst rejected.

Prompts are posttrain.core.data.rows.prompt_rows of every source: data prep's output (its preference rows, or
its SFT rows where it prepared no pairs) or the user's own files, in any TRL format or prompts only
(`{"prompt": "2+2?", "answer": "4"}`). A message prompt is rendered with the chat template
(data.chat_template or the tokenizer's) and a generation prompt; a string prompt is plain text, as
encode_prompt_completion encodes it.

The reward (DPOConfig):
  judge      set: a completion's reward is the judge model's mean per-token log-likelihood of it
             (its sampled tokens, the stop token included) given the prompt's tokens; the judge
             must share the policy's vocabulary
  reward     'exact_match' / 'normalized_match' against row[reference_column], or a verifier
             'module:function(prompt, completion, row) -> float' (posttrain.core.rewards.load_verifier)
A verifier gets the prompt as text (the last user turn), the completion decoded without special
tokens, and the row: its other columns plus prompt / completion / chosen / rejected as text.

Per prompt, `num_samples` completions are scored; chosen = the best, rejected = the worst (the first
of equals); a prompt whose samples all score the same gives no pair, except that under a built-in
verifier, when no sample is correct, the row's reference answer stands as chosen.

Splits: data prep's own; a user's file's rows by the split a saved DatasetDict names, else by a
hash of the prompt with data.val_fraction / test_fraction (posttrain.core.data.split, as load_data splits the
same file). Training samples at most as many prompts as max_steps can use. Validation pairs are the
data's own pairs where a source holds pairs (data prep's preference validation split, the validation
share of a user's preference file), else pairs sampled as above for the validation prompts.

Ranks: the prompts go in chunks; rank r samples chunks r, r + world, ..., each with its own seed,
and the outcomes are all-gathered in chunk order, so every rank trains on the same pairs, and on the
same ones whatever the world size. An error on any rank (a verifier that raises) stops every rank.

Bad rows (a missing reference, a template that fails, a prompt with no room left under
max_seq_len) are DataErrors naming file, line/row and field, or are counted with on_bad_row='skip',
all before sampling. Each prompt's samples, rewards and choice go to <output>/on_policy/<split>.jsonl.
"""

from __future__ import annotations

import contextlib

import json
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from posttrain.core.atomic import write_text_atomic
from posttrain.core.data.dataset import read_template
from posttrain.core.data.encode import Document, PreferencePair
from posttrain.core.data.errors import DataError, DropStats, RowError
from posttrain.core.data.packing import collate_padding_free, sequence_sums
from posttrain.core.data.prepared import fit_pair, is_prepared, load_splits
from posttrain.core.data.rows import PromptRow, completion_text, prompt_rows, prompt_text
from posttrain.core.data.split import assign_split, split_key
from posttrain.core.losses import IGNORE_INDEX
from posttrain.core.manifest import read_manifest
from posttrain.core.model.generate import SamplingParams, generate
from posttrain.core.objectives import token_logps
from posttrain.core.rewards import BUILTIN, VerifierError, load_verifier
from posttrain.stages.common import StageError, find_tokenizer_dir, load_model, load_tokenizer
from posttrain.stages.training import sampling, sampling_unit, to_device

log = logging.getLogger("posttrain.dpo")

CHUNK = 32  # prompts per generation batch (times num_samples sequences)


@dataclass
class Prompt:
    """A prompt ready to sample: its row, its tokens, the row as verifiers see it, and (built-in
    rewards) the reference answer as a completion's tokens and labels."""

    row: PromptRow
    ids: list[int]
    data: dict[str, Any]
    reference: tuple[list[int], list[int]] | None = None


def verifier_row(pr: PromptRow) -> dict[str, Any]:
    row = dict(pr.fields)
    row["prompt"] = prompt_text(pr.prompt)
    for name in ("completion", "chosen", "rejected"):
        value = getattr(pr, name)
        if value is not None:
            row[name] = completion_text(value)
    return row


# --------------------------------------------------------------------------------------- rewards

class Reward:
    """Scores completions of prompts: by the judge model, or by the verifier `cfg.reward`."""

    def __init__(self, cfg, tok, policy, device: torch.device, stage: str = "dpo"):
        self.cfg, self.device, self.judge, self.stage = cfg, device, None, stage  # stage: the errors' prefix
        self.builtin = cfg.judge is None and cfg.reward in BUILTIN
        if cfg.judge is not None:
            self.judge = load_judge(cfg, tok, policy, device, stage)
            self.name = f"judge {cfg.judge.name_or_path!r}"
            return
        try:
            self.verifier = load_verifier(cfg.reward, cfg.reference_column, cfg.allow_unsafe_exec)
        except VerifierError as e:
            raise StageError(f"{stage}: reward: {e}") from None
        self.name = f"verifier {cfg.reward!r}"

    def scores(self, prompts: list[Prompt], completions: list[list[list[int]]],
               texts: list[list[str]]) -> list[list[float]]:
        """Rewards of every completion (token ids, and decoded) of every prompt."""
        if self.judge is not None:
            flat = mean_logliks(self.judge, [(p.ids, c) for p, cs in zip(prompts, completions) for c in cs],
                                self.device)
            n = self.cfg.num_samples
            return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]
        return [[self.verify(p, t) for t in ts] for p, ts in zip(prompts, texts)]

    def verify(self, p: Prompt, text: str) -> float:
        try:
            return self.verifier(prompt_text(p.row.prompt), text, dict(p.data))
        except VerifierError as e:
            raise StageError(f"{self.stage}: {p.row.where}: {e}") from None
        except Exception as e:  # the user's code: name the row and the entry point
            raise StageError(f"{self.stage}: {p.row.where}: verifier {self.cfg.reward!r} raised "
                             f"{type(e).__name__}: {e}") from e


def load_judge(cfg, tok, policy, device: torch.device, stage: str = "dpo"):
    """The judge model, frozen, checked to share the policy's vocabulary (size, and the tokens
    themselves where the judge carries a tokenizer)."""
    judge, _ = load_model(cfg.judge, device, cfg.seed)
    judge.requires_grad_(False).eval()
    name = cfg.judge.name_or_path
    if judge.args.vocab_size != policy.args.vocab_size:
        raise StageError(f"{stage}: judge {name!r} has a vocabulary of {judge.args.vocab_size} tokens, the policy "
                         f"{policy.args.vocab_size}; the judge scores the policy's tokens, so it must share its "
                         "tokenizer")
    try:
        judge_dir = find_tokenizer_dir(cfg.judge.tokenizer, name)
    except StageError:
        return judge  # a preset judge: no tokenizer of its own to compare
    theirs = load_tokenizer(judge_dir).backend.get_vocab(with_added_tokens=True)
    if theirs != tok.backend.get_vocab(with_added_tokens=True):
        raise StageError(f"{stage}: judge {name!r} has a different tokenizer ({judge_dir}) from the policy's; the "
                         "judge scores the policy's tokens, so it must share its tokenizer")
    return judge


@torch.no_grad()
def mean_logliks(model, seqs: list[tuple[list[int], list[int]]], device: torch.device,
                 batch: int = 64) -> list[float]:
    """Mean per-token log-likelihood of each completion given its prompt: (prompt ids, completion ids)."""
    out: list[float] = []
    for i in range(0, len(seqs), batch):
        part = seqs[i:i + batch]
        docs = [Document(p + c, [IGNORE_INDEX] * len(p) + c) for p, c in part]
        b = to_device(collate_padding_free(docs), device)
        sums = sequence_sums(token_logps(model, b).float(), b["sequence_ids"], len(part))
        out.extend((s / max(len(c), 1)) for s, (_, c) in zip(sums.tolist(), part))
    return out


# --------------------------------------------------------------------------------------- prompts

def split_of(row: PromptRow, data) -> str:
    return row.split or assign_split(split_key(row), data.val_fraction, data.test_fraction)


def prompt_sets(cfg, tok, stats: DropStats) -> tuple[list[PromptRow], list[PromptRow], list[PreferencePair]]:
    """(training prompts, validation prompts to sample, the data's own validation pairs)."""
    data = cfg.data
    if not data.sources:
        raise StageError("dpo: pairs='on_policy' needs prompts: data.sources is empty")
    train: list[PromptRow] = []
    val: list[PromptRow] = []
    val_pairs: list[PreferencePair] = []

    def own_pairs(src) -> list[PreferencePair]:
        return [p for p, _ in load_splits([src], "preference", ["validation"], tok, data)["validation"]]

    for src in data.sources:
        if is_prepared(src):
            outputs = read_manifest(src)["outputs"]
            task = "preference" if any(k.startswith("preference_") for k in outputs) else "sft"
            train += prompt_rows([src], "train", data.on_bad_row, stats, task=task)
            if task == "preference":
                val_pairs += own_pairs(src)
            else:
                val += prompt_rows([src], "validation", data.on_bad_row, stats, task=task)
            continue
        rows = prompt_rows([src], "train", data.on_bad_row, stats)
        by_split: dict[str, list[PromptRow]] = {"train": [], "validation": [], "test": []}
        for r in rows:
            by_split[split_of(r, data)].append(r)
        train += by_split["train"]
        if rows and all(r.is_pair for r in rows):
            val_pairs += own_pairs(src)
        else:
            val += by_split["validation"]
    return train, val, val_pairs


def encode_prompt(tok, prompt, template: dict[str, Any]) -> list[int]:
    """A message prompt through the chat template with the generation prompt; a string as plain text
    (the BOS the tokenizer adds, no EOS after it)."""
    if not isinstance(prompt, str):
        return tok.apply_chat_template(prompt, add_generation_prompt=True, **template)
    ids = tok.encode(prompt)
    eos = tok.eos_id
    if eos is not None and ids[-1:] == [eos] and tok.encode(prompt, add_special_tokens=False)[-1:] != [eos]:
        ids = ids[:-1]  # a post-processor that appends EOS: the completion follows the prompt
    return ids


def reference_tokens(tok, row: PromptRow, ids: list[int], answer: str, template: dict[str, Any]):
    """The reference answer as a completion of the prompt `ids`: (tokens, labels)."""
    completion = answer if isinstance(row.prompt, str) else [{"role": "assistant", "content": answer}]
    full, mask = tok.encode_prompt_completion(row.prompt, completion, **template)
    n = len(ids)
    if full[:n] == ids and any(mask[n:]):
        return full[n:], [t if m else IGNORE_INDEX for t, m in zip(full[n:], mask[n:])]
    tail = tok.encode(answer, add_special_tokens=False) + ([tok.eos_id] if tok.eos_id is not None else [])
    return tail, list(tail)  # the prompt was cut (truncation='left') or BPE merged across the boundary


def prepare_prompts(rows: list[PromptRow], tok, cfg, builtin: bool, stats: DropStats) -> list[Prompt]:
    """Tokenize every prompt (and reference); a bad row is a DataError naming it, or counted."""
    data = cfg.data
    template = {} if data.chat_template is None else {"chat_template": read_template(data.chat_template)}
    out = []
    for r in rows:
        if not isinstance(r.prompt, str) and tok.chat_template is None and not template:
            raise DataError(f"the tokenizer ({tok.origin}) has no chat template and data.chat_template is not set, "
                            "but the data holds chat messages", source=r.where)
        try:
            out.append(_prepare(r, tok, cfg, builtin, template))
        except RowError as e:
            err = DataError(e.detail, source=r.where, field=e.field, reason=e.reason)
            if not (e.always_skip or data.on_bad_row == "skip"):
                raise err from None
            stats.drop(err)
            stats.kept -= 1
    return out


def _prepare(r: PromptRow, tok, cfg, builtin: bool, template: dict[str, Any]) -> Prompt:
    data = verifier_row(r)
    if builtin and data.get(cfg.reference_column) is None:
        raise RowError("missing_field", cfg.reference_column,
                       f"missing: reward {cfg.reward!r} compares completions against it (reference_column)")
    try:
        ids = encode_prompt(tok, r.prompt, template)
    except Exception as e:  # templates are user code
        raise RowError("template_error", "prompt", f"tokenizing failed: {type(e).__name__}: {e}") from e
    if not ids:
        raise RowError("empty_content", "prompt", "the prompt has no tokens")
    max_len = cfg.data.max_seq_len
    if len(ids) >= max_len:
        over = f"the prompt has {len(ids)} tokens, leaving no room for a completion under max_seq_len={max_len}"
        if cfg.data.truncation == "drop":
            raise RowError("too_long", "prompt", f"{over} (truncation='drop')", always_skip=True)
        if cfg.data.truncation == "right":
            raise RowError("too_long", "prompt", f"{over} (truncation='right' cuts completions, not prompts)")
        head = 1 if tok.bos_id is not None and ids[:1] == [tok.bos_id] else 0
        keep = max(max_len - cfg.max_new_tokens, head + 1)  # left: the prompt's end, room to sample
        ids = ids[:head] + ids[len(ids) - (keep - head):]
    reference = None
    if builtin:
        try:
            reference = reference_tokens(tok, r, ids, str(data[cfg.reference_column]), template)
        except Exception as e:
            raise RowError("template_error", cfg.reference_column, f"tokenizing the reference failed: "
                                                                   f"{type(e).__name__}: {e}") from e
    return Prompt(r, ids, data, reference)


# --------------------------------------------------------------------------------------- sampling

def chunk_seed(seed: int, split: str, k: int) -> int:
    return (seed * 1_000_003 + k * 2 + (split != "train")) % 2**63


def choose(p: Prompt, cands: list[list[int]], texts: list[str], scores: list[float], builtin: bool,
           cfg, bos_id: int | None) -> tuple[PreferencePair | None, dict[str, Any]]:
    """The pair of one prompt's scored samples (or None), and the record of the choice."""
    best = max(range(len(scores)), key=lambda i: scores[i])
    worst = min(range(len(scores)), key=lambda i: scores[i])
    rec: dict[str, Any] = {"where": p.row.where, "prompt": prompt_text(p.row.prompt),
                           "samples": [{"completion": t, "tokens": c, "reward": s}
                                       for c, t, s in zip(cands, texts, scores)],
                           "chosen": None, "rejected": None, "skipped": None}
    if builtin and scores[best] <= 0 and p.reference is not None:
        chosen, rec["chosen"] = p.reference, "reference"  # no sample is correct: the known answer
    elif scores[best] == scores[worst]:
        rec["skipped"] = "tie"
        return None, rec
    else:
        chosen, rec["chosen"] = (cands[best], cands[best]), best
    rec["rejected"] = worst
    if chosen[0] == cands[worst]:
        rec["skipped"] = "identical"
        return None, rec
    pair = PreferencePair(p.ids, chosen[0], chosen[1], cands[worst], list(cands[worst]))
    if pair.longest > cfg.data.max_seq_len:
        try:
            pair = fit_pair(pair, cfg.data.max_seq_len, cfg.data.truncation, bos_id)
        except RowError as e:
            rec["skipped"] = f"too_long: {e.detail}"
            return None, rec
    return pair, rec


@torch.no_grad()
def sample_pairs(s, prompts: list[Prompt], reward: Reward, split: str, generators=None
                 ) -> tuple[list[PreferencePair], list[dict[str, Any]]]:
    """Pairs of `prompts`, identical on every rank (module doc), and one record per prompt. With
    `generators` (posttrain.stages.generators.Generators, synced) the disaggregated workers sample every
    chunk, with the seeds the trainer's ranks would have used, and the ranks score their chunks."""
    cfg, d, tok, model = s.cfg, s.dist, s.tok, s.model
    n = cfg.num_samples
    chunks = [prompts[i:i + CHUNK] for i in range(0, len(prompts), CHUNK)]

    def params(k: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.gen_temperature,
                              stop_token_ids=tuple(tok.eos_ids), seed=chunk_seed(cfg.seed, split, k))

    remote = None
    if generators is not None:
        from posttrain.core.generation.remote import Request

        requests = [Request([p.ids for p in chunk], {**vars(params(k)), "stop_token_ids": list(tok.eos_ids)}, n=n)
                    for k, chunk in enumerate(chunks)]
        generators.submit(0, requests)
        remote = [gens for gens, _ in generators.collect(0)]  # every rank: all chunks
    done: list[tuple[int, list]] = []
    failure: BaseException | None = None
    was = model.training
    model.eval()
    unit, units = sampling_unit(d)
    context = sampling(model, cfg.parallel) if remote is None else contextlib.nullcontext()
    with context:  # collective: every rank enters, then samples with its tp group
        for k in range(unit, len(chunks), units):
            try:
                chunk = chunks[k]
                if remote is not None:
                    gens = remote[k]
                elif cfg.sampler == "engine":  # the n samples of a prompt share its KV blocks
                    from posttrain.core.generation.engine import engine_generate

                    gens = engine_generate(model, [p.ids for p in chunk], params(k), n=n)
                else:
                    gens = generate(model, [p.ids for p in chunk for _ in range(n)], params(k), pad_id=tok.pad_id or 0)
                cands = [[g.tokens for g in gens[j * n:(j + 1) * n]] for j in range(len(chunk))]
                texts = [[tok.decode(c, skip_special_tokens=True) for c in cs] for cs in cands]
                scores = reward.scores(chunk, cands, texts)
                done.append((k, [choose(p, c, t, sc, reward.builtin, cfg, tok.bos_id)
                                 for p, c, t, sc in zip(chunk, cands, texts, scores)]))
            except Exception as e:  # raised below, once every rank knows
                failure = e
                break
    model.train(was)
    outcomes = gather_chunks(d, done, failure, "dpo: on-policy sampling")
    return [p for p, _ in outcomes if p is not None], [rec for _, rec in outcomes]


def gather_chunks(d, done: list[tuple[int, list]], failure: BaseException | None, what: str) -> list:
    """Every rank's (chunk index, results) gathered, in chunk order, flattened: the same list on
    every rank. A rank's failure is raised on every rank once all know (`what` failed on rank r),
    so none waits in a collective for a rank that stopped. Collective."""
    parts = [(done, None if failure is None else f"{type(failure).__name__}: {failure}")]
    if d.world > 1:
        gathered: list[Any] = [None] * d.world
        dist.all_gather_object(gathered, parts[0])
        parts = gathered
    if failure is not None:
        raise failure
    for rank, (_, error) in enumerate(parts):
        if error is not None:
            raise StageError(f"{what} failed on rank {rank}: {error}")
    by_chunk = {k: c for part, _ in parts for k, c in part}  # a tp group's ranks hold the same chunks
    return [o for _, results in sorted(by_chunk.items()) for o in results]


def summarize(records: list[dict[str, Any]], prefix: str) -> dict[str, float]:
    rewards = [x["reward"] for r in records for x in r["samples"]]
    paired = [r for r in records if r["skipped"] is None]
    return {f"{prefix}prompts": len(records), f"{prefix}pairs": len(paired),
            f"{prefix}pair_share": len(paired) / max(len(records), 1),
            f"{prefix}reward_mean": sum(rewards) / max(len(rewards), 1),
            f"{prefix}reference_chosen": sum(r["chosen"] == "reference" for r in paired)}


def on_policy_pairs(s) -> tuple[list[PreferencePair], list[PreferencePair], dict[str, float]]:
    """(training pairs, validation pairs, metrics) sampled by the policy for the data's prompts."""
    cfg, d, tok = s.cfg, s.dist, s.tok
    t0 = time.time()
    reward = Reward(cfg, tok, s.model, d.device)  # a bad entry point or judge fails before any reading
    stats = DropStats()
    train_rows, val_rows, val_pairs = prompt_sets(cfg, tok, stats)
    train = prepare_prompts(train_rows, tok, cfg, reward.builtin, stats)
    val = prepare_prompts(val_rows, tok, cfg, reward.builtin, stats)
    if not train:
        raise StageError(f"dpo: no training prompts in {', '.join(map(str, cfg.data.sources))} ({stats})")
    random.Random(cfg.data.seed).shuffle(train)
    if cfg.max_steps:  # no more prompts than the steps can use: each gives at most one pair
        train = train[:cfg.max_steps * cfg.optim.grad_accum_steps * cfg.data.micro_batch_size * d.data_shard[1]]
    val = val[:len(train)]
    generators = None
    if cfg.generation.mode == "disaggregated":  # the workers live for the sampling only
        from posttrain.stages.generators import Generators

        generators = Generators(s)
    try:
        if generators is not None:
            generators.sync(0)
        pairs, records = sample_pairs(s, train, reward, "train", generators)
        vpairs, vrecords = sample_pairs(s, val, reward, "validation", generators) if val else ([], [])
    finally:
        if generators is not None:  # training starts while they exit
            generators.close(wait=False)
    metrics = summarize(records, "on_policy/")
    if generators is not None:
        metrics.update({f"on_policy/{k}": v for k, v in generators.stats.items()})
    written = {"train": records}
    if val:
        val_pairs = val_pairs + vpairs
        metrics.update(summarize(vrecords, "on_policy/val_"))
        written["validation"] = vrecords
    if stats.total_dropped:
        log.warning("dpo: skipped prompts (%s); e.g. %s", stats,
                    "; ".join(m for shown in stats.examples.values() for m in shown[:1]))
        metrics.update({f"data/{k}": v for k, v in stats.to_dict().items()})
    if d.is_main:
        for split, recs in written.items():
            path = s.out / "on_policy" / f"{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), fsync=False)
            s.run.log_artifact(str(path), "on_policy")
    metrics["on_policy/seconds"] = time.time() - t0
    log.info("dpo: %d on-policy pairs from %d prompts (%s, mean reward %.4g)", len(pairs), len(train), reward.name,
             metrics["on_policy/reward_mean"])
    return pairs, val_pairs, metrics
