"""Peak host memory per rank while a training stage loads its policy under FSDP, before and after
sharded loading, on CPU (gloo).

    python -m posttrain.benchmarks.load_memory [--models smollm2-135m qwen2.5-0.5b] [--nproc 4]
                                     [--cases bfloat16:float32 float32:float32 ...]
                                     [--workdir DIR] [--out file.json]

Models: presets of public shapes (posttrain.core.model.args): smollm2-135m (SmolLM-135M: hidden 576, 30
layers, 9 heads, 3 KV heads, intermediate 1536, vocab 49152, tied) and qwen2.5-0.5b (Qwen2-0.5B:
hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151936, qkv bias, tied),
random weights (build_model, seed 0) saved once with posttrain.registry.hf.save_pretrained as one
`model.safetensors`, kept in --workdir (a temporary directory by default). A case is
`checkpoint dtype:model dtype` (ModelConfig.dtype): bfloat16:float32 is a published checkpoint
(HF ships these in bf16) trained in fp32 on CPU, the stages' default; float32:float32 converts
nothing.

Each (model, path) runs once under `torchrun --standalone --nproc-per-node N`, FSDP over all N
ranks (parallel.dp_shard=N), the stage's own functions in open_session's order, no LoRA:
  old  posttrain.stages.common.load_model (posttrain.registry.hf.load_pretrained: every tensor whole on every rank),
       then posttrain.stages.recipe.parallelize_policy (fully_shard keeps each rank's rows)
  new  load_model(meta=True), parallelize_policy, posttrain.stages.common.materialize_model (this rank's
       shards allocated, then read from the memory-mapped file's slices: posttrain.registry.hf_sharded)
Per rank: peak_rss_mb = ru_maxrss (getrusage RUSAGE_SELF: the kernel's high-water mark of
resident memory, file-backed pages of the mapped checkpoint included) at the end;
rss_before_mb = RSS after imports and the process group, just before loading; added_mb = peak -
before, what loading cost at its worst; peak_anon_mb = the largest private (RssAnon) memory seen
by a thread sampling /proc/self/status every 5 ms (approximate: a peak between samples is
missed); rss_after_mb = RSS once loaded; shard_mb = the bytes of this rank's parameters;
read_mb = checkpoint bytes the new path read. Wall-clock seconds of the load too. Only one run
happens at a time; run it on an otherwise idle machine.

--qlora measures QLoRA's load instead (NF4 base, double quant, LoRA r16 on every linear layer):
old = the whole dense model on every rank, then apply_lora quantizes it; new =
posttrain.stages.common.load_quantized (built on meta, each targeted weight read from the mapped file just
before it is quantized, then the dense rest). Both then shard under FSDP (posttrain.core.quant's NF4
storage pieces); shard_mb counts buffers too (the NF4 codes and scales are buffers).

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

MODELS = ("smollm2-135m", "qwen2.5-0.5b")
PATHS = ("old", "new")
CASES = ("bfloat16:float32", "float32:float32", "bfloat16:bfloat16")
QLORA = {"enabled": True, "quantize_base": "nf4", "rank": 16, "alpha": 32}


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


def worker(path: str, model_dir: str, dtype: str, out: str, qlora: bool = False) -> None:
    """One rank of one measurement (under torchrun); rank 0 writes every rank's figures to `out`."""
    import torch
    import torch.distributed as dist

    from posttrain.core.lora import apply_lora
    from posttrain.core.parallel.materialize import local_part
    from posttrain.stages.common import load_model, load_quantized, materialize_model, start_distributed
    from posttrain.stages.config import SFTConfig
    from posttrain.stages.recipe import parallelize_policy

    world = int(os.environ["WORLD_SIZE"])
    cfg = SFTConfig(model={"name_or_path": model_dir, "dtype": dtype},
                    parallel={"dp_shard": world, "backend": "gloo", "device": "cpu"}, lora=QLORA if qlora else {})
    d = start_distributed(cfg.parallel)
    d.barrier()
    before, anon, t0 = _rss_mb(), AnonPeak(), time.perf_counter()
    torch.manual_seed(cfg.seed)
    read = 0
    if qlora and path == "new":  # each weight quantized as it is read
        model, _ = load_quantized(cfg.model, cfg.lora, d.device)
    else:
        model, _ = load_model(cfg.model, d.device, cfg.seed, meta=path == "new" and not qlora)
        if qlora:  # the whole dense model, then quantized
            apply_lora(model, cfg.lora)
    d.mesh = parallelize_policy(model, cfg, d)
    if path == "new" and not qlora:
        read = materialize_model(model, cfg.model, d.device, cfg.seed)
    seconds, peak_anon = time.perf_counter() - t0, anon.stop()
    held = [*model.parameters(), *(model.buffers() if qlora else ())]  # (QLoRA: the NF4 codes are buffers)
    shard = sum(local_part(t)[0].nbytes for t in held)
    figures = {"rank": d.rank, "peak_rss_mb": _peak_mb(), "rss_before_mb": before, "rss_after_mb": _rss_mb(),
               "peak_anon_mb": peak_anon, "shard_mb": shard / 2**20, "read_mb": read / 2**20, "seconds": seconds}
    figures["added_mb"] = figures["peak_rss_mb"] - before
    ranks = [None] * world
    dist.all_gather_object(ranks, figures)
    if d.is_main:
        Path(out).write_text(json.dumps(ranks))
    dist.barrier()  # no rank tears its group down while another still talks on it
    dist.destroy_process_group()


