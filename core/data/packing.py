"""Packing documents into fixed token budgets, and collating them into model-ready tensors.

Packed rows never let one document see another: position_ids restart at 0 at each document start
(posttrain.core.model reads a reset as a document boundary and masks attention across it), and `cu_seqlens`
(int32 prefix sums of document lengths, as varlen flash-attention kernels take them) says the same
for kernels that want it. Loss labels must not cross documents either: with shifted labels the
logits at the last token of document A are scored against labels[first token of B], so the label of
every document's first token is set to -100. Its label is never a target within its own document
(nothing precedes it), so a packed row's loss equals the token-weighted loss of its documents alone.

Two layouts:
  padding-free  all documents of the micro-batch in one row, shape (1, total_tokens), no padding;
  padded        one packed row per batch row, (B, L), right-padded: attention_mask 0 and labels -100
                on padding, whose positions form their own run from 0 (so cu_seqlens, over the
                flattened (B*L) tokens, stays consistent with position_ids).

Documents tagged with an adapter (several adapters trained at once, posttrain.core.data.routing) add
`adapter_ids`, each token's adapter (-1 on padding and untagged documents), the routing
posttrain.core.lora.route_adapters takes, and `sequence_adapters`, each document's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain.core.data.encode import Document, PreferencePair, UnpairedExample
from posttrain.core.losses import IGNORE_INDEX

PACKING_STRATEGIES = ("ffd", "greedy")


def pack(lengths: Sequence[int], capacity: int, strategy: str = "ffd") -> list[list[int]]:
    """Group document indices into rows of at most `capacity` tokens; deterministic.

    ffd: first-fit decreasing (longest first, each into the earliest row with room) wastes the
    fewest tokens; rows list their documents in placement order. greedy: in order, a new row when
    the next document does not fit; keeps the data order (curricula, evaluation)."""
    if strategy not in PACKING_STRATEGIES:
        raise ValueError(f"unknown packing strategy {strategy!r}; expected one of {PACKING_STRATEGIES}")
    too_long = [i for i, n in enumerate(lengths) if not 0 < n <= capacity]
    if too_long:
        i = too_long[0]
        raise ValueError(f"document {i} has {lengths[i]} tokens; packing needs 1..{capacity} (truncate first)")
    if strategy == "greedy":
        rows: list[list[int]] = []
        used = capacity
        for i, n in enumerate(lengths):
            if used + n > capacity:
                rows.append([])
                used = 0
            rows[-1].append(i)
            used += n
        return rows
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    fit = _FirstFit(len(lengths), capacity)
    rows = []
    for i in order:
        r = fit.take(lengths[i])
        if r == len(rows):
            rows.append([])
        rows[r].append(i)
    return rows


class _FirstFit:
    """Earliest row with at least `need` free tokens in O(log n): a max-tree over free space, with
    n rows all empty at the start (n documents never need more). Unopened rows are full-capacity,
    so the earliest fitting row is always an open one or the next new one."""

    def __init__(self, n: int, capacity: int):
        self.size = 1
        while self.size < max(n, 1):
            self.size *= 2
        self.free = [0] * self.size + [capacity] * n + [0] * (self.size - n)
        for i in range(self.size - 1, 0, -1):
            self.free[i] = max(self.free[2 * i], self.free[2 * i + 1])

    def take(self, need: int) -> int:
        i = 1
        while i < self.size:  # descend, preferring the left (earlier) subtree
            i = 2 * i if self.free[2 * i] >= need else 2 * i + 1
        row = i - self.size
        self.free[i] -= need
        while i > 1:
            i //= 2
            self.free[i] = max(self.free[2 * i], self.free[2 * i + 1])
        return row


# ------------------------------------------------------------------------------------------ collate


def _flatten(rows: Sequence[Sequence[Document]], lengths: list[int]):
    ids, labels, pos, seq = [], [], [], []
    for r, row in enumerate(rows):
        for doc in row:
            n = len(doc)
            ids += doc.input_ids
            labels += [IGNORE_INDEX] + doc.labels[1:]  # no target across a document boundary
            pos += range(n)
            seq += [len(lengths)] * n
            lengths.append(n)
    return ids, labels, pos, seq


def _adapters(docs: Sequence[Document], batch: dict) -> dict:
    """Add adapter_ids (the tokens' adapters, laid out as sequence_ids) and sequence_adapters to a
    batch of `docs` (in sequence order), if any is tagged."""
    if all(d.adapter is None for d in docs):
        return batch
    seq = torch.tensor([-1 if d.adapter is None else d.adapter for d in docs] + [-1], dtype=torch.long)
    batch["sequence_adapters"] = seq[:-1]
    batch["adapter_ids"] = seq[batch["sequence_ids"]]  # sequence id -1 (padding) picks the last: -1
    return batch


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return cu


def collate_padding_free(docs: Sequence[Document]) -> dict[str, torch.Tensor | int]:
    """All documents in one (1, total_tokens) row. Keys: input_ids, labels, position_ids, cu_seqlens
    (int32, (n_docs + 1,)), max_seqlen (int), num_target_tokens (scalar), sequence_ids (1, T): which
    document each token belongs to, for per-sequence sums (see `sequence_sums`)."""
    lengths: list[int] = []
    ids, labels, pos, seq = _flatten([docs], lengths)
    labels_t = torch.tensor([labels], dtype=torch.long)
    return _adapters(docs, {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "labels": labels_t,
        "position_ids": torch.tensor([pos], dtype=torch.long),
        "cu_seqlens": _cu_seqlens(lengths),
        "max_seqlen": max(lengths, default=0),
        "num_target_tokens": (labels_t != IGNORE_INDEX).sum(),
        "sequence_ids": torch.tensor([seq], dtype=torch.long),
    })


def collate_padded(rows: Sequence[Sequence[Document]], pad_id: int, pad_to: int | None = None
                   ) -> dict[str, torch.Tensor | int]:
    """One row per entry of `rows` (each a list of documents packed together), right-padded to the
    longest row or to `pad_to`. Same keys as `collate_padding_free` plus attention_mask; padding has
    sequence_id -1."""
    width = max((sum(len(d) for d in row) for row in rows), default=0)
    if pad_to is not None:
        if pad_to < width:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest row ({width} tokens)")
        width = pad_to
    B = len(rows)
    input_ids = torch.full((B, width), pad_id, dtype=torch.long)
    labels = torch.full((B, width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((B, width), dtype=torch.long)
    attention_mask = torch.zeros((B, width), dtype=torch.long)
    sequence_ids = torch.full((B, width), -1, dtype=torch.long)
    segments: list[int] = []  # lengths of the runs of the flattened (B*width) tokens, pads included
    lengths: list[int] = []
    for b, row in enumerate(rows):
        ids, lab, pos, seq = _flatten([row], lengths)
        n = len(ids)
        input_ids[b, :n] = torch.tensor(ids, dtype=torch.long)
        labels[b, :n] = torch.tensor(lab, dtype=torch.long)
        position_ids[b, :n] = torch.tensor(pos, dtype=torch.long)
        attention_mask[b, :n] = 1
        sequence_ids[b, :n] = torch.tensor(seq, dtype=torch.long)  # numbered across the whole batch
        position_ids[b, n:] = torch.arange(width - n)
        segments += lengths[len(lengths) - len(row):] + ([width - n] if width > n else [])
    return _adapters([d for row in rows for d in row], {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "attention_mask": attention_mask,
        "cu_seqlens": _cu_seqlens(segments),
        "max_seqlen": max(segments, default=0),
        "num_target_tokens": (labels != IGNORE_INDEX).sum(),
        "sequence_ids": sequence_ids,
    })


def collate_preference(pairs: Sequence[PreferencePair], padding_free: bool = True, pad_id: int = 0
                       ) -> dict[str, torch.Tensor | int]:
    """Chosen and rejected of every pair in one batch, so one forward scores both: sequences
    0..N-1 are the chosen, N..2N-1 the rejected (padding-free: one row; padded: one row each).
    Per-sequence log-probs: `sequence_sums(token_logps, batch["sequence_ids"], 2 * N)`."""
    docs = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    batch = collate_padding_free(docs) if padding_free else collate_padded([[d] for d in docs], pad_id)
    batch["num_pairs"] = len(pairs)
    return batch


def collate_unpaired(examples: Sequence[UnpairedExample], padding_free: bool = True, pad_id: int = 0,
                     kl: bool = True) -> dict[str, torch.Tensor | int]:
    """Unpaired preference examples (KTO), one sequence each (prompt + completion), with
    `num_sequences` (N), `desirable` (bool (N,)) and, with `kl`, `kto_kl_batch`: the mismatched
    pairs KTO's reference point is estimated from, collated alike. They are TRL's: the completions
    rotated by one within the micro-batch, so prompt i goes with completion i-1 (the first with the
    last), and the mismatched completions are the batch's own."""
    docs = [e.document for e in examples]
    batch = collate_padding_free(docs) if padding_free else collate_padded([[d] for d in docs], pad_id)
    batch["num_sequences"] = len(examples)
    batch["desirable"] = torch.tensor([bool(e.label) for e in examples], dtype=torch.bool)
    if kl:
        prev = list(examples[-1:]) + list(examples[:-1])
        mism = [e.with_completion_of(q) for e, q in zip(examples, prev)]
        kl_batch = collate_padding_free(mism) if padding_free else collate_padded([[d] for d in mism], pad_id)
        kl_batch["num_sequences"] = len(examples)
        batch["kto_kl_batch"] = kl_batch
    return batch


def sequence_sums(values: torch.Tensor, sequence_ids: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """Sum per sequence of per-token values (e.g. `posttrain.core.losses.token_logps`) -> (num_sequences,).

    With shifted labels the value at position t scores token t + 1; it is credited to token t's
    sequence, which is right because a document's last position scores the next document's first
    label, which is -100, so its value is 0. Tokens with sequence id -1 (padding) are left out."""
    v, s = values.reshape(-1), sequence_ids.reshape(-1).to(values.device)
    keep = s >= 0
    return torch.zeros(num_sequences, dtype=v.dtype, device=v.device).index_add(0, s[keep], v[keep])
