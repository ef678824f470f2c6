"""Shared helpers of the kernel tests (tests/kernels/*)."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import torch


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float], what: str = "",
                 scaled: bool = False) -> None:
    """Compare in fp32 with (atol, rtol) from a test file's tolerance table. scaled=True reads
    atol relative to max|expected|: for matmul outputs, whose rounding error is proportional to
    the size of the terms summed, not to each (possibly cancelled) element."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    atol = tol[0] * (expected.abs().max().item() if scaled else 1.0)
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=tol[1],
                               msg=lambda m: f"{what}: {m}")


@contextlib.contextmanager
def launched(counter: Counter, *names: str) -> Iterator[None]:
    """Fails unless every named kernel launched inside the block: proof the Triton path ran and
    the test is not comparing the reference with itself."""
    before = {n: counter[n] for n in names}
    yield
    missing = [n for n in names if counter[n] <= before[n]]
    assert not missing, f"Triton kernels {missing} did not launch: the dispatch took the reference"


def fp32_copy(t: torch.Tensor | None, requires_grad: bool = True) -> torch.Tensor | None:
    """A detached fp32 copy: the inputs of the fp32 reference (same values, exact upcast)."""
    if t is None:
        return None
    return t.detach().float().requires_grad_(requires_grad and t.requires_grad)


def leaf(shape, dtype: torch.dtype, scale: float = 1.0, requires_grad: bool = True) -> torch.Tensor:
    return (torch.randn(shape) * scale).to(dtype).requires_grad_(requires_grad)
