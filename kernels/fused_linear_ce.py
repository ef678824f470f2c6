"""Fused linear + cross entropy: the loss of `hidden @ weight.T` without the (tokens, V) logits.

Liger-Kernel's scheme (arXiv 2410.10989): tokens go through in chunks; per chunk torch's matmul
makes the (chunk, V) logits, then one Triton program per row makes two passes over that row:

    pass 1  online max / sum-exp (Milakov & Gimelshein 2018)  ->  lse, loss = lse - z_y
    pass 2  dCE/dz = (softmax(z) - onehot(y)) * scale, written over the logits in place

so the only vocab-sized buffer is one chunk of logits, reused as its own gradient. With a scalar
upstream gradient (mean/sum) forward also does d/dhidden = g @ W and d/dweight += g^T h per chunk
and backward only rescales them. With reduction="none" every token has its own upstream
gradient, unknown in forward: forward keeps its inputs and backward recomputes each chunk's
logits (one more matmul per chunk), the kernel scaling row t by grad_out[t].

Layers: kernel (kernels/jit/fused_linear_ce.py) -> launcher (`ce_rows_`) -> chunk loops
(`_forward`, `_backward`) -> `FusedLinearCrossEntropyFunction` (hand-written backward) ->
`posttrain::fused_linear_ce` custom op (reuses the Function's setup_context/backward) ->
`fused_linear_cross_entropy` (dispatch). Torch path and reference:
`posttrain.kernels.chunked_losses.chunked_cross_entropy` (same signature and semantics).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from posttrain.kernels import _utils
from posttrain.kernels.chunked_losses import check_linear_ce_args, chunked_cross_entropy, shift_labels
from posttrain.kernels.dispatch import use_triton

LAUNCHES = _utils.counter()  # kernel name -> launches: tests prove the Triton path ran
# Largest vocab block one program loads at a time. Module-level so tests can shrink it and make
# the online logsumexp run over several blocks on a tiny vocab.
MAX_BLOCK = 16384


def ce_rows_(logits: Tensor, target: Tensor, loss: Tensor, scale: Tensor, ignore_index: int,
             softcap: float | None, write_grad: bool) -> None:
    """Per row of `logits` (rows, V): loss[r] = CE and, if write_grad, logits[r] <- scale * dCE/dz.

    `scale` is (1,) (one factor for all rows) or (rows,) (per-row upstream gradients), fp32.
    Targets must lie in [0, V) or equal ignore_index; the kernel does not bounds-check them
    (that would cost a device->host sync per chunk).
    """
    from posttrain.kernels.jit import fused_linear_ce as jit  # device code, imported on first launch
    rows, n_cols = logits.shape
    assert logits.stride(1) == 1 and scale.numel() in (1, rows)
    block = min(MAX_BLOCK, _utils.next_power_of_2(n_cols))
    jit.ce_rows_kernel[(rows,)](
        logits, logits.stride(0), target, loss, scale, 0 if scale.numel() == 1 else scale.stride(0),
        n_cols, ignore_index, 1.0 if softcap is None else float(softcap),
        BLOCK=block, HAS_SOFTCAP=softcap is not None, WRITE_GRAD=write_grad,
        num_warps=_utils.num_warps(block),
    )
    LAUNCHES["ce_rows"] += 1


def default_chunk_size(n_tokens: int, vocab: int, hidden: int) -> int:
    """Liger's choice: chunk * V ~ tokens * H, so the logits chunk costs about one hidden state.
    At least 64 tokens: smaller chunks only add launches (64 * V stays below the (V, H) weight
    gradient for any H >= 64)."""
    return max(64, _utils.next_power_of_2(_utils.cdiv(max(n_tokens, 1), _utils.cdiv(vocab, hidden))))


def accumulate_linear_grads(g: Tensor, h: Tensor, weight: Tensor, grad_h: Tensor | None, grad_w: Tensor | None) -> None:
    """grad_h[chunk] = g @ W (written into the view), grad_w += g^T h (fp32 accumulator)."""
    if grad_h is not None:
        torch.mm(g, weight, out=grad_h)
    if grad_w is not None:
        if grad_w.dtype == g.dtype:
            grad_w.addmm_(g.T, h)
        else:  # low-precision chunk product, summed across chunks in fp32
            grad_w.add_(g.T @ h)


def _forward(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, chunk_size: int,
             reduction: str, softcap: float | None, need_h: bool, need_w: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, grad_hidden, grad_weight); the grads are 0-element tensors when not computed."""
    n = hidden.shape[0]
    target = target.contiguous()  # the kernel reads target[row] at unit stride
    eager = reduction != "none" and (need_h or need_w)
    losses = hidden.new_empty(n, dtype=torch.float32)
    keep = (target != ignore_index).sum()
    # mean's 1/n goes into the gradient now; as a tensor, so no host sync for the count
    scale = (1.0 / keep.clamp(min=1).float() if reduction == "mean" else torch.ones((), device=hidden.device))
    scale = scale.reshape(1)
    grad_h = torch.empty_like(hidden) if eager and need_h else hidden.new_empty(0)
    grad_w = weight.new_zeros(weight.shape, dtype=torch.float32) if eager and need_w else None
    for s in range(0, n, chunk_size):
        h = hidden[s:s + chunk_size]
        logits = h @ weight.T  # (c, V) in the input dtype: the one vocab-sized buffer
        ce_rows_(logits, target[s:s + chunk_size], losses[s:s + chunk_size], scale, ignore_index, softcap, eager)
        if eager:
            accumulate_linear_grads(logits, h, weight, grad_h[s:s + chunk_size] if need_h else None, grad_w)
    # cast now: keeping a (V, H) fp32 buffer alive until backward costs more than it buys
    grad_w = grad_w.to(weight.dtype) if grad_w is not None else weight.new_empty(0)
    if reduction == "none":
        return losses, grad_h, grad_w
    total = losses.sum()
    return (total * scale[0] if reduction == "mean" else total), grad_h, grad_w


