"""The one loader the training stages use: documents or preference pairs -> micro-batches.

Units. The sampler deals *units* of known token length:
  documents, packing=true   packed rows (posttrain.core.data.packing.pack, first-fit decreasing) of at most
                            max_seq_len tokens each, several documents per row;
  documents, packing=false  one document per unit (a "sequence" of micro_batch_size);
  preference pairs          one pair per unit (chosen and rejected always travel together);
  unpaired examples (KTO)   one example per unit, collated with their mismatched pairs.
A micro-batch is micro_batch_size units, or, with batch_tokens, as many units as fit in that
many tokens (batch_tokens replaces micro_batch_size).

Layout. Padding-free by default: the micro-batch's documents in one (1, T) row whose position_ids
restart at 0 at every document, so attention never crosses documents (posttrain.core.model reads the resets;
the varlen / per-document attention path costs what the documents cost). packing=false keeps that
layout, one document per sequence, rather than padded (B, L) rows with an attention_mask: the model
accepts those, but an attention_mask turns attention into a dense (B, 1, L, L) masked SDPA over the
padding, and distillation's on-policy mix and teacher cache read (1, T) rows with cu_seqlens. The
losses are token sums normalized once per step, so the layout never changes the loss.
`padding_free=False` still gives padded rows (tests, callers that want them).

Every batch carries `doc_indices`: the indices (into the list the loader was built on) of the
documents or pairs it holds, in the order their tokens appear; with packing a unit is a row of
several documents, so this, not the sampler's unit indices, is what per-document side data
(distillation's cached teacher top-k) is gathered by. The loader's `collate` is called with the
same list.

Training loaders shuffle (seeded by data.seed and the epoch) and drop the ragged tail so data-
parallel ranks stay in lockstep; evaluation loaders (`evaluation=True`) see every item once, in
order, and with `lockstep=True` (a mesh where every forward communicates) every rank yields as many
batches, a rank short of the tail repeating the first batch marked `padding` (run, not counted).
State is the sampler's (epoch, position): resumable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from posttrain.core.data.encode import Document, PreferencePair, UnpairedExample
from posttrain.core.data.errors import DataError
from posttrain.core.data.packing import collate_padded, collate_padding_free, collate_preference, collate_unpaired, pack
from posttrain.core.data.sampler import BatchSampler, StatefulLoader

if TYPE_CHECKING:
    from posttrain.core.data.config import DataConfig
    from posttrain.core.data.dataset import PreparedData


class Loader(StatefulLoader):
    """A StatefulLoader over units that each hold one or more items (documents or pairs).

    `groups[u]` lists the item indices of unit u (None: unit u is item u). `collate(indices)` gets
    the item indices of a micro-batch and returns the batch."""

    def __init__(self, sampler: BatchSampler, collate: Callable[[list[int]], dict],
                 groups: list[list[int]] | None = None, lockstep: bool = False):
        super().__init__(sampler, collate)
        self.groups, self.lockstep = groups, lockstep
        if lockstep and sampler.num_epochs != 1:
            raise ValueError("lockstep evaluation loaders run one epoch (num_epochs=1)")

    def indices(self, units: Sequence[int]) -> list[int]:
        """Item indices of a micro-batch of units, in collation order."""
        return list(units) if self.groups is None else [i for u in units for i in self.groups[u]]

    def __iter__(self) -> Iterator[dict]:
        short = len(self) - len(self.sampler)
        for units in self.sampler:
            yield self.collate(self.indices(units))
        for _ in range(short):
            yield {**self.collate(self.indices(self.sampler.global_batches(0)[0])), "padding": True}

    def __len__(self) -> int:
        if self.lockstep:  # ceil(global batches / ranks) on every rank
            return -(-len(self.sampler.global_batches(0)) // self.sampler.world_size)
        return len(self.sampler)


def build_loader(items: Sequence[Document | PreferencePair] | PreparedData, cfg: DataConfig, split: str = "train", *,
                 rank: int = 0, world_size: int = 1, evaluation: bool = False, lockstep: bool = False,
                 num_epochs: int | None = 1, padding_free: bool = True, pack_strategy: str = "ffd",
                 shuffle: bool | None = None, drop_last: bool | None = None, pad_id: int | None = None) -> Loader:
    """A resumable, rank-sharded loader over documents (SFT, distillation) or preference pairs (DPO).

    items: the documents or pairs, or a PreparedData (its `split` is taken, and its pad id).
    cfg: the DataConfig whose packing, micro_batch_size, batch_tokens, max_seq_len and seed apply.
    rank, world_size: this rank's data-parallel shard and the number of shards.
    evaluation: every item once in order (no shuffle, no dropped tail, one epoch); lockstep: with
    evaluation, the same number of batches on every rank (see the module doc).
    padding_free: one (1, T) row per micro-batch (default) or (B, L) padded rows with an
    attention_mask. shuffle / drop_last override the defaults (train: both; evaluation: neither)."""
    from posttrain.core.data.dataset import PreparedData

    if isinstance(items, PreparedData):
        pad_id = items.pad_id if pad_id is None else pad_id
        shuffle = split == "train" if shuffle is None else shuffle
        name = f"split {split!r}"
        stats = f" ({items.stats})"
        items = items[split]
    else:
        name, stats = "the data", ""
    if not items:
        raise DataError(f"{name} has no rows{stats}")
    if lockstep and not evaluation:
        raise ValueError("lockstep=True is for evaluation loaders (training drops the ragged tail instead)")
    if evaluation:
        num_epochs = 1
    shuffle = not evaluation if shuffle is None else shuffle
    drop_last = not evaluation if drop_last is None else drop_last
    pad_id = 0 if pad_id is None else pad_id  # padding is masked out everywhere; any id serves
    budget = {"batch_tokens": cfg.batch_tokens} if cfg.batch_tokens else {"micro_batch_size": cfg.micro_batch_size}
    common = dict(rank=rank, world_size=world_size, seed=cfg.seed, shuffle=shuffle, drop_last=drop_last,
                  num_epochs=num_epochs, padded=not padding_free, **budget)

    if all(isinstance(x, PreferencePair) for x in items):
        pairs: Sequence[PreferencePair] = items

        def collate_pairs(indices: list[int]) -> dict[str, Any]:
            batch = collate_preference([pairs[i] for i in indices], padding_free, pad_id)
            batch["doc_indices"] = indices
            return batch

        return Loader(BatchSampler([len(p) for p in pairs], **common), collate_pairs, lockstep=lockstep)
    if all(isinstance(x, UnpairedExample) for x in items):
        examples: Sequence[UnpairedExample] = items

        def collate_examples(indices: list[int]) -> dict[str, Any]:
            batch = collate_unpaired([examples[i] for i in indices], padding_free, pad_id)
            batch["doc_indices"] = indices
            return batch

        return Loader(BatchSampler([len(e) for e in examples], **common), collate_examples, lockstep=lockstep)
    if not all(isinstance(x, Document) for x in items):
        raise TypeError("build_loader takes Documents, PreferencePairs or UnpairedExamples, not a mix")

    docs: Sequence[Document] = items
    lengths = [len(d) for d in docs]
    if cfg.packing:
        try:
            groups = pack(lengths, cfg.max_seq_len, pack_strategy)
        except ValueError as e:
            raise DataError(f"cannot pack into rows of max_seq_len={cfg.max_seq_len}: {e}") from None
    else:
        groups = [[i] for i in range(len(docs))]
    row_of = {i: r for r, group in enumerate(groups) for i in group}

    def collate_docs(indices: list[int]) -> dict[str, Any]:
        if padding_free:
            batch = collate_padding_free([docs[i] for i in indices])
        else:  # consecutive documents of one packed row share a padded row
            rows: list[list[Document]] = []
            for k, i in enumerate(indices):
                if k == 0 or row_of[i] != row_of[indices[k - 1]]:
                    rows.append([])
                rows[-1].append(docs[i])
            batch = collate_padded(rows, pad_id)
        batch["doc_indices"] = indices
        return batch

    sampler = BatchSampler([sum(lengths[i] for i in g) for g in groups], **common)
    return Loader(sampler, collate_docs, groups, lockstep=lockstep)
