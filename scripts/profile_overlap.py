"""Profile compute/communication overlap of FSDP2 on CPU (gloo, 2 ranks) and report it as JSON.

    .venv/bin/python scripts/profile_overlap.py --out /tmp/overlap --steps 3

Spawns 2 ranks (torch.multiprocessing.spawn), parallelizes the `debug` model (num_layers=4) with
ParallelConfig(dp_shard=2) (FSDP2, one unit per block + root), runs a few train steps under
torch.profiler, writes one Chrome trace per rank (<out>/trace_rank{r}.json), then analyses each
trace:

- collective events: names containing all_gather / allgather / reduce_scatter / allreduce /
  all_reduce (case-insensitive). With gloo the transfer itself runs on a gloo worker thread; the
  main thread only records the (short) c10d launch op and FSDP's wait.
- compute events: aten::mm / aten::addmm / aten::linear / aten::bmm / aten::matmul.
- overlap: per thread t, |union(collectives on t) n union(compute on threads != t)|, summed over
  threads; overlap_fraction = overlap / collective time (collective time = sum over threads of
  |union(collectives on t)|). Nested events are merged, never double counted within a thread.

See docs/overlap.md for what is (and is not) expected to overlap. On a loaded CPU the figure is
noisy; it says whether overlap happens at all, not how much a GPU run would get.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path


COLLECTIVE_KEYS = ("all_gather", "allgather", "reduce_scatter", "reducescatter", "allreduce", "all_reduce")
COMPUTE_NAMES = {"aten::mm", "aten::addmm", "aten::linear", "aten::bmm", "aten::matmul"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out: str, steps: int, seq_len: int, num_layers: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from posttrain.core.parallel.config import ParallelConfig
    from posttrain.core.losses import cross_entropy
    from posttrain.core.model import build_model, get_preset
    from posttrain.core.parallel import parallelize
    from posttrain.core.parallel.mesh import init_distributed

    torch.set_num_threads(1)
    cfg = ParallelConfig(dp_shard=2, device="cpu")
    args = get_preset("debug", num_layers=num_layers)
    mesh, device = init_distributed(cfg, args)
    try:
        model = parallelize(build_model(args, device), cfg, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, args.vocab_size, (2, seq_len), generator=g)

        def step() -> None:
            loss = cross_entropy(model(ids), ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # warm-up outside the profile (lazy init, first all-gathers)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        prof.export_chrome_trace(str(Path(out) / f"trace_rank{rank}.json"))
    finally:
        dist.destroy_process_group()


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if hi > lo:
            total += hi - lo
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def analyse_trace(path: str | Path) -> dict:
    """Collective count / time and their overlap with compute on other threads (times in us)."""
    events = json.loads(Path(path).read_text())
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    coll: dict[object, list[tuple[float, float]]] = {}
    comp: dict[object, list[tuple[float, float]]] = {}
    names: dict[str, int] = {}
    n_coll = 0
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        name, tid = str(e.get("name", "")), (e.get("pid"), e.get("tid"))
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        low = name.lower()
        if any(k in low for k in COLLECTIVE_KEYS):
            coll.setdefault(tid, []).append(span)
            names[name] = names.get(name, 0) + 1
            n_coll += 1
        elif name in COMPUTE_NAMES:
            comp.setdefault(tid, []).append(span)
    coll_u = {t: _union(v) for t, v in coll.items()}
    total = sum(_length(v) for v in coll_u.values())
    overlap = 0.0
    for t, spans in coll_u.items():
        others = _union([s for u, v in comp.items() if u != t for s in v])
        overlap += _intersection(spans, others)
    return {
        "trace": str(path),
        "num_collective_events": n_coll,
        "collective_names": names,
        "collective_threads": len(coll_u),
        "compute_events": sum(len(v) for v in comp.values()),
        "collective_time_us": round(total, 1),
        "overlap_with_compute_us": round(overlap, 1),
        "overlap_fraction": round(overlap / total, 4) if total > 0 else 0.0,
    }


def run(out: str | Path, steps: int = 3, seq_len: int = 64, num_layers: int = 4, world_size: int = 2) -> dict:
    import torch.multiprocessing as mp

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(_worker, args=(world_size, _free_port(), str(out), steps, seq_len, num_layers),
             nprocs=world_size, join=True)
    return {f"rank{r}": analyse_trace(out / f"trace_rank{r}.json") for r in range(world_size)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="overlap_traces", help="directory for the Chrome traces")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--analyse-only", action="store_true", help="re-analyse traces already in --out")
    a = p.parse_args()
    if a.analyse_only:
        report = {t.stem: analyse_trace(t) for t in sorted(Path(a.out).glob("trace_rank*.json"))}
    else:
        report = run(a.out, a.steps, a.seq_len, a.num_layers)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
