"""Paged KV cache: a pool of fixed-size blocks, and the manager that hands them to sequences.

Layout. Keys and values live in two tensors of shape (layers, num_blocks, kv_heads, block_size,
head_dim); layer l's pool is `k[l]`, (num_blocks, kv_heads, block_size, head_dim). Token t of a
sequence sits in block `block_table[t // block_size]` at offset `t % block_size`; its flat slot is
block * block_size + offset. Pools start zeroed: attention reads whole blocks and masks the unused
slots, so their contents must be finite (they hold stale keys of earlier sequences, or zeros).

Reference counts. A block may be held by several sequences: the n samples of one prompt (after
`fork`) and requests whose prompts share a cached prefix. A block returns to the pool when its
count drops to zero. Blocks are written only by a sequence that holds them alone: before a
sequence writes into a block others also hold (the partly filled last block after a fork),
`reserve` gives it a private copy of the block first (copy-on-write, every layer at once).

Prefix cache. Each full block of a sequence gets a content hash chained over its predecessors:
h_i = sha256(h_{i-1} || token ids of block i), so equal hashes mean equal whole prefixes (not just
equal blocks). `register_full` records full blocks in `cached` (hash -> block). A new sequence
looks up the hashes of its prompt's full blocks in order and takes every hit until the first miss
(`lookup` / `acquire`); only the tokens after them are computed. The last prompt token is always
left to compute (the sampler needs its logits), so at most (len - 1) // block_size blocks hit.
A cached block whose count reaches zero is not freed but parked in an LRU list: a later request
can still hit it; allocation evicts the least recently parked one (forgetting its hash) only when
the free list is empty.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import torch


class PagedKVCache:
    """The block pools of every layer: k, v (layers, num_blocks * block_size, kv_heads, head_dim),
    block b's slots being rows b * block_size .. (b + 1) * block_size - 1 of a layer's pool, so a
    write is one indexed store per layer and a gather one indexed load."""

    def __init__(self, num_layers: int, num_blocks: int, kv_heads: int, block_size: int, head_dim: int,
                 device: torch.device | str, dtype: torch.dtype):
        shape = (num_layers, num_blocks * block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.block_size = block_size
        self._offsets = torch.arange(block_size, device=device)

    def write(self, i: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys/values (T, kv_heads, head_dim) of layer i at flat `slots` (T,)."""
        self.k[i, slots] = k
        self.v[i, slots] = v

    def gather(self, i: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys/values of sequences' blocks: block_tables (S, n) -> (S, kv_heads, n * block_size,
        head_dim) each (a strided view of one gathered copy), slot j of row s being token j of sequence s."""
        S, n = block_tables.shape
        ids = block_tables.reshape(-1)
        bs, rest = self.block_size, self.k.shape[2:]
        # whole blocks by index_select (a memcpy per block), not token by token (aten::index)
        k = self.k[i].view(-1, bs, *rest).index_select(0, ids).view(S, n * bs, *rest)
        v = self.v[i].view(-1, bs, *rest).index_select(0, ids).view(S, n * bs, *rest)
        return k.transpose(1, 2), v.transpose(1, 2)

    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        self.k[:, dst * bs:(dst + 1) * bs] = self.k[:, src * bs:(src + 1) * bs]
        self.v[:, dst * bs:(dst + 1) * bs] = self.v[:, src * bs:(src + 1) * bs]


def block_hash(parent: bytes | None, tokens: list[int] | tuple[int, ...], salt: bytes = b"") -> bytes:
    """Content hash of a full block given its predecessor's hash (None for the first block)."""
    h = hashlib.sha256(salt)
    h.update(parent or b"\0")
    h.update(torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes())
    return h.digest()