def make_checkpoint(name: str, dtype: str, workdir: Path) -> Path:
    import torch

    from posttrain.core.model import build_model, get_preset
    from posttrain.registry.hf import save_pretrained

    path = workdir / f"{name}-{dtype}"
    if not (path / "config.json").exists():
        model = build_model(get_preset(name), seed=0)
        save_pretrained(model, path, dtype=getattr(torch, dtype))
        del model
    return path


def measure(path: str, model_dir: Path, dtype: str, nproc: int, workdir: Path, qlora: bool = False) -> list[dict]:
    out = workdir / f"ranks-{path}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "posttrain.benchmarks.load_memory", "--worker", path, "--model-dir", str(model_dir), "--dtype", dtype,
           "--ranks-out", str(out), *(["--qlora"] if qlora else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # gloo has been seen to abort a rank on CPU ("terminate called without an active exception",
    # SIGABRT) once in many runs: such a run is measured again, once; any other failure fails at once.
    for retry in (True, False):
        out.unlink(missing_ok=True)
        proc = subprocess.run(cmd, env=env, cwd=workdir, capture_output=True, text=True)
        ranks = json.loads(out.read_text()) if out.exists() else None
        if ranks is not None and len(ranks) == nproc:
            if proc.returncode:  # every rank's figures were gathered and written: the crash was at teardown
                print(f"load_memory: {path} exited {proc.returncode} after writing every rank's figures "
                      "(a crash at process teardown); the figures stand", file=sys.stderr)
            return ranks
        if not (retry and "SIGABRT" in proc.stdout + proc.stderr):
            break
    raise SystemExit(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")


def summary(ranks: list[dict]) -> dict:
    keys = ("peak_rss_mb", "added_mb", "peak_anon_mb", "rss_after_mb", "shard_mb", "read_mb", "seconds")
    return {"max_" + k: round(max(r[k] for r in ranks), 1) for k in keys} | {"ranks": ranks}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), help="posttrain.core.model presets")
    p.add_argument("--nproc", type=int, default=4, help="ranks (FSDP over all of them)")
    p.add_argument("--cases", nargs="+", default=list(CASES[:2]), choices=CASES,
                   help="checkpoint dtype:model dtype")
    p.add_argument("--workdir", help="where the checkpoints are made and kept (default: a temporary directory)")
    p.add_argument("--out", help="also write the JSON document here")
    p.add_argument("--qlora", action="store_true",
                   help="QLoRA (NF4 base, LoRA r16 all-linear): old = the whole dense model, then quantized; "
                        "new = each weight quantized as it is read (posttrain.stages.common.load_quantized)")
    p.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--ranks-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.model_dir, args.dtype, args.ranks_out, args.qlora)
        return 0

    from posttrain.core.model import get_preset

    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="load_memory.")
    workdir = Path(args.workdir or tmp.name)
    workdir.mkdir(parents=True, exist_ok=True)
    doc: dict = {"command": "python -m posttrain.benchmarks.load_memory " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "nproc": args.nproc, "layout": f"dp_shard={args.nproc} (FSDP2), gloo, CPU",
                 "lora": "qlora nf4 r16 all-linear" if args.qlora else None,
                 "cpus": os.cpu_count(), "models": {}}
    for name in args.models:
        doc["models"][name] = {"parameters": get_preset(name).num_params()}
        for case in args.cases:
            saved, dtype = case.split(":")
            model_dir = make_checkpoint(name, saved, workdir)
            entry: dict = {"checkpoint_mb": round((model_dir / "model.safetensors").stat().st_size / 2**20, 1)}
            for path in PATHS:
                entry[path] = summary(measure(path, model_dir, dtype, args.nproc, workdir, args.qlora))
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
