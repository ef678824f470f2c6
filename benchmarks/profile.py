"""Where an SFT step's time goes, posttrain beside transformers + peft: torch.profiler over one step
of each side of benchmarks/sft.py, the same model, adapter and documents, summed by op category.

    python -m posttrain.benchmarks.profile [--quick] [--shapes dense,realistic] [--out file.json]
    posttrain bench profile [...]

The speed goals of benchmarks/sft.py (1.5x dense, 4x realistic) are ratios of step times. This
says which part of a step differs. Each side's step (after one warm-up step) runs under
torch.profiler, on the CPU, without shapes or stacks. Each op's self time is then put in one
category: matmul (mm, addmm, bmm, matmul and their backward kernels), attention (scaled-dot-product
and flash kernels, forward and backward), loss (log-softmax, cross-entropy, nll and posttrain's
fused head), optimizer (the AdamW step's foreach ops), and other (elementwise, copies, norms,
reshapes, autograd bookkeeping). Python time outside aten ops is `unaccounted`: the step's wall
time minus the ops' self time. Both sides run in this process, one after the other, with the
same thread count. The figures are one step each: they are for shares and ratios, not for
throughput (benchmarks/sft.py is).

JSON: per shape, per side, step_s, tokens, padded_tokens, then by category the seconds and the
share of the step, and the 12 ops with the most self time. Then the ratio of the two sides' times
per category (baseline / ours): the categories that make the speedup.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from posttrain.benchmarks import emit
from posttrain.benchmarks.sft import FULL, INSTALL_HINT, QUICK, SHAPES, missing_packages, steps_of

CATEGORIES = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::_mm", "aten::baddbmm",
               "aten::linear_backward", "aten::addmv"),
    "attention": ("scaled_dot_product", "flash_attention", "_efficient_attention", "attention"),
    "loss": ("log_softmax", "cross_entropy", "nll_loss", "logsumexp", "chunked", "fused_head", "_softmax"),
    "optimizer": ("_foreach", "adam"),
}


def category(op: str) -> str:
    name = op.lower()
    if op in CATEGORIES["matmul"]:
        return "matmul"
    for cat in ("attention", "loss", "optimizer"):
        if any(k in name for k in CATEGORIES[cat]):
            return cat
    return "other"


def profile_side(side: str, shape: str, cfg: dict[str, Any], model_dir: str, adapter_dir: str) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from posttrain.benchmarks import sft

    torch.manual_seed(sft.SEED)
    steps = steps_of(shape, cfg)
    step_fn, info = (sft._ours if side == "ours" else sft._baseline)(cfg, model_dir, adapter_dir)
    step_fn(steps[0])  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step_fn(steps[1])
        wall = time.perf_counter() - t0
    by_cat: dict[str, float] = {c: 0.0 for c in (*CATEGORIES, "other")}
    ops = []
    for e in prof.key_averages():
        s = e.self_cpu_time_total / 1e6
        by_cat[category(e.key)] += s
        ops.append((s, e.key, e.count))
    ops.sort(reverse=True)
    accounted = sum(by_cat.values())
    padded = info.get("padded_tokens_per_step") or []
    return {
        "step_s": wall,
        "tokens": sum(len(ids) for ids, _ in steps[1]),
        "padded_tokens": padded[-1] if padded else None,
        "seconds": {**by_cat, "unaccounted": max(wall - accounted, 0.0)},
        "share": {**{c: v / wall for c, v in by_cat.items()}, "unaccounted": max(wall - accounted, 0.0) / wall},
        "top_ops": [{"op": k, "self_s": s, "calls": n} for s, k, n in ops[:12]],
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m posttrain.benchmarks.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model (for the tests)")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--out")
    a = p.parse_args(argv)
    missing = missing_packages()
    if missing:
        print(f"posttrain.benchmarks.profile compares against transformers + peft; not installed: {', '.join(missing)}. "
              f"Install them with: {INSTALL_HINT}", file=sys.stderr)
        return 2
    cfg = dict(QUICK if a.quick else FULL, warmup=1, steps=1)
    shapes = [s for s in a.shapes.split(",") if s]
    if set(shapes) - set(SHAPES):
        p.error(f"--shapes takes a comma-separated subset of {SHAPES}")
    from posttrain.benchmarks.sft import export

    doc: dict[str, Any] = {"benchmark": "profile", "quick": a.quick, "device": "cpu", "dtype": "float32",
                           "config": {k: v for k, v in cfg.items() if k not in ("steps", "warmup", "reps")},
                           "load_avg_start": list(os.getloadavg()), "shapes": {}}
    with tempfile.TemporaryDirectory(prefix="bench_profile_") as tmp:
        model_dir, adapter_dir = str(Path(tmp) / "model"), str(Path(tmp) / "adapter")
        export(cfg, model_dir, adapter_dir)
        for shape in shapes:
            sides = {side: profile_side(side, shape, cfg, model_dir, adapter_dir) for side in ("ours", "baseline")}
            ours, base = sides["ours"]["seconds"], sides["baseline"]["seconds"]
            sides["baseline_over_ours"] = {
                "step": sides["baseline"]["step_s"] / sides["ours"]["step_s"],
                **{c: base[c] / ours[c] if ours[c] > 0 else None for c in ours},
            }
            doc["shapes"][shape] = sides
            print(f"[bench profile] {shape}: step {sides['ours']['step_s']:.2f} s vs {sides['baseline']['step_s']:.2f} s",
                  file=sys.stderr, flush=True)
    doc["load_avg_end"] = list(os.getloadavg())
    return emit(doc, a.out)


if __name__ == "__main__":
    sys.exit(main())
