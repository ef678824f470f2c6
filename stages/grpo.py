"""GRPO (Shao et al. 2024): the policy samples a group of `num_generations` completions for each
prompt, a reward scores them (the verifier or judge on-policy DPO uses: stages/on_policy.py), each
completion's advantage is its reward against its group's (posttrain.core.grpo.group_advantages), and the
policy is trained on its own samples with the clipped policy-gradient loss (posttrain.core.grpo).

Rounds: each round takes the next `prompts_per_step` prompts (shuffled per epoch by data.seed),
samples them, scores them, and then runs `num_iterations` optimizer steps over the same samples,
each step a pass over all of them in optim.grad_accum_steps micro-batches per data-parallel rank.
With one step per round the ratio to the sampling-time policy is 1 (its gradient is the policy
gradient); with more the sampling-time log-probs are computed once, after sampling, and the ratio
and its clip act from the round's second step on. With beta > 0 the reference's log-probs (the
LoRA base under disable_adapter, else a frozen copy of the starting model) are computed then too.

Ranks: the round's prompts go in chunks of CHUNK, each sampled with its own seed (from the seed,
the round and the chunk), rank r (or tp group r) sampling chunks r, r + units, ...; the outcomes
are all-gathered in chunk order, so every rank holds the same samples, and the same whatever the
world size. The samples are then cut into dp x grad_accum micro-batches (global ones: rank r takes
r, r + dp, ...), so every layout trains on the batches one process does.

Every round's samples, rewards and advantages are appended to <output>/grpo/rollouts.jsonl.
A resumed run continues at the round and micro-batch the checkpoint recorded; a round cut by the
kill is sampled again, with the resumed policy.

    torchrun --nproc-per-node 2 -m posttrain.stages.grpo --config spec.json
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
from typing import Any

import torch

from posttrain.core.data.encode import Document
from posttrain.core.data.errors import DropStats
from posttrain.core.data.packing import collate_padding_free
from posttrain.core.data.prepared import is_prepared
from posttrain.core.data.rows import prompt_rows
from posttrain.core.grpo import group_advantages, grpo_objective, zero_std_share
from posttrain.core.losses import IGNORE_INDEX
from posttrain.core.lora import disable_adapter
from posttrain.core.manifest import read_manifest
from posttrain.core.model.generate import SamplingParams, generate
from posttrain.core.objectives import token_logps
from posttrain.stages.common import StageError, parse_spec
from posttrain.stages.config import GRPOConfig
from posttrain.stages.on_policy import Prompt, Reward, gather_chunks, prepare_prompts, prompt_sets
from posttrain.stages.recipe import Plan, Session, load_frozen, run_training
from posttrain.stages.training import sampling, sampling_lead, sampling_unit, to_device

log = logging.getLogger("posttrain.grpo")

CHUNK = 16  # prompts per generation batch (times num_generations sequences)


def round_seed(seed: int, split: str, rnd: int, chunk: int) -> int:
    return (seed * 1_000_003 + rnd * 7919 + chunk * 2 + (split != "train")) % 2**63


def sample_chunk(s: Session, prompts: list[list[int]], n: int, params: dict[str, Any], seed: int
                 ) -> list[list[list[int]]]:
    """`n` completions (token ids) of each prompt: posttrain.core.model.generate on the prompts x n as one
    static batch, or (sampler='engine', one process) the paged-KV engine, whose n samples of a
    prompt share its KV blocks (posttrain.core.generation.engine.engine_generate: a fresh engine each call,
    its cache holding the policy's KV, which the next step changes)."""
    tok, model = s.tok, s.model
    sp = SamplingParams(stop_token_ids=tuple(tok.eos_ids), seed=seed, **params)
    if s.cfg.sampler == "engine":  # prompt-major, as generate on the prompts repeated n times
        from posttrain.core.generation.engine import engine_generate

        gens = engine_generate(model, prompts, sp, n=n)
    else:
        gens = generate(model, [p for p in prompts for _ in range(n)], sp, pad_id=tok.pad_id or 0)
    return [[g.tokens for g in gens[j * n:(j + 1) * n]] for j in range(len(prompts))]


@torch.no_grad()
def sample_groups(s: Session, prompts: list[Prompt], reward: Reward, n: int, params: dict[str, Any],
                  split: str, rnd: int, generated: list[list[list[list[int]]]] | None = None
                  ) -> list[tuple[list[list[int]], list[str], list[float]]]:
    """(completions, texts, rewards) of `n` samples of every prompt, the same on every rank (module
    doc). `generated`: each chunk's completions, already sampled (by generator workers), to score.
    Collective: every rank enters the sampling context."""
    d, tok, model = s.dist, s.tok, s.model
    chunks = chunked(prompts)
    done: list[tuple[int, list]] = []
    failure: BaseException | None = None
    was = model.training
    model.eval()
    unit, units = sampling_unit(d)
    with sampling(model, s.cfg.parallel) if generated is None else contextlib.nullcontext():
        for k in range(unit, len(chunks), units):
            try:
                chunk = chunks[k]
                cands = generated[k] if generated is not None else \
                    sample_chunk(s, [p.ids for p in chunk], n, params, round_seed(s.cfg.seed, split, rnd, k))
                texts = [[tok.decode(c, skip_special_tokens=True) for c in cs] for cs in cands]
                scores = reward.scores(chunk, cands, texts)
                done.append((k, list(zip(cands, texts, scores))))
            except Exception as e:  # raised below, once every rank knows
                failure = e
                break
    model.train(was)
    return gather_chunks(d, done, failure, "grpo: sampling")


def chunked(prompts: list[Prompt]) -> list[list[Prompt]]:
    return [prompts[i:i + CHUNK] for i in range(0, len(prompts), CHUNK)]


class Rollouts:
    """The training loader: per round, the policy's scored samples as this rank's micro-batches,
    yielded num_iterations times (module doc). Its state is (round, micro-batch in the round)."""

    def __init__(self, s: Session, prompts: list[Prompt], reward: Reward, ref_model=None, generators=None):
        cfg, d = s.cfg, s.dist
        self.s, self.cfg, self.d, self.prompts, self.reward, self.ref_model = s, cfg, d, prompts, reward, ref_model
        self.generators = generators  # posttrain.stages.generators.Generators (generation.mode: disaggregated), or None
        self.P, self.G = cfg.prompts_per_step, cfg.num_generations
        self.rounds_per_epoch = len(prompts) // self.P
        if self.rounds_per_epoch == 0:
            raise StageError(f"grpo: prompts_per_step={self.P} but only {len(prompts)} training prompts")
        self.dp = d.data_shard[1]
        self.micro_batches = self.dp * cfg.optim.grad_accum_steps  # global micro-batches of a pass
        if (self.P * self.G) % self.micro_batches:
            raise StageError(f"grpo: {self.P} prompts x {self.G} generations do not split into {self.dp} data-parallel "
                             f"ranks x {cfg.optim.grad_accum_steps} micro-batches; make prompts_per_step x "
                             "num_generations a multiple")
        self.per_rank = cfg.optim.grad_accum_steps
        self.total_rounds = cfg.epochs * self.rounds_per_epoch
        if cfg.max_steps:
            self.total_rounds = min(self.total_rounds, -(-cfg.max_steps // cfg.num_iterations))
        self.round = self.micro = 0
        self.samples = 0
        self.params = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                           top_k=cfg.top_k)

    def round_prompts(self, rnd: int) -> list[Prompt]:
        epoch, i = divmod(rnd, self.rounds_per_epoch)
        order = list(range(len(self.prompts)))
        random.Random(f"{self.cfg.data.seed}:{epoch}").shuffle(order)
        return [self.prompts[j] for j in order[i * self.P:(i + 1) * self.P]]

    def __len__(self) -> int:
        return self.total_rounds * self.cfg.num_iterations * self.per_rank

    def state_dict(self) -> dict[str, int]:
        return {"round": self.round, "micro": self.micro}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.round, self.micro = int(state["round"]), int(state["micro"])

    def __iter__(self):
        while self.round < self.total_rounds:
            rnd = self.round
            with self.s.phase("sampling"):
                batches = self.build_round(rnd)
            last = len(batches) * self.cfg.num_iterations
            for k in range(self.micro, last):
                self.round, self.micro = (rnd + 1, 0) if k + 1 == last else (rnd, k + 1)
                yield batches[k % len(batches)]

    def build_round(self, rnd: int) -> list[dict[str, Any]]:
        """Sample and score the round's prompts; this rank's micro-batches, on the device, with
        their advantages (and sampling-time / reference log-probs where the loss needs them)."""
        cfg, d, G = self.cfg, self.d, self.G
        prompts = self.round_prompts(rnd)
        generated, weights = self.remote_round(rnd) if self.generators is not None else (None, None)
        groups = sample_groups(self.s, prompts, self.reward, G, self.params, "train", rnd, generated)
        rewards = torch.tensor([g[2] for g in groups], dtype=torch.float64)
        adv = group_advantages(rewards, cfg.scale_rewards)
        if weights is not None:  # a stale sample's worth (generation.stale: reweight)
            adv = adv * torch.tensor([w for w, c in zip(weights, chunked(prompts)) for _ in c],
                                     dtype=adv.dtype)[:, None]
        lengths = [len(c) for g in groups for c in g[0]]
        metrics = {"rewards/mean": float(rewards.mean()), "rewards/std": float(rewards.std()) if rewards.numel() > 1
                   else 0.0, "rewards/zero_std_frac": zero_std_share(rewards),
                   "completions/mean_length": sum(lengths) / len(lengths),
                   "completions/clipped_frac": sum(n >= cfg.max_new_tokens for n in lengths) / len(lengths)}
        self.samples += len(lengths)
        seqs = []
        for p, (cands, _, _), a in zip(prompts, groups, adv.tolist()):
            for c, ai in zip(cands, a):
                c = c[:max(cfg.data.max_seq_len - len(p.ids), 0)]
                seqs.append((Document(p.ids + c, [IGNORE_INDEX] * len(p.ids) + c), ai))
        self.record(rnd, prompts, groups, adv)
        m = len(seqs) // self.micro_batches
        rank, world = d.data_shard
        out = []
        for j in range(rank, self.micro_batches, world):
            part = seqs[j * m:(j + 1) * m]
            batch = collate_padding_free([x for x, _ in part])
            batch["advantages"] = torch.tensor([a for _, a in part], dtype=torch.float32)
            batch["num_sequences"] = len(part)
            batch["rollout_metrics"] = metrics
            out.append(to_device(batch, d.device))
        self.score(out)
        return out

    def requests(self, rnd: int) -> list:
        """Round `rnd`'s chunks as generator requests: the seeds and parameters colocated
        sampling uses, so the samples are the engine's on the trainer's processes."""
        from posttrain.core.generation.remote import Request

        params = {**self.params, "stop_token_ids": tuple(self.s.tok.eos_ids)}
        return [Request([p.ids for p in chunk], {**params, "seed": round_seed(self.cfg.seed, "train", rnd, k)},
                        self.G) for k, chunk in enumerate(chunked(self.round_prompts(rnd)))]

    def remote_round(self, rnd: int) -> tuple[list, list[float]]:
        """Round `rnd`'s completions per chunk from the generator workers, and each chunk's weight.
        Submitted now with the current weights (version = rounds trained) unless prefetched; with
        generation.prefetch the next round is submitted before this one trains."""
        g = self.generators
        if not g.has(rnd):
            g.sync(rnd)
            g.submit(rnd, self.requests(rnd))
        results = g.collect(rnd)
        if g.prefetch and rnd + 1 < self.total_rounds:
            g.sync(rnd)
            g.submit(rnd + 1, self.requests(rnd + 1))
        n = self.G
        return ([[[x.tokens for x in gens[j * n:(j + 1) * n]] for j in range(len(gens) // n)] for gens, _ in results],
                [w for _, w in results])

    @torch.no_grad()
    def score(self, batches: list[dict[str, Any]]) -> None:
        """The sampling-time log-probs (num_iterations > 1) and the reference's (beta > 0) of each
        micro-batch. Every rank runs as many forwards (a sharded policy's are collective), under the
        autocast the trainer's forwards run in (posttrain.stages.recipe.build_trainer), so that the ratio at
        the sampling policy is 1 in bf16 too."""
        cfg, model = self.cfg, self.s.model
        if cfg.num_iterations == 1 and not cfg.beta:
            return
        was = model.training
        model.eval()
        device = self.d.device
        bf16 = cfg.model.dtype == "bfloat16" and device.type == "cuda"
        autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with autocast:
            self._score(batches)
        model.train(was)

    def _score(self, batches: list[dict[str, Any]]) -> None:
        cfg, model = self.cfg, self.s.model
        for b in batches:
            if cfg.num_iterations > 1:
                b["old_logps"] = token_logps(model, b).float()
            if cfg.beta:
                if self.ref_model is not None:
                    b["ref_logps"] = token_logps(self.ref_model, b).float()
                else:
                    with disable_adapter(model):
                        b["ref_logps"] = token_logps(model, b).float()

    def record(self, rnd: int, prompts: list[Prompt], groups, adv: torch.Tensor) -> None:
        if not self.d.is_main:
            return
        path = self.s.out / "grpo" / "rollouts.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            for p, (cands, texts, scores), a in zip(prompts, groups, adv.tolist()):
                f.write(json.dumps({"round": rnd, "where": p.row.where, "samples": [
                    {"completion": t, "tokens": c, "reward": r, "advantage": ai}
                    for c, t, r, ai in zip(cands, texts, scores, a)]}, ensure_ascii=False) + "\n")


def validation(s: Session, prompts: list[Prompt], reward: Reward):
    """val/reward: the mean reward of one greedy completion per validation prompt."""
    cfg = s.cfg
    params = dict(max_new_tokens=cfg.max_new_tokens, temperature=0.0)

    def validate() -> dict[str, float]:
        if not prompts:
            return {}
        groups = sample_groups(s, prompts, reward, 1, params, "validation", 0)
        scores = [g[2][0] for g in groups]
        return {"val/reward": sum(scores) / len(scores)}

    return validate


def prepared_validation_prompts(cfg: GRPOConfig, stats: DropStats) -> list:
    """The validation prompts of data prep's outputs that hold pairs (prompt_sets gives their own
    pairs for validation there, which GRPO does not use)."""
    rows: list = []
    for src in cfg.data.sources:
        if is_prepared(src) and any(k.startswith("preference_") for k in read_manifest(src)["outputs"]):
            rows += prompt_rows([src], "validation", cfg.data.on_bad_row, stats, task="preference")
    return rows


class GRPO:
    name = "grpo"

    def setup(self, s: Session) -> Plan:
        cfg, d, tok = s.cfg, s.dist, s.tok
        if cfg.sampler == "engine" and d.mesh is not None:
            raise StageError(f"grpo: sampler='engine' runs on one process for now; this job has {d.world} ranks "
                             "(use sampler='static')")
        reward = Reward(cfg, tok, s.model, d.device, "grpo")  # a bad entry point or judge fails before any reading
        stats = DropStats()
        train_rows, val_rows, _ = prompt_sets(cfg, tok, stats)
        val_rows += prepared_validation_prompts(cfg, stats)
        train = prepare_prompts(train_rows, tok, cfg, reward.builtin, stats)
        val = prepare_prompts(val_rows, tok, cfg, reward.builtin, stats)[:cfg.val_prompts]
        if not train:
            raise StageError(f"grpo: no training prompts in {', '.join(map(str, cfg.data.sources))} ({stats})")
        if stats.total_dropped:
            log.warning("grpo: skipped prompts (%s)", stats)
        ref_model = None
        if cfg.beta and not (cfg.lora.enabled and cfg.lora.init_lora_weights != "pissa"):
            ref_model = load_frozen(cfg.model, cfg.parallel, d, cfg.seed, what="reference")[0]
        generators = None
        if cfg.generation.mode == "disaggregated":
            from posttrain.stages.generators import Generators

            generators = Generators(s)
        rollouts = Rollouts(s, train, reward, ref_model, generators)
        objective = grpo_objective(cfg.loss_type, cfg.epsilon, cfg.epsilon_high, cfg.beta, cfg.max_new_tokens)
        if sampling_lead(d):
            log.info("grpo: %d training prompts, %d rounds of %d prompts x %d generations (%s)", len(train),
                     rollouts.total_rounds, cfg.prompts_per_step, cfg.num_generations, reward.name)

        def summary() -> dict[str, float]:
            extra = {f"data/{k}": v for k, v in stats.to_dict().items()} if stats.total_dropped else {}
            if generators is not None:
                extra |= generators.stats
            return {"grpo/train_prompts": len(train), "grpo/samples": rollouts.samples, **extra}

        return Plan(rollouts, objective, validation(s, val, reward), inputs={"reward": reward.name},
                    summary=summary, **({"close": generators.close} if generators is not None else {}))


def run(cfg: GRPOConfig) -> dict:
    return run_training(GRPO(), cfg)


def main(argv: list[str] | None = None) -> None:
    run(parse_spec(GRPOConfig, argv))


if __name__ == "__main__":
    main()
