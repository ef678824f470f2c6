"""Deterministic, resumable, rank-sharded micro-batches.

The sampler works on "units" (packed rows for SFT, pairs for preference data) of known token
lengths. Each epoch it shuffles the units with a generator seeded by (seed, epoch), groups them into
*global* micro-batches (micro_batch_size units, or as many as fit in batch_tokens), and deals those
round-robin to ranks: rank r takes global batches r, r + W, r + 2W, ... So the batches do not
depend on the world size, and with drop_last every rank gets the same number of micro-batches (a
rank that ran out early would hang the others in their next collective).

Its state is (epoch, index): the epoch and how many of this rank's batches of that epoch were
consumed. A new sampler given that state yields exactly the batches the uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any


class BatchSampler:
    """Yields lists of unit indices, one list per micro-batch of this rank.

    lengths: tokens per unit. Exactly one of micro_batch_size (units per batch) or batch_tokens (a
    token budget: units are added while the batch stays within it; a single unit over budget forms a
    batch of its own). padded=True counts a batch as (units x longest unit) tokens, its padded size.
    num_epochs=None iterates forever."""

    def __init__(self, lengths: Sequence[int], *, micro_batch_size: int | None = None, batch_tokens: int | None = None,
                 padded: bool = False, rank: int = 0, world_size: int = 1, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True, num_epochs: int | None = 1):
        if (micro_batch_size is None) == (batch_tokens is None):
            raise ValueError("give exactly one of micro_batch_size and batch_tokens")
        if (micro_batch_size or batch_tokens) <= 0:
            raise ValueError("micro_batch_size / batch_tokens must be positive")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.lengths = list(lengths)
        self.micro_batch_size, self.batch_tokens, self.padded = micro_batch_size, batch_tokens, padded
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.drop_last, self.num_epochs = drop_last, num_epochs
        self.epoch, self.index = 0, 0
        # Resuming onto different data would silently yield other batches; the fingerprint catches it.
        self.fingerprint = hashlib.sha256(array("q", self.lengths).tobytes()).hexdigest()[:16]
        self._cached: tuple[int, list[list[int]]] | None = None

    # ------------------------------------------------------------------------------------- batches

    def global_batches(self, epoch: int) -> list[list[int]]:
        """Every micro-batch of an epoch, across all ranks, in order."""
        order = list(range(len(self.lengths)))
        if self.shuffle:
            # random.Random seeded by a string hashes it with SHA-512: the same order on every
            # rank, process and platform.
            random.Random(f"posttrain.data:{self.seed}:{epoch}").shuffle(order)
        if self.micro_batch_size is not None:
            return [order[i : i + self.micro_batch_size] for i in range(0, len(order), self.micro_batch_size)]
        batches: list[list[int]] = []
        cur: list[int] = []
        total = longest = 0
        for i in order:
            n = self.lengths[i]
            cost = (len(cur) + 1) * max(longest, n) if self.padded else total + n
            if cur and cost > self.batch_tokens:
                batches.append(cur)
                cur, total, longest = [], 0, 0
            cur.append(i)
            total, longest = total + n, max(longest, n)
        if cur:
            batches.append(cur)
        return batches

    def batches(self, epoch: int) -> list[list[int]]:
        """This rank's micro-batches of an epoch."""
        if self._cached is None or self._cached[0] != epoch:
            every = self.global_batches(epoch)
            mine = every[self.rank :: self.world_size]
            if self.drop_last:
                mine = mine[: len(every) // self.world_size]
            self._cached = (epoch, mine)
        return self._cached[1]

    def __len__(self) -> int:
        """Micro-batches per epoch on this rank."""
        return len(self.batches(self.epoch))

    def __iter__(self) -> Iterator[list[int]]:
        while self.num_epochs is None or self.epoch < self.num_epochs:
            batches = self.batches(self.epoch)
            while self.index < len(batches):
                self.index += 1  # counted before the yield: the state says "consumed"
                yield batches[self.index - 1]
            self.epoch, self.index = self.epoch + 1, 0

    # --------------------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "world_size": self.world_size,
                "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["fingerprint"] != self.fingerprint or state["seed"] != self.seed:
            raise ValueError("sampler state is from other data or another seed "
                             f"(fingerprint {state['fingerprint']}, seed {state['seed']}; "
                             f"now {self.fingerprint}, seed {self.seed}): resuming would not continue the same order")
        index = state["index"]
        if state["world_size"] != self.world_size:
            # Ranks move in lockstep, so `index` batches per rank = index * W global batches consumed.
            consumed = index * state["world_size"]
            if not self.drop_last or consumed % self.world_size:
                raise ValueError(f"cannot resume {consumed} consumed global batches on world_size "
                                 f"{self.world_size}: not a multiple (or drop_last=False)")
            index = consumed // self.world_size
        self.epoch, self.index = state["epoch"], index


class StatefulLoader:
    """Iterates collated micro-batches; its state is the sampler's, so a checkpoint taken after a
    batch resumes at the next one. Collation is cheap list work and stays in this process (worker
    processes would prefetch ahead of the state)."""

    def __init__(self, sampler: BatchSampler, collate: Callable[[list[int]], dict]):
        self.sampler, self.collate = sampler, collate

    def __iter__(self) -> Iterator[dict]:
        for units in self.sampler:
            yield self.collate(units)

    def __len__(self) -> int:
        return len(self.sampler)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
