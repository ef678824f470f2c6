"""Weight sync latency (posttrain.core.generation.weights): a trainer process publishing its weights to a
generator process on the same host, full and LoRA-only, over each transport (the shared-memory
ring, "shm", and a gloo broadcast, "gloo"), against the floor of a plain memcpy of the same bytes in
one process.

    python -m posttrain.benchmarks.weight_sync [--models debug smollm2-135m qwen2.5-0.5b] [--reps 3]
                                     [--bucket-mb MB] [--out file.json]
    posttrain bench weight_sync [...]

Each model (a posttrain.core.model preset, random weights, fp32, LoRA r16 alpha 32 on every linear layer
but the head) runs in 2 processes under `torchrun --standalone --nproc-per-node 2`: rank 0 the
trainer (one process: WeightPublisher), rank 1 the generator (WeightSubscriber on its own copy).
Per transport and mode (full: every weight; lora_only: the adapters), `reps` syncs after one
warm-up; a sync's
time is rank 0's from the header to the last bucket sent plus the generator's confirmation (a
1-element all-reduce), median over the reps. floor_s: the median time of `dst.copy_(src)` of one
buffer of the same bytes in the trainer process (what moving the bytes costs at memory
bandwidth, with no transport; src is written first: an untouched buffer maps the zero page, and
copying from it reads cache, not memory, which made the floor of the 2026-12-02 run 1.5x too low); ratio_to_floor = sync / floor. lora_share = lora_only / full.
JSON: models.<name>.<shm|gloo>.<full|lora_only> and .lora_share.
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

from posttrain.benchmarks import emit

MODELS = ("debug", "smollm2-135m", "qwen2.5-0.5b")
LORA = dict(rank=16, alpha=32.0, targets="all-linear")


def worker(name: str, reps: int, bucket_mb: float | None, out: str) -> None:
    import torch
    import torch.distributed as dist

    from posttrain.core.generation.weights import WeightPublisher, WeightSubscriber, sync_group
    from posttrain.core.lora import apply_lora
    from posttrain.core.model import build_model, get_preset

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = build_model(get_preset(name), seed=0)
    apply_lora(model, **LORA)
    group = sync_group(0, [1])
    result: dict = {"parameters": sum(p.numel() for p in model.parameters())}
    for transport, name_ in (("shm", "shm"), ("dist", "gloo")):
        runs = result.setdefault(name_, {})
        for mode in ("full", "lora_only"):
            runs[mode] = _one(model, group, rank, mode == "lora_only", transport, reps, bucket_mb)
        if rank == 0:
            runs["lora_share"] = runs["lora_only"]["sync_s"] / runs["full"]["sync_s"]
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()  # no rank tears its group down while another still talks on it
    dist.destroy_process_group()


def _one(model, group, rank: int, lora: bool, transport: str, reps: int, bucket_mb: float | None) -> dict | None:
    """`reps` syncs (after one warm-up) of one mode over one transport; rank 0's figures."""
    import torch
    import torch.distributed as dist

    from posttrain.core.generation.weights import WeightPublisher, WeightSubscriber

    done = torch.zeros(1)
    if rank != 0:
        sub = WeightSubscriber(model, group, source=0)
        while sub.receive() is not None:
            dist.all_reduce(done, group=group)
        return None
    pub = WeightPublisher(model, group, lora_only=lora, bucket_mb=bucket_mb, transport=transport)
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        stats = pub.publish()
        dist.all_reduce(done, group=group)  # the generator has applied it
        if i:
            times.append(time.perf_counter() - t0)
    pub.close()
    assert stats.transport == transport, (stats.transport, transport)
    src = torch.rand(stats.bytes // 4)  # written: an untouched buffer reads the zero page, at cache speed
    dst = torch.empty_like(src)
    floors = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        floors.append(time.perf_counter() - t0)
    sync, floor = statistics.median(times), statistics.median(floors[1:])
    return {"bytes": stats.bytes, "buckets": stats.buckets, "sync_s": sync, "floor_s": floor,
            "ratio_to_floor": sync / floor, "sync_gb_per_s": stats.bytes / sync / 1e9}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), help="posttrain.core.model presets")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="bucket size (default: WeightPublisher's, 64 MiB full, a quarter of the bytes LoRA-only)")
    p.add_argument("--out", help="also write the JSON document here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.reps, args.bucket_mb, args.result)
        return 0
    doc: dict = {"command": "python -m posttrain.benchmarks.weight_sync " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "transports": {"shm": "shared-memory ring (2 slots in /dev/shm) with gloo for the signals",
                                "gloo": "gloo broadcast over loopback TCP"},
                 "processes": "2 (trainer, generator), CPU, 1 thread each", "cpus": os.cpu_count(),
                 "bucket_mb": args.bucket_mb, "lora": LORA, "models": {}}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="weight_sync.") as tmp:
        for name in args.models:
            out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                   "posttrain.benchmarks.weight_sync", "--worker", name, "--reps", str(args.reps), "--result", str(out)]
            if args.bucket_mb is not None:
                cmd += ["--bucket-mb", str(args.bucket_mb)]
            proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
            doc["models"][name] = json.loads(out.read_text())
    return emit(doc, args.out)


if __name__ == "__main__":
    sys.exit(main())
