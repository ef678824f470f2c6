"""Weight sync from a trainer to generator processes (disaggregated generation): versioned,
bucketed, full or LoRA-only, from any layout core.parallel trains under.

Roles. Trainer ranks hold the policy in whatever layout they train it (one process, DDP, FSDP /
HSDP, TP, or a mix; every trainer rank takes part in a sync, since gathering a sharded tensor is
collective over the trainer's mesh). Generator ranks hold a model of the same architecture, whole
or split by tensor parallelism, and run the generation engine between syncs. A sync group (a
torch.distributed group, gloo on CPU, NCCL on GPUs) holds the trainer's source rank and every
generator rank: `sync_group` makes it (collective over the world, like every new_group).

What moves. Both sides list the same tensors in the same order (`manifest`): for a full sync every
parameter and persistent buffer of the state dict (a tied head once: it is the embedding), for
`lora_only` the adapter tensors alone (the base stays what the generator loaded). The source sends
its manifest once; a generator checks it against its own (names, shapes, dtypes) and refuses a
mismatch, naming the first tensor that differs. The manifest is cut into buckets of at most
`bucket_mb` of one dtype each.

A sync (`WeightPublisher.publish` on every trainer rank, `WeightSubscriber.receive` on every
generator): the source broadcasts a header (version, number of buckets); then per bucket every
trainer rank gathers the bucket's tensors (DTensor.full_tensor: one bucket at a time, so no rank
holds more than its shards plus one bucket), the source packs them into one flat buffer and
broadcasts it, and each generator copies its block of every tensor out of it (the whole tensor,
or its tensor-parallel slice: core.parallel.materialize.local_part). The generator then carries the
version, which the engine tags its generations with; `Staleness` says what to do with a sample
made by weights more than k versions old. A generator waiting longer than the group's timeout for
a sync raises (torch.distributed's timeout), so no side waits forever.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

STOP = -1  # header version that tells generators no more syncs come


def sync_group(source: int, generators: list[int], timeout_s: float = 300.0) -> dist.ProcessGroup | None:
    """The group of the trainer's `source` rank and the generator ranks (global ranks); None on
    ranks outside it. Collective over the world: every rank calls it."""
    ranks = [source, *generators]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"the source rank {source} and generator ranks {generators} must be distinct")
    group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
    return group if dist.get_rank() in ranks else None


def manifest(model: nn.Module, lora_only: bool = False) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, whole shape, dtype) of what a sync moves, in order (see the module docstring)."""
    return [(name, tuple(t.shape), t.dtype) for name, t in _tensors(model, lora_only)]


def _tensors(model: nn.Module, lora_only: bool) -> list[tuple[str, Tensor]]:
    if lora_only:
        from core.lora.model import lora_parameters

        adapters = {id(p) for p in lora_parameters(model)}
        out = [(n, p) for n, p in model.named_parameters() if id(p) in adapters]
        if not out:
            raise ValueError("lora_only sync: the model has no LoRA adapters")
        return out
    tied = getattr(getattr(model, "args", None), "tie_embeddings", False)
    seen: set[int] = set()
    out = []
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen or (tied and name == "lm_head.weight"):  # a tied head: the embedding, sent once
            continue
        seen.add(id(t))
        out.append((name, t))
    return out


def _head_copy(model: nn.Module) -> Tensor | None:
    """A tied head that is a tensor of its own (tensor parallelism splits the embedding and the
    head apart), which must get the embedding's values too; None when it is the embedding."""
    args = getattr(model, "args", None)
    if not getattr(args, "tie_embeddings", False) or model.lm_head.weight is model.embed.weight:
        return None
    return model.lm_head.weight


