"""Continuous batching: which sequences run in the next step, and how many tokens each.

A sequence is a prompt plus its sampled tokens; `num_computed` of them have their KV in the
cache. Each step the scheduler picks, under a token budget (max_batch_tokens) and a cap on
running sequences (max_num_seqs, counting the n seats a request of n samples will fill):

1. the running sequences, oldest first: a decoding one needs 1 token; one still prefilling takes
   the rest of its prompt, cut to the budget left (chunked prefill: the rest comes next step).
   When the pool cannot hold a sequence's new tokens, the newest running sequence is preempted
   (its blocks freed, its tokens kept, put back at the head of the waiting queue to be recomputed
   later, prefix cache permitting cheaply) until the tokens fit; if the sequence is itself the
   newest, it is the one preempted.
2. then waiting sequences in arrival order (preempted ones first), while budget, seats and free
   blocks last: each starts with the longest cached prefix of its tokens (whole blocks) and
   computes the rest, chunked to the budget. Admission never preempts; the queue waits at its
   head (first come, first served).

A request of n samples is one sequence until its prompt is computed; then it forks into n that
share every prompt block (reference counts; copy-on-write of the partly filled last block).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from posttrain.core.generation.paged import BlockManager, BlockTable
from posttrain.core.generation.sampling import RequestParams, make_generator


@dataclass
class Request:
    request_id: int
    prompt: list[int]
    params: RequestParams
    completions: list = field(default_factory=list)
    """One slot per sample (None until that sample finishes)."""
    cached_tokens: int = 0


@dataclass(eq=False)  # a sequence is itself: running.index/remove compare identity, not every field
class Sequence:
    seq_id: int
    request: Request
    index: int
    """Which of the request's samples (0 for the parent before a fork)."""
    tokens: list[int]
    """Prompt, then the sampled tokens."""
    generator: torch.Generator | None
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0
    fork_into: int = 1
    """Samples this sequence becomes once its prompt is computed (n > 1: not forked yet)."""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    preemptions: int = 0

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.request.prompt)

    @property
    def seats(self) -> int:
        return self.fork_into

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache."""
        return len(self.tokens) - self.num_computed


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_batch_tokens: int, device: torch.device):
        self.blocks, self.max_num_seqs, self.max_batch_tokens = blocks, max_num_seqs, max_batch_tokens
        self.device = device
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._next_seq = 0

    def add(self, request: Request) -> None:
        n = request.params.n
        request.completions = [None] * n
        seq = self._new_seq(request, 0, list(request.prompt))
        seq.fork_into = n
        self.waiting.append(seq)

    def _new_seq(self, request: Request, index: int, tokens: list[int]) -> Sequence:
        self._next_seq += 1
        return Sequence(self._next_seq, request, index, tokens, make_generator(request.params, index, self.device))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _seats_used(self) -> int:
        return sum(s.seats for s in self.running)

    def preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and queue it to be recomputed (tokens and generator kept)."""
        self.running.remove(seq)
        self.blocks.free(seq.table)
        seq.num_computed = 0
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens to compute) for the next step; their slots are reserved."""
        bm, budget = self.blocks, self.max_batch_tokens
        scheduled: list[tuple[Sequence, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.pending, budget)
            while not bm.can_reserve(seq.table, seq.num_computed, n):
                victim = self.running[-1]  # never one already scheduled: those come before seq
                self.preempt(victim)
                if victim is seq:
                    break
            if seq not in self.running:
                break  # preempted itself, the newest: nothing runs after it
            bm.reserve(seq.table, seq.num_computed, n)
            scheduled.append((seq, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if self._seats_used() + seq.seats > self.max_num_seqs:
                break
            hits, hashes = bm.lookup(seq.tokens, self.salt(seq))
            cached = len(hits) * bm.block_size
            n = min(len(seq.tokens) - cached, budget)
            evictable_hits = sum(1 for b in hits if bm.refcount[b] == 0)
            need = -(-(cached + n) // bm.block_size) - len(hits)
            if need > bm.num_free - evictable_hits:
                break
            self.waiting.popleft()
            bm.acquire(seq.table, hits, hashes)
            seq.num_computed = cached
            if seq.preemptions == 0:
                seq.request.cached_tokens = cached
            bm.reserve(seq.table, cached, n)
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        return scheduled

    @staticmethod
    def salt(seq: Sequence) -> bytes:
        """Prefix-cache namespace of a sequence: its LoRA adapter's (the same tokens give other KV
        through another adapter)."""
        adapter = seq.request.params.adapter
        return b"" if adapter is None else b"adapter:" + adapter.encode()

    def fork(self, seq: Sequence) -> list[Sequence]:
        """seq (its prompt just computed) and its n - 1 siblings sharing its blocks, in running
        right after it."""
        n, seq.fork_into = seq.fork_into, 1
        children = []
        for index in range(1, n):
            child = self._new_seq(seq.request, index, list(seq.tokens))
            child.table = self.blocks.fork(seq.table)
            child.num_computed = seq.num_computed
            children.append(child)
        at = self.running.index(seq) + 1
        self.running[at:at] = children
        return [seq] + children

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.table)

    def abort(self, request_id: int) -> int:
        """Drop every sequence of a request, running or waiting, freeing its blocks; how many."""
        seqs = [s for s in (*self.running, *self.waiting) if s.request.request_id == request_id]
        for seq in seqs:
            if seq in self.running:
                self.running.remove(seq)
            else:
                self.waiting.remove(seq)
            self.blocks.free(seq.table)  # a waiting sequence holds none (never started or preempted)
        return len(seqs)
