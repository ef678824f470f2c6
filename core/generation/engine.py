"""The generation engine: continuous batching over a paged KV cache.

    engine = Engine(model, max_num_seqs=8, block_size=16, num_blocks=256, max_batch_tokens=512)
    rid = engine.add_request(prompt_ids, RequestParams(temperature=0, max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step(): ...        # RequestOutputs of the requests that finished
    outs = engine.generate(prompts, params)  # or all at once, in prompt order

Each `step` asks the scheduler (posttrain.core.generation.scheduler) for the next batch (requests join and
leave every step; prompts are prefilled in chunks under the token budget; the newest sequence is
preempted when the block pool runs out), flattens it into one ForwardBatch, makes one model call
(`ModelRunner.forward`, the piece a tensor-parallel or LoRA-aware runner replaces), and then, for
each sequence whose tokens are all computed, samples one token from its logits row with its own
generator (posttrain.core.generation.sampling), records log-probs, and checks stop tokens, stop strings and
max_tokens. A finished sequence frees its blocks at once (prefix-cached ones stay evictable).
"""

from __future__ import annotations

from typing import Callable

import torch

from posttrain.core.generation.paged import BlockManager
from posttrain.core.generation.runner import ForwardBatch, ModelRunner
from posttrain.core.generation.sampling import (Completion, RequestOutput, RequestParams, hits_stop_string, sample_rows,
                                      token_logprobs)
from posttrain.core.generation.scheduler import Request, Scheduler, Sequence
from posttrain.core.model.model import Transformer


