"""Kernel benchmarks: each posttrain op beside torch eager, torch.compile and Liger, in one run.

    python -m posttrain.benchmarks.kernels [--device cpu|cuda] [--quick] [--out file.json] [--ops a,b]

Prints one JSON document: run metadata and `records`, one per (op, shape, impl) with
    op, shape, dtype, impl, status, ms, peak_mem_bytes, ms_vs_eager, mem_vs_eager,
    ms_vs_compile, mem_vs_compile, and `path` (triton | torch-reference) for impl "posttrain".
impl: posttrain (our dispatch function), eager (the plain-torch reference; for the fused losses
the one that materializes (tokens, V) logits), chunked_torch (the losses' chunked pure-torch
fallback), compile (torch.compile of eager), liger (Liger-Kernel's equivalent), flash_attn
(Dao's package, attention only). status: ok | missing (the posttrain op cannot be imported) |
unavailable (no such implementation here) | skipped (by flag) | error (it raised; see note).

Each step is one training step of the op: forward, then backward from fixed upstream gradients
into every input that requires grad (forward only for dequantize_nf4). ms is the median over
`reps` steps after warmup (compile time excluded), timed with CUDA events on GPU and
time.perf_counter on CPU. peak_mem_bytes is torch.cuda.max_memory_allocated during one step
minus what was allocated before it (inputs and weights excluded: the op's working memory);
on CPU it is null (not measured: tracemalloc does not see torch's allocator).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

from posttrain.core import losses

OPS = ("fused_linear_cross_entropy", "fused_linear_logps", "fused_linear_distill", "flash_attn_varlen",
       "rms_norm", "apply_rope", "swiglu", "lora_linear", "dequantize_nf4")


@dataclass
class Bench:
    """One op at one shape: inputs, the implementations to time, and the module whose LAUNCHES
    counter tells whether the posttrain call really took the Triton path."""

    inputs: tuple
    ours: Callable
    eager: Callable
    module: Any
    others: dict[str, Callable | str] = field(default_factory=dict)  # a str: why it is unavailable
    train: bool = True


def _leaf(shape, device, dtype, scale=1.0, grad=True):
    return (torch.randn(shape, device=device) * scale).to(dtype).requires_grad_(grad)


def _liger(device: str, what: str, get: Callable[[], Callable]) -> Callable | str:
    if device != "cuda":
        return "Liger kernels need CUDA"
    try:
        return get()
    except ImportError as e:
        return f"liger_kernel not importable ({e})" if "liger" in str(e) else f"no Liger {what}: {e}"


# --------------------------------------------------------------------------- the ops


def _fused_linear_ce(s, device, dtype):
    from posttrain.kernels.fused_linear_ce import fused_linear_cross_entropy as ours

    n, h, v = s["tokens"], s["hidden"], s["vocab"]
    hidden, weight = _leaf((1, n, h), device, dtype), _leaf((v, h), device, dtype, h**-0.5)
    labels = torch.randint(0, v, (1, n), device=device)

    def liger():
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        fn = LigerFusedLinearCrossEntropyLoss()
        return lambda x, w, y: fn(w, x.view(-1, x.shape[-1]), _shifted(y).view(-1))

    return Bench((hidden, weight, labels), ours,
                 lambda x, w, y: losses.cross_entropy(x @ w.T, y), importlib.import_module("posttrain.kernels.fused_linear_ce"),
                 {"chunked_torch": lambda x, w, y: losses.chunked_cross_entropy(x, w, y),
                  "liger": _liger(device, "fused linear CE", liger)})


def _shifted(labels):
    return torch.cat([labels[..., 1:], torch.full_like(labels[..., :1], -100)], dim=-1)


def _fused_linear_logps(s, device, dtype):
    from posttrain.kernels.fused_linear_kl import fused_linear_logps as ours

    n, h, v = s["tokens"], s["hidden"], s["vocab"]
    hidden, weight = _leaf((1, n, h), device, dtype), _leaf((v, h), device, dtype, h**-0.5)
    labels = torch.randint(0, v, (1, n), device=device)
    return Bench((hidden, weight, labels), ours, lambda x, w, y: losses.token_logps(x @ w.T, y),
                 importlib.import_module("posttrain.kernels.fused_linear_kl"),
                 {"chunked_torch": lambda x, w, y: losses.chunked_token_logps(x, w, y),
                  "liger": "no Liger per-token log-prob op"})


def _fused_linear_distill(s, device, dtype):
    from posttrain.kernels.fused_linear_kl import fused_linear_distill as ours

    n, hs, ht, v = s["tokens"], s["student_hidden"], s["teacher_hidden"], s["vocab"]
    sh, sw = _leaf((n, hs), device, dtype), _leaf((v, hs), device, dtype, hs**-0.5)
    th, tw = _leaf((n, ht), device, dtype, grad=False), _leaf((v, ht), device, dtype, ht**-0.5, grad=False)
    mask = torch.ones(n, dtype=torch.bool, device=device)
    kind, temp, beta = "jsd", 2.0, 0.5

    def liger():
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        fn = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=beta, temperature=temp)
        labels = torch.zeros(n, dtype=torch.long, device=device)
        return lambda a, b, c, d, m: fn(a, b, c, d, labels)

    return Bench((sh, sw, th, tw, mask), lambda a, b, c, d, m: ours(a, b, c, d, m, kind, temp, beta),
                 lambda a, b, c, d, m: losses.distill_loss(a @ b.T, c @ d.T, kind, temp, beta, m),
                 importlib.import_module("posttrain.kernels.fused_linear_kl"),
                 {"chunked_torch": lambda a, b, c, d, m: losses.chunked_distill_loss(a, b, c, d, kind, temp, beta, m),
                  "liger": _liger(device, "fused linear JSD", liger)})


def _flash_attn_varlen(s, device, dtype):
    mod = importlib.import_module("posttrain.kernels.flash_attention")
    docs, length, nh, nkv, hd = s["docs"], s["doc_len"], s["heads"], s["kv_heads"], s["head_dim"]
    # ragged documents around doc_len, summing to docs * doc_len
    lens = [length + (length // 4) * (1 if i % 2 else -1) for i in range(docs)]
    lens[-1] += docs * length - sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    total, max_len = docs * length, max(lens)
    q, k, v = (_leaf((total, heads, hd), device, dtype) for heads in (nh, nkv, nkv))

    def flash():
        from flash_attn import flash_attn_varlen_func

        return lambda q, k, v, cu: flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True)

    flash_impl: Callable | str = "flash_attn needs CUDA"
    if device == "cuda":
        try:
            flash_impl = flash()
        except ImportError as e:
            flash_impl = f"flash_attn not importable ({e})"
    return Bench((q, k, v, cu), lambda q, k, v, cu: mod.flash_attn_varlen(q, k, v, cu, max_len),
                 lambda q, k, v, cu: mod.flash_attn_varlen_reference(q, k, v, cu), mod,
                 {"liger": "no Liger attention kernel", "flash_attn": flash_impl})


def _rms_norm(s, device, dtype):
    mod = importlib.import_module("posttrain.kernels.rmsnorm")
    x, w = _leaf((s["tokens"], s["hidden"]), device, dtype), _leaf((s["hidden"],), device, dtype)

    def liger():
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        return lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6)

    return Bench((x, w), lambda x, w: mod.rms_norm(x, w, 1e-6), lambda x, w: mod.rms_norm_reference(x, w, 1e-6),
                 mod, {"liger": _liger(device, "RMSNorm", liger)})


def _apply_rope(s, device, dtype):
    mod = importlib.import_module("posttrain.kernels.rope")
    from posttrain.core.model.rope import rope_cos_sin, rope_frequencies

    b, t, nh, nkv, hd = s["batch"], s["seq"], s["heads"], s["kv_heads"], s["head_dim"]
    q, k = _leaf((b, nh, t, hd), device, dtype), _leaf((b, nkv, t, hd), device, dtype)
    inv_freq, scale = rope_frequencies(hd, 10000.0, None, t)
    cos, sin = rope_cos_sin(inv_freq.to(device), torch.arange(t, device=device)[None], scale, dtype)

    def liger():
        from liger_kernel.transformers import liger_rotary_pos_emb

        return liger_rotary_pos_emb

    return Bench((q, k, cos, sin), mod.apply_rope, mod.apply_rope_reference, mod,
                 {"liger": _liger(device, "RoPE", liger)})


def _swiglu(s, device, dtype):
    mod = importlib.import_module("posttrain.kernels.swiglu")
    gate, up = (_leaf((s["tokens"], s["intermediate"]), device, dtype) for _ in range(2))

    def liger():
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        return LigerSiLUMulFunction.apply

    return Bench((gate, up), mod.swiglu, mod.swiglu_reference, mod, {"liger": _liger(device, "SwiGLU", liger)})


def _lora_linear(s, device, dtype):
    mod = importlib.import_module("posttrain.kernels.lora")
    n, din, dout, r = s["tokens"], s["in"], s["out"], s["rank"]
    x = _leaf((n, din), device, dtype)
    w = _leaf((dout, din), device, dtype, din**-0.5, grad=False)  # the frozen base
    a, b = _leaf((r, din), device, dtype, din**-0.5), _leaf((dout, r), device, dtype, 0.01)
    return Bench((x, w, a, b), lambda x, w, a, b: mod.lora_linear(x, w, None, a, b, 2.0),
                 lambda x, w, a, b: mod.lora_linear_reference(x, w, None, a, b, 2.0), mod,
                 {"liger": "no Liger LoRA kernel"})


def _dequantize_nf4(s, device, dtype):
    mod = importlib.import_module("posttrain.kernels.nf4")
    from posttrain.core.quant import dequantize_nf4 as reference
    from posttrain.core.quant import quantize_nf4

    nf4 = quantize_nf4(torch.randn(s["out"], s["in"], device=device).to(dtype))
    return Bench((nf4,), lambda t: mod.dequantize_nf4(t, dtype), lambda t: reference(t, dtype), mod,
                 {"liger": "no Liger NF4 kernel"}, train=False)


BUILDERS = {"fused_linear_cross_entropy": _fused_linear_ce, "fused_linear_logps": _fused_linear_logps,
            "fused_linear_distill": _fused_linear_distill, "flash_attn_varlen": _flash_attn_varlen,
            "rms_norm": _rms_norm, "apply_rope": _apply_rope, "swiglu": _swiglu, "lora_linear": _lora_linear,
            "dequantize_nf4": _dequantize_nf4}

# GPU shapes are those of real 2B-8B models (Llama-3 vocab 128256, Qwen2 152064); the first of
# each list is the one --quick keeps. CPU shapes are tiny: the CPU run checks the harness.
# Fused-linear losses: their working memory is O(V * H) (the fp32 weight-gradient accumulator)
# where eager's is O(tokens * V), so the ratio falls as tokens grow; 16k tokens per GPU is a
# usual packed micro-batch.
GPU_SHAPES = {
    "fused_linear_cross_entropy": [dict(tokens=16384, hidden=4096, vocab=128256),
                                   dict(tokens=8192, hidden=4096, vocab=128256),
                                   dict(tokens=16384, hidden=2048, vocab=32000),
                                   dict(tokens=4096, hidden=3584, vocab=152064)],
    "fused_linear_logps": [dict(tokens=8192, hidden=4096, vocab=128256)],
    "fused_linear_distill": [dict(tokens=8192, student_hidden=2048, teacher_hidden=4096, vocab=128256)],
    "flash_attn_varlen": [dict(docs=8, doc_len=2048, heads=32, kv_heads=8, head_dim=128),
                          dict(docs=4, doc_len=4096, heads=16, kv_heads=16, head_dim=80)],
    "rms_norm": [dict(tokens=16384, hidden=4096), dict(tokens=8192, hidden=8192)],
    "apply_rope": [dict(batch=1, seq=8192, heads=32, kv_heads=8, head_dim=128)],
    "swiglu": [dict(tokens=16384, intermediate=14336)],
    "lora_linear": [dict(tokens=8192, **{"in": 4096, "out": 4096}, rank=16)],
    "dequantize_nf4": [dict(**{"in": 4096, "out": 14336})],
}
CPU_SHAPES = {
    "fused_linear_cross_entropy": [dict(tokens=64, hidden=32, vocab=1000)],
    "fused_linear_logps": [dict(tokens=64, hidden=32, vocab=1000)],
    "fused_linear_distill": [dict(tokens=64, student_hidden=32, teacher_hidden=48, vocab=1000)],
    "flash_attn_varlen": [dict(docs=3, doc_len=32, heads=4, kv_heads=2, head_dim=32)],
    "rms_norm": [dict(tokens=64, hidden=256)],
    "apply_rope": [dict(batch=1, seq=32, heads=4, kv_heads=2, head_dim=32)],
    "swiglu": [dict(tokens=64, intermediate=256)],
    "lora_linear": [dict(tokens=64, **{"in": 128, "out": 128}, rank=8)],
    "dequantize_nf4": [dict(**{"in": 128, "out": 128})],
}


# --------------------------------------------------------------------------- measuring


def _step(fn: Callable, bench: Bench) -> Callable[[], None]:
    """One forward (+ backward from cached upstream gradients) of fn on the bench's inputs."""
    leaves = [t for t in bench.inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    upstream: list[torch.Tensor] = []

    def run() -> None:
        for t in leaves:
            t.grad = None
        out = fn(*bench.inputs)
        if not bench.train:
            return
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not upstream:
            upstream.extend(torch.randn_like(t) for t in outs)
        torch.autograd.backward(outs, upstream)

    run.leaves = leaves  # type: ignore[attr-defined]
    return run


def _measure(run: Callable[[], None], device: str, warmup: int, reps: int) -> tuple[float, int | None]:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = None
    if device == "cuda":
        for t in run.leaves:  # type: ignore[attr-defined]
            t.grad = None  # so the baseline excludes the previous step's gradients
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    return statistics.median(times), peak


def _launches(module: Any) -> int:
    return sum(getattr(module, "LAUNCHES", {}).values())


def bench_op(op: str, shape: dict, dtype: torch.dtype, device: str, quick: bool, warmup: int,
             reps: int) -> list[dict]:
    base = dict(op=op, shape=shape, dtype=str(dtype).removeprefix("torch."))
    try:
        bench = BUILDERS[op](shape, device, dtype)
    except (ImportError, AttributeError) as e:  # part of the kernels not written (yet)
        return [dict(base, impl="posttrain", status="missing", note=f"{type(e).__name__}: {e}")]
    impls: dict[str, Callable | str] = {"posttrain": bench.ours, "eager": bench.eager}
    if device == "cpu" and quick:
        impls["compile"] = "skipped: torch.compile on CPU is too slow for --quick"
    else:
        impls["compile"] = torch.compile(bench.eager)
    impls.update(bench.others)

    records = []
    for impl, fn in impls.items():
        rec = dict(base, impl=impl)
        if isinstance(fn, str):
            rec.update(status="skipped" if fn.startswith("skipped") else "unavailable", note=fn)
            records.append(rec)
            continue
        try:
            before = _launches(bench.module)
            ms, peak = _measure(_step(fn, bench), device, warmup, reps)
            rec.update(status="ok", ms=round(ms, 4), peak_mem_bytes=peak)
            if impl == "posttrain":
                rec["path"] = "triton" if _launches(bench.module) > before else "torch-reference"
        except Exception as e:  # an OOM or a version mismatch in a baseline must not end the run
            rec.update(status="error", note=f"{type(e).__name__}: {str(e)[:300]}")
            if device == "cuda":
                torch.cuda.empty_cache()
        records.append(rec)
    _add_ratios(records)
    return records


def _add_ratios(records: list[dict]) -> None:
    """ms_vs_X = ms / X's ms (< 1: faster than X); mem_vs_X likewise for peak memory."""
    by_impl = {r["impl"]: r for r in records if r.get("status") == "ok"}
    for r in records:
        for ref in ("eager", "compile"):
            other = by_impl.get(ref)
            for key, out in (("ms", f"ms_vs_{ref}"), ("peak_mem_bytes", f"mem_vs_{ref}")):
                mine, theirs = r.get(key), other.get(key) if other else None
                r[out] = round(mine / theirs, 4) if mine is not None and theirs else None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="one shape per op; tiny on CPU, no compile on CPU")
    parser.add_argument("--out", help="also write the JSON document to this file")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {', '.join(OPS)}")
    args = parser.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        parser.error(f"unknown ops {unknown}; known: {', '.join(OPS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False")

    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    warmup, reps = (1, 3) if args.quick and not cuda else (3, 10) if cuda else (2, 5)
    records = []
    for op in ops:
        shapes = (GPU_SHAPES if cuda else CPU_SHAPES)[op]
        for shape in shapes[:1] if args.quick else shapes:
            records.extend(bench_op(op, shape, dtype, args.device, args.quick, warmup, reps))

    import triton

    doc = dict(device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
               triton=triton.__version__, quick=args.quick, dtype=str(dtype).removeprefix("torch."),
               warmup=warmup, reps=reps,
               timing="median of reps; CUDA events" if cuda else "median of reps; time.perf_counter",
               peak_mem="torch.cuda.max_memory_allocated during one step minus memory allocated before it"
                        if cuda else "not measured on CPU (null)",
               records=records)
    text = json.dumps(doc, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return doc


if __name__ == "__main__":
    main(sys.argv[1:])
