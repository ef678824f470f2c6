"""SwiGLU gating (Shazeer 2020, arXiv 2002.05202): y = silu(gate) * up, elementwise.

    silu(g) = g * sigmoid(g),   silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
    dgate = dy * up * silu'(gate),   dup = dy * silu(gate)

Backward recomputes sigmoid(gate) from the saved gate instead of keeping silu(gate): one
exp per element is far cheaper than a (tokens, hidden) activation held until backward.
Math in fp32, stores in the input dtype. gate/up may be strided row views (e.g. the two halves
of a fused gate_up projection): rows are addressed by stride, columns must be unit-stride.

Layers: kernels (kernels/jit/swiglu.py) -> launchers -> SwiGLUFunction -> `posttrain::swiglu`
custom op -> `swiglu` (dispatch). Reference: `swiglu_reference` (what posttrain.core.model.layers.MLP
computes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from posttrain.kernels import _utils
from posttrain.kernels.dispatch import lean_autograd, use_triton

LAUNCHES = _utils.counter()
MAX_BLOCK = 1024  # columns per program; module-level so tests can shrink it to cover the tiling


def _grid(n_rows: int, n_cols: int) -> tuple[tuple[int, int], int]:
    block = min(MAX_BLOCK, _utils.next_power_of_2(n_cols))
    return (n_rows, _utils.cdiv(n_cols, block)), block


def swiglu_fwd(gate: Tensor, up: Tensor) -> Tensor:
    """gate, up (N, D) with unit column stride -> silu(gate) * up (N, D)."""
    from posttrain.kernels.jit import swiglu as jit  # device code, imported on first launch
    y = gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))
    grid, block = _grid(*gate.shape)
    jit.swiglu_fwd_kernel[grid](gate, up, y, gate.stride(0), up.stride(0), y.stride(0), gate.shape[1],
                             BLOCK=block, num_warps=_utils.num_warps(block))
    LAUNCHES["swiglu_fwd"] += 1
    return y


def swiglu_bwd(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    from posttrain.kernels.jit import swiglu as jit  # device code, imported on first launch
    dy = _utils.as_rows(dy)
    dgate, dup = gate.new_empty(gate.shape), up.new_empty(up.shape)
    grid, block = _grid(*gate.shape)
    jit.swiglu_bwd_kernel[grid](dy, gate, up, dgate, dup, dy.stride(0), gate.stride(0), up.stride(0),
                             dgate.stride(0), dup.stride(0), gate.shape[1],
                             BLOCK=block, num_warps=_utils.num_warps(block))
    LAUNCHES["swiglu_bwd"] += 1
    return dgate, dup


class SwiGLUFunction(torch.autograd.Function):
    """y = silu(gate) * up; saves gate and up (the inputs), never silu(gate)."""

    @staticmethod
    def forward(gate, up):
        return swiglu_fwd(gate, up)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return torch.ops.posttrain.swiglu_backward(dy, gate, up)


@torch.library.custom_op("posttrain::swiglu", mutates_args=())
def _swiglu_op(gate: Tensor, up: Tensor) -> Tensor:
    return SwiGLUFunction.forward(gate, up)


@_swiglu_op.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


@torch.library.custom_op("posttrain::swiglu_backward", mutates_args=())
def _swiglu_backward_op(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return swiglu_bwd(dy, gate, up)


@_swiglu_backward_op.register_fake
def _(dy, gate, up):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


torch.library.register_autograd("posttrain::swiglu", SwiGLUFunction.backward,
                                setup_context=SwiGLUFunction.setup_context)


def swiglu_reference(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


class SwiGLUTorchFunction(torch.autograd.Function):
    """silu(gate) * up in plain torch for devices without the Triton kernel, saving only gate and
    up (autograd through the reference also keeps silu(gate)). With s = sigmoid(gate):
        dup = dy * gate * s,   dgate = dy * up * s * (1 + gate * (1 - s))  (aten's silu_backward)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return swiglu_backward_torch(dy, gate, up, *ctx.needs_input_grad[:2])


def swiglu_backward_torch(dy: Tensor, gate: Tensor, up: Tensor, need_gate: bool = True, need_up: bool = True,
                          silu: Tensor | None = None) -> tuple[Tensor | None, Tensor | None]:
    """(dgate, dup) of silu(gate) * up in torch's fused ops: dup = dy * silu(gate), dgate =
    silu'(gate) * (dy * up) via aten's silu_backward. `silu`: silu(gate) if already at hand."""
    dgate = torch.ops.aten.silu_backward(dy * up, gate) if need_gate else None
    dup = None
    if need_up:
        dup = dy * (F.silu(gate) if silu is None else silu)
    return dgate, dup


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up for gate, up of the same shape (..., D)."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    if not use_triton(gate, up) or not _utils.supported(gate, up) or gate.numel() == 0:
        if lean_autograd(gate, up):
            return SwiGLUTorchFunction.apply(gate, up)
        return swiglu_reference(gate, up)
    y = torch.ops.posttrain.swiglu(_utils.as_rows(gate), _utils.as_rows(up))
    return y.view(gate.shape)