def _buckets(entries: list[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int) -> list[list[int]]:
    """Indices into `entries`, consecutive runs of one dtype of at most bucket_bytes (a larger
    tensor alone)."""
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for i, (_, shape, dt) in enumerate(entries):
        n = _numel(shape) * torch.empty((), dtype=dt).element_size()
        if not buckets or dt != dtype or size + n > bucket_bytes:
            buckets.append([])
            size, dtype = 0, dt
        buckets[-1].append(i)
        size += n
    return buckets


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass
class SyncStats:
    version: int
    bytes: int
    buckets: int
    seconds: float


@dataclass
class Staleness:
    """What a sample made by weights `behind` versions older than the trainer's is worth: up to
    `max_behind` it is kept at weight 1 (0: strictly on-policy); beyond, dropped (policy "drop",
    weight None) or kept at weight decay ** (behind - max_behind) (policy "reweight")."""

    max_behind: int = 1
    policy: str = "drop"
    decay: float = 0.5

    def __post_init__(self):
        if self.max_behind < 0 or self.policy not in ("drop", "reweight") or not 0 < self.decay <= 1:
            raise ValueError(f"Staleness(max_behind={self.max_behind}, policy={self.policy!r}, decay={self.decay}): "
                             "max_behind >= 0, policy 'drop' or 'reweight', 0 < decay <= 1")

    def weight(self, sample_version: int, current_version: int) -> float | None:
        behind = current_version - sample_version
        if behind < 0:
            raise ValueError(f"a sample of version {sample_version} is newer than the weights ({current_version})")
        if behind <= self.max_behind:
            return 1.0
        return None if self.policy == "drop" else self.decay ** (behind - self.max_behind)


class WeightPublisher:
    """The trainer's side, on every trainer rank (`group`: the sync group on the source rank,
    None on the other trainer ranks, which only help gather sharded tensors). More generator
    groups can be attached on the source (`attach`: one group per generator process, so that one
    generator's death breaks no other's); `keep_last` keeps the last version's packed buckets on
    the source so that a generator attached late (restarted) is sent it without the trainer ranks
    gathering again. `group_src`: the source's rank within the group (default: from the world)."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None, lora_only: bool = False,
                 bucket_mb: float = 64.0, keep_last: bool = False, group_src: int | None = None):
        self.model, self.lora_only, self.keep_last = model, lora_only, keep_last
        self.entries = manifest(model, lora_only)
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.buckets = _buckets(self.entries, self.bucket_bytes)
        self.version = 0
        self.groups: list[tuple[dist.ProcessGroup, int]] = []
        self.failed: dict[dist.ProcessGroup, str] = {}
        self.last: list[Tensor] = []  # the last version's packed buckets (keep_last)
        if group is not None:
            self.attach(group, dist.get_group_rank(group, dist.get_rank()) if group_src is None else group_src)

    def attach(self, group: dist.ProcessGroup, src: int = 0) -> None:
        """Add a generator group (this process is its rank `src`); the manifest goes to it now."""
        dist.broadcast_object_list([(self.entries, self.lora_only, self.bucket_bytes)], group=group, group_src=src)
        self.groups.append((group, src))

    def send_last(self, group: dist.ProcessGroup) -> None:
        """Send an attached group the last published version again (keep_last), e.g. to a
        generator that was restarted."""
        if not self.keep_last:
            raise ValueError("send_last needs WeightPublisher(keep_last=True)")
        self._send([g for g in self.groups if g[0] is group], [self._header(self.version), *self.last])

    def detach(self, group: dist.ProcessGroup) -> None:
        self.groups = [(g, s) for g, s in self.groups if g is not group]
        self.failed.pop(group, None)

    def take_failed(self) -> dict[dist.ProcessGroup, str]:
        """The groups a send failed on since the last call (a dead generator), with the error;
        they got nothing more after it."""
        failed, self.failed = self.failed, {}
        return failed

    @torch.no_grad()
    def publish(self, version: int | None = None) -> SyncStats:
        """Send the current weights as `version` (default: the last one + 1). Collective over the
        trainer's ranks and the sync groups."""
        self.version = self.version + 1 if version is None else version
        t0 = time.perf_counter()
        tensors = [t for _, t in _tensors(self.model, self.lora_only)]
        self._send(self.groups, [self._header(self.version)])
        sent, kept = 0, []
        for bucket in self.buckets:
            whole = [_whole(tensors[i]) for i in bucket]  # collective where sharded: every trainer rank
            if not self.groups:
                continue
            flat = torch.cat([w.detach().reshape(-1) for w in whole]) if len(whole) > 1 else \
                whole[0].detach().reshape(-1).contiguous()
            sent += self._send(self.groups, [flat])
            if self.keep_last:  # (a lone tensor's flat is a view of it: copied)
                kept.append(flat.clone() if len(bucket) == 1 else flat)
        self.last = kept
        return SyncStats(self.version, sent, len(self.buckets), time.perf_counter() - t0)

    def _header(self, version: int) -> Tensor:
        return torch.tensor([version, len(self.buckets)], dtype=torch.long)

    def _send(self, groups: list[tuple[dist.ProcessGroup, int]], tensors: list[Tensor]) -> int:
        """`tensors` to each group, in order; their bytes. A group whose send fails (its generator
        died) is recorded in `failed` and skipped from then on, never raised here: the other
        trainer ranks are still gathering buckets, and the source must keep gathering with them."""
        for tensor in tensors:
            for group, src in groups:
                if group in self.failed:
                    continue
                try:
                    dist.broadcast(tensor, group=group, group_src=src)
                except RuntimeError as e:
                    self.failed[group] = f"{type(e).__name__}: {e}"
        return sum(t.numel() * t.element_size() for t in tensors)

    def close(self) -> None:
        """Tell the generators no more syncs come (their `receive` returns None)."""
        for group, src in self.groups:
            dist.broadcast(torch.tensor([STOP, 0], dtype=torch.long), group=group, group_src=src)


class WeightSubscriber:
    """A generator's side: `receive` fills its model's tensors in place (its block of each under
    tensor parallelism) and returns the version, or None when the trainer closed."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, source: int = 0, group_src: int | None = None):
        self.model, self.group = model, group
        self.src = dist.get_group_rank(group, source) if group_src is None else group_src
        got: list = [None]
        dist.broadcast_object_list(got, group=group, group_src=self.src)
        entries, self.lora_only, bucket_bytes = got[0]
        mine = manifest(model, self.lora_only)
        for (name, shape, dtype), (n2, s2, d2) in zip(entries, mine):
            if (name, shape, dtype) != (n2, s2, d2):
                raise ValueError(f"weight sync: the trainer sends {name} {shape} {dtype}, this generator's model has "
                                 f"{n2} {s2} {d2} there (same architecture, adapters and dtype needed)")
        if len(entries) != len(mine):
            raise ValueError(f"weight sync: the trainer sends {len(entries)} tensors, this generator's model has "
                             f"{len(mine)} (lora_only={self.lora_only})")
        self.entries = entries
        self.buckets = _buckets(entries, bucket_bytes)  # the publisher's cut
        self.version: int | None = None

    @torch.no_grad()
    def receive(self) -> int | None:
        """Wait for the next sync (up to the group's timeout) and apply it; the version, or None
        when the trainer closed."""
        header = torch.zeros(2, dtype=torch.long)
        dist.broadcast(header, group=self.group, group_src=self.src)
        version, count = int(header[0]), int(header[1])
        if version == STOP:
            return None
        if count != len(self.buckets):
            raise ValueError(f"weight sync: the trainer sends {count} buckets, {len(self.buckets)} expected")
        named = _tensors(self.model, self.lora_only)
        tensors = [t for _, t in named]
        head = None if self.lora_only else _head_copy(self.model)
        for bucket in self.buckets:
            dtype = self.entries[bucket[0]][2]
            device = _local(tensors[bucket[0]]).device
            flat = torch.empty(sum(_numel(self.entries[i][1]) for i in bucket), dtype=dtype, device=device)
            dist.broadcast(flat, group=self.group, group_src=self.src)
            offset = 0
            for i in bucket:
                shape = self.entries[i][1]
                n = _numel(shape)
                _copy_block(tensors[i], flat[offset:offset + n].view(shape))
                if head is not None and named[i][0] == "embed.weight":
                    _copy_block(head, flat[offset:offset + n].view(shape))
                offset += n
        self.version = version
        return version


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _whole(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _copy_block(dst: Tensor, whole: Tensor) -> None:
    """Copy into `dst` its block of `whole` (all of it for a plain tensor; a DTensor's local
    block under its placements: a tensor-parallel generator keeps its slice)."""
    from core.parallel.materialize import local_part

    local, block = local_part(dst)
    local.copy_(whole[block].to(local.device))
