"""Weight sync latency (core.generation.weights): a trainer process publishing its weights to a
generator process over gloo (CPU), full and LoRA-only, against the floor of a plain memcpy of the
same bytes in one process.

    python -m benchmarks.weight_sync [--models debug smollm2-135m qwen2.5-0.5b] [--reps 3]
                                     [--bucket-mb 64] [--out file.json]
    posttrain bench weight_sync [...]

Each model (a core.model preset, random weights, fp32, LoRA r16 alpha 32 on every linear layer
but the head) runs in 2 processes under `torchrun --standalone --nproc-per-node 2`: rank 0 the
trainer (one process: WeightPublisher), rank 1 the generator (WeightSubscriber on its own copy).
Per mode (full: every weight; lora_only: the adapters), `reps` syncs after one warm-up; a sync's
time is rank 0's from the header to the last bucket sent plus the generator's confirmation (a
1-element all-reduce), median over the reps. floor_s: the median time of `dst.copy_(src)` of one
buffer of the same bytes in the trainer process (what moving the bytes costs at memory
bandwidth, with no transport); ratio_to_floor = sync / floor. lora_share = lora_only / full.
Run it alone on the machine: it times things.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import emit

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("debug", "smollm2-135m", "qwen2.5-0.5b")
LORA = dict(rank=16, alpha=32.0, targets="all-linear")


def worker(name: str, reps: int, bucket_mb: float, out: str) -> None:
    import torch
    import torch.distributed as dist

    from core.generation.weights import WeightPublisher, WeightSubscriber, sync_group
    from core.lora import apply_lora
    from core.model import build_model, get_preset

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = build_model(get_preset(name), seed=0)
    apply_lora(model, **LORA)
    group = sync_group(0, [1])
    result: dict = {"parameters": sum(p.numel() for p in model.parameters())}
    for mode in ("full", "lora_only"):
        lora = mode == "lora_only"
        done = torch.zeros(1)
        if rank == 0:
            pub = WeightPublisher(model, group, lora_only=lora, bucket_mb=bucket_mb)
            times, sent = [], 0
            for i in range(reps + 1):
                t0 = time.perf_counter()
                stats = pub.publish()
                dist.all_reduce(done, group=group)  # the generator has applied it
                if i:
                    times.append(time.perf_counter() - t0)
                sent = stats.bytes
            pub.close()
            src = torch.empty(sent // 4)
            dst = torch.empty_like(src)
            floors = []
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                dst.copy_(src)
                floors.append(time.perf_counter() - t0)
            sync, floor = statistics.median(times), statistics.median(floors[1:])
            result[mode] = {"bytes": sent, "buckets": stats.buckets, "sync_s": sync, "floor_s": floor,
                            "ratio_to_floor": sync / floor, "sync_gb_per_s": sent / sync / 1e9}
        else:
            sub = WeightSubscriber(model, group, source=0)
            while sub.receive() is not None:
                dist.all_reduce(done, group=group)
    if rank == 0:
        result["lora_share"] = result["lora_only"]["sync_s"] / result["full"]["sync_s"]
        Path(out).write_text(json.dumps(result))
    dist.barrier()  # no rank tears its group down while another still talks on it
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), help="core.model presets")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--out", help="also write the JSON document here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.reps, args.bucket_mb, args.result)
        return 0
    doc: dict = {"command": "python -m benchmarks.weight_sync " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "transport": "gloo over loopback TCP, 2 processes (trainer, generator), CPU", "cpus": os.cpu_count(),
                 "bucket_mb": args.bucket_mb, "lora": LORA, "models": {}}
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory(prefix="weight_sync.") as tmp:
        for name in args.models:
            out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                   "benchmarks.weight_sync", "--worker", name, "--reps", str(args.reps), "--bucket-mb",
                   str(args.bucket_mb), "--result", str(out)]
            proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
            doc["models"][name] = json.loads(out.read_text())
    return emit(doc, args.out)


if __name__ == "__main__":
    sys.exit(main())