def _backward(grad_loss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int,
              chunk_size: int, softcap: float | None, need_h: bool, need_w: bool) -> tuple[Tensor, Tensor]:
    """reduction="none": recompute each chunk's logits, gradient row t scaled by grad_loss[t]."""
    n = hidden.shape[0]
    grad_loss, target = grad_loss.float().contiguous(), target.contiguous()
    losses = hidden.new_empty(n, dtype=torch.float32)  # recomputed, unused
    grad_h = torch.empty_like(hidden) if need_h else hidden.new_empty(0)
    grad_w = weight.new_zeros(weight.shape, dtype=torch.float32) if need_w else None
    for s in range(0, n, chunk_size):
        h = hidden[s:s + chunk_size]
        logits = h @ weight.T
        ce_rows_(logits, target[s:s + chunk_size], losses[s:s + chunk_size], grad_loss[s:s + chunk_size],
                 ignore_index, softcap, True)
        accumulate_linear_grads(logits, h, weight, grad_h[s:s + chunk_size] if need_h else None, grad_w)
    return grad_h, grad_w.to(weight.dtype) if grad_w is not None else weight.new_empty(0)


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Inputs: hidden (N, H), weight (V, H), target (N,) (already shifted), then the non-tensor
    options. Outputs (loss, grad_hidden, grad_weight): the grads ride along as outputs so that the
    custom op stays functional (torch.compile traces no hidden state); only loss is used."""

    @staticmethod
    def forward(hidden, weight, target, ignore_index, chunk_size, reduction, softcap, need_h, need_w):
        return _forward(hidden, weight, target, ignore_index, chunk_size, reduction, softcap, need_h, need_w)

    @staticmethod
    def setup_context(ctx, inputs, output):
        hidden, weight, target, ignore_index, chunk_size, reduction, softcap, need_h, need_w = inputs
        ctx.opts = (ignore_index, chunk_size, softcap, need_h, need_w)
        ctx.reduction = reduction
        if reduction == "none":
            ctx.save_for_backward(hidden, weight, target)  # saved by reference: no copies
        else:
            ctx.save_for_backward(output[1], output[2])

    @staticmethod
    def backward(ctx, grad_loss, _grad_gh, _grad_gw):
        ignore_index, chunk_size, softcap, need_h, need_w = ctx.opts
        if ctx.reduction == "none":
            hidden, weight, target = ctx.saved_tensors
            gh, gw = torch.ops.posttrain.fused_linear_ce_backward(
                grad_loss, hidden, weight, target, ignore_index, chunk_size, softcap, need_h, need_w)
        else:
            gh, gw = ctx.saved_tensors
            gh = gh * grad_loss.to(gh.dtype) if need_h else None
            gw = gw * grad_loss.to(gw.dtype) if need_w else None
        return (gh if need_h else None), (gw if need_w else None), None, None, None, None, None, None, None


@torch.library.custom_op("posttrain::fused_linear_ce", mutates_args=())
def _fused_linear_ce_op(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, chunk_size: int,
                        reduction: str, softcap: Optional[float], need_h: bool,
                        need_w: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _forward(hidden, weight, target, ignore_index, chunk_size, reduction, softcap, need_h, need_w)


@_fused_linear_ce_op.register_fake
def _(hidden, weight, target, ignore_index, chunk_size, reduction, softcap, need_h, need_w):
    eager = reduction != "none" and (need_h or need_w)
    loss = hidden.new_empty((hidden.shape[0],) if reduction == "none" else (), dtype=torch.float32)
    grad_h = torch.empty_like(hidden) if eager and need_h else hidden.new_empty(0)
    grad_w = torch.empty_like(weight) if eager and need_w else weight.new_empty(0)
    return loss, grad_h, grad_w


@torch.library.custom_op("posttrain::fused_linear_ce_backward", mutates_args=())
def _fused_linear_ce_backward_op(grad_loss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor,
                                 ignore_index: int, chunk_size: int, softcap: Optional[float], need_h: bool,
                                 need_w: bool) -> tuple[Tensor, Tensor]:
    return _backward(grad_loss, hidden, weight, target, ignore_index, chunk_size, softcap, need_h, need_w)


@_fused_linear_ce_backward_op.register_fake
def _(grad_loss, hidden, weight, target, ignore_index, chunk_size, softcap, need_h, need_w):
    return (torch.empty_like(hidden) if need_h else hidden.new_empty(0),
            torch.empty_like(weight) if need_w else weight.new_empty(0))


torch.library.register_autograd("posttrain::fused_linear_ce", FusedLinearCrossEntropyFunction.backward,
                                setup_context=FusedLinearCrossEntropyFunction.setup_context)


def fused_linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = -100,
                               reduction: str = "mean", shift: bool = True, chunk_size: int | None = None,
                               softcap: float | None = None) -> Tensor:
    """Cross entropy of `hidden @ weight.T` against `labels`, never holding more than one chunk of
    logits: same semantics as `chunked_cross_entropy` (kernels/chunked_losses.py), its torch path.

    hidden (N..., H), weight (V, H), labels (N...) int. shift=True scores labels[t + 1] at t.
    reduction: mean over scored tokens (0 when none), sum, or none ((N...) with 0 at ignored).
    The loss is fp32 (the Triton path computes in fp32; fp64 inputs take the reference, which
    keeps fp64). chunk_size defaults to Liger's rule (chunk * V ~ tokens * H).
    """
    check_linear_ce_args(hidden, weight, labels, reduction, chunk_size)
    h2 = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    chunk = chunk_size or default_chunk_size(h2.shape[0], weight.shape[0], weight.shape[1])
    if not (use_triton(hidden, weight, labels) and _utils.supported(hidden, weight)):
        return chunked_cross_entropy(hidden, weight, labels, ignore_index, chunk, reduction, shift, softcap)
    target = shift_labels(labels, ignore_index) if shift else labels
    grad = torch.is_grad_enabled()
    loss, _, _ = torch.ops.posttrain.fused_linear_ce(
        h2, weight.contiguous(), target.reshape(-1).long().contiguous(), ignore_index, chunk, reduction, softcap,
        grad and hidden.requires_grad, grad and weight.requires_grad)
    return loss.view(labels.shape) if reduction == "none" else loss
