"""On-policy DPO stage throughput with the three ways a stage can sample: the static in-process
sampler (sampler: static), the paged-KV engine in the trainer's process (sampler: engine,
generation colocated) and generator worker processes beside the trainer (generation:
disaggregated), in one run, on the same prompts, model and seeds.

    python -m posttrain.benchmarks.online [--shapes debug mid] [--prompts 32] [--samples 4] [--new-tokens 16]
                                [--workers 1] [--threads 0] [--out file.json]
    posttrain bench online [...]

Each side is the real stage (`python -m posttrain.stages.dpo --config spec.json`, one process, tracking off)
on data prep's synthetic set: on-policy pairs (reward exact_match, `samples` completions per
prompt of at most `new-tokens` tokens, temperature 1), then DPO with LoRA (r 8, reference
disable_adapter), micro-batch 4, one pair per prompt: steps = prompts / 4. Shapes: `debug` (the
debug preset) and `mid` (Llama-shaped: hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate
1408), random weights, fp32 on CPU.

Measures, per side: wall_s (the stage process, start to exit), sampling_s (the stage's
on_policy/seconds: sampling, scoring and pairing of the training and validation prompts; for
disaggregated it includes starting the workers, start_s, and the weight sync, sync_s), train_s
(the stage's train/seconds), completions_per_s = completions / sampling_s, steps_per_s = steps /
wall_s; speedup_vs_static = static's wall_s / the side's. pairs_equal says whether the
disaggregated side's pairs (on_policy/train.jsonl) are the colocated engine's, token for token.

On one machine the workers share the trainer's cores (2 here), so disaggregation cannot be faster
on CPU: the figure shows its cost (process start, weight sync, transport). Its gain is on a machine
where the workers have devices of their own. Run it alone on the machine: it times things.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from posttrain.benchmarks import emit

SHAPES = {"debug": {}, "mid": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4,
                               "intermediate_size": 1408}}
SIDES = ("static", "engine", "disaggregated")


def spec(root: Path, shape: str, side: str, args) -> dict:
    from posttrain.core.config import to_json_file
    from posttrain.core.tracking import TrackingConfig
    from posttrain.stages.config import DPOConfig

    generation = {"mode": "disaggregated", "workers": args.workers, "threads": args.threads} \
        if side == "disaggregated" else {}
    cfg = DPOConfig(output_dir=str(root / f"{shape}-{side}"), tracking=TrackingConfig(enabled=False),
                    model={"name_or_path": "debug", "overrides": SHAPES[shape]},
                    lora={"enabled": True, "rank": 8, "alpha": 16},
                    data={"sources": [str(root / "data")], "micro_batch_size": 4, "max_seq_len": 256},
                    pairs="on_policy", num_samples=args.samples, max_new_tokens=args.new_tokens,
                    sampler="static" if side == "static" else "engine", generation=generation,
                    max_steps=args.prompts // 4, eval_interval=0, checkpoint={"interval_steps": 0})
    path = root / f"{shape}-{side}.json"
    to_json_file(cfg, path)
    return {"path": path, "out": Path(cfg.output_dir)}


def run_side(root: Path, shape: str, side: str, args) -> dict:
    s = spec(root, shape, side, args)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "posttrain.stages.dpo", "--config", str(s["path"])], cwd=root,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{shape}/{side} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    m = json.loads((s["out"] / "manifest.json").read_text())["metrics"]
    completions = (m["on_policy/prompts"] + m.get("on_policy/val_prompts", 0)) * args.samples
    out = {"wall_s": round(wall, 3), "sampling_s": round(m["on_policy/seconds"], 3),
           "train_s": round(m["train/seconds"], 3), "steps": m["steps"], "pairs": m["on_policy/pairs"],
           "completions": completions, "completions_per_s": round(completions / m["on_policy/seconds"], 2),
           "steps_per_s": round(m["steps"] / wall, 4)}
    if side == "disaggregated":
        out.update(start_s=round(m["on_policy/generation/start_s"], 3),
                   sync_s=round(m["on_policy/generation/sync_s"], 4))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--prompts", type=int, default=32, help="training prompts (a multiple of 4)")
    p.add_argument("--samples", type=int, default=4, help="completions per prompt")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--workers", type=int, default=1, help="disaggregated: generator processes")
    p.add_argument("--threads", type=int, default=0, help="disaggregated: torch threads per worker (0: default)")
    p.add_argument("--out", help="also write the JSON document here")
    args = p.parse_args(argv)
    if args.prompts % 4:
        p.error("--prompts: a multiple of 4 (one step of micro-batch 4 each)")
    doc: dict = {"command": "python -m posttrain.benchmarks.online " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "cpus": os.cpu_count(), "prompts": args.prompts, "samples": args.samples,
                 "new_tokens": args.new_tokens, "workers": args.workers, "shapes": {}}
    with tempfile.TemporaryDirectory(prefix="online.") as tmp:
        root = Path(tmp)
        from posttrain.core.tracking import TrackingConfig
        from posttrain.stages.config import DataPrepConfig
        from posttrain.stages.data_prep import prepare

        prepare(DataPrepConfig(output_dir=str(root / "data"), synthetic_size=max(4 * args.prompts, 64),
                               tracking=TrackingConfig(enabled=False)))
        for shape in args.shapes:
            sides = {side: run_side(root, shape, side, args) for side in SIDES}
            for side in SIDES:
                sides[side]["speedup_vs_static"] = round(sides["static"]["wall_s"] / sides[side]["wall_s"], 3)
            pairs = [(root / f"{shape}-{s}" / "on_policy" / "train.jsonl").read_text()
                     for s in ("engine", "disaggregated")]
            doc["shapes"][shape] = {"model": SHAPES[shape] or "debug preset", "sides": sides,
                                    "pairs_equal": pairs[0] == pairs[1]}
    return emit(doc, args.out)


if __name__ == "__main__":
    sys.exit(main())