@dataclass
class BlockTable:
    """One sequence's blocks: blocks[i] holds tokens [i * block_size, (i + 1) * block_size);
    hashes[i] is the chained hash of block i, for its full blocks registered so far."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)

    def copy(self) -> "BlockTable":
        return BlockTable(list(self.blocks), list(self.hashes))


class OutOfBlocks(RuntimeError):
    """The pool has too few free (or evictable) blocks for the request."""


class BlockManager:
    """Allocates blocks of a PagedKVCache, counts their holders, caches full prompt blocks by hash."""

    def __init__(self, num_blocks: int, block_size: int, cache: PagedKVCache | None = None,
                 enable_prefix_cache: bool = True):
        self.num_blocks, self.block_size, self.cache = num_blocks, block_size, cache
        self.enable_prefix_cache = enable_prefix_cache
        self.free_list: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives block 0 first
        self.refcount = [0] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block
        self.hash_of: dict[int, bytes] = {}  # block -> its hash, for blocks in `cached`
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, LRU first
        self.copies = 0  # copy-on-write copies made (for tests and stats)
        self.allocations = 0  # blocks handed out, ever

    # -- pool -------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: free ones and evictable cached ones."""
        return len(self.free_list) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def _allocate(self) -> int:
        if self.free_list:
            b = self.free_list.pop()
        elif self.evictable:
            b, _ = self.evictable.popitem(last=False)  # least recently released
            del self.cached[self.hash_of.pop(b)]
        else:
            raise OutOfBlocks("no free block")
        self.refcount[b] = 1
        self.allocations += 1
        return b

    def _release(self, b: int) -> None:
        self.refcount[b] -= 1
        assert self.refcount[b] >= 0, f"block {b} released more often than held"
        if self.refcount[b] == 0:
            if b in self.hash_of:
                self.evictable[b] = None  # stays cached until evicted
            else:
                self.free_list.append(b)

    def _hold(self, b: int) -> None:
        if self.refcount[b] == 0:
            self.evictable.pop(b, None)
        self.refcount[b] += 1

    # -- prefix cache -----------------------------------------------------------------------------
    def prefix_hashes(self, tokens: list[int], n_blocks: int, salt: bytes = b"") -> list[bytes]:
        out: list[bytes] = []
        bs = self.block_size
        for i in range(n_blocks):
            out.append(block_hash(out[-1] if out else None, tokens[i * bs:(i + 1) * bs], salt))
        return out

    def lookup(self, tokens: list[int], salt: bytes = b"") -> tuple[list[int], list[bytes]]:
        """The cached blocks (and their hashes) of the longest cached prefix of `tokens`, in whole
        blocks, never covering the last token. No side effects."""
        if not self.enable_prefix_cache:
            return [], []
        blocks, hashes = [], []
        n = (len(tokens) - 1) // self.block_size
        parent = None
        for i in range(n):
            h = block_hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size], salt)
            b = self.cached.get(h)
            if b is None:
                break
            blocks.append(b)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def acquire(self, table: BlockTable, blocks: list[int], hashes: list[bytes]) -> None:
        """Start an empty table with the cached prefix blocks found by `lookup`."""
        assert not table.blocks
        for b in blocks:
            self._hold(b)
        table.blocks, table.hashes = list(blocks), list(hashes)

    def register_full(self, table: BlockTable, tokens: list[int], num_computed: int, salt: bytes = b"") -> None:
        """Hash the table's blocks that `num_computed` tokens have filled, and cache them."""
        if not self.enable_prefix_cache:
            return
        full = num_computed // self.block_size
        bs = self.block_size
        while len(table.hashes) < full:
            i = len(table.hashes)
            h = block_hash(table.hashes[-1] if table.hashes else None, tokens[i * bs:(i + 1) * bs], salt)
            table.hashes.append(h)
            b = table.blocks[i]
            if h not in self.cached and b not in self.hash_of:
                self.cached[h] = b
                self.hash_of[b] = h

    # -- sequences --------------------------------------------------------------------------------
    def blocks_needed(self, table: BlockTable, num_computed: int, n_new: int) -> int:
        """New blocks `reserve(table, num_computed, n_new)` would take (copy-on-write included)."""
        total = -(-(num_computed + n_new) // self.block_size)
        need = max(0, total - len(table.blocks))
        if n_new and num_computed % self.block_size:
            last = table.blocks[num_computed // self.block_size]
            if self.refcount[last] > 1:
                need += 1
        return need

    def can_reserve(self, table: BlockTable, num_computed: int, n_new: int, extra_taken: int = 0) -> bool:
        return self.blocks_needed(table, num_computed, n_new) <= self.num_free - extra_taken

    def reserve(self, table: BlockTable, num_computed: int, n_new: int) -> None:
        """Make room in `table` to write tokens [num_computed, num_computed + n_new): a private
        copy of a shared, partly filled last block, and new blocks. All or nothing."""
        if not self.can_reserve(table, num_computed, n_new):
            raise OutOfBlocks(f"{self.blocks_needed(table, num_computed, n_new)} blocks needed, "
                              f"{self.num_free} free")
        if n_new and num_computed % self.block_size:
            i = num_computed // self.block_size
            old = table.blocks[i]
            if self.refcount[old] > 1:  # copy on write
                new = self._allocate()
                if self.cache is not None:
                    self.cache.copy_block(old, new)
                self._release(old)
                table.blocks[i] = new
                del table.hashes[i:]  # a partly filled block has no hash yet; keep it that way
                self.copies += 1
        total = -(-(num_computed + n_new) // self.block_size)
        while len(table.blocks) < total:
            table.blocks.append(self._allocate())

    def fork(self, table: BlockTable) -> BlockTable:
        """A second holder of every block of `table` (a new sample of the same prompt)."""
        for b in table.blocks:
            self._hold(b)
        return table.copy()

    def free(self, table: BlockTable) -> None:
        """Release every block of `table` (a finished or preempted sequence), newest first, so the
        LRU list evicts a prefix's tail before its head."""
        for b in reversed(table.blocks):
            self._release(b)
        table.blocks, table.hashes = [], []

    def slots(self, table: BlockTable, start: int, n: int) -> list[int]:
        """Flat slots of tokens [start, start + n) of the table's sequence."""
        bs = self.block_size
        return [table.blocks[t // bs] * bs + t % bs for t in range(start, start + n)]
