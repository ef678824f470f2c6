"""Batched sampling with a KV cache: greedy, temperature, top-k, top-p, stop tokens.

Prompts of different lengths share one batch by left padding, so every row writes the cache at
the same slot each step; position ids count only real tokens, so padding changes nothing.
Every step is one call of the model's forward (the lm_head applied to the last position as its
`head`), so wrappers that act in forward hooks (FSDP gathering weights) see it like training.
Under tensor parallelism (outside sequence parallelism: parallel.tensor's decode mode) each rank
caches its own KV heads, the vocab-split logits are gathered, and the ranks of a tp group, which
decode the same rows, all take the tokens tp rank 0 drew. Under pipeline parallelism (a model
split by posttrain.core.parallel.pipeline.keep_own_stages) each step runs the stages one after the other
(posttrain.core.parallel.pipeline_decode: each rank caches its stages' layers only), and the last stage's
tokens and log-probs are broadcast to the pipeline's other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from posttrain.core.model.model import KVCache, Transformer


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    """0 means greedy."""
    top_k: int = 0
    """Keep the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability mass reaches top_p (nucleus)."""
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclass
class Generation:
    tokens: list[int]
    """New tokens, the stop token included when one ended the sequence."""
    finish_reason: str
    """"stop" or "length"."""
    logprobs: list[float] = field(default_factory=list)
    """Log-probability of each new token under the model's raw (temperature 1) distribution."""


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Scale by temperature and mask everything outside top-k / top-p with -inf. (B, V) fp32."""
    if temperature != 1.0:  # dividing by 1 changes nothing, and costs a pass over (B, V)
        logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass *before* it already reaches top_p: the first always stays.
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _tp_group(model: Transformer):
    """The tp group of a model whose lm_head tensor parallelism split by vocab, else None."""
    return getattr(model.lm_head, "tp_group", None)


def _last_logits(model: Transformer, ids, positions, mask, cache: KVCache) -> torch.Tensor:
    """(B, V) fp32 logits of the last position, through forward (under tensor parallelism each
    rank's vocab slice, gathered)."""
    logits = model(ids, positions, mask, cache=cache, head=lambda h, w: model.lm_head(h[:, -1])).float()
    group = _tp_group(model)
    if group is not None:
        from posttrain.core.parallel.mappings import all_gather

        logits = all_gather(logits, -1, group)
    return logits


def _kv_heads(model: Transformer) -> int:
    """KV heads this rank holds: all of them, or its share under tensor parallelism."""
    return model.layers[0].attn.k_proj.out_features // model.args.head_dim


class _WholeModel:
    """One forward per step through the model (every layer on this rank)."""

    def __init__(self, model: Transformer):
        self.model = model
        self.device, self.dtype = model.embed.weight.device, model.embed.weight.dtype

    def cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.empty(self.model.args, batch, max_len, self.device, self.dtype, kv_heads=_kv_heads(self.model))

    def last_logits(self, ids, positions, mask, cache) -> torch.Tensor:
        return _last_logits(self.model, ids, positions, mask, cache)

    def share(self, token: torch.Tensor, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token, logp


@torch.no_grad()
def generate(
    model: Transformer, prompts: list[list[int]], params: SamplingParams, pad_id: int = 0, lockstep=None
) -> list[Generation]:
    """Sample a completion of each prompt (left-padded into one batch). lockstep: a process group
    whose ranks decode their own prompts with one model sharded over them (FSDP, EP): every
    forward is collective there, so each rank runs decode steps until all of the group's
    sequences are done (a rank whose rows are done feeds pad tokens meanwhile)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and every prompt at least one token")
    if getattr(model, "pipeline", None) is not None:
        from posttrain.core.parallel.pipeline_decode import StagedModel

        fwd = StagedModel(model, model.pipeline)
    else:
        fwd = _WholeModel(model)
    device = fwd.device
    B, T0 = len(prompts), max(len(p) for p in prompts)
    total = T0 + params.max_new_tokens
    ids = torch.full((B, T0), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros(B, total, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, T0 - len(p):] = torch.tensor(p, device=device)
        mask[b, T0 - len(p):T0] = 1
    positions = (mask[:, :T0].cumsum(-1) - 1).clamp(min=0)
    cache = fwd.cache(B, total)
    group = _tp_group(model)  # tp ranks decode the same rows in lockstep: rank 0's tokens are everyone's
    gen = torch.Generator(device=device).manual_seed(params.seed) if params.seed is not None else None
    stop = torch.tensor(list(params.stop_token_ids) or [-1], device=device)

    was_training = model.training
    model.eval()
    out = torch.zeros(B, params.max_new_tokens, dtype=torch.long, device=device)
    logps = torch.zeros(B, params.max_new_tokens, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    lengths = torch.full((B,), params.max_new_tokens, device=device)
    logits = fwd.last_logits(ids, positions, mask[:, :T0], cache)  # (B, V); None off a pipeline's last stage
    pos = positions[:, -1]
    for t in range(params.max_new_tokens):
        token = torch.zeros(B, dtype=torch.long, device=device)
        logp = torch.zeros(B, device=device)
        if logits is not None:
            if params.temperature == 0:
                token = logits.argmax(-1)
            else:
                probs = filter_logits(logits, params.temperature, params.top_k, params.top_p).softmax(-1)
                token = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            token = torch.where(done, pad_id, token)
            if group is not None:
                import torch.distributed as dist

                dist.broadcast(token, dist.get_global_rank(group, 0), group=group)
            logp = logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
        token, logp = fwd.share(token, logp)
        out[:, t] = token
        logps[:, t] = logp
        newly = ~done & torch.isin(token, stop)
        lengths = torch.where(newly, t + 1, lengths)
        done |= newly
        finished = done.all()
        if lockstep is not None:
            import torch.distributed as dist

            finished = finished.to(torch.int32)
            dist.all_reduce(finished, op=dist.ReduceOp.MIN, group=lockstep)
        if bool(finished) or t == params.max_new_tokens - 1:
            break
        mask[:, T0 + t] = 1
        pos = pos + 1
        logits = fwd.last_logits(token[:, None], pos[:, None], mask[:, :T0 + t + 1], cache)
    model.train(was_training)

    results = []
    for b in range(B):
        n = int(lengths[b])
        results.append(Generation(out[b, :n].tolist(), "stop" if bool(done[b]) else "length", logps[b, :n].tolist()))
    return results
