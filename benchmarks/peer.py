"""What the side-by-side benchmarks against TRL (benchmarks/dpo.py, benchmarks/distill.py) share:
their command line, the run of each side in a fresh forkserver child per repetition (sides
alternating), and the summary of the repetitions (medians, peaks, ratios, targets)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from posttrain.benchmarks.sft import _in_fresh_process, _median, missing_packages, side_figures

SIDES = ("ours", "trl", "ours_sft")
REQUIRED = ("transformers", "peft", "trl", "datasets")
INSTALL_HINT = "pip install 'posttrain[bench]'"


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def parse(name: str, description: str, full: dict[str, Any], quick: dict[str, Any],
          argv: list[str] | None, required: tuple[str, ...] = REQUIRED,
          against: str = "TRL + peft") -> tuple[argparse.Namespace, dict[str, Any] | None]:
    """The shared flags; (args, cfg), cfg None when a peer library of `required` is missing
    (already said, naming `against`, what the benchmark compares with)."""
    p = argparse.ArgumentParser(prog=f"python -m posttrain.benchmarks.{name}", description=description)
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (for the tests)")
    p.add_argument("--steps", type=int, help="timed steps per side and repetition (after the warmup)")
    p.add_argument("--warmup", type=int, help="untimed steps first (>= 1)")
    p.add_argument("--reps", type=int, help="repetitions per side, alternating the order")
    p.add_argument("--out", help="also write the JSON document here")
    a = p.parse_args(argv)
    cfg = dict(quick if a.quick else full)
    for key in ("steps", "warmup", "reps"):
        if getattr(a, key) is not None:
            cfg[key] = getattr(a, key)
    # warmup >= 1: TRL's step time is measured from the previous step's end; steps >= 1 and the
    # warmup give the second step the loss checks compare
    if cfg["steps"] < 1 or cfg["reps"] < 1 or cfg["warmup"] < 1:
        p.error("--steps, --reps and --warmup must be >= 1")
    missing = missing_packages(required)
    if missing:
        print(f"posttrain.benchmarks.{name} compares against {against}; not installed: {', '.join(missing)}. "
              f"Install them with: {INSTALL_HINT}", file=sys.stderr)
        return a, None
    return a, cfg


def run_sides(name: str, cfg: dict[str, Any], preload: list[str], export: Callable[..., dict],
              export_dirs: tuple[str, ...], run_side: Callable[..., dict],
              extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Export the shared weights once (`export(cfg, *dirs)`), then every side (SIDES and
    `extra`, more of posttrain's variants) of every repetition in a fresh process forked from
    one forkserver (`run_side(side, cfg, dirs, work)`), the sides' order alternating; returns the
    exported facts, the runs and the load."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    load_start, t_start = os.getloadavg(), time.time()
    sides = SIDES + tuple(extra)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    with tempfile.TemporaryDirectory(prefix=f"bench_{name}_") as tmp:
        dirs = {k: str(Path(tmp) / k) for k in export_dirs}
        exported = _in_fresh_process(ctx, export, cfg, *dirs.values())
        for rep in range(cfg["reps"]):
            for side in sides if rep % 2 == 0 else sides[::-1]:
                r = _in_fresh_process(ctx, run_side, side, cfg, dirs, str(Path(tmp) / f"trl-{rep}"))
                runs[side].append(r)
                print(f"[bench {name}] rep {rep} {side:8s} {r['tokens_per_s']:9.1f} tok/s "
                      f"peak +{r['peak_mem_mb']:.0f} MB", file=sys.stderr, flush=True)
    return {"exported": exported, "runs": runs, "load_avg": {"start": list(load_start), "end": list(os.getloadavg())},
            "wall_s": time.time() - t_start}


def versions() -> dict[str, str]:
    import peft
    import torch
    import transformers
    import trl

    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
            "trl": trl.__version__}


def summarize(runs: dict[str, list[dict[str, Any]]], warmup: int, real_tokens: int,
              loss_check: Callable[[dict, dict], dict], targets: dict[str, tuple[str, float]]) -> dict[str, Any]:
    """Each side's median tokens/s and peak memory over the repetitions (and the first
    repetition's other records), TRL's padding, the ratios, `loss_check(ours, trl)` and the
    targets. real_tokens: the timed steps' tokens without padding. A side beyond SIDES,
    "ours_<variant>", gets its ratio to the SFT step too: ratios["sft_step_ratio_<variant>"]; one
    of the peer's (another name) only its figures."""
    out: dict[str, Any] = {}
    for side in runs:
        rs = runs[side]
        out[side] = {
            **side_figures(rs),
            **{k: v for k, v in rs[0].items() if k not in ("tokens_per_s", "peak_mem_mb", "process_peak_rss_mb")},
        }
    out["trl"]["padding_fraction"] = 1 - real_tokens / sum(out["trl"]["padded_tokens_per_step"][warmup:])
    speed = [o["tokens_per_s"] / t["tokens_per_s"] for o, t in zip(runs["ours"], runs["trl"])]
    floor = [s["tokens_per_s"] / o["tokens_per_s"] for o, s in zip(runs["ours"], runs["ours_sft"])]
    out["ratios"] = {
        "speedup": _median(speed), "speedup_reps": speed,
        "memory_ratio": out["ours"]["peak_mem_mb"] / out["trl"]["peak_mem_mb"],
        "process_rss_ratio": out["ours"]["process_peak_rss_mb"] / out["trl"]["process_peak_rss_mb"],
        "sft_step_ratio": _median(floor), "sft_step_ratio_reps": floor,
    }
    for side in runs:
        if side not in SIDES and side.startswith("ours_"):
            variant = [s["tokens_per_s"] / v["tokens_per_s"] for v, s in zip(runs[side], runs["ours_sft"])]
            name = side.removeprefix("ours_")
            out["ratios"][f"sft_step_ratio_{name}"], out["ratios"][f"sft_step_ratio_{name}_reps"] = _median(variant), variant
    out["loss_check"] = loss_check(out["ours"], out["trl"])
    out["targets"] = {name: {"target": f"{op} {value}", "value": out["ratios"][name],
                             "met": out["ratios"][name] >= value if op == ">=" else out["ratios"][name] <= value}
                      for name, (op, value) in targets.items()}
    return out
