"""Collectives as autograd functions, each the mirror image of its backward (Megatron-Core's
`tensor_parallel/mappings.py`), with the process group always passed in: no global state.

Names follow the tensor-parallel region they border. A "region" is the stretch of a block where
activations are split over the tp ranks (by heads, by MLP columns, or by vocab): a column-parallel
layer enters it, a row-parallel layer leaves it. With sequence parallelism the activations outside
regions are split by sequence instead of replicated, so entering gathers and leaving scatters.

    forward                       backward                      used by
    copy_to_tp        identity            all-reduce              enter a region (replicated input)
    reduce_from_tp    all-reduce          identity                leave a region (replicated output)
    gather_from_sp    all-gather(dim)     reduce-scatter(dim)     enter a region (sequence-split input)
    reduce_scatter_to_sp  reduce-scatter(dim)  all-gather(dim)    leave a region (sequence-split output)
    scatter_to_sp     split(dim)          all-gather(dim)         split a replicated tensor by sequence
    gather_from_sp_replicated  all-gather(dim)  split(dim)        un-split, outside any region
    all_to_all        all-to-all          all-to-all (reversed)   expert-parallel token exchange

Activations here are (B, T, ...) with the sequence on dim 1, so gathers and scatters work on any
dim: the collective always runs on dim 0 of a contiguous buffer, and the result is moved back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

# torch >= 2.10 renamed these; the old names still work but warn.
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _size(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def all_reduce(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    if _size(group) > 1:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
    return x


def all_gather(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """Concatenate every rank's `x` along `dim` (rank order)."""
    n = _size(group)
    if n == 1:
        return x
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((n * src.shape[0], *src.shape[1:]))
    _all_gather_into(out, src, group=group)
    return out.movedim(0, dim)


def reduce_scatter(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """Sum over ranks, then keep this rank's 1/n slice along `dim`."""
    n = _size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split over {n} ranks")
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((src.shape[0] // n, *src.shape[1:]))
    _reduce_scatter_into(out, src, group=group)
    return out.movedim(0, dim)


def split(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """This rank's 1/n slice of `x` along `dim` (no communication)."""
    n = _size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split over {n} ranks")
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromSP(torch.autograd.Function):
    """All-gather along `dim` forward; reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter(g, ctx.dim, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """Reduce-scatter along `dim` forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.dim, ctx.group), None, None


class _ScatterToSP(torch.autograd.Function):
    """Split along `dim` forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return split(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.dim, ctx.group), None, None


class _GatherFromSPReplicated(torch.autograd.Function):
    """All-gather along `dim` forward; split of the (replicated) gradient backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return split(g, ctx.dim, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    """All-to-all of dim-0 rows with the given splits forward; the reverse exchange backward."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        grad = g.new_empty((sum(in_splits), *g.shape[1:]))
        dist.all_to_all_single(grad, g.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad, None, None, None


def copy_to_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return _CopyToTP.apply(x, group) if _size(group) > 1 else x


def reduce_from_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return _ReduceFromTP.apply(x, group) if _size(group) > 1 else x


def gather_from_sp(x: Tensor, group: dist.ProcessGroup, dim: int = 1) -> Tensor:
    return _GatherFromSP.apply(x, dim, group) if _size(group) > 1 else x


def reduce_scatter_to_sp(x: Tensor, group: dist.ProcessGroup, dim: int = 1) -> Tensor:
    return _ReduceScatterToSP.apply(x, dim, group) if _size(group) > 1 else x


def scatter_to_sp(x: Tensor, group: dist.ProcessGroup, dim: int = 1) -> Tensor:
    return _ScatterToSP.apply(x, dim, group) if _size(group) > 1 else x


def gather_from_sp_replicated(x: Tensor, group: dist.ProcessGroup, dim: int = 1) -> Tensor:
    return _GatherFromSPReplicated.apply(x, dim, group) if _size(group) > 1 else x


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    """Rows x[sum(in_splits[:r]):...] go to rank r; out_splits[r] rows come back from rank r."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def enter_region(x: Tensor, group: dist.ProcessGroup, sequence_parallel: bool) -> Tensor:
    """The input of a tensor-parallel region: gathered by sequence, or copied."""
    return gather_from_sp(x, group) if sequence_parallel else copy_to_tp(x, group)


def leave_region(x: Tensor, group: dist.ProcessGroup, sequence_parallel: bool) -> Tensor:
    """The partial-sum output of a region: reduce-scattered by sequence, or all-reduced."""
    return reduce_scatter_to_sp(x, group) if sequence_parallel else reduce_from_tp(x, group)
