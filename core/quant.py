"""NF4 quantization of frozen base weights, for QLoRA (Dettmers et al. 2023, arXiv 2305.14314).

The storage format (the NF4 code table, `NF4Tensor`, `quantize_nf4` and the pure-torch
`dequantize_nf4`) is defined beside its Triton kernels in kernels/nf4.py, which explains it, and
is re-exported here. This module adds what the model needs on top: `NF4Weight`, an NF4Tensor held
as module buffers, and `nf4_linear`, a linear layer that keeps no dense weight for backward.

Under FSDP (FSDP-QLoRA) `shard_storage` cuts an NF4Weight's buffers (packed codes, block scales,
double-quant scales) into equal flat pieces over the data-parallel mesh, as DTensors: each rank
stores 1/N of the base. A forward gathers the whole weight for its matmul and lets it go; its
backward gathers it again (nothing whole is kept between them), as FSDP does for parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.kernels.nf4 import NF4_CODE, NF4Tensor, quantize_nf4  # noqa: F401
from posttrain.kernels.nf4 import dequantize_nf4_reference as dequantize_nf4


class _NF4Linear(torch.autograd.Function):
    """y = x W^T with W held in NF4; backward dequantizes W again rather than saving it dense."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: NF4Tensor | NF4Weight) -> torch.Tensor:
        # What is kept is the holder: packed buffers only (a quarter of the dense weight's bf16
        # bytes), and for sharded storage only this rank's piece of them.
        ctx.weight = weight
        return F.linear(x, _whole(weight).dequantize(x.dtype))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        # The base is frozen: only the input gradient is needed.
        return grad_out @ _whole(ctx.weight).dequantize(grad_out.dtype), None


def _whole(weight: NF4Tensor | NF4Weight) -> NF4Tensor:
    return weight if isinstance(weight, NF4Tensor) else weight.tensor


def nf4_linear(x: torch.Tensor, weight: NF4Tensor | NF4Weight) -> torch.Tensor:
    """F.linear(x, dequantize(weight)) without keeping the dense weight for backward. Pass the
    NF4Weight module itself when its storage may be sharded (`shard_storage`): its pieces are
    gathered in forward and again in backward."""
    return _NF4Linear.apply(x, weight)


def nf4_shard(t: NF4Tensor, dim: int, parts: int, index: int) -> NF4Tensor:
    """Part `index` of `parts` of a 2-D NF4 weight cut along `dim` (0: rows, 1: columns), as an
    NF4Tensor of its own that dequantizes to exactly that slice of the whole weight: the same
    codes, each under its block's fp32 scale (double quantization undone). Its blocks are the
    whole weight's blocks cut where the slice cuts them (gcd of the block size and the slice's
    run of contiguous values), so none straddles two scales. What tensor parallelism computes on."""
    import math

    rows, cols = t.shape
    if t.shape[dim] % parts:
        raise ValueError(f"cannot split a {tuple(t.shape)} NF4 weight in {parts} along dim {dim}")
    n = t.shape[dim] // parts
    row0, col0 = (index * n, 0) if dim == 0 else (0, index * n)
    shape = (n, cols) if dim == 0 else (rows, n)
    b = math.gcd(t.block_size, n * cols if dim == 0 else n)
    if b % 2:
        raise ValueError(f"a {tuple(t.shape)} NF4 weight split in {parts} along dim {dim} leaves blocks of {b} "
                         "values, which two-per-byte packing cannot hold")
    codes = torch.stack([t.packed >> 4, t.packed & 0xF], dim=-1).flatten()[: rows * cols].view(rows, cols)
    local = codes[row0:row0 + shape[0], col0:col0 + shape[1]].flatten()
    starts = torch.arange(0, local.numel(), b, device=local.device)  # each local block's first value
    whole_index = (starts // shape[1] + row0) * cols + starts % shape[1] + col0
    absmax = t.block_absmax()[whole_index // t.block_size].clone()
    packed = (local[0::2] << 4) | local[1::2]
    return NF4Tensor(packed, absmax, torch.Size(shape), t.dtype, b)


class NF4Weight(nn.Module):
    """An NF4Tensor held as buffers, so .to(device), state_dict and FSDP see it. persistent=False:
    not in the state dict (a tensor-parallel rank's slice, derived from the whole weight)."""

    def __init__(self, t: NF4Tensor, persistent: bool = True):
        super().__init__()
        self.shape, self.dtype = t.shape, t.dtype
        self.block_size, self.dq_block_size = t.block_size, t.dq_block_size
        self.register_buffer("packed", t.packed, persistent=persistent)
        self.register_buffer("absmax", t.absmax, persistent=persistent)
        if t.double_quant:
            self.register_buffer("absmax_scale", t.absmax_scale, persistent=persistent)
            self.register_buffer("absmax_offset", t.absmax_offset, persistent=persistent)

    @property
    def tensor(self) -> NF4Tensor:
        """The whole NF4 weight. Rebuilt from the buffers on each access so it follows .to()
        moves; with sharded storage the pieces are gathered first (collective over the mesh)."""
        return NF4Tensor(
            _full(self.packed), _full(self.absmax), self.shape, self.dtype, self.block_size,
            _full(getattr(self, "absmax_scale", None)), _full(getattr(self, "absmax_offset", None)),
            self.dq_block_size,
        )

    @property
    def sharded(self) -> bool:
        from torch.distributed.tensor import DTensor

        return isinstance(self.packed, DTensor)

    def local_nbytes(self) -> int:
        """Bytes this rank stores (its pieces only, when sharded)."""
        from torch.distributed.tensor import DTensor

        bufs = [b.to_local() if isinstance(b, DTensor) else b for b in self._buffers.values() if b is not None]
        return sum(b.numel() * b.element_size() for b in bufs)

    def shard_storage(self, mesh) -> None:
        """Keep only this rank's piece of every buffer, as a DTensor sharded along its one (flat)
        dimension over `mesh` (the FSDP mesh: 1-D, or 2-D for HSDP, replicated over the first
        dimension). The pieces are torch.chunk's (uneven sizes allowed); nothing is
        communicated, every rank holds the whole weight when this is called."""
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        if self.sharded:
            return
        placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
        for name, buf in list(self._buffers.items()):
            if buf is not None and buf.dim() == 1 and buf.numel() >= mesh.size(-1):
                self._buffers[name] = distribute_tensor(buf, mesh, placements, src_data_rank=None)

    @property
    def bits_per_weight(self) -> float:
        return self.tensor.bits_per_weight

    def numel(self) -> int:
        return self.shape.numel()

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_nf4(self.tensor, dtype)

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) must not round the fp32 scales: take only the device from fn.
        for name, buf in self._buffers.items():
            if buf is not None:
                probe = torch.empty(0, dtype=buf.dtype, device=buf.device)
                self._buffers[name] = buf.to(fn(probe).device)
        return self

    def extra_repr(self) -> str:
        dq = ", double_quant" if hasattr(self, "absmax_scale") else ""
        shard = ", sharded" if self.sharded else ""
        return f"shape={tuple(self.shape)}, dtype={self.dtype}, block={self.block_size}{dq}{shard}"


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_nf4_storage(model: nn.Module, mesh) -> int:
    """FSDP-QLoRA: shard the storage of every NF4 weight in `model` over `mesh`
    (NF4Weight.shard_storage). Returns how many were sharded."""
    weights = [m for m in model.modules() if isinstance(m, NF4Weight) and not m.sharded]
    for w in weights:
        w.shard_storage(mesh)
    return len(weights)
