"""Throughput, MFU, step-time breakdown and profiler traces.

MFU follows the PaLM appendix-B convention: model FLOPs per token = 6 * N (active, non-embedding
parameters touched by matmuls) + 12 * L * H * T for attention (forward + backward), divided by
the device's peak dense bf16 FLOP/s.

Loss-spike and NaN handling, the hang watchdog (heartbeats, stack dumps, collective flight
recorder) and preemption live in posttrain.core.reliability, which posttrain.core.loop.fit drives.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterator

import torch

from posttrain.core.model.args import ModelArgs

# Peak dense bf16 tensor-core FLOP/s by device name fragment (vendor data sheets).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "4090": 165e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def flops_per_token(args: ModelArgs, seq_len: int, trainable_fraction: float = 1.0) -> float:
    """Training FLOPs per token (forward + backward).

    With a frozen base (LoRA), the backward still computes input gradients through every layer
    but skips weight gradients: 2N (fwd) + 2N (input grads) + 2N * trainable_fraction."""
    n = args.num_params(exclude_embeddings=True)
    if args.moe is not None:  # only top_k of the routed experts run per token
        m = args.moe
        per_expert = 3 * args.hidden_size * m.intermediate_size
        n_moe = sum(args.is_moe_layer(i) for i in range(args.num_layers))
        n -= n_moe * per_expert * (m.num_experts - m.top_k)
    n += args.vocab_size * args.hidden_size  # the output head is a matmul per token
    attn = 12 * args.num_layers * args.num_heads * args.head_dim * seq_len
    return (4 + 2 * trainable_fraction) * n + attn


class ThroughputMeter:
    """Tokens/s, MFU and named phase timings: per window (`report`, since the last report) and
    over the whole run (`totals`, since `start`). Phases may nest (the teacher's forwards run
    inside forward_backward), so their fractions need not add up to 1.

    peak_flops: the device's peak FLOP/s for MFU; default from PEAK_FLOPS by the CUDA device
    name (none on CPU, where MFU is not reported)."""

    def __init__(self, flops_per_token: float, device: torch.device, world_size: int = 1,
                 peak: float | None = None):
        self.fpt = flops_per_token
        self.peak = peak if peak is not None else peak_flops(device)
        self.device = device
        self.world = world_size
        self.phases: dict[str, float] = defaultdict(float)
        self.start()

    def start(self) -> None:
        """Begin the run (and the first window) now."""
        self._run = (time.perf_counter(), 0)
        self._run_phases: dict[str, float] = defaultdict(float)
        self._reset()

    def _reset(self) -> None:
        self.tokens = 0
        self.window_start = time.perf_counter()
        self.phases.clear()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a part of the step (data, forward_backward, optim_step, teacher, ...)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            dt = time.perf_counter() - t0
            self.phases[name] += dt
            self._run_phases[name] += dt

    def add_tokens(self, n: int) -> None:
        self.tokens += n
        self._run = (self._run[0], self._run[1] + n)

    def _rates(self, tokens: int, seconds: float, phases: dict[str, float]) -> dict[str, float]:
        seconds = max(seconds, 1e-9)
        tps = tokens / seconds
        out = {"tokens_per_s": tps * self.world, "tokens_per_s_per_device": tps}
        if self.peak:
            out["mfu"] = tps * self.fpt / self.peak
        out.update({f"time/{name}_frac": t / seconds for name, t in phases.items()})
        return out

    def report(self) -> dict[str, float]:
        """The window since the last report (or start); starts the next window."""
        self._sync()
        out = self._rates(self.tokens, time.perf_counter() - self.window_start, self.phases)
        if self.device.type == "cuda":
            out["memory/peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self._reset()
        return out

    def totals(self) -> dict[str, float]:
        """The same figures over the whole run since `start`."""
        self._sync()
        t0, tokens = self._run
        return self._rates(tokens, time.perf_counter() - t0, self._run_phases)


def batch_tokens(batch: dict) -> int:
    """Real (non-padding) input tokens of a model batch."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else int(batch["input_ids"].numel())


@contextlib.contextmanager
def profile(trace_dir: str | Path | None, wait: int = 1, warmup: int = 1, active: int = 3) -> Iterator:
    """A torch.profiler schedule writing Chrome traces to `trace_dir`; yields `step()`.
    With trace_dir None it yields a no-op, so loops call `prof_step()` unconditionally."""
    if trace_dir is None:
        yield lambda: None
        return
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    with torch.profiler.profile(
        activities=acts,
        schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(trace_dir)),
        record_shapes=True,
    ) as prof:
        yield prof.step