class Engine:
    def __init__(self, model: Transformer, max_num_seqs: int = 8, block_size: int = 16, num_blocks: int | None = None,
                 max_batch_tokens: int = 512, decode: Callable[[list[int]], str] | None = None,
                 enable_prefix_cache: bool = True, runner: ModelRunner | None = None):
        """num_blocks: the pool's size (default: room for max_num_seqs sequences of
        max_position_embeddings tokens). decode: token ids -> text, for stop strings. runner: a
        replacement model call (default: ModelRunner over `model`)."""
        if getattr(model, "staged_forward", None) is not None:
            raise ValueError("the engine runs a whole model; a pipeline-parallel one decodes through "
                             "posttrain.core.model.generate")
        if max_batch_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_batch_tokens and max_num_seqs must be at least 1")
        if num_blocks is None:
            num_blocks = max_num_seqs * -(-model.args.max_position_embeddings // block_size)
        self.model, self.block_size, self.num_blocks, self.decode = model, block_size, num_blocks, decode
        self.runner = runner or ModelRunner(model, num_blocks, block_size)
        self.device = self.runner.device
        self.blocks = BlockManager(num_blocks, block_size, self.runner.cache, enable_prefix_cache)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_batch_tokens, self.device)
        from posttrain.core.lora.model import adapter_names

        self.adapters = adapter_names(model)
        self.requests: dict[int, Request] = {}
        self.unclaimed: dict[int, RequestOutput] = {}
        self._next_id = 0
        self.num_steps = 0
        self.step_tokens: list[tuple[int, int, int, float | None, dict[int, float] | None]] = []
        """The tokens the last `step` appended, in order: (request id, sample index, token, its
        log-probability or None, its top log-probabilities or None): per-token progress for
        streaming, before a request's RequestOutput (which comes when all its samples finish)."""

    def add_request(self, prompt: list[int], params: RequestParams | None = None) -> int:
        """Queue a request; its id. It starts at the next `step` that has room for it."""
        params = params or RequestParams()
        prompt = list(prompt)
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        if len(prompt) + params.max_tokens > self.num_blocks * self.block_size:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceed the pool's "
                             f"{self.num_blocks} blocks of {self.block_size} tokens")
        if params.n > self.scheduler.max_num_seqs:
            raise ValueError(f"n = {params.n} samples exceed max_num_seqs = {self.scheduler.max_num_seqs}")
        if params.stop and self.decode is None:
            raise ValueError("stop strings need the engine's `decode`")
        if params.adapter is not None and params.adapter not in self.adapters:
            raise ValueError(f"unknown LoRA adapter {params.adapter!r}; the model has {self.adapters or 'none'}")
        rid = self._next_id
        self._next_id += 1
        request = Request(rid, prompt, params)
        self.requests[rid] = request
        self.scheduler.add(request)
        return rid

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, request_id: int) -> bool:
        """Stop a request (its client went away): its sequences leave the scheduler, their blocks
        return to the pool, it produces no RequestOutput. False when it is not in the engine
        (finished, or never added)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.abort(request_id)
        return True

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """One model call over the scheduled batch; the requests it finished (and, in
        `step_tokens`, every token it appended)."""
        self.step_tokens = []
        scheduled = self.scheduler.schedule()
        if not scheduled:
            if self.has_unfinished():
                raise RuntimeError("the scheduler found nothing to run with requests pending (a bug)")
            return []
        self.num_steps += 1
        entries, adapters = [], []
        for seq, n in scheduled:
            start = seq.num_computed
            entries.append((seq.tokens[start:start + n], start, self.blocks.slots(seq.table, start, n),
                            seq.table.blocks, start + n == len(seq.tokens)))
            name = seq.request.params.adapter
            adapters.append(-1 if name is None else self.adapters.index(name))
        batch = ForwardBatch.build(entries, self.block_size, self.device)
        if any(a >= 0 for a in adapters):  # each token through its request's adapter (-1: the base)
            batch.adapter_ids = torch.tensor([a for a, (seq, n) in zip(adapters, scheduled) for _ in range(n)],
                                             device=self.device)
            batch.adapter_names = self.adapters
        logits = self.runner.forward(batch)
        picks: list[tuple[Sequence, int]] = []  # each sequence that samples now, and its logits row
        row = 0
        for seq, n in scheduled:
            seq.num_computed += n
            self.blocks.register_full(seq.table, seq.tokens, seq.num_computed, self.scheduler.salt(seq))
            if seq.pending:
                continue  # a prompt chunk; the rest comes in later steps
            for s in (self.scheduler.fork(seq) if seq.fork_into > 1 else [seq]):
                picks.append((s, row))  # the n samples of a prompt draw from its one logits row
            row += 1
        tokens = sample_rows(logits, picks)
        logp = logits.log_softmax(-1) if any(s.request.params.logprobs or s.request.params.top_logprobs
                                             for s, _ in picks) else None
        done: list[RequestOutput] = []
        for (seq, r), token in zip(picks, tokens):
            out = self._append(seq, None if logp is None else logp[r], token)
            if out is not None:
                done.append(out)
        return done

    def _append(self, seq: Sequence, logp: torch.Tensor | None, token: int) -> RequestOutput | None:
        """Append seq's next token (logp: its (V,) log-probabilities, when asked for); the request's
        output if that finished its last sample."""
        params = seq.request.params
        if params.logprobs or params.top_logprobs:
            chosen, tops = token_logprobs(logp, token, params.top_logprobs)
            seq.logprobs.append(chosen)
            if params.top_logprobs:
                seq.top_logprobs.append(tops)
        seq.tokens.append(token)
        self.step_tokens.append((seq.request.request_id, seq.index, token,
                                 seq.logprobs[-1] if params.logprobs or params.top_logprobs else None,
                                 seq.top_logprobs[-1] if params.top_logprobs else None))
        reason = None
        if token in params.stop_token_ids:
            reason = "stop"
        elif params.stop and hits_stop_string(seq.tokens[len(seq.request.prompt):], params.stop, self.decode,
                                              window=2 * max(len(s) for s in params.stop) + 4):
            reason = "stop"
        elif seq.num_output >= params.max_tokens:
            reason = "length"
        if reason is None:
            return None
        self.scheduler.finish(seq)
        request = seq.request
        request.completions[seq.index] = Completion(seq.tokens[len(request.prompt):], reason, seq.logprobs,
                                                    seq.top_logprobs, seq.index)
        if any(c is None for c in request.completions):
            return None
        del self.requests[request.request_id]
        return RequestOutput(request.request_id, request.prompt, request.completions, request.cached_tokens)

    def generate(self, prompts: list[list[int]], params: RequestParams | list[RequestParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run `prompts` (one params for all, or one each) to completion; outputs in prompt order.
        Requests added earlier and still unfinished run along; those that finish meanwhile are
        kept in `self.unclaimed` (request id -> output)."""
        if not isinstance(params, list):
            params = [params or RequestParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} params for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        wanted, outputs = set(ids), {}
        while wanted - outputs.keys():
            for out in self.step():
                if out.request_id in wanted:
                    outputs[out.request_id] = out
                else:
                    self.unclaimed[out.request_id] = out
        return [outputs[i] for i in ids]


