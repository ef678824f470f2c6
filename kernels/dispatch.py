"""Which implementation an op runs: the Triton kernel or its pure-torch reference.

Rule (no config needed): Triton for CUDA tensors; the torch reference elsewhere; Triton on CPU
tensors too when TRITON_INTERPRET=1 (the interpreter the kernel tests run under).
`POSTTRAIN_KERNELS=torch` (or `set_mode("torch")`, ModelConfig.kernels) forces the references.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator

import torch

_MODE: str | None = None  # None: read POSTTRAIN_KERNELS


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def mode() -> str:
    m = _MODE or os.environ.get("POSTTRAIN_KERNELS", "auto")
    if m not in ("auto", "torch"):
        raise ValueError(f"POSTTRAIN_KERNELS must be 'auto' or 'torch', got {m!r}")
    return m


def set_mode(m: str | None) -> None:
    """'auto' (default rule), 'torch' (references only), or None (back to the environment)."""
    global _MODE
    _MODE = m
    mode()


@contextlib.contextmanager
def kernels_mode(m: str) -> Iterator[None]:
    global _MODE
    old, _MODE = _MODE, m
    try:
        mode()
        yield
    finally:
        _MODE = old


def lean_autograd(*tensors: torch.Tensor | None) -> bool:
    """True when the torch path of an op should run its memory-lean autograd.Function: eager
    autograd will differentiate it. Inference and compiled graphs (which fuse the reference
    themselves) take the plain reference."""
    return (torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and any(t is not None and t.requires_grad for t in tensors))


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when `tensors` (the op's inputs) should go through the Triton kernel."""
    if mode() == "torch" or not triton_available():
        return False
    devices = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    if devices == {"cuda"}:
        return True
    return devices == {"cpu"} and interpreting()
