"""Weight sync from a trainer to generator processes (disaggregated generation): versioned,
bucketed, full or LoRA-only, from any layout posttrain.core.parallel trains under.

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
`bucket_mb` of one dtype each (default 64 MiB, or a quarter of a LoRA-only sync's bytes).

A sync (`WeightPublisher.publish` on every trainer rank, `WeightSubscriber.receive` on every
generator): the source broadcasts a header (version, number of buckets); then per bucket every
trainer rank gathers the bucket's tensors (DTensor.full_tensor: one bucket at a time, so no rank
holds more than its shards plus one bucket), the source packs them into one flat buffer and
broadcasts it, and each generator copies its block of every tensor out of it (the whole tensor,
or its tensor-parallel slice: posttrain.core.parallel.materialize.local_part) through views made once of
the buffer (a staging buffer kept between syncs, or a ring slot). The generator then carries the
version, which the engine tags its generations with; `Staleness` says what to do with a sample
made by weights more than k versions old. A generator waiting longer than the group's timeout
for a sync raises (torch.distributed's timeout), so no side waits forever.

Transports. Over gloo the bytes cross loopback TCP, at well under memory bandwidth (0.65 GB/s
measured on this project's 2-core CPU machine, 30-37x a memcpy). So on CPU, when a generator
shares the source's host, the buckets go through shared memory instead (`transport="auto"`, the
default; "shm" insists, "dist" never): the source owns a ring of `SLOTS` files in /dev/shm, each
the size of the largest bucket; it packs bucket k straight into slot k % SLOTS (its one memcpy),
tells the group bucket k is ready (a one-element broadcast), and the generators copy their blocks
out of the slot (theirs) and acknowledge (a one-element all-reduce, waited on asynchronously by the
source only before it writes that slot again; a notice carries the version and the bucket count
too, so a sync over the ring has no separate header). The source packs bucket k+1 while the generators
copy out bucket k, so the two copies overlap. Which transport a group gets is agreed when it is
attached: the source offers its slots' paths, and each generator takes them only if it can open
them (same host, same /dev/shm); every member must, or the group uses the process group. NCCL
groups (CUDA tensors) never use the ring.
"""

from __future__ import annotations

import math
import os
import time
import uuid
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

STOP = -1  # header version that tells generators no more syncs come
SLOTS = 2  # shared-memory slots of the "shm" transport (module doc)
SHM_DIR = "/dev/shm"
TRANSPORTS = ("auto", "shm", "dist")


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
        from posttrain.core.lora.model import lora_parameters

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
        n = math.prod(shape) * torch.empty((), dtype=dt).element_size()
        if not buckets or dt != dtype or size + n > bucket_bytes:
            buckets.append([])
            size, dtype = 0, dt
        buckets[-1].append(i)
        size += n
    return buckets


def _bucket_bytes(entries, bucket: list[int]) -> int:
    return sum(math.prod(entries[i][1]) * torch.empty((), dtype=entries[i][2]).element_size() for i in bucket)


