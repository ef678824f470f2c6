"""Rotary position embedding applied to q and k in place (Su et al. 2021, arXiv 2104.09864).

Half-split convention of HF checkpoints (`rotate_reference`): with x = [x1, x2] split along
head_dim and cos = [c1, c2], sin = [s1, s2] likewise,

    forward   y1 = c1 x1 - s1 x2        y2 = c2 x2 + s2 x1
    backward  g1 = c1 d1 + s2 d2        g2 = c2 d2 - s1 d1     (the transpose: rotate by -sin)

One program per (batch, position) loads that position's cos/sin once and rotates every head
there; q and k are one launch each (see RoPEFunction for why not one). Packed sequences need
nothing special: position_ids are already folded into cos/sin (B, T, head_dim).

Forward writes q and k in place (autograd.Function.mark_dirty): the rotated q/k replace the
projections rather than doubling activation memory. Backward writes fresh tensors: a gradient
can be shared with other graph branches, so it is never overwritten.

Where autograd forbids the write (q from split/chunk of a fused qkv, a leaf that requires grad)
the same kernel rotates out of place: `posttrain::rope(x, cos, sin, inverse)`, functional, with
register_autograd (its backward is itself with `not inverse`). register_autograd refuses ops
that mutate their inputs, so the in-place path's autograd is `RoPEFunction` around the mutating
`posttrain::rope_` op; its backward is `posttrain::rope(dy, inverse=True)`.
Device code: kernels/jit/rope.py. Reference: `rotate_reference` (posttrain.core.model.rope.apply_rope).
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.kernels import _utils
from posttrain.kernels.dispatch import use_triton

LAUNCHES = _utils.counter()


def rope_(x: Tensor, cos: Tensor, sin: Tensor, out: Tensor, backward: bool) -> None:
    """Rotate x (B, H, T, hd) into out (x itself for in place; else strided like x)."""
    from posttrain.kernels.jit import rope as jit  # device code, imported on first launch
    bsz, n_heads, seq_len, head_dim = x.shape
    cos, sin = cos.expand(bsz, seq_len, head_dim), sin.expand(bsz, seq_len, head_dim)
    block_h, block_d = _utils.next_power_of_2(n_heads), _utils.next_power_of_2(head_dim // 2)
    jit.rope_kernel[(bsz * seq_len,)](
        x, out, cos, sin, x.stride(0), x.stride(1), x.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), seq_len, n_heads, head_dim // 2,
        BACKWARD=backward, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=_utils.num_warps(block_h * block_d),
    )
    LAUNCHES["rope_bwd" if backward else "rope_fwd"] += 1


def _same_layout_empty(g: Tensor) -> tuple[Tensor, Tensor]:
    """(g, out) with out shaped and strided like g: the kernel indexes both with g's strides."""
    out = torch.empty_like(g)
    if out.stride() != g.stride():  # g is not dense (e.g. a slice): make both contiguous
        g = g.contiguous()
        out = torch.empty_like(g)
    return g, out


def rope_rotate(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    """Out of place: the rotation (inverse=False) or its transpose (backward, inverse=True)."""
    x, out = _same_layout_empty(x)
    rope_(x, cos, sin, out, backward=inverse)
    return out


@torch.library.custom_op("posttrain::rope_", mutates_args=("x",))
def _rope_inplace_op(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    rope_(x, cos, sin, x, backward=False)


@_rope_inplace_op.register_fake
def _(x, cos, sin):
    return None


@torch.library.custom_op("posttrain::rope", mutates_args=())
def _rope_op(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    return rope_rotate(x, cos, sin, inverse)


@_rope_op.register_fake
def _(x, cos, sin, inverse):
    return _same_layout_empty(x)[1]


def _rope_setup_context(ctx, inputs, output):
    _, cos, sin, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.inverse = inverse


def _rope_backward(ctx, dy):
    cos, sin = ctx.saved_tensors
    return torch.ops.posttrain.rope(dy, cos, sin, not ctx.inverse), None, None, None


torch.library.register_autograd("posttrain::rope", _rope_backward, setup_context=_rope_setup_context)


class RoPEFunction(torch.autograd.Function):
    """x rotated in place; saves only cos/sin (alive anyway: every layer shares them).

    One tensor per call: autograd refuses a Function that modifies a view input in place and
    returns more than one output, and q/k are views of the projections. So q and k are two
    launches, each loading its position's cos/sin once for all of its heads."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        torch.ops.posttrain.rope_(x, cos, sin)
        ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin)
        return x

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return torch.ops.posttrain.rope(dy, cos, sin, True), None, None


def _writable(t: Tensor) -> bool:
    """Whether autograd lets a Function overwrite t: not a leaf that requires grad, and not one
    of several views returned together (split/chunk/unbind), which autograd cannot rebase."""
    if not (t.requires_grad and torch.is_grad_enabled()):
        return True
    if t.is_leaf:
        return False
    from torch._C._autograd import CreationMeta, _get_creation_meta  # no public equivalent

    return not t._is_view() or _get_creation_meta(t) == CreationMeta.DEFAULT


def rotate_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (B, n_heads, T, head_dim) by cos/sin (B or 1, T, head_dim), out of place, in the
    half-split convention HF checkpoints use (posttrain.core.model.rope.apply_rope is this function)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def apply_rope_reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Out of place, pure torch (`rotate_reference` on each of q and k)."""
    return rotate_reference(q, cos, sin), rotate_reference(k, cos, sin)


def apply_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate q (B, n_heads, T, hd) and k (B, n_kv, T, hd) by cos/sin (B or 1, T, hd).

    The Triton path rotates q and k in place and returns them (do not read the unrotated q/k
    afterwards), except where autograd forbids it; the reference returns new tensors. Gradients do
    not flow into cos/sin (positions are not learned); cos/sin that require grad take the
    reference."""
    if (q.dim() != 4 or k.dim() != 4 or q.shape[-1] % 2 or k.shape[-1] != q.shape[-1]
            or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]):
        raise ValueError(f"apply_rope: q {tuple(q.shape)}, k {tuple(k.shape)} must be "
                         "(B, heads, T, head_dim) with the same B, T and even head_dim")
    if (cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] not in (1, q.shape[0])
            or cos.shape[1:] != (q.shape[2], q.shape[3])):
        raise ValueError(f"apply_rope: cos {tuple(cos.shape)} / sin {tuple(sin.shape)} must be "
                         f"(B, T, head_dim) = (*, {q.shape[2]}, {q.shape[3]})")
    if (not use_triton(q, k, cos, sin) or not _utils.supported(q, k, cos, sin)
            or cos.requires_grad or sin.requires_grad or q.stride(-1) != 1 or k.stride(-1) != 1
            or cos.stride(-1) != 1 or sin.stride(-1) != 1 or q.numel() == 0):
        return apply_rope_reference(q, k, cos, sin)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # Under torch.compile the graph is functionalized (an in-place op becomes a copy anyway), so
    # trace the functional op; in eager, write into x whenever autograd allows it.
    if not torch.compiler.is_compiling() and _writable(x):
        return RoPEFunction.apply(x, cos, sin)
    return torch.ops.posttrain.rope(x, cos, sin, False)  # differentiable too (inverse rotation)
