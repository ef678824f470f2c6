"""The real-model pipeline (configs/real.yaml) once per seed, and its evaluation table: every
model's held-out exact match (overall and per task) and general-text perplexity, as the mean and
spread over the seeds, plus each run's wall time. Issue 29's figures come from here.

    .venv/bin/python scripts/real_seeds.py --seeds 1 2 3 [--set nodes.sft.max_steps=32 ...] \
        [--out benchmarks/results/real-pipeline-<date>.json]

Each seed is its own pipeline (name real-s<seed>, so the runs sit side by side in the workspace
and in MLflow): the seed of SFT, DPO and GRPO and of their data order. The base model is greedy and
evaluated in every run, so its figure has no spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "real.yaml"
SEEDED = ("sft", "dpo", "grpo")


def run_seed(seed: int, sets: list[str], workspace: Path) -> dict:
    name = f"real-s{seed}"
    overrides = [f"name={name}", f"workspace={workspace}", *sets]
    for node in SEEDED:
        overrides += [f"nodes.{node}.seed={seed}", f"nodes.{node}.data.seed={seed}"]
    cmd = [sys.executable, "-m", "posttrain.flows.cli", "run", str(CONFIG), *(f"--set={o}" for o in overrides)]
    t0 = time.monotonic()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    if out.returncode != 0:
        raise SystemExit(f"seed {seed} failed ({out.returncode}):\n{(out.stdout + out.stderr)[-4000:]}")
    run = workspace / name
    evaluate = json.loads((run / "evaluate" / "manifest.json").read_text())["results"]
    guard = json.loads((run / "guard" / "manifest.json").read_text())["results"]
    return {"seed": seed, "seconds": round(seconds, 1),
            "models": {m: {**{k: v for k, v in r.items() if k.startswith("exact_match")},
                           "perplexity": guard[m]["perplexity"]} for m, r in evaluate.items()}}


def summary(runs: list[dict]) -> dict:
    """{model: {metric: [mean, population std]}} over the runs."""
    out: dict = {}
    for model in runs[0]["models"]:
        for metric in runs[0]["models"][model]:
            values = [r["models"][model][metric] for r in runs]
            out.setdefault(model, {})[metric] = [round(statistics.fmean(values), 4), round(statistics.pstdev(values), 4)]
    return out


def table(result: dict) -> str:
    metrics = list(next(iter(result["summary"].values())))
    lines = ["| model | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 1) + "|"]
    for model, got in result["summary"].items():
        lines.append(f"| {model} | " + " | ".join(f"{m:.3f} ± {s:.3f}" for m, s in got.values()) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--set", dest="sets", action="append", default=[], help="a config override, as posttrain run's")
    p.add_argument("--workspace", type=Path, default=ROOT / "runs")
    p.add_argument("--out", type=Path, help="write the JSON here too")
    args = p.parse_args(argv)
    runs = []
    for seed in args.seeds:
        runs.append(run_seed(seed, args.sets, args.workspace.resolve()))
        print(json.dumps(runs[-1]), flush=True)
    result = {"config": str(CONFIG.relative_to(ROOT)), "overrides": args.sets, "runs": runs, "summary": summary(runs)}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