def _unlink(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _remove_orphans() -> None:
    """Remove the slots of trainers that died without closing (SIGKILL: no finalizer ran)."""
    for name in os.listdir(SHM_DIR):
        if name.startswith("posttrain-sync-"):
            pid = name.split("-")[2]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                _unlink([os.path.join(SHM_DIR, name)])


class _Ring:
    """The source's shared-memory slots (module doc: Transports): files in /dev/shm mapped shared,
    removed when the publisher closes or is collected (or the process exits)."""

    def __init__(self, slot_bytes: int):
        _remove_orphans()
        base = os.path.join(SHM_DIR, f"posttrain-sync-{os.getpid()}-{uuid.uuid4().hex}")
        self.paths = [f"{base}-{i}" for i in range(SLOTS)]
        self.slot_bytes = slot_bytes
        self._finalizer = weakref.finalize(self, _unlink, list(self.paths))
        self.slots = [torch.from_file(p, shared=True, size=slot_bytes, dtype=torch.uint8) for p in self.paths]
        self.pending: list[list] = [[] for _ in self.paths]  # per slot: (group, work, tensor) acks outstanding

    def offer(self) -> dict:
        return {"paths": self.paths, "slot_bytes": self.slot_bytes}

    def close(self) -> None:
        self._finalizer()


def _open_slots(offer: dict | None) -> list[Tensor] | None:
    """A generator's view of the source's slots, or None when it cannot open them (another host)."""
    if not offer:
        return None
    try:
        if any(os.path.getsize(p) != offer["slot_bytes"] for p in offer["paths"]):
            return None
        return [torch.from_file(p, shared=True, size=offer["slot_bytes"], dtype=torch.uint8) for p in offer["paths"]]
    except OSError:
        return None


@dataclass
class SyncStats:
    version: int
    bytes: int
    buckets: int
    seconds: float
    transport: str = "dist"  # "shm", "dist" (the process group's backend), "shm+dist" when both


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
    gathering again. `group_src`: the source's rank within the group (default: from the world).
    `transport`: "auto" (shared memory with the generators that share this host, when the weights
    are on CPU), "shm" (the same, refusing a group that cannot) or "dist" (module doc)."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None, lora_only: bool = False,
                 bucket_mb: float | None = None, keep_last: bool = False, group_src: int | None = None,
                 transport: str = "auto"):
        if transport not in TRANSPORTS:
            raise ValueError(f"weight sync transport={transport!r}: one of {', '.join(TRANSPORTS)}")
        self.model, self.lora_only, self.keep_last, self.transport = model, lora_only, keep_last, transport
        self.tensors = [t for _, t in _tensors(model, lora_only)]  # looked up once (module doc: Tensors)
        self.entries = manifest(model, lora_only)
        if bucket_mb is None:  # LoRA-only: ~4 buckets, so generators copy one out while the next is packed
            bucket_mb = max(1.0, _bucket_bytes(self.entries, range(len(self.entries))) / 4 / 2**20) if lora_only else 64.0
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.buckets = _buckets(self.entries, self.bucket_bytes)
        self.nbytes = [_bucket_bytes(self.entries, b) for b in self.buckets]
        # a plain contiguous tensor's flat view, made once; None where each sync gathers (a DTensor)
        self.flat = [None if isinstance(t, DTensor) or not t.is_contiguous() else t.detach().view(-1)
                     for t in self.tensors]
        self.version = 0
        self.groups: list[tuple[dist.ProcessGroup, int]] = []
        self.shm: set[dist.ProcessGroup] = set()  # the groups that take the buckets through the ring
        self.ring: _Ring | None = None
        self.failed: dict[dist.ProcessGroup, str] = {}
        self.last: list[Tensor] = []  # the last version's packed buckets (keep_last), reused sync to sync
        if group is not None:
            self.attach(group, dist.get_group_rank(group, dist.get_rank()) if group_src is None else group_src)

    def _shm_possible(self) -> bool:
        if self.transport == "dist" or not os.path.isdir(SHM_DIR):
            return False
        return all(_local(t).device.type == "cpu" for t in self.tensors)

    def attach(self, group: dist.ProcessGroup, src: int = 0) -> None:
        """Add a generator group (this process is its rank `src`); the manifest goes to it now, and
        the group's transport is agreed (module doc)."""
        offer = None
        if self._shm_possible() and _backend(group) == "gloo":
            if self.ring is None:
                self.ring = _Ring(max(self.nbytes))
            offer = self.ring.offer()
        dist.broadcast_object_list([(self.entries, self.lora_only, self.bucket_bytes, offer)], group=group,
                                   group_src=src)
        accepted = torch.tensor([1 if offer else 0])
        dist.all_reduce(accepted, op=dist.ReduceOp.MIN, group=group)
        if accepted.item():
            self.shm.add(group)
        elif self.transport == "shm":
            raise ValueError("weight sync transport='shm': a generator of this group cannot open the shared-memory "
                             f"slots {offer['paths'][0] if offer else SHM_DIR} (another host, or tensors not on CPU); "
                             "use transport='auto' or 'dist'")
        self.groups.append((group, src))

    def send_last(self, group: dist.ProcessGroup) -> None:
        """Send an attached group the last published version again (keep_last), e.g. to a
        generator that was restarted."""
        if not self.keep_last:
            raise ValueError("send_last needs WeightPublisher(keep_last=True)")
        groups = [g for g in self.groups if g[0] is group]
        self._send([g for g in groups if g[0] not in self.shm], [self._header(self.version)])
        for k, flat in enumerate(self.last):
            self._send_bucket(k, groups, flat)
        self._drain()

    def detach(self, group: dist.ProcessGroup) -> None:
        self.groups = [(g, s) for g, s in self.groups if g is not group]
        self.failed.pop(group, None)
        self.shm.discard(group)

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
        tensors = self.tensors
        self._send([g for g in self.groups if g[0] not in self.shm], [self._header(self.version)])  # (shm: in the notices)
        sent = 0
        for k, bucket in enumerate(self.buckets):
            whole = [self.flat[i] if self.flat[i] is not None else _whole(tensors[i]).detach().reshape(-1)
                     for i in bucket]  # collective where sharded
            if not self.groups:
                continue
            flat = self._keep(k, whole) if self.keep_last else None
            sent += self._send_bucket(k, self.groups, flat if flat is not None else whole)
        self._drain()
        transports = sorted({"shm" if g in self.shm else "dist" for g, _ in self.groups})
        return SyncStats(self.version, sent, len(self.buckets), time.perf_counter() - t0, "+".join(transports) or "-")

    def _keep(self, k: int, parts: list[Tensor]) -> Tensor:
        """Bucket k packed into the kept copy of the last version (its buffer reused sync to sync)."""
        numel = sum(p.numel() for p in parts)
        if k >= len(self.last) or self.last[k].numel() != numel or self.last[k].dtype != parts[0].dtype:
            self.last[k:k + 1] = [torch.empty(numel, dtype=parts[0].dtype, device=parts[0].device)]
        torch.cat(parts, out=self.last[k])
        return self.last[k]

    def _send_bucket(self, k: int, groups: list[tuple[dist.ProcessGroup, int]], data: Tensor | list[Tensor]) -> int:
        """Bucket k (packed, or its tensors' flat views) to `groups`: through the ring to the shm
        groups, by broadcast to the others; its bytes."""
        parts = [data] if isinstance(data, Tensor) else data
        ring_groups = [g for g in groups if g[0] in self.shm and g[0] not in self.failed]
        if ring_groups:
            slot = k % SLOTS
            self._wait(slot)
            view = self.ring.slots[slot][:self.nbytes[k]].view(parts[0].dtype)  # bucket k's flat buffer
            torch.cat(parts, out=view) if len(parts) > 1 else view.copy_(parts[0])
            notice = torch.tensor([self.version, len(self.buckets), k], dtype=torch.long)  # the header too
            for group, src in ring_groups:
                try:
                    dist.broadcast(notice, group=group, group_src=src)
                    ack = torch.zeros(1)
                    self.ring.pending[slot].append((group, dist.all_reduce(ack, group=group, async_op=True), ack))
                except RuntimeError as e:
                    self.failed[group] = f"{type(e).__name__}: {e}"
        others = [g for g in groups if g[0] not in self.shm]
        if others:
            flat = parts[0] if len(parts) == 1 else torch.cat(parts)
            self._send(others, [flat.contiguous()])
        return sum(p.numel() * p.element_size() for p in parts)

    def _wait(self, slot: int) -> None:
        """Wait until every generator has copied out of `slot` (a failed one is recorded)."""
        if self.ring is None:
            return
        for group, work, _ in self.ring.pending[slot]:
            if group in self.failed:
                continue
            try:
                work.wait()
            except RuntimeError as e:
                self.failed[group] = f"{type(e).__name__}: {e}"
        self.ring.pending[slot] = []

    def _drain(self) -> None:
        for slot in range(SLOTS):
            self._wait(slot)

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
        """Tell the generators no more syncs come (their `receive` returns None); remove the ring."""
        for group, src in self.groups:
            stop = [STOP, 0, 0] if group in self.shm else [STOP, 0]
            dist.broadcast(torch.tensor(stop, dtype=torch.long), group=group, group_src=src)
        if self.ring is not None:
            self.ring.close()