def engine_generate(model: Transformer, prompts: list[list[int]], params, n: int = 1, block_size: int = 16,
                    max_batch_tokens: int = 2048) -> list:
    """posttrain.core.model.generate's contract through the engine: `n` samples of each prompt (they share
    its KV blocks; the prompt is computed once), as posttrain.core.model.generate.Generation objects in
    prompt-major order (prompt 0's n samples, then prompt 1's, ...), the same as generate() on
    the prompts repeated n times. params: a posttrain.core.model.generate.SamplingParams, or a list of one
    per prompt (e.g. each with its own seed). Sample i of a
    prompt draws from its own generator seeded seed + i (posttrain.core.generation.sampling), so it does not
    depend on what else is in the batch; greedy tokens equal generate()'s. The model must be whole
    on this process or split by tensor parallelism (decode mode: no sequence parallelism), every
    rank of the tp group calling this with the same prompts; not pipelined or FSDP-sharded."""
    from torch.distributed.tensor import DTensor

    from posttrain.core.model.generate import Generation

    from torch.distributed.fsdp import FSDPModule

    tp = getattr(model.lm_head, "tp_group", None) is not None
    sharded = any(isinstance(m, FSDPModule) for m in model.modules()) or \
        (not _tp_split(model) and any(isinstance(p, DTensor) for p in model.parameters()))
    if getattr(model, "pipeline", None) is not None or sharded:
        raise ValueError("sampler: engine needs the model whole on each rank or split by tensor parallelism; "
                         "this layout pipelines or shards it (PP, FSDP): use sampler: static")
    many = params if isinstance(params, list) else [params] * len(prompts)  # one each, or one for all
    if len(many) != len(prompts):
        raise ValueError(f"{len(many)} sampling params for {len(prompts)} prompts")
    if tp and any(q.temperature > 0 and q.seed is None for q in many):
        raise ValueError("engine under tensor parallelism: sampling needs a seed (every rank of the tp group "
                         "must draw the same tokens)")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and every prompt at least one token")
    engine = Engine(model, max_num_seqs=len(prompts) * n, block_size=block_size,
                    num_blocks=pool_blocks([len(p) for p in prompts], [q.max_new_tokens for q in many], n, block_size),
                    max_batch_tokens=max_batch_tokens)
    requests = [RequestParams(max_tokens=q.max_new_tokens, temperature=q.temperature, top_k=q.top_k, top_p=q.top_p,
                              stop_token_ids=tuple(q.stop_token_ids), seed=q.seed, n=n) for q in many]
    outs = engine.generate(prompts, requests)
    return [Generation(c.tokens, c.finish_reason, c.logprobs) for o in outs for c in o.completions]


def pool_blocks(prompt_lens: list[int], max_new: list[int], n: int, block_size: int) -> int:
    """Blocks enough for every prompt's n samples to run at once: a prompt's blocks (shared by its
    samples), and per sample a copy of its partly filled last block plus room for its new tokens."""
    return sum(-(-length // block_size) + n * (-(-new // block_size) + 1) for length, new in zip(prompt_lens, max_new))


def _tp_split(model: Transformer) -> bool:
    """Whether the model's DTensors are tensor parallelism's (one mesh dimension, the tp group's):
    split, not FSDP-sharded."""
    return getattr(model.lm_head, "tp_group", None) is not None and \
        all(not hasattr(p, "device_mesh") or p.device_mesh.ndim == 1 for p in model.parameters())
