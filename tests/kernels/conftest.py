"""Kernel tests run the Triton kernels on CPU through Triton's interpreter.

TRITON_INTERPRET=1 must be in the environment before triton is imported (`triton.jit` reads it
when a kernel is defined), so the Makefile runs `TRITON_INTERPRET=1 pytest tests/kernels` as a
process of its own. Without it every op would quietly take its torch reference on CPU and the
tests would compare the reference with itself: refuse to run instead.

The interpreter (triton 3.9) has two bf16 defects the GPU does not have, fixed here for the test
session only, each after a probe shows it and followed by a check that the fix holds:
  * tl.dot on bf16 runs np.matmul on the raw uint16 storage (garbage);
  * fp32 -> bf16 casts truncate, where the hardware rounds to nearest even.
Without the fixes bf16 could not be tested at all (dot) or would need a 2x looser tolerance
than the hardware deserves (casts).
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.exit(
        "tests/kernels must run under Triton's interpreter: TRITON_INTERPRET=1 has to be set before "
        "triton is imported. Run `TRITON_INTERPRET=1 pytest tests/kernels` (a separate process "
        "from the rest of the suite).",
        returncode=4,
    )

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter as _interp  # noqa: E402


@triton.jit
def _probe_kernel(A, B, C, S, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    a = tl.load(A + i[:, None] * BLOCK + i[None, :])
    b = tl.load(B + i[:, None] * BLOCK + i[None, :])
    tl.store(C + i[:, None] * BLOCK + i[None, :], tl.dot(a, b))
    tl.store(S + i, tl.load(C + i).to(tl.bfloat16))


def _probe() -> tuple[bool, bool]:
    """(dot ok, cast rounds to nearest even) for bf16 in the interpreter."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=g).bfloat16() for _ in range(2))
    c = torch.empty(16, 16)
    s = torch.empty(16, dtype=torch.bfloat16)
    _probe_kernel[(1,)](a, b, c, s, BLOCK=16)
    dot_ok = torch.allclose(c, a.float() @ b.float(), atol=1e-4, rtol=1e-4)
    return dot_ok, torch.equal(s, c.flatten()[:16].bfloat16())


def _bf16_bits_to_f32(h):
    if h.dtype.scalar != tl.bfloat16:
        return h
    return _interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)


def _f32_to_bf16_rne(data: np.ndarray) -> np.ndarray:
    bits = data.astype(np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    quiet_nan = (bits >> 16) | np.uint32(0x40)
    return np.where(np.isnan(data), quiet_nan, rounded).astype(np.uint16)


def _fix_interpreter_bf16() -> None:
    builder = _interp.InterpreterBuilder
    dot_ok, cast_ok = _probe()
    if not dot_ok:
        orig_dot = builder.create_dot

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            # bf16 -> fp32 is exact, so this is what an MMA with fp32 accumulation computes.
            return orig_dot(self, _bf16_bits_to_f32(a), _bf16_bits_to_f32(b), d, input_precision,
                            max_num_imprecise_acc)

        builder.create_dot = create_dot
    if not cast_ok:
        orig_cast = builder.cast_impl

        def cast_impl(self, src, dst_type):
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
                return _interp.TensorHandle(_f32_to_bf16_rne(src.data), tl.bfloat16)
            return orig_cast(self, src, dst_type)

        builder.cast_impl = cast_impl
    if _probe() != (True, True):
        pytest.exit(f"could not fix the Triton interpreter's bf16 dot/cast (triton {triton.__version__})",
                    returncode=4)


_fix_interpreter_bf16()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