class WeightSubscriber:
    """A generator's side: `receive` fills its model's tensors in place (its block of each under
    tensor parallelism) and returns the version, or None when the trainer closed."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, source: int = 0, group_src: int | None = None):
        self.model, self.group = model, group
        self.src = dist.get_group_rank(group, source) if group_src is None else group_src
        got: list = [None]
        dist.broadcast_object_list(got, group=group, group_src=self.src)
        entries, self.lora_only, bucket_bytes, offer = got[0]
        self.slots = _open_slots(offer)
        accepted = torch.tensor([1 if self.slots is not None else 0])
        dist.all_reduce(accepted, op=dist.ReduceOp.MIN, group=group)
        if not accepted.item():
            self.slots = None
        self.transport = "shm" if self.slots is not None else "dist"
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
        self.nbytes = [_bucket_bytes(entries, b) for b in self.buckets]
        self.named = _tensors(model, self.lora_only)  # looked up once (module doc: Tensors)
        self.head = None if self.lora_only else _head_copy(model)
        self.staging: dict[torch.device, Tensor] = {}  # "dist": one buffer per device that buckets land in
        self.plan = [self._plan(k, bucket) for k, bucket in enumerate(self.buckets)]
        self.version: int | None = None

    def _plan(self, k: int, bucket: list[int]) -> tuple[Tensor, list, list, list]:
        """Where bucket k lands (its ring slot, or the staging buffer it is broadcast into: both stay
        put) and the views that copy it out, made once: (that buffer, plain destinations and their
        sources for one foreach copy, (destination, whole) pairs copied block by block)."""
        device = _local(self.named[bucket[0]][1]).device
        if self.slots is None and device not in self.staging:
            self.staging[device] = torch.empty(max(self.nbytes), dtype=torch.uint8, device=device)
        buffer = self.slots[k % SLOTS] if self.slots is not None else self.staging[device]
        flat = buffer[:self.nbytes[k]].view(self.entries[bucket[0]][2])
        dsts, srcs, blocks = [], [], []
        sizes = [math.prod(self.entries[i][1]) for i in bucket]
        for i, part in zip(bucket, flat.split(sizes)):
            whole, dst = part.view(self.entries[i][1]), self.named[i][1]
            if isinstance(dst, DTensor) or dst.device != flat.device:
                blocks.append((dst, whole))
            else:
                dsts.append(dst)
                srcs.append(whole)
            if self.head is not None and self.named[i][0] == "embed.weight":
                blocks.append((self.head, whole))
        return flat, dsts, srcs, blocks

    @torch.no_grad()
    def receive(self) -> int | None:
        """Wait for the next sync (up to the group's timeout) and apply it; the version, or None
        when the trainer closed."""
        header = torch.zeros(2 if self.slots is None else 3, dtype=torch.long)  # the ring: bucket 0's notice
        dist.broadcast(header, group=self.group, group_src=self.src)
        version, count = int(header[0]), int(header[1])
        if version == STOP:
            return None
        if count != len(self.buckets):
            raise ValueError(f"weight sync: the trainer sends {count} buckets, {len(self.buckets)} expected")
        for k, (flat, dsts, srcs, blocks) in enumerate(self.plan):
            if self.slots is not None:  # the ring: wait for "version v, bucket k is in its slot"
                notice = header
                if k:
                    notice = torch.zeros(3, dtype=torch.long)
                    dist.broadcast(notice, group=self.group, group_src=self.src)
                if (int(notice[0]), int(notice[2])) != (version, k):
                    raise ValueError(f"weight sync: version {int(notice[0])} bucket {int(notice[2])} announced, "
                                     f"version {version} bucket {k} expected")
            else:
                dist.broadcast(flat, group=self.group, group_src=self.src)
            if dsts:
                torch._foreach_copy_(dsts, srcs)
            for dst, whole in blocks:
                _copy_block(dst, whole)
            if self.slots is not None:  # copied out: the source may write the slot again
                dist.all_reduce(torch.zeros(1), group=self.group)
        self.version = version
        return version


def _backend(group) -> str:
    try:
        return str(dist.get_backend(group))
    except (ValueError, RuntimeError):  # a raw group, not in the world's map (posttrain.core.generation.remote)
        return group.name()


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _whole(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _copy_block(dst: Tensor, whole: Tensor) -> None:
    """Copy into `dst` its block of `whole` (all of it for a plain tensor; a DTensor's local
    block under its placements: a tensor-parallel generator keeps its slice)."""
    if not isinstance(dst, DTensor):
        dst.copy_(whole)
        return
    from posttrain.core.parallel.materialize import local_part

    local, block = local_part(dst)
    local.copy_(whole[block].to(local.device))
