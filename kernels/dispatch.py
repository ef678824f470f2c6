"""Which implementation an op runs: the Triton kernel or its pure-torch path.

Every public op of this package asks `use_triton(*inputs)`, which says yes only when all of:

  * the kernels mode is "auto" (see below; "torch" forces the torch paths everywhere),
  * every input tensor is on a CUDA device, or on the CPU with TRITON_INTERPRET=1 (Triton's
    interpreter, which the kernel tests run under), and
  * Triton imports (it is Linux-only in pyproject; `triton_available`).

The op then adds its own conditions (dtypes, shapes, autograd state) before launching a kernel,
and takes its torch path otherwise. The torch paths compute the same function.

The kernels mode, process-wide:

  "auto"   the rule above: Triton on CUDA, torch elsewhere (the default).
  "torch"  the torch paths only, on every device: for debugging, for numerics that must not
           depend on the hardware, or to compare the two implementations.

`set_mode(m)` sets it; that is what a stage calls with its config value (ModelConfig.kernels)
before building the model. While nothing has been set (or after `set_mode(None)`) the mode
comes from the environment variable POSTTRAIN_KERNELS ("auto" or "torch"; "auto" when unset),
so processes that never call set_mode (tests, scripts) can still be switched from outside. A
mode set by set_mode wins over the variable. `kernels_mode(m)` sets it for a `with` block only.
The mode is read at each call, so it may change between steps; ops already recorded for
backward keep the path they took in forward.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator

import torch

MODES = ("auto", "torch")
ENV_VAR = "POSTTRAIN_KERNELS"

_MODE: str | None = None  # set by set_mode / kernels_mode; None: read ENV_VAR


def _check(m: str, source: str) -> str:
    if m not in MODES:
        raise ValueError(f"{source} must be one of {', '.join(map(repr, MODES))}, got {m!r}")
    return m


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports in this process (asked only when a kernel would otherwise run)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def mode() -> str:
    """The kernels mode in effect: set_mode's value if one is set, else POSTTRAIN_KERNELS, else
    "auto"."""
    if _MODE is not None:
        return _MODE
    return _check(os.environ.get(ENV_VAR, "auto"), ENV_VAR)


def set_mode(m: str | None) -> str | None:
    """Set the process-wide kernels mode: "auto" (Triton on CUDA, torch elsewhere), "torch" (the
    torch paths only), or None (back to the default, POSTTRAIN_KERNELS or "auto"). Stages call it
    with ModelConfig.kernels. Returns the previous setting (None if there was none), for a caller
    that restores it; an invalid value raises ValueError and changes nothing."""
    global _MODE
    if m is not None:
        _check(m, "kernels mode")
    old, _MODE = _MODE, m
    return old


@contextlib.contextmanager
def kernels_mode(m: str) -> Iterator[None]:
    """set_mode(m) for the body of a `with` block; the previous setting is restored after it."""
    old = set_mode(m)
    try:
        yield
    finally:
        set_mode(old)


def lean_autograd(*tensors: torch.Tensor | None) -> bool:
    """True when the torch path of an op should run its memory-lean autograd.Function: eager
    autograd will differentiate it. Inference and compiled graphs (which fuse the reference
    themselves) take the plain reference."""
    return (torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and any(t is not None and t.requires_grad for t in tensors))


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when `tensors` (the op's inputs) should go through the Triton kernel (rule above)."""
    if mode() == "torch":
        return False
    devices = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    if devices != {"cuda"} and not (devices == {"cpu"} and interpreting()):
        return False
    return triton_available()
