"""Peak host memory per rank while a training stage loads its policy under FSDP, before and after
sharded loading, on CPU (gloo).

    python -m benchmarks.load_memory [--models smollm2-135m qwen2.5-0.5b] [--nproc 4]
                                     [--cases bfloat16:float32 float32:float32 ...]
                                     [--workdir DIR] [--out file.json]

Models: presets of public shapes (core.model.args): smollm2-135m (SmolLM-135M: hidden 576, 30
layers, 9 heads, 3 KV heads, intermediate 1536, vocab 49152, tied) and qwen2.5-0.5b (Qwen2-0.5B:
hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151936, qkv bias, tied),
random weights (build_model, seed 0) saved once with registry.hf.save_pretrained as one
`model.safetensors`, kept in --workdir (a temporary directory by default). A case is
`checkpoint dtype:model dtype` (ModelConfig.dtype): bfloat16:float32 is a published checkpoint
(HF ships these in bf16) trained in fp32 on CPU, the stages' default; float32:float32 converts
nothing.

Each (model, path) runs once under `torchrun --standalone --nproc-per-node N`, FSDP over all N
ranks (parallel.dp_shard=N), the stage's own functions in open_session's order, no LoRA:
  old  stages.common.load_model (registry.hf.load_pretrained: every tensor whole on every rank),
       then stages.recipe.parallelize_policy (fully_shard keeps each rank's rows)
  new  load_model(meta=True), parallelize_policy, stages.common.materialize_model (this rank's
       shards allocated, then read from the memory-mapped file's slices: registry.hf_sharded)
Per rank: peak_rss_mb = ru_maxrss (getrusage RUSAGE_SELF: the kernel's high-water mark of
resident memory, file-backed pages of the mapped checkpoint included) at the end;
rss_before_mb = RSS after imports and the process group, just before loading; added_mb = peak -
before, what loading cost at its worst; peak_anon_mb = the largest private (RssAnon) memory seen
by a thread sampling /proc/self/status every 5 ms (approximate: a peak between samples is
missed); rss_after_mb = RSS once loaded; shard_mb = the bytes of this rank's parameters;
read_mb = checkpoint bytes the new path read. Wall-clock seconds of the load too. Only one run
happens at a time; run it on an otherwise idle machine.

Why float32:float32 barely differs: safetensors' get_tensor returns tensors backed by the
memory-mapped file, whose pages become resident only when touched, and fully_shard copies only
a rank's rows; so on CPU, without a cast, the whole load already touched about a rank's share.
A cast (`.to(dtype)`) or a copy to a GPU makes every tensor whole on every rank.
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

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("smollm2-135m", "qwen2.5-0.5b")
PATHS = ("old", "new")
CASES = ("bfloat16:float32", "float32:float32", "bfloat16:bfloat16")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _anon_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


class AnonPeak:
    """The largest RssAnon seen by a background thread sampling every `every` seconds."""

    def __init__(self, every: float = 0.005):
        import threading

        self.peak, self.every = _anon_mb(), every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, _anon_mb())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _anon_mb())


def worker(path: str, model_dir: str, dtype: str, out: str) -> None:
    """One rank of one measurement (under torchrun); rank 0 writes every rank's figures to `out`."""
    import torch
    import torch.distributed as dist

    from core.parallel.materialize import local_part
    from stages.common import load_model, materialize_model, start_distributed
    from stages.config import SFTConfig
    from stages.recipe import parallelize_policy

    world = int(os.environ["WORLD_SIZE"])
    cfg = SFTConfig(model={"name_or_path": model_dir, "dtype": dtype},
                    parallel={"dp_shard": world, "backend": "gloo", "device": "cpu"})
    d = start_distributed(cfg.parallel)
    d.barrier()
    before, anon, t0 = _rss_mb(), AnonPeak(), time.perf_counter()
    torch.manual_seed(cfg.seed)
    read = 0
    model, _ = load_model(cfg.model, d.device, cfg.seed, meta=path == "new")
    d.mesh = parallelize_policy(model, cfg, d)
    if path == "new":
        read = materialize_model(model, cfg.model, d.device, cfg.seed)
    seconds, peak_anon = time.perf_counter() - t0, anon.stop()
    shard = sum(local_part(p)[0].nbytes for p in model.parameters())
    figures = {"rank": d.rank, "peak_rss_mb": _peak_mb(), "rss_before_mb": before, "rss_after_mb": _rss_mb(),
               "peak_anon_mb": peak_anon, "shard_mb": shard / 2**20, "read_mb": read / 2**20, "seconds": seconds}
    figures["added_mb"] = figures["peak_rss_mb"] - before
    ranks = [None] * world
    dist.all_gather_object(ranks, figures)
    if d.is_main:
        Path(out).write_text(json.dumps(ranks))
    dist.destroy_process_group()


def make_checkpoint(name: str, dtype: str, workdir: Path) -> Path:
    import torch

    from core.model import build_model, get_preset
    from registry.hf import save_pretrained

    path = workdir / f"{name}-{dtype}"
    if not (path / "config.json").exists():
        model = build_model(get_preset(name), seed=0)
        save_pretrained(model, path, dtype=getattr(torch, dtype))
        del model
    return path


def measure(path: str, model_dir: Path, dtype: str, nproc: int, workdir: Path) -> list[dict]:
    out = workdir / f"ranks-{path}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "benchmarks.load_memory", "--worker", path, "--model-dir", str(model_dir), "--dtype", dtype,
           "--ranks-out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(out.read_text())


def summary(ranks: list[dict]) -> dict:
    keys = ("peak_rss_mb", "added_mb", "peak_anon_mb", "rss_after_mb", "shard_mb", "read_mb", "seconds")
    return {"max_" + k: round(max(r[k] for r in ranks), 1) for k in keys} | {"ranks": ranks}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), help="core.model presets")
    p.add_argument("--nproc", type=int, default=4, help="ranks (FSDP over all of them)")
    p.add_argument("--cases", nargs="+", default=list(CASES[:2]), choices=CASES,
                   help="checkpoint dtype:model dtype")
    p.add_argument("--workdir", help="where the checkpoints are made and kept (default: a temporary directory)")
    p.add_argument("--out", help="also write the JSON document here")
    p.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--ranks-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.model_dir, args.dtype, args.ranks_out)
        return 0

    from core.model import get_preset

    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="load_memory.")
    workdir = Path(args.workdir or tmp.name)
    workdir.mkdir(parents=True, exist_ok=True)
    doc: dict = {"command": "python -m benchmarks.load_memory " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "nproc": args.nproc, "layout": f"dp_shard={args.nproc} (FSDP2), gloo, CPU",
                 "cpus": os.cpu_count(), "models": {}}
    for name in args.models:
        doc["models"][name] = {"parameters": get_preset(name).num_params()}
        for case in args.cases:
            saved, dtype = case.split(":")
            model_dir = make_checkpoint(name, saved, workdir)
            entry: dict = {"checkpoint_mb": round((model_dir / "model.safetensors").stat().st_size / 2**20, 1)}
            for path in PATHS:
                entry[path] = summary(measure(path, model_dir, dtype, args.nproc, workdir))
            entry["peak_ratio_new_old"] = round(entry["new"]["max_peak_rss_mb"] / entry["old"]["max_peak_rss_mb"], 3)
            doc["models"][name][case] = entry
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
